"""Parsing of one request against the interface (`interface.py`: the tensor names of Triton's
TensorRT-LLM and vLLM backends).

`parse()` turns one request's input arrays and parameters into a prompt and SamplingParams,
raising InvalidRequest with a message that names the offending input. It takes plain numpy arrays,
so it is tested without a server.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from specdec.core.errors import InvalidRequest
from specdec.core.sampling import SamplingParams
from specdec.serving.interface import INPUT_NAMES, INPUTS

DEFAULTS = {f.name: f.default for f in INPUTS}

# keys of the vLLM backend's `sampling_parameters` JSON that map onto our inputs
SAMPLING_JSON = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "seed": "seed", "stop": "stop_words", "min_tokens": "min_tokens", "ignore_eos": "ignore_eos"}


@dataclass
class ParsedRequest:
    prompt: str
    params: SamplingParams
    stream: bool
    exclude_input: bool


def parse(inputs: dict[str, np.ndarray], parameters: dict | str | None = None) -> ParsedRequest:
    """Inputs by name (numpy arrays as Triton hands them over) + request parameters -> ParsedRequest.

    Request parameters may carry the same names as the inputs (an input wins); any other parameter
    is rejected, so a misspelt option never silently does nothing."""
    if isinstance(parameters, str):
        parameters = json.loads(parameters) if parameters.strip() else {}
    values: dict[str, object] = {}
    for key, value in (parameters or {}).items():
        if key.startswith("triton_"):  # set by Triton's frontends themselves
            continue
        if key not in INPUT_NAMES:
            raise InvalidRequest(f"unknown parameter {key!r}; known: {', '.join(sorted(INPUT_NAMES))}")
        values[key] = np.array([value.encode() if isinstance(value, str) else value])
    for key, array in inputs.items():
        if key not in INPUT_NAMES:
            raise InvalidRequest(f"unknown input {key!r}; known: {', '.join(sorted(INPUT_NAMES))}")
        values[key] = np.asarray(array)

    if "sampling_parameters" in values:
        _merge_sampling_json(values)

    if "text_input" not in values:
        raise InvalidRequest("text_input is missing")
    prompt = _text(values["text_input"], "text_input")
    if not prompt:
        raise InvalidRequest("text_input is empty")

    seed = _scalar(values, "seed", int)
    if seed is None:
        seed = _scalar(values, "random_seed", int)
    min_tokens = _scalar(values, "min_tokens", int)
    if min_tokens is None:
        min_tokens = _scalar(values, "min_length", int)
    stop = [_decode(s, "stop_words") for s in np.asarray(values.get("stop_words", [])).reshape(-1)]
    params = SamplingParams(
        max_tokens=_get(values, "max_tokens", int),
        temperature=_get(values, "temperature", float),
        top_p=_get(values, "top_p", float),
        top_k=_get(values, "top_k", int),
        seed=seed,
        stop=[s for s in stop if s],
        min_tokens=min_tokens or 0,
        ignore_eos=_get(values, "ignore_eos", bool),
        num_draft_tokens=_scalar(values, "num_draft_tokens", int),
    )
    if math.isnan(params.temperature):
        raise InvalidRequest("temperature must be a finite number >= 0, got nan")
    _check_wrapped(values)
    params.validate()
    return ParsedRequest(prompt, params, _get(values, "stream", bool),
                         _get(values, "exclude_input_in_output", bool))


INT32_INPUTS = [f.name for f in INPUTS if f.dtype == "TYPE_INT32"]


def _check_wrapped(values: dict) -> None:
    """Triton's HTTP endpoint wraps JSON numbers outside a 32-bit input's range (2^31 arrives as
    -2^31) instead of refusing them, so a negative value may be one the client never sent: say so."""
    for name in INT32_INPUTS:
        v = _scalar(values, name, int)
        if v is not None and v < 0:
            must = "a positive integer" if name == "max_tokens" else "an integer >= 0"
            raise InvalidRequest(f"{name} must be {must}, got {v} (over HTTP, {name} is a 32-bit integer: "
                                 f"numbers above {2**31 - 1} arrive wrapped around, e.g. {v + 2**32} as {v})")


def _scalar(values: dict, name: str, kind: type):
    if name not in values:
        return None
    array = np.asarray(values[name])
    if array.size != 1:
        raise InvalidRequest(f"{name} must hold exactly one value, got shape {list(array.shape)}")
    v = array.reshape(-1)[0]
    if isinstance(v, (bytes, str, np.bytes_, np.str_)) and kind is not str:
        raise InvalidRequest(f"{name} must be a number, got text {v!r}")
    if kind is bool:
        return bool(v)
    if kind is int:
        if isinstance(v, (float, np.floating)) and not float(v).is_integer():
            raise InvalidRequest(f"{name} must be an integer, got {v!r}")
        return int(v)
    return float(v)


def _get(values: dict, name: str, kind: type):
    """The input's value, or its default from the interface table."""
    v = _scalar(values, name, kind)
    return DEFAULTS[name] if v is None else v


def _text(array: np.ndarray, name: str) -> str:
    array = np.asarray(array)
    if array.size != 1:
        raise InvalidRequest(f"{name} must hold exactly one string, got shape {list(array.shape)}")
    return _decode(array.reshape(-1)[0], name)


def _decode(v, name: str) -> str:
    if isinstance(v, (bytes, np.bytes_)):
        try:
            return bytes(v).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequest(f"{name} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    if isinstance(v, str):
        return v
    raise InvalidRequest(f"{name} must be a string, got {type(v).__name__}")


def _merge_sampling_json(values: dict) -> None:
    raw = _text(values.pop("sampling_parameters"), "sampling_parameters")
    try:
        options = json.loads(raw) if raw.strip() else {}
    except ValueError as exc:
        raise InvalidRequest(f"sampling_parameters is not valid JSON ({exc})") from None
    if not isinstance(options, dict):
        raise InvalidRequest("sampling_parameters must be a JSON object")
    for key, value in options.items():
        if key not in SAMPLING_JSON:
            raise InvalidRequest(f"sampling_parameters: unsupported key {key!r}; supported: {', '.join(SAMPLING_JSON)}")
        name = SAMPLING_JSON[key]
        if name in values:  # an explicit input wins
            continue
        if name == "stop_words":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
                raise InvalidRequest("sampling_parameters: stop must be a string or a list of strings")
            values[name] = np.array([x.encode() for x in stops], dtype=np.object_)
        elif isinstance(value, (bool, int, float)) or value is None:
            if value is not None:
                values[name] = np.array([value])
        else:
            raise InvalidRequest(f"sampling_parameters: {key} must be a number, got {value!r}")
