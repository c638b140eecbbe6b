"""TensorRT-LLM >= 1.x `llmapi` models: the model folders build/trtllm/build_engines.py --interface llmapi
writes (1/model.yaml with speculative_config), and the requests `specdec client` and the load tests send
them, checked against the real model's declared inputs. No GPU and no tensorrt_llm here: the stand-in
template below is a copy of the real config.pbtxt's input list, not NVIDIA's model.py.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from specdec.serving.client import ClientError, request_inputs
from specdec.serving.trtllm_llmapi import llmapi_body

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("build_engines", ROOT / "build" / "trtllm" / "build_engines.py")
be = importlib.util.module_from_spec(spec)
sys.modules.setdefault("build_engines", be)
spec.loader.exec_module(be)

# Every input of triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt in NVIDIA/TensorRT-LLM, as
# stored at commit 0a71057313ec0626527e164a8fc0205c5822e2f5 (main; no release tag could be resolved for it
# here), name -> (data_type, dims). The model.yaml keys follow 1/model.yaml there and the speculative_config
# examples (decoding_type Eagle3 / Draft_Target / NGram) of TensorRT-LLM's llmapi speculative-decoding docs.
LLMAPI_INPUTS = {
    "text_input": ("TYPE_STRING", "[ -1 ]"),
    "image_url": ("TYPE_STRING", "[ -1 ]"),
    "streaming": ("TYPE_BOOL", "[ 1 ]"),
    "sampling_param_best_of": ("TYPE_INT32", "[ 1 ]"),
    "sampling_param_temperature": ("TYPE_FP32", "[ 1 ]"),
    "sampling_param_top_k": ("TYPE_INT32", "[ 1 ]"),
    "sampling_param_top_p": ("TYPE_FP32", "[ 1 ]"),
    "sampling_param_frequency_penalty": ("TYPE_FP32", "[ 1 ]"),
    "sampling_param_presence_penalty": ("TYPE_FP32", "[ 1 ]"),
    "sampling_param_max_tokens": ("TYPE_INT32", "[ 1 ]"),
    "sampling_param_stop": ("TYPE_STRING", "[ -1 ]"),
    "sampling_param_seed": ("TYPE_UINT64", "[ 1 ]"),
    "sampling_param_exclude_input_from_output": ("TYPE_BOOL", "[ 1 ]"),
    "sampling_param_return_perf_metrics": ("TYPE_BOOL", "[ 1 ]"),
    "return_finish_reason": ("TYPE_BOOL", "[ 1 ]"),
    "return_stop_reason": ("TYPE_BOOL", "[ 1 ]"),
    "return_cumulative_logprob": ("TYPE_BOOL", "[ 1 ]"),
    "stop": ("TYPE_BOOL", "[ 1 ]"),
    "lora_id": ("TYPE_UINT64", "[ 1 ]"),
    "lora_name": ("TYPE_STRING", "[ 1 ]"),
    "lora_path": ("TYPE_STRING", "[ 1 ]"),
    "lora_ckpt_source": ("TYPE_STRING", "[ 1 ]"),
}
# outputs of the same file that client.parse_chunk reads
LLMAPI_OUTPUTS = {"text_output", "finish_reason", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"}
NP_TO_TRITON = {"object": "TYPE_STRING", "int32": "TYPE_INT32", "float32": "TYPE_FP32", "uint64": "TYPE_UINT64",
                "bool": "TYPE_BOOL"}


def stand_in_config() -> str:
    inputs = ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: {d} optional: {str(n != "text_input").lower()} }}'
                        for n, (t, d) in LLMAPI_INPUTS.items())
    outputs = ",\n".join(f'  {{ name: "{n}" data_type: TYPE_STRING dims: [ -1 ] }}' for n in sorted(LLMAPI_OUTPUTS))
    return f'name: "tensorrt_llm"\nbackend: "python"\ninput [\n{inputs}\n]\noutput [\n{outputs}\n]\n'


@pytest.fixture(scope="module")
def llmapi_repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("llmapi")
    template = root / "backend" / "all_models" / "llmapi" / "tensorrt_llm"
    (template / "1").mkdir(parents=True)
    (template / "config.pbtxt").write_text(stand_in_config())
    (template / "1" / "model.py").write_text("# stand-in for NVIDIA's llmapi model.py\n")
    for name in ("target", "draft", "eagle3"):
        (root / "kit" / name).mkdir(parents=True)
        (root / "kit" / name / "config.json").write_text("{}")
    opts = be.Options(out=root / "out", trtllm_root=Path("/app"), backend_root=root / "backend",
                      target=root / "kit" / "target", draft=root / "kit" / "draft", eagle3=root / "kit" / "eagle3",
                      methods=be.LLMAPI_METHODS, interface="llmapi", draft_len=5, python=sys.executable)
    be.run_plan(be.plan(opts))  # copies the template, writes model.yaml, then checks the repository
    return opts


def model_yaml(opts, name):
    return yaml.safe_load((opts.repository / name / "1" / "model.yaml").read_text())


def test_every_method_gets_a_model_folder_with_a_parsing_model_yaml(llmapi_repo):
    repo = llmapi_repo.repository
    assert sorted(p.name for p in repo.iterdir()) == ["baseline", "spec_draft", "spec_eagle3", "spec_ngram"]
    assert be.verify_repository(repo) == []
    for name in ("baseline", "spec_draft", "spec_eagle3", "spec_ngram"):
        assert f'name: "{name}"' in (repo / name / "config.pbtxt").read_text()
        config = model_yaml(llmapi_repo, name)
        assert config["model"] == str(llmapi_repo.target) and config["backend"] == "pytorch"
        assert config["triton_config"] == {"max_batch_size": 0, "decoupled": True}  # streaming needs decoupled
    assert "speculative_config" not in model_yaml(llmapi_repo, "baseline")


@pytest.mark.parametrize("name, expected", [
    ("spec_eagle3", {"decoding_type": "Eagle3", "max_draft_len": 5, "speculative_model": "eagle3"}),
    ("spec_draft", {"decoding_type": "Draft_Target", "max_draft_len": 5, "speculative_model": "draft"}),
    ("spec_ngram", {"decoding_type": "NGram", "max_draft_len": 5, "max_matching_ngram_size": be.NGRAM_MATCH}),
])
def test_speculative_config_has_what_each_method_needs(llmapi_repo, name, expected):
    spec = model_yaml(llmapi_repo, name)["speculative_config"]
    kit = llmapi_repo.target.parent
    if "speculative_model" in expected:
        expected = {**expected, "speculative_model": str(kit / expected["speculative_model"])}
        assert Path(spec["speculative_model"]).is_dir()
    assert spec == expected


def test_llmapi_plan_errors(llmapi_repo, tmp_path):
    base = dict(out=tmp_path, trtllm_root=Path("/app"), backend_root=tmp_path, target=llmapi_repo.target,
                interface="llmapi")
    with pytest.raises(be.PlanError, match="method 'medusa' is not served by the llmapi interface"):
        be.plan(be.Options(**base, methods=("medusa",)))
    with pytest.raises(be.PlanError, match="method 'eagle3' needs a eagle3 checkpoint folder"):
        be.plan(be.Options(**base, methods=("eagle3",)))


def declared(arrays: dict[str, np.ndarray]) -> None:
    for name, array in arrays.items():
        assert name in LLMAPI_INPUTS, f"{name} is not an input of the llmapi model"
        assert NP_TO_TRITON[array.dtype.name] == LLMAPI_INPUTS[name][0], name
        assert array.ndim == 1  # max_batch_size 0: no batch dimension


def test_the_clients_llmapi_request_uses_only_declared_inputs():
    sampled = request_inputs("def f():", interface="llmapi", max_tokens=16, temperature=0.7, top_p=0.9, top_k=5,
                             seed=3, stop_words=["\n\n"], exclude_input_in_output=True, stream=True)
    declared(sampled)
    assert sampled["sampling_param_seed"].tolist() == [3] and sampled["streaming"].tolist() == [True]
    assert sampled["sampling_param_return_perf_metrics"].tolist() == [True]  # the acceptance counters
    greedy = request_inputs("def f():", interface="llmapi", max_tokens=16, temperature=0.0, top_p=1.0, top_k=0)
    declared(greedy)
    assert not {"sampling_param_temperature", "sampling_param_top_p", "sampling_param_top_k"} & set(greedy)
    with pytest.raises(ClientError, match="no input for 'num_draft_tokens'"):
        request_inputs("x", interface="llmapi", num_draft_tokens=3)


# run in a subprocess: importing Locust monkey-patches the interpreter (gevent), which must not leak into
# the tests that run tritonserver in this process
PROBE = """
import json
from types import SimpleNamespace
from specdec.serving.client import llmapi_arrays
from specdec.tools.loadtest import users

class Probe(users.GrpcStreamUser):
    def __init__(self):  # no Locust environment: only the request building runs
        self.state = SimpleNamespace(
            options=SimpleNamespace(interface="llmapi", max_tokens=8, max_tokens_spread=0.0, temperature=0.8, top_p=1.0,
                                    top_k=0, seed=10,
                                    request_timeout=1.0),
            prompts=["p0", "p1"], next_request=lambda: (1, "spec_eagle3", -1), record=lambda sample: None)
        self.name = "probe"

    def stream(self, model, body, sample, t0, timeout):
        arrays = llmapi_arrays(body)
        print(json.dumps({"http": body, "grpc": {k: [a.dtype.name, a.ndim] for k, a in arrays.items()}}))

Probe().generate()
"""


def test_the_load_tests_llmapi_request_uses_only_declared_inputs():
    """What tools/loadtest/users.py sends with --interface llmapi: its body (HTTP) and arrays (gRPC)."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True)
    sent = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(sent["http"]) <= set(LLMAPI_INPUTS)
    for name, (dtype, ndim) in sent["grpc"].items():
        assert NP_TO_TRITON[dtype] == LLMAPI_INPUTS[name][0] and ndim == 1, name
    assert sent["http"]["text_input"] == "p1" and sent["http"]["sampling_param_seed"] == 11
    assert sent["http"]["streaming"] is True and sent["http"]["sampling_param_max_tokens"] == 8


def test_llmapi_outputs_are_read_by_the_client():
    from specdec.serving.client import parse_event

    chunk = parse_event({"text_output": "hi", "finish_reason": "length", "acceptance_rate": 0.5,
                         "total_draft_tokens": 8, "total_accepted_draft_tokens": 4})
    assert (chunk.text, chunk.finish_reason, chunk.draft_tokens, chunk.accepted_tokens) == ("hi", "length", 8, 4)
    assert llmapi_body("x", stop_words="END")["sampling_param_stop"] == ["END"]
