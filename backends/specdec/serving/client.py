"""`specdec client`: stream one prompt from a served model over gRPC (default) or HTTP SSE, print
the text as it arrives, then TTFT, tokens/s and the speculative-decoding outputs.

`stream()` yields `Chunk`s and raises `ClientError` with the server's message; the benchmark and
the load tests reuse it. Copyable, dependency-light versions of both protocols are in clients/.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from specdec.serving.interface import DEFAULT_GRPC_URL, DEFAULT_HTTP_URL, INPUTS
from specdec.serving.trtllm_llmapi import TYPES as LLMAPI_TYPES
from specdec.serving.trtllm_llmapi import llmapi_body

NP_TYPES = {"TYPE_STRING": np.object_, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64, "TYPE_UINT64": np.uint64,
            "TYPE_FP32": np.float32, "TYPE_BOOL": np.bool_}


class ClientError(RuntimeError):
    pass


@dataclass
class Chunk:
    text: str
    token_ids: list[int]
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    finish_reason: str
    final: bool
    time: float = field(default_factory=time.perf_counter)


@dataclass
class Summary:
    text: str
    tokens: int
    ttft_s: float
    total_s: float
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    finish_reason: str
    chunks: int

    @property
    def tokens_per_s(self) -> float:
        """Decode rate after the first token (what speculation changes)."""
        gen = self.total_s - self.ttft_s
        return (self.tokens - 1) / gen if self.tokens > 1 and gen > 0 else 0.0


def request_inputs(prompt: str, interface: str = "specdec", **options) -> dict[str, np.ndarray]:
    """Input arrays (the model's dtypes, shape [1]) for the options that are not None; interface
    `llmapi` names them as TensorRT-LLM's llmapi model does (serving/trtllm_llmapi.py)."""
    if interface == "llmapi":
        try:
            return llmapi_arrays(llmapi_body(prompt, **options))
        except ValueError as exc:
            raise ClientError(str(exc)) from None
    if interface != "specdec":
        raise ClientError(f"interface must be specdec or llmapi, got {interface!r}")
    spec = {f.name: f for f in INPUTS}
    arrays = {"text_input": np.array([prompt.encode("utf-8")], dtype=np.object_)}
    for name, value in options.items():
        if value is None:
            continue
        if name not in spec:
            raise ClientError(f"unknown input {name!r}")
        f = spec[name]
        if f.dtype == "TYPE_STRING":
            values = value if isinstance(value, (list, tuple)) else [value]
            arrays[name] = np.array([v.encode("utf-8") for v in values], dtype=np.object_)
        else:
            arrays[name] = np.array([value], dtype=NP_TYPES[f.dtype])
    return arrays


def llmapi_arrays(body: dict[str, object]) -> dict[str, np.ndarray]:
    """An llmapi request body (`trtllm_llmapi.llmapi_body`) as gRPC input arrays in the model's dtypes."""
    arrays = {}
    for name, value in body.items():
        dtype = NP_TYPES[LLMAPI_TYPES[name]]
        values = value if isinstance(value, list) else [value]
        arrays[name] = np.array([v.encode("utf-8") for v in values] if dtype is np.object_ else values, dtype=dtype)
    return arrays


def stream(url: str, model: str, inputs: dict[str, np.ndarray], protocol: str = "grpc",
           timeout_s: float = 600.0) -> Iterator[Chunk]:
    if protocol == "grpc":
        return _stream_grpc(url, model, inputs, timeout_s)
    if protocol == "http":
        return _stream_http(url, model, inputs, timeout_s)
    raise ClientError(f"protocol must be grpc or http, got {protocol!r}")


def grpc_tensors(inputs: dict[str, np.ndarray]) -> list:
    """Named numpy arrays -> tritonclient gRPC InferInputs (dtype names follow the arrays)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    tensors = []
    for name, array in inputs.items():
        t = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        t.set_data_from_numpy(array)
        tensors.append(t)
    return tensors


def _stream_grpc(url: str, model: str, inputs: dict[str, np.ndarray], timeout_s: float) -> Iterator[Chunk]:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    complete = False
    try:
        client.start_stream(callback=lambda result=None, error=None: results.put((result, error)))
        tensors = grpc_tensors(inputs)
        client.async_stream_infer(model, tensors, request_id=uuid.uuid4().hex[:12], enable_empty_final_response=True)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                result, error = results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise ClientError(f"no response within {timeout_s:.0f} s") from None
            if error is not None:
                raise ClientError(error.message() if isinstance(error, InferenceServerException) else str(error))
            final = result.get_response().parameters["triton_final_response"].bool_param
            complete = final
            if result.as_numpy("text_output") is None:  # an empty final response
                if final:
                    yield Chunk("", [], 0, 0, 0.0, "", True)
                    return
                continue
            yield parse_chunk(result.as_numpy, final)
            if final:
                return
    except InferenceServerException as exc:
        raise ClientError(exc.message()) from None
    finally:
        # a finished stream is closed, not cancelled: cancelling the call after its final
        # response is at best pointless; only a reader that stops early cancels its request
        client.stop_stream(cancel_requests=not complete)
        client.close()


def close_stream(client) -> None:
    """Cancel a tritonclient gRPC client's stream and its requests, then close the client and its
    channel; errors are ignored (a stream being given up may be in any state)."""
    try:
        client.stop_stream(cancel_requests=True)
        client.close()
    except Exception:
        pass


def _stream_http(url: str, model: str, inputs: dict[str, np.ndarray], timeout_s: float) -> Iterator[Chunk]:
    import requests

    body = {}
    for name, array in inputs.items():
        values = [v.decode("utf-8") if isinstance(v, bytes) else v.item() for v in array.reshape(-1)]
        body[name] = values if name in ("stop_words", "sampling_param_stop") else values[0]
    base = url if url.startswith("http") else f"http://{url}"
    try:
        with requests.post(f"{base}/v2/models/{model}/generate_stream", json=body, stream=True, timeout=timeout_s) as r:
            if r.status_code != 200 and not r.headers.get("content-type", "").startswith("text/event-stream"):
                raise ClientError(_error_text(r.text) or f"HTTP {r.status_code}")
            last = None
            for line in r.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise ClientError(event["error"])
                if last is not None:
                    yield last
                last = parse_event(event)
            if last is None:
                raise ClientError("the stream ended without a response")
            last.final = True
            yield last
    except requests.RequestException as exc:
        raise ClientError(f"HTTP request failed: {exc}") from None


def parse_event(event: dict) -> Chunk:
    """One server-sent event's JSON (`generate_stream`) as a Chunk (not final: the caller knows)."""
    return parse_chunk(lambda n: _json_array(event.get(n)), False)


def _json_array(v):
    if v is None:
        return None
    return np.array(v if isinstance(v, list) else [v], dtype=np.object_ if isinstance(v, str) else None)


def _error_text(body: str) -> str:
    for line in body.splitlines():
        line = line[5:] if line.startswith("data:") else line
        try:
            return json.loads(line)["error"]
        except (ValueError, KeyError, TypeError):
            continue
    return body.strip()


def parse_chunk(get, final: bool) -> Chunk:
    """A response as a Chunk; `get(name)` returns the named output as an array (None if absent)."""
    def first(name, default):
        a = get(name)
        return default if a is None or np.asarray(a).size == 0 else np.asarray(a).reshape(-1)[0]

    text = first("text_output", b"")
    reason = first("finish_reason", b"")
    ids = get("output_ids")
    return Chunk(
        text=text.decode("utf-8") if isinstance(text, bytes) else str(text),
        token_ids=[] if ids is None else [int(x) for x in np.asarray(ids).reshape(-1)],
        draft_tokens=int(first("total_draft_tokens", 0)), accepted_tokens=int(first("total_accepted_draft_tokens", 0)),
        acceptance_rate=float(first("acceptance_rate", 0.0)),
        finish_reason=reason.decode() if isinstance(reason, bytes) else str(reason), final=final,
    )


def run(url: str, model: str, prompt: str, protocol: str = "grpc", echo=None, timeout_s: float = 600.0,
        **options) -> Summary:
    """Stream one request to the end; `echo(text)` sees each chunk's text as it arrives."""
    t0 = time.perf_counter()
    first = None
    text, tokens, chunks, last = [], 0, 0, None
    for chunk in stream(url, model, request_inputs(prompt, **options), protocol, timeout_s):
        if (chunk.token_ids or chunk.text) and first is None:  # llmapi models return text only
            first = chunk.time
        if echo is not None and chunk.text:
            echo(chunk.text)
        text.append(chunk.text)
        tokens += len(chunk.token_ids)
        chunks += 1
        last = chunk
    end = time.perf_counter()
    return Summary("".join(text), tokens, (first or end) - t0, end - t0, last.draft_tokens, last.accepted_tokens,
                   last.acceptance_rate, last.finish_reason, chunks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specdec client", description="Stream one prompt from a served specdec model.")
    ap.add_argument("prompt", help="the prompt ('-' reads stdin)")
    ap.add_argument("--model", default="spec_eagle")
    ap.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    ap.add_argument("--interface", choices=["specdec", "llmapi"], default="specdec",
                    help="llmapi: a TensorRT-LLM >= 1.x llmapi model (text only: no token counts)")
    ap.add_argument("--url", help=f"server address (default {DEFAULT_GRPC_URL} for gRPC, {DEFAULT_HTTP_URL} for HTTP)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, help="0 = greedy (the server's default)")
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--stop", action="append", help="stop string (repeatable)")
    ap.add_argument("--min-tokens", type=int)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--num-draft-tokens", type=int, help="cap on speculated tokens per step")
    ap.add_argument("--include-prompt", action="store_true", help="the server prepends the prompt to the text")
    ap.add_argument("--no-stream", action="store_true", help="ask for one response with the whole text")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", action="store_true", help="print the summary as JSON instead of text lines")
    args = ap.parse_args(argv)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    url = args.url or (DEFAULT_GRPC_URL if args.protocol == "grpc" else DEFAULT_HTTP_URL)
    if args.seed is not None and args.seed < 0:
        print("error: --seed must be >= 0", file=sys.stderr)
        return 2

    def echo(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        s = run(url, args.model, prompt, args.protocol, None if args.json else echo, args.timeout,
                max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                seed=args.seed, stop_words=args.stop, min_tokens=args.min_tokens,
                ignore_eos=True if args.ignore_eos else None, num_draft_tokens=args.num_draft_tokens,
                exclude_input_in_output=not args.include_prompt, stream=not args.no_stream, interface=args.interface)
    except ClientError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ncancelled", file=sys.stderr)
        return 130
    stats = {"model": args.model, "protocol": args.protocol, "tokens": s.tokens, "ttft_s": round(s.ttft_s, 4),
             "tokens_per_s": round(s.tokens_per_s, 1), "total_s": round(s.total_s, 3),
             "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
             "acceptance_rate": round(s.acceptance_rate, 3), "finish_reason": s.finish_reason}
    if args.json:
        print(json.dumps({**stats, "text": s.text}))
    else:
        print(f"\n\n--- {args.model} over {args.protocol}: {s.tokens} tokens, TTFT {s.ttft_s * 1000:.0f} ms, "
              f"{s.tokens_per_s:.1f} tokens/s, finish: {s.finish_reason}\n"
              f"--- drafts: {s.draft_tokens} tokens proposed, {s.accepted_tokens} accepted "
              f"(acceptance rate {s.acceptance_rate:.2f})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
