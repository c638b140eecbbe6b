"""Request parsing (no server needed); model-config parameters and the repository writer: test_config.py."""

from __future__ import annotations

import re

import numpy as np
import pytest

from specdec.core.errors import InvalidRequest
from specdec.serving.request import DEFAULTS, parse


def text(s: str | bytes) -> np.ndarray:
    return np.array([s.encode() if isinstance(s, str) else s], dtype=np.object_)


def test_defaults():
    r = parse({"text_input": text("hello")})
    assert r.prompt == "hello" and not r.stream and not r.exclude_input
    p = r.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.min_tokens) == \
        (DEFAULTS["max_tokens"], 0.0, 1.0, 0, None, [], 0)
    assert p.num_draft_tokens is None and not p.ignore_eos


def test_all_inputs_and_aliases():
    r = parse({
        "text_input": text("héllo"), "max_tokens": np.array([7], np.int32), "stream": np.array([True]),
        "temperature": np.array([0.5], np.float32), "top_p": np.array([0.9], np.float32),
        "top_k": np.array([5], np.int32), "random_seed": np.array([2**63 + 5], np.uint64),
        "stop_words": np.array([b"\n\n", b"def"], dtype=np.object_), "exclude_input_in_output": np.array([True]),
        "num_draft_tokens": np.array([2], np.int32), "min_length": np.array([3], np.int32),
        "ignore_eos": np.array([True]),
    })
    p = r.params
    assert r.prompt == "héllo" and r.stream and r.exclude_input
    assert (p.max_tokens, p.top_k, p.seed, p.stop, p.num_draft_tokens, p.min_tokens, p.ignore_eos) == \
        (7, 5, 2**63 + 5, ["\n\n", "def"], 2, 3, True)
    assert p.temperature == pytest.approx(0.5) and p.top_p == pytest.approx(0.9)


def test_parameters_carry_known_names_and_triton_ones_are_ignored():
    r = parse({"text_input": text("x")}, '{"max_tokens": 3, "triton_enable_empty_final_response": true}')
    assert r.params.max_tokens == 3


@pytest.mark.parametrize("inputs,params,message", [
    ({}, None, "text_input is missing"),
    ({"text_input": text("")}, None, "text_input is empty"),
    ({"text_input": text(b"\xff\xfe")}, None, "text_input is not valid UTF-8"),
    ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, None, "text_input must hold exactly one"),
    ({"text_input": text("x"), "max_tokens": np.array([0], np.int32)}, None, "max_tokens must be a positive"),
    ({"text_input": text("x"), "max_tokens": np.array([1, 2], np.int32)}, None, "max_tokens must hold exactly one"),
    ({"text_input": text("x"), "temperature": np.array([-0.1], np.float32)}, None, "temperature"),
    ({"text_input": text("x"), "temperature": np.array([np.nan], np.float32)}, None, "temperature"),
    ({"text_input": text("x"), "top_p": np.array([0.0], np.float32)}, None, "top_p"),
    ({"text_input": text("x"), "top_p": np.array([1.5], np.float32)}, None, "top_p"),
    ({"text_input": text("x"), "top_k": np.array([-1], np.int32)}, None, "top_k"),
    ({"text_input": text("x"), "max_tokens": text("5")}, None, "max_tokens must be a number"),
    ({"text_input": text("x"), "seed": np.array([-1], np.int64)}, None, "seed must be a non-negative integer, got -1"),
    ({"text_input": text("x"), "max_tokens": np.array([-2**31], np.int32)}, None,  # 2^31 sent over HTTP
     "max_tokens must be a positive integer, got -2147483648 (over HTTP, max_tokens is a 32-bit integer: "
     "numbers above 2147483647 arrive wrapped around, e.g. 2147483648 as -2147483648)"),
    ({"text_input": text("x"), "min_tokens": np.array([9], np.int32), "max_tokens": np.array([5], np.int32)}, None,
     "min_tokens (9) must not exceed max_tokens (5)"),
    ({"text_input": text("x"), "bogus": np.array([1])}, None, "unknown input 'bogus'"),
    ({"text_input": text("x")}, {"beam_width": 2}, "unknown parameter 'beam_width'"),
])
def test_bad_requests_name_the_problem(inputs, params, message):
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        parse(inputs, params)


def test_vllm_style_sampling_parameters():
    r = parse({"text_input": text("x"), "top_k": np.array([3], np.int32), "sampling_parameters": text(
        '{"temperature": 0.5, "top_p": 0.9, "top_k": 7, "max_tokens": 9, "seed": 4, "stop": ["\\n"], "min_tokens": 2}')})
    p = r.params
    assert (p.max_tokens, p.top_k, p.seed, p.stop, p.min_tokens) == (9, 3, 4, ["\n"], 2)  # the tensor top_k wins
    assert p.temperature == pytest.approx(0.5) and p.top_p == pytest.approx(0.9)
    for bad, message in [('{"n": 2}', "unsupported key 'n'"), ("[1]", "JSON object"), ("{", "not valid JSON"),
                         ('{"temperature": "hot"}', "temperature must be a number"),
                         ('{"top_p": 0}', "top_p must be in")]:
        with pytest.raises(InvalidRequest, match=re.escape(message)):
            parse({"text_input": text("x"), "sampling_parameters": text(bad)})
