"""Requests for TensorRT-LLM's `llmapi` Triton model (TensorRT-LLM >= 1.x, triton_backend/all_models/llmapi),
so `specdec client` and the load tests can A/B the models `build/trtllm/build_engines.py --interface llmapi`
writes (baseline, Eagle3, Draft_Target, NGram) with the same options they send specdec's models.

That model takes `text_input`, `streaming` and per-request `sampling_param_*` tensors and answers
`text_output` (no token ids) plus, when asked with `sampling_param_return_perf_metrics`, the
speculative-decoding counters under the names specdec's models use (`acceptance_rate`,
`total_draft_tokens`, `total_accepted_draft_tokens`), so `client.parse_chunk` reads both.
Plain data, no torch (`client.llmapi_arrays` makes the gRPC arrays).
"""

from __future__ import annotations

# specdec option -> (llmapi input, Triton type of that input in the llmapi config.pbtxt)
OPTIONS = {
    "max_tokens": ("sampling_param_max_tokens", "TYPE_INT32"),
    "stream": ("streaming", "TYPE_BOOL"),
    "temperature": ("sampling_param_temperature", "TYPE_FP32"),
    "top_p": ("sampling_param_top_p", "TYPE_FP32"),
    "top_k": ("sampling_param_top_k", "TYPE_INT32"),
    "seed": ("sampling_param_seed", "TYPE_UINT64"),
    "random_seed": ("sampling_param_seed", "TYPE_UINT64"),
    "stop_words": ("sampling_param_stop", "TYPE_STRING"),
    "exclude_input_in_output": ("sampling_param_exclude_input_from_output", "TYPE_BOOL"),
}
# always sent: the finish reason and the acceptance counters come back only when asked for
ALWAYS = {"sampling_param_return_perf_metrics": (True, "TYPE_BOOL"), "return_finish_reason": (True, "TYPE_BOOL")}
TYPES = {"text_input": "TYPE_STRING", **{name: t for name, t in OPTIONS.values()},
         **{name: t for name, (_, t) in ALWAYS.items()}}


def llmapi_body(prompt: str, **options) -> dict[str, object]:
    """The request as llmapi input name -> JSON value (what HTTP `generate_stream` takes). Options set
    to None are left out; so are the sampling cuts of a greedy request (temperature 0: the LLM API's
    default decoding is greedy) and top_k 0 / top_p 1 (no cut). ValueError names an option the llmapi
    model has no input for."""
    body: dict[str, object] = {"text_input": prompt}
    greedy = not options.get("temperature")
    for option, value in options.items():
        if value is None:
            continue
        if option not in OPTIONS:
            raise ValueError(f"the llmapi interface has no input for {option!r}; "
                             f"it takes {', '.join(sorted(OPTIONS))}")
        if greedy and option in ("temperature", "top_p", "top_k", "seed", "random_seed"):
            continue
        if (option, value) in (("top_k", 0), ("top_p", 1.0)):
            continue
        name = OPTIONS[option][0]
        body[name] = ([value] if isinstance(value, str) else list(value)) if option == "stop_words" else value
    body.update({name: value for name, (value, _) in ALWAYS.items()})
    return body
