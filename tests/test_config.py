"""One config vocabulary: the CLI flags, the config.pbtxt parameters, `specdec build-repo` and the
TensorRT-LLM build script all read their defaults from `specdec.core.config`, and the committed
model repository is what its own first line's command writes. No server needed."""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from specdec import cli
from specdec.core.config import SETTINGS, EngineConfig, add_arguments, from_strings, to_strings
from specdec.core.errors import ConfigurationError
from specdec.serving.config import (BACKEND_SETTINGS, BackendOptions, backend_options, engine_config,
                                   engine_config_for, placed, read_parameters)
from specdec.serving.repository import MODELS, main as build_repo_main, write_repository

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("target", "draft", "medusa", "eagle")


@pytest.fixture
def kit(tmp_path):
    folders = {}
    for name in PATHS:
        folders[name] = tmp_path / "kit" / name
        folders[name].mkdir(parents=True)
    return folders


def engine_defaults() -> dict:
    return {k: v for k, v in EngineConfig().settings().items() if k not in PATHS}


def test_cli_build_repo_and_config_pbtxt_defaults_agree(kit, tmp_path):
    """Three derived surfaces, one set of defaults (the CLI's --policy once said fixed, the rest adaptive)."""
    parser = argparse.ArgumentParser()
    cli.engine_args(parser)
    from_cli = cli.engine_config(parser.parse_args(["--kit", str(kit["target"].parent)]), "baseline", 8)
    assert {k: v for k, v in from_cli.settings().items() if k not in PATHS} == engine_defaults()

    assert build_repo_main(["--target", str(kit["target"]), "--out", str(tmp_path / "repo")]) == 0
    folder = tmp_path / "repo" / "baseline"
    served = engine_config_for(folder)
    assert {k: v for k, v in served.settings().items() if k not in PATHS} == engine_defaults()
    assert backend_options(read_parameters(folder / "config.pbtxt")) == BackendOptions()
    # every setting a config states is one of the vocabulary's, written in its text form
    params = read_parameters(folder / "config.pbtxt")
    assert set(params) <= set(SETTINGS) | set(BACKEND_SETTINGS)
    assert params["policy"] == "adaptive" and params["k"] == str(EngineConfig().proposer.k)


def test_trtllm_build_script_defaults_agree():
    """build/trtllm/build_engines.py is standard-library only (it runs in the TensorRT-LLM image), so
    it cannot import the config; its shared defaults are checked here instead."""
    spec = importlib.util.spec_from_file_location("build_engines", ROOT / "build" / "trtllm" / "build_engines.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    args = module.parser().parse_args(["--out", "x"])
    cfg = EngineConfig()
    assert args.max_batch == cfg.scheduler.max_batch
    assert args.draft_len == cfg.proposer.k


def test_every_setting_round_trips_through_its_text_form():
    for key, s in SETTINGS.items():
        if s.default is not None:
            assert from_strings({key: s.to_text(s.default)}) == {key: s.default}, key
    values = {"eagle_tree": (3, 3, 8), "medusa_tree": ((0,), (0, 0), (1,)), "queue_timeout_s": 1.5}
    assert from_strings(to_strings(values)) == values
    assert to_strings(values)["eagle_tree"] == "3,3,8"


@pytest.mark.parametrize("key, raw, message", [
    ("k", "four", "k='four'"),
    ("eagle_tree", "4,5", "top_k,depth,total_tokens"),
    ("eagle_tree", "4,0,24", "integers >= 1"),
    ("medusa_tree", "[[0], [x]]", "JSON list"),
    ("medusa_tree", "[0, 1]", "lists of integers"),
    ("policy", "sometimes", "policy must be one of adaptive, fixed"),
    ("dtype", "int8", "dtype must be one of"),
    ("kk", "1", "unknown setting 'kk'"),
])
def test_bad_text_values_name_the_setting(key, raw, message):
    with pytest.raises(ConfigurationError, match=message):
        from_strings({key: raw})


def test_flags_are_typed_and_refuse_bad_values(capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser, ["k", "eagle_tree", "policy"])
    a = parser.parse_args(["-k", "3", "--eagle-tree", "2,3,6"])
    assert (a.k, a.eagle_tree, a.policy) == (3, (2, 3, 6), "adaptive")
    with pytest.raises(SystemExit):
        parser.parse_args(["--eagle-tree", "2,3"])
    assert "top_k,depth,total_tokens" in capsys.readouterr().err


def test_nested_config_from_flat_keys():
    cfg = EngineConfig.of(method="eagle2", k=3, policy="fixed", max_batch=2, dtype="float64", target="t")
    assert (cfg.proposer.method, cfg.proposer.k, cfg.scheduler.policy, cfg.scheduler.max_batch,
            cfg.runtime.dtype, cfg.checkpoints.target) == ("eagle2", 3, "fixed", 2, "float64", "t")
    assert cfg.with_(k=5).proposer.k == 5 and cfg.proposer.k == 3
    with pytest.raises(ConfigurationError, match="unknown setting 'adaptive'"):
        EngineConfig.of(adaptive=False)


def test_engine_config_from_parameters(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "ckpt").mkdir()
    cfg = engine_config({"target": "../ckpt", "method": "ngram", "k": "3", "policy": "fixed", "max_batch": "2",
                         "queue_timeout_s": "1.5", "dtype": "float64", "draft": ""}, tmp_path / "m")
    assert cfg.checkpoints.target == str((tmp_path / "ckpt").resolve())
    assert (cfg.proposer.method, cfg.proposer.k, cfg.scheduler.policy, cfg.scheduler.max_batch,
            cfg.scheduler.queue_timeout_s, cfg.runtime.dtype, cfg.checkpoints.draft) == \
        ("ngram", 3, "fixed", 2, 1.5, "float64", None)
    with pytest.raises(ConfigurationError, match="unknown setting 'kk'"):
        engine_config({"target": "x", "kk": "1"}, tmp_path)
    with pytest.raises(ConfigurationError, match="model parameter k="):
        engine_config({"target": "x", "k": "four"}, tmp_path)
    with pytest.raises(ConfigurationError, match="target"):
        engine_config({"method": "baseline"}, tmp_path)
    with pytest.raises(ConfigurationError, match="stream_interval must be >= 1"):
        engine_config({"target": "x", "stream_interval": "0"}, tmp_path)


def test_spec_eagle_is_eagle1_unless_a_tree_is_given(tmp_path, kit):
    write_repository(tmp_path / "a", kit["target"], eagle=kit["eagle"], models=["spec_eagle"])
    assert read_parameters(tmp_path / "a" / "spec_eagle" / "config.pbtxt")["method"] == "eagle"
    write_repository(tmp_path / "b", kit["target"], eagle=kit["eagle"], models=["spec_eagle"], eagle_tree=(2, 3, 6))
    params = read_parameters(tmp_path / "b" / "spec_eagle" / "config.pbtxt")
    assert (params["method"], params["eagle_tree"]) == ("eagle2", "2,3,6")
    assert engine_config_for(tmp_path / "b" / "spec_eagle").proposer.eagle_tree == (2, 3, 6)


def test_gpu_repository_places_each_instance_on_its_gpu(tmp_path, kit):
    write_repository(tmp_path / "repo", kit["target"], models=["baseline"], device="cuda", dtype="bfloat16")
    folder = tmp_path / "repo" / "baseline"
    assert "kind: KIND_GPU" in (folder / "config.pbtxt").read_text()
    cfg = engine_config_for(folder)
    assert placed(cfg, "GPU", 1).runtime.device == "cuda:1" and placed(cfg, "CPU", 0).runtime.device == "cuda"
    write_repository(tmp_path / "cpu", kit["target"], models=["baseline"])
    cpu = engine_config_for(tmp_path / "cpu" / "baseline")
    assert "kind: KIND_CPU" in (tmp_path / "cpu" / "baseline" / "config.pbtxt").read_text()
    with pytest.raises(ConfigurationError, match="device"):
        placed(cpu, "GPU", 0)


def test_repository_round_trip(tmp_path, kit):
    names = write_repository(tmp_path / "repo", **kit, k=3, max_batch=2, dtype="float64", policy="fixed")
    assert names == list(MODELS)
    for name, (method, _) in MODELS.items():
        folder = tmp_path / "repo" / name
        assert (folder / "1").is_dir()
        text_ = (folder / "config.pbtxt").read_text()
        assert 'backend: "specdec"' in text_ and "decoupled: true" in text_ and 'name: "text_input"' in text_
        params = read_parameters(folder / "config.pbtxt")
        assert params["method"] == method and not params["target"].startswith("/")  # relative: portable
        cfg = engine_config_for(folder)
        assert cfg.checkpoints.target == str(kit["target"].resolve())
        assert (cfg.proposer.k, cfg.scheduler.policy, cfg.scheduler.max_batch) == (3, "fixed", 2)
    # only what the checkpoints allow
    assert write_repository(tmp_path / "r2", kit["target"]) == ["baseline", "spec_ngram"]
    assert build_repo_main(["--target", str(kit["target"]), "--eagle", str(kit["eagle"]), "--out",
                            str(tmp_path / "r3"), "--prefix", "ab_"]) == 0
    assert sorted(p.name for p in (tmp_path / "r3").iterdir()) == ["ab_baseline", "ab_spec_eagle", "ab_spec_ngram"]
    assert build_repo_main(["--target", str(tmp_path / "missing"), "--out", str(tmp_path / "r4")]) == 2
    with pytest.raises(ValueError, match="unknown engine settings: adaptive"):
        write_repository(tmp_path / "r5", kit["target"], adaptive=False)


def test_committed_model_repository_is_what_its_command_writes(tmp_path, monkeypatch):
    """model_repository/ is generated, never hand-edited: each config's first line is the
    `specdec build-repo` command, and rerunning it writes the same file (checkpoint paths aside,
    which are relative to where the files live; they must name the same folders)."""
    committed = sorted((ROOT / "model_repository").glob("*/config.pbtxt"))
    assert {p.parent.name for p in committed} == set(MODELS)
    monkeypatch.chdir(ROOT)
    commands = set()
    for path in committed:
        first = path.read_text().splitlines()[0]
        commands.add(first.split("`")[1])
    assert len(commands) == 1, commands
    argv = shlex.split(commands.pop())
    assert argv[:2] == ["specdec", "build-repo"]
    out = argv.index("--out") + 1
    argv[out] = str(tmp_path / "model_repository")
    assert build_repo_main(argv[2:]) == 0

    def without_paths(text: str) -> list[str]:
        return [line for line in text.splitlines()[1:] if not any(f'key: "{k}"' in line for k in PATHS)]

    for path in committed:
        fresh = tmp_path / "model_repository" / path.parent.name
        assert without_paths((fresh / "config.pbtxt").read_text()) == without_paths(path.read_text()), path
        assert engine_config_for(fresh) == engine_config_for(path.parent)


def test_a_client_does_not_load_torch():
    """The interface's tensor names live in a torch-free module: a client only talking to Triton
    (`specdec.serving.client`, the Locust users) never imports torch."""
    code = "import specdec.serving.client, sys; assert 'torch' not in sys.modules, 'torch was imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_method_help_names_every_registered_proposer():
    """The config stays torch-free, so its help text names the methods; the registry is the truth."""
    from specdec.core.proposers import PROPOSERS

    for method in ("baseline", *PROPOSERS):
        assert method in SETTINGS["method"].help, method


def test_request_defaults_are_the_sampling_defaults():
    """A request's defaults are written in the interface table (torch-free, what clients and the
    docs read) and in SamplingParams (core): the two must agree, name by name."""
    from dataclasses import fields as dc_fields

    from specdec.core.sampling import SamplingParams
    from specdec.serving.interface import INPUTS

    core = {f.name: getattr(SamplingParams(), f.name) for f in dc_fields(SamplingParams)}
    shared = [f for f in INPUTS if f.name in core]
    assert {f.name for f in shared} >= {"max_tokens", "temperature", "top_p", "top_k", "seed", "min_tokens",
                                         "ignore_eos", "num_draft_tokens"}
    for f in shared:
        assert f.default == core[f.name], f.name
