"""The request interface: tensor names, types and defaults of Triton's TensorRT-LLM and vLLM
backends, as specdec serves them. The single source for the model configs (`repository.py`), the
request parser (`request.py`), the clients (`client.py`, the Locust users) and docs/serving.md.
Plain data, no torch: a client that only talks to Triton imports this and nothing heavier.
"""

from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class Field:
    name: str
    dtype: str  # Triton config type
    dims: str
    default: object
    doc: str
    optional: bool = True


# Triton's default ports: `specdec serve` listens on them, and every client and load test
# defaults to them on localhost
HTTP_PORT, GRPC_PORT, METRICS_PORT = 8000, 8001, 8002
DEFAULT_HTTP_URL = f"localhost:{HTTP_PORT}"
DEFAULT_GRPC_URL = f"localhost:{GRPC_PORT}"
DEFAULT_METRICS_URL = f"http://localhost:{METRICS_PORT}/metrics"

# config type -> the datatype name on the wire (tritonclient, HTTP JSON)
WIRE_TYPES = {"TYPE_STRING": "BYTES", "TYPE_INT32": "INT32", "TYPE_INT64": "INT64", "TYPE_UINT64": "UINT64",
              "TYPE_FP32": "FP32", "TYPE_BOOL": "BOOL"}


INPUTS = [
    Field("text_input", "TYPE_STRING", "[ 1 ]", None, "the prompt (UTF-8)", optional=False),
    Field("max_tokens", "TYPE_INT32", "[ 1 ]", 64, "tokens to generate, 1 .. max_context - 1"),
    Field("stream", "TYPE_BOOL", "[ 1 ]", False, "true: one response per engine step (text delta); false: one response"),
    Field("temperature", "TYPE_FP32", "[ 1 ]", 0.0, "0 = greedy; > 0 samples"),
    Field("top_p", "TYPE_FP32", "[ 1 ]", 1.0, "nucleus cut, in (0, 1]"),
    Field("top_k", "TYPE_INT32", "[ 1 ]", 0, "0 = no top-k cut"),
    # INT64, not UINT64: Triton's HTTP endpoint answers a JSON -1 for a UINT64 input with an error
    # that does not name it; as INT64 the value reaches parse() and the error names `seed`
    Field("seed", "TYPE_INT64", "[ 1 ]", None, "sampling seed 0 .. 2^63-1 (reproducible output); none = random"),
    Field("random_seed", "TYPE_UINT64", "[ 1 ]", None, "alias of seed (TensorRT-LLM's name and type)"),
    Field("stop_words", "TYPE_STRING", "[ -1 ]", [], "strings that end the output (not included)"),
    Field("exclude_input_in_output", "TYPE_BOOL", "[ 1 ]", False, "false: the prompt is prepended to the text"),
    Field("num_draft_tokens", "TYPE_INT32", "[ 1 ]", None, "cap on speculated tokens per step (0 = off); none = model's k (a seeded sampled request under the adaptive policy: 0)"),
    Field("min_tokens", "TYPE_INT32", "[ 1 ]", 0, "EOS is suppressed before this many tokens"),
    Field("min_length", "TYPE_INT32", "[ 1 ]", 0, "alias of min_tokens (genai-perf sends it)"),
    Field("ignore_eos", "TYPE_BOOL", "[ 1 ]", False, "keep generating past EOS (fixed-length benchmarks)"),
    Field("sampling_parameters", "TYPE_STRING", "[ 1 ]", None,
          "JSON object as Triton's vLLM backend takes it: max_tokens, temperature, top_p, top_k, seed, "
          "stop, min_tokens, ignore_eos (the tensors above win)"),
]

OUTPUTS = [
    Field("text_output", "TYPE_STRING", "[ -1 ]", None, "streamed: the new text of this step; else the whole text"),
    Field("output_ids", "TYPE_INT32", "[ -1 ]", None, "the token ids in this response"),
    Field("total_draft_tokens", "TYPE_INT32", "[ 1 ]", None, "draft tokens proposed for this request so far"),
    Field("total_accepted_draft_tokens", "TYPE_INT32", "[ 1 ]", None, "of those, accepted by the target"),
    Field("acceptance_rate", "TYPE_FP32", "[ 1 ]", None, "accepted / draft tokens (0 when nothing was drafted)"),
    Field("finish_reason", "TYPE_STRING", "[ 1 ]", None, "empty until the last response: length, eos, stop, cancelled"),
]

INPUT_NAMES = {f.name for f in INPUTS}
