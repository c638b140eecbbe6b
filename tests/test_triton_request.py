"""Request parsing, model-config parameters and the repository writer (no server needed)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from specdec.core.errors import ConfigurationError, InvalidRequest
from specdec.serving.config import engine_config, engine_config_for, placed, read_parameters
from specdec.serving.repository import MODELS, main as build_repo_main, write_repository
from specdec.serving.request import DEFAULT_MAX_TOKENS, parse


def text(s: str | bytes) -> np.ndarray:
    return np.array([s.encode() if isinstance(s, str) else s], dtype=np.object_)


def test_defaults():
    r = parse({"text_input": text("hello")})
    assert r.prompt == "hello" and not r.stream and not r.exclude_input
    p = r.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.min_tokens) == \
        (DEFAULT_MAX_TOKENS, 0.0, 1.0, 0, None, [], 0)
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


def test_engine_config_from_parameters(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "ckpt").mkdir()
    cfg = engine_config({"target": "../ckpt", "method": "ngram", "k": "3", "policy": "fixed", "max_batch": "2",
                         "queue_timeout_s": "1.5", "dtype": "float64", "draft": ""}, tmp_path / "m")
    assert cfg.target == str((tmp_path / "ckpt").resolve())
    assert (cfg.method, cfg.k, cfg.adaptive, cfg.max_batch, cfg.queue_timeout_s, cfg.dtype, cfg.draft) == \
        ("ngram", 3, False, 2, 1.5, "float64", None)
    with pytest.raises(ConfigurationError, match="unknown model parameter 'kk'"):
        engine_config({"target": "x", "kk": "1"}, tmp_path)
    with pytest.raises(ConfigurationError, match="k="):
        engine_config({"target": "x", "k": "four"}, tmp_path)
    with pytest.raises(ConfigurationError, match="target"):
        engine_config({"method": "baseline"}, tmp_path)


def test_spec_eagle_is_eagle1_unless_a_tree_is_given(tmp_path):
    for name in ("t", "e"):
        (tmp_path / name).mkdir()
    write_repository(tmp_path / "a", tmp_path / "t", eagle=tmp_path / "e", models=["spec_eagle"])
    assert read_parameters(tmp_path / "a" / "spec_eagle" / "config.pbtxt")["method"] == "eagle"
    write_repository(tmp_path / "b", tmp_path / "t", eagle=tmp_path / "e", models=["spec_eagle"], eagle_tree="4,5,24")
    params = read_parameters(tmp_path / "b" / "spec_eagle" / "config.pbtxt")
    assert (params["method"], params["eagle_tree"]) == ("eagle2", "4,5,24")


def test_gpu_repository_places_each_instance_on_its_gpu(tmp_path):
    (tmp_path / "t").mkdir()
    write_repository(tmp_path / "repo", tmp_path / "t", models=["baseline"], device="cuda", dtype="bfloat16")
    folder = tmp_path / "repo" / "baseline"
    assert "kind: KIND_GPU" in (folder / "config.pbtxt").read_text()
    cfg = engine_config_for(folder)
    assert placed(cfg, "GPU", 1).device == "cuda:1" and placed(cfg, "CPU", 0).device == "cuda"
    write_repository(tmp_path / "cpu", tmp_path / "t", models=["baseline"])
    cpu = engine_config_for(tmp_path / "cpu" / "baseline")
    assert "kind: KIND_CPU" in (tmp_path / "cpu" / "baseline" / "config.pbtxt").read_text()
    with pytest.raises(ConfigurationError, match="device"):
        placed(cpu, "GPU", 0)


def test_repository_round_trip(tmp_path):
    kit = {}
    for name in ("target", "draft", "medusa", "eagle"):
        kit[name] = tmp_path / "kit" / name
        kit[name].mkdir(parents=True)
    names = write_repository(tmp_path / "repo", **kit, k=3, max_batch=2, dtype="float64", adaptive=False)
    assert names == list(MODELS)
    for name, (method, _) in MODELS.items():
        folder = tmp_path / "repo" / name
        assert (folder / "1").is_dir()
        text_ = (folder / "config.pbtxt").read_text()
        assert 'backend: "specdec"' in text_ and "decoupled: true" in text_ and 'name: "text_input"' in text_
        params = read_parameters(folder / "config.pbtxt")
        assert params["method"] == method and not params["target"].startswith("/")  # relative: portable
        cfg = engine_config_for(folder)
        assert cfg.target == str(kit["target"].resolve()) and cfg.k == 3 and not cfg.adaptive
    # only what the checkpoints allow
    assert write_repository(tmp_path / "r2", kit["target"]) == ["baseline", "spec_ngram"]
    assert build_repo_main(["--target", str(kit["target"]), "--eagle", str(kit["eagle"]), "--out",
                            str(tmp_path / "r3"), "--prefix", "ab_"]) == 0
    assert sorted(p.name for p in (tmp_path / "r3").iterdir()) == ["ab_baseline", "ab_spec_eagle", "ab_spec_ngram"]
    assert build_repo_main(["--target", str(tmp_path / "missing"), "--out", str(tmp_path / "r4")]) == 2


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
