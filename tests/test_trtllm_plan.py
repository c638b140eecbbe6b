"""The TensorRT-LLM build plan (build/trtllm/build_engines.py), checked without a GPU.

What runs here: the plan (every convert / trtllm-build command and its flags), the template parameters,
the checkpoint staging helpers, and the repository assembly end to end against small stand-in templates
(written below with the real templates' placeholder and tensor names) and a stand-in fill_template.py with
the documented command line. The real NVIDIA templates, converters and trtllm-build only exist on a GPU
host: the test that needs them is skipped here.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "build" / "trtllm" / "build_engines.py"

spec = importlib.util.spec_from_file_location("build_engines", SCRIPT)
be = importlib.util.module_from_spec(spec)
sys.modules["build_engines"] = be
spec.loader.exec_module(be)


# ------------------------------------------------------------------------------------- tiny kit

def tensor(shape, dtype="F16"):
    n = 1
    for s in shape:
        n *= s
    return dtype, list(shape), os.urandom(n * 2)


def llama_config(vocab, hidden, layers, tie=True, **extra):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": hidden * 3, "num_hidden_layers": layers,
            "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 128, "tie_word_embeddings": tie, "torch_dtype": "float16", **extra}


def decoder_layer(prefix, hidden, input_norm=True):
    t = {f"{prefix}.self_attn.{p}.weight": tensor((hidden if p in "qo" else hidden // 2, hidden))
         for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    t.update({f"{prefix}.mlp.{p}.weight": tensor((hidden * 3, hidden)) for p in ("gate_proj", "up_proj")})
    t[f"{prefix}.mlp.down_proj.weight"] = tensor((hidden, hidden * 3))
    t[f"{prefix}.post_attention_layernorm.weight"] = tensor((hidden,))
    if input_norm:
        t[f"{prefix}.input_layernorm.weight"] = tensor((hidden,))
    return t


def write_model(folder, config, tensors):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    be.write_safetensors(folder / ("medusa_lm_head.safetensors" if "medusa_num_heads" in config
                                   else "model.safetensors"), tensors)


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    root = tmp_path_factory.mktemp("kit")
    vocab, hidden = 64, 16
    for name, layers, h in (("target", 2, hidden), ("draft", 1, 8)):
        t = {"model.embed_tokens.weight": tensor((vocab, h)), "model.norm.weight": tensor((h,))}
        for i in range(layers):
            t.update(decoder_layer(f"model.layers.{i}", h))
        write_model(root / name, llama_config(vocab, h, layers), t)
    medusa = {}
    for head in range(3):
        medusa[f"{head}.0.linear.weight"] = tensor((hidden, hidden))
        medusa[f"{head}.0.linear.bias"] = tensor((hidden,))
        medusa[f"{head}.1.weight"] = tensor((vocab, hidden))
    write_model(root / "medusa", {"medusa_num_heads": 3, "medusa_num_layers": 1, "hidden_size": hidden,
                                  "vocab_size": vocab}, medusa)
    eagle = {"fc.weight": tensor((hidden, 2 * hidden)), "fc.bias": tensor((hidden,)),
             **decoder_layer("layers.0", hidden, input_norm=False)}
    write_model(root / "eagle", llama_config(vocab, hidden, 1, tie=False, bias=True), eagle)
    return root


# ------------------------------------------------------- stand-in tensorrtllm_backend checkout

PARAM = 'parameters: {{\n  key: "{key}"\n  value: {{\n    string_value: "${{{key}}}"\n  }}\n}}\n'

CLIENT_INPUTS = """input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "temperature" data_type: TYPE_FP32 dims: [ 1 ] optional: true },
  { name: "top_p" data_type: TYPE_FP32 dims: [ 1 ] optional: true },
  { name: "top_k" data_type: TYPE_INT32 dims: [ 1 ] optional: true },
  { name: "random_seed" data_type: TYPE_UINT64 dims: [ 1 ] optional: true }%s
]
output [
  { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] },
  { name: "generation_logits" data_type: ${logits_datatype} dims: [ -1, -1, -1 ] }
]
"""

STAND_IN = {
    "ensemble": 'name: "ensemble"\nplatform: "ensemble"\nmax_batch_size: ${triton_max_batch_size}\n'
                + CLIENT_INPUTS % "" + """ensemble_scheduling {
  step [
    { model_name: "preprocessing" model_version: -1
      input_map { key: "QUERY" value: "text_input" }
      output_map { key: "INPUT_ID" value: "_INPUT_ID" } },
    { model_name: "tensorrt_llm" model_version: -1
      input_map { key: "input_ids" value: "_INPUT_ID" }
      output_map { key: "output_ids" value: "_TOKENS_BATCH" } },
    { model_name: "postprocessing" model_version: -1
      input_map { key: "TOKENS_BATCH" value: "_TOKENS_BATCH" }
      output_map { key: "OUTPUT" value: "text_output" } }
  ]
}
""",
    "preprocessing": 'name: "preprocessing"\nbackend: "python"\nmax_batch_size: ${triton_max_batch_size}\n'
                     'dynamic_batching { max_queue_delay_microseconds: ${max_queue_delay_microseconds}\n'
                     '  default_queue_policy { max_queue_size: ${max_queue_size} } }\n'
                     'instance_group [ { count: ${preprocessing_instance_count} kind: KIND_CPU } ]\n'
                     + "".join(PARAM.format(key=k) for k in ("tokenizer_dir", "add_special_tokens")),
    "postprocessing": 'name: "postprocessing"\nbackend: "python"\nmax_batch_size: ${triton_max_batch_size}\n'
                      'instance_group [ { count: ${postprocessing_instance_count} kind: KIND_CPU } ]\n'
                      + "".join(PARAM.format(key=k) for k in ("tokenizer_dir", "skip_special_tokens")),
    "tensorrt_llm": 'name: "tensorrt_llm"\nbackend: "${triton_backend}"\nmax_batch_size: ${triton_max_batch_size}\n'
                    'model_transaction_policy { decoupled: ${decoupled_mode} }\n'
                    'dynamic_batching { preferred_batch_size: [ ${triton_max_batch_size} ]\n'
                    '  max_queue_delay_microseconds: ${max_queue_delay_microseconds}\n'
                    '  default_queue_policy { max_queue_size: ${max_queue_size} } }\n'
                    'input [ { name: "input_ids" data_type: TYPE_INT32 dims: [ -1 ] allow_ragged_batch: true },\n'
                    '  { name: "encoder_input_features" data_type: ${encoder_input_features_data_type}'
                    ' dims: [ -1, -1 ] optional: true } ]\n'
                    'output [ { name: "output_ids" data_type: TYPE_INT32 dims: [ -1, -1 ] },\n'
                    '  { name: "generation_logits" data_type: ${logits_datatype} dims: [ -1, -1, -1 ] } ]\n'
                    'instance_group [ { count: 1 kind : KIND_CPU } ]\n'
                    + "".join(PARAM.format(key=k) for k in (
                        "max_beam_width", "batching_strategy", "engine_dir", "kv_cache_free_gpu_mem_fraction",
                        "enable_kv_cache_reuse", "exclude_input_in_output", "enable_chunked_context",
                        "decoding_mode", "medusa_choices", "eagle_choices", "gpu_device_ids",
                        "lookahead_window_size")),
    "tensorrt_llm_bls": 'name: "tensorrt_llm_bls"\nbackend: "python"\nmax_batch_size: ${triton_max_batch_size}\n'
                        'model_transaction_policy { decoupled: ${decoupled_mode} }\n'
                        + CLIENT_INPUTS % ',\n  { name: "num_draft_tokens" data_type: TYPE_INT32 dims: [ 1 ]'
                                          ' optional: true }'
                        + 'instance_group [ { count: ${bls_instance_count} kind : KIND_CPU } ]\n'
                        + "".join(PARAM.format(key=k) for k in (
                            "accumulate_tokens", "tensorrt_llm_model_name", "tensorrt_llm_draft_model_name")),
}

# The documented command line: fill_template.py -i FILE k:v,k:v ('\\' escapes the next character, at
# both the ',' and the ':' split), string.Template.safe_substitute, every key must occur in the file.
FILL_TEMPLATE = r'''
import argparse, string

def split(text, delimiter):
    parts, current, escaped = [], "", False
    for ch in text:
        if escaped:
            current, escaped = current + ch, False
        elif ch == "\\":
            escaped = True
        elif ch == delimiter:
            parts.append(current)
            current = ""
        else:
            current += ch
    return parts + [current]

ap = argparse.ArgumentParser()
ap.add_argument("file_path")
ap.add_argument("substitutions")
ap.add_argument("-i", "--in_place", action="store_true")
args = ap.parse_args()
text = open(args.file_path).read()
subs = {}
for item in split(args.substitutions, ","):
    key, value = split(item, ":")
    assert key in text, f"key {key} not in {args.file_path}"
    subs[key] = value
out = string.Template(text).safe_substitute(subs)
if args.in_place:
    open(args.file_path, "w").write(out)
else:
    print(out)
'''


@pytest.fixture(scope="module")
def backend_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("backend")
    for name, text in STAND_IN.items():
        folder = root / "all_models" / "inflight_batcher_llm" / name
        (folder / "1").mkdir(parents=True)
        (folder / "config.pbtxt").write_text(text)
    (root / "tools").mkdir()
    (root / "tools" / "fill_template.py").write_text(FILL_TEMPLATE)
    return root


def options(kit, out, backend_root, **kw):
    base = dict(out=out, trtllm_root=Path("/app"), backend_root=backend_root, target=kit / "target",
                draft=kit / "draft", medusa=kit / "medusa", eagle=kit / "eagle", python=sys.executable)
    base.update(kw)
    return be.Options(**base)


def flag(argv, name):
    return argv[argv.index(name) + 1]


# ------------------------------------------------------------------------------------------ plan

def test_dry_run_prints_convert_and_build_for_every_method(kit, backend_root, tmp_path):
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = be.main(["--kit", str(kit), "--out", str(tmp_path / "out"), "--trtllm-root", "/app",
                      "--backend-root", str(backend_root), "--dry-run", "--dtype", "float16", "--max-batch", "8"])
    text = buf.getvalue()
    assert rc == 0
    assert not (tmp_path / "out").exists(), "a dry run must not write anything"
    assert "/app/examples/llama/convert_checkpoint.py --model_dir" in text
    assert "/app/examples/medusa/convert_checkpoint.py" in text and "--medusa_model_dir" in text
    assert "/app/examples/eagle/convert_checkpoint.py" in text and "--eagle_model_dir" in text
    for mode in ("draft_tokens_external", "medusa", "eagle"):
        assert f"--speculative_decoding_mode {mode} --max_draft_len" in text
    assert text.count("trtllm-build ") == 5  # target, target (external drafts), draft, medusa, eagle
    assert "fill_template.py -i" in text and "#     engine_dir = " in text  # every parameter is listed


def test_plan_flags(kit, backend_root, tmp_path):
    opts = options(kit, tmp_path / "out", backend_root, draft_len=5)
    steps = be.plan(opts)
    builds = {s.name: s.argv for s in steps if s.argv[0] == "trtllm-build"}
    medusa_nodes = len([p for p in be.MC_SIM_7B_63 if len(p) <= 3])  # 3 heads in the kit
    assert medusa_nodes < 63
    m = builds["build medusa engine"]
    assert flag(m, "--speculative_decoding_mode") == "medusa" and flag(m, "--max_draft_len") == str(medusa_nodes)
    e = builds["build eagle engine"]
    assert flag(e, "--speculative_decoding_mode") == "eagle" and flag(e, "--max_draft_len") == "63"
    d = builds["build target engine for external draft tokens"]
    assert flag(d, "--speculative_decoding_mode") == "draft_tokens_external" and flag(d, "--max_draft_len") == "5"
    assert "--speculative_decoding_mode" not in builds["build target engine"]
    assert "--speculative_decoding_mode" not in builds["build draft engine"]
    for argv in builds.values():
        assert flag(argv, "--max_batch_size") == "8" and flag(argv, "--gemm_plugin") == "float16"
        assert flag(argv, "--max_seq_len") == "128" and flag(argv, "--max_input_len") == "64"
        assert flag(argv, "--use_paged_context_fmha") == "enable"  # KV reuse for draft-target

    converts = {s.name: s.argv for s in steps if s.name.startswith("convert")}
    mc = converts["convert target + medusa heads"]
    assert flag(mc, "--num_medusa_heads") == "3" and flag(mc, "--num_medusa_layers") == "1"
    assert flag(mc, "--max_medusa_token_len") == str(medusa_nodes) and flag(mc, "--rotary_base") == "10000.0"
    ec = converts["convert target + eagle head"]
    assert flag(ec, "--num_eagle_layers") == "4" and flag(ec, "--max_draft_len") == "63"
    assert flag(ec, "--max_non_leaves_per_layer") == "10"  # mc_sim_7b_63: all ten first-level nodes branch
    # the kit ties embeddings: every conversion reads the staged copy that stores lm_head.weight
    assert flag(mc, "--model_dir").endswith("staging/target-untied")
    assert flag(converts["convert draft"], "--model_dir").endswith("staging/draft-untied")

    # order: staging before converting, converting before building, engines before the repository
    names = [s.name for s in steps]
    assert names.index("stage target: store lm_head.weight (tied embeddings)") < names.index("convert target")
    assert names.index("convert target") < names.index("build target engine")
    assert names.index("convert target + medusa heads") < names.index("build medusa engine")
    engines = {flag(a, "--output_dir") for a in builds.values()}
    filled = [dict(s.params) for s in steps if s.params]
    used = {p["engine_dir"] for p in filled if "engine_dir" in p}
    assert used == engines  # every engine is served, and every served engine is built


def test_tree_helpers_match_the_pytorch_engine():
    from specdec.core.proposers.medusa import MC_SIM_7B_63, check_tree

    assert be.MC_SIM_7B_63 == MC_SIM_7B_63
    for heads in (1, 2, 3, 4):
        assert be.filter_tree(be.MC_SIM_7B_63, heads) == check_tree(MC_SIM_7B_63, heads, 10**6)
    tree = be.filter_tree(be.MC_SIM_7B_63, 3)
    text = be.choices_string(tree)
    assert text.startswith("{0}, {0, 0}, {1}, {0, 1}")
    # read back the way the backend does (csvStrToVecVecInt: "{a, b}, {c}")
    assert [[int(x) for x in g.split(",")] for g in re.findall(r"\{([^}]*)\}", text)] == tree
    assert be.parse_tree("chain:3") == [[0], [0, 0], [0, 0, 0]]
    assert be.max_non_leaves_per_level([[0], [0, 0], [0, 0, 0]]) == 1
    with pytest.raises(be.PlanError):
        be.filter_tree([[0, 1], [0]], 4)  # child before parent


def test_template_parameters_are_complete(kit, backend_root, tmp_path):
    opts = options(kit, tmp_path / "out", backend_root)
    [(repo, models)] = be.repositories(opts).items()
    names = [m.name for m in models]
    assert names == ["preprocessing", "postprocessing", "baseline", "baseline_trtllm", "spec_draft",
                     "spec_draft_target_trtllm", "spec_draft_draft_trtllm", "spec_medusa", "spec_medusa_trtllm",
                     "spec_eagle", "spec_eagle_trtllm"]
    by_name = {m.name: m for m in models}
    for m in models:
        missing = set(be.MANDATORY[m.template]) - set(m.params)
        assert not missing, f"{m.name}: mandatory parameters missing: {missing}"
    assert by_name["preprocessing"].params["tokenizer_dir"] == str(kit / "target")
    assert by_name["preprocessing"].params["add_special_tokens"] == "False"
    assert by_name["spec_medusa_trtllm"].params["decoding_mode"] == "medusa"
    assert by_name["spec_medusa_trtllm"].params["medusa_choices"].count("{") == len(be.filter_tree(be.MC_SIM_7B_63, 3))
    assert by_name["spec_eagle_trtllm"].params["decoding_mode"] == "eagle"
    assert by_name["spec_eagle_trtllm"].params["eagle_choices"].count("{") == 63
    bls = by_name["spec_draft"].params
    assert bls["tensorrt_llm_model_name"] == "spec_draft_target_trtllm"
    assert bls["tensorrt_llm_draft_model_name"] == "spec_draft_draft_trtllm"
    for name in ("spec_draft_target_trtllm", "spec_draft_draft_trtllm"):  # the BLS calls them non-decoupled
        assert by_name[name].params["decoupled_mode"] == "False"
        assert by_name[name].params["enable_kv_cache_reuse"] == "True"
    for name in ("baseline_trtllm", "spec_medusa_trtllm", "spec_eagle_trtllm"):  # streamed via the ensemble
        assert by_name[name].params["decoupled_mode"] == "True"
    fractions = [float(m.params["kv_cache_free_gpu_mem_fraction"]) for m in models if m.template == "tensorrt_llm"]
    assert len(fractions) == 5 and sum(fractions) <= 0.9


def test_fill_values_are_escaped_for_fill_template():
    ns: dict = {}
    exec(compile(FILL_TEMPLATE.split("ap = argparse")[0], "fill", "exec"), ns)
    split = ns["split"]
    params = {"medusa_choices": "{0}, {0, 0}, {1}", "tokenizer_dir": "/models/a,b:c\\d", "x": "plain"}
    arg = be.fill_argument(params)
    parsed = dict(split(item, ":") for item in split(arg, ","))
    assert parsed == params


def test_repository_end_to_end_with_stand_in_templates(kit, backend_root, tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    opts = options(kit, tmp_path / "out", backend_root)
    steps = be.repository_steps(opts)
    be.run_plan(steps)  # copy, fill with (stand-in) fill_template.py, then the repository check
    repo = opts.repository
    assert be.verify_repository(repo) == []
    configs = {}
    for folder in sorted(p for p in repo.iterdir()):
        text = (folder / "config.pbtxt").read_text()
        assert "${triton_max_batch_size}" not in text
        configs[folder.name] = text_format.Parse(text, model_config_pb2.ModelConfig())
        assert configs[folder.name].name == folder.name
    assert set(configs) == {"preprocessing", "postprocessing", "baseline", "baseline_trtllm", "spec_draft",
                            "spec_draft_target_trtllm", "spec_draft_draft_trtllm", "spec_medusa",
                            "spec_medusa_trtllm", "spec_eagle", "spec_eagle_trtllm"}
    steps_of = {n: [s.model_name for s in c.ensemble_scheduling.step] for n, c in configs.items() if c.platform}
    assert steps_of["spec_medusa"] == ["preprocessing", "spec_medusa_trtllm", "postprocessing"]
    assert steps_of["baseline"] == ["preprocessing", "baseline_trtllm", "postprocessing"]
    for served in ("baseline", "spec_draft", "spec_medusa", "spec_eagle"):  # the client tensor names
        c = configs[served]
        assert {"text_input", "max_tokens", "stream", "temperature", "top_p", "top_k"} <= {i.name for i in c.input}
        assert "text_output" in {o.name for o in c.output}
    assert "num_draft_tokens" in {i.name for i in configs["spec_draft"].input}
    medusa = configs["spec_medusa_trtllm"]
    assert medusa.backend == "tensorrtllm" and medusa.model_transaction_policy.decoupled
    assert medusa.parameters["medusa_choices"].string_value == be.choices_string(be.filter_tree(be.MC_SIM_7B_63, 3))
    assert medusa.parameters["engine_dir"].string_value == str(opts.engines / "medusa")
    assert medusa.parameters["lookahead_window_size"].string_value == "${lookahead_window_size}"  # optional: unset
    assert not configs["spec_draft_target_trtllm"].model_transaction_policy.decoupled
    assert configs["spec_draft"].parameters["tensorrt_llm_draft_model_name"].string_value == "spec_draft_draft_trtllm"
    assert configs["spec_draft"].instance_group[0].count == 8


def test_per_method_layout(kit, backend_root, tmp_path):
    opts = options(kit, tmp_path / "out", backend_root, layout="per-method", methods=("baseline", "medusa"))
    repos = be.repositories(opts)
    assert sorted(p.name for p in repos) == ["baseline", "spec_medusa"]
    for repo, models in repos.items():
        assert [m.name for m in models][:2] == ["preprocessing", "postprocessing"]
        assert float(models[-1].params["kv_cache_free_gpu_mem_fraction"]) == 0.85


def test_verify_repository_names_problems(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text(
        'name: "other"\nplatform: "ensemble"\nmax_batch_size: ${triton_max_batch_size}\n'
        'ensemble_scheduling { step [ { model_name: "missing" model_version: -1 } ] }\n')
    problems = " | ".join(be.verify_repository(tmp_path))
    assert "differs from its folder" in problems and "triton_max_batch_size" in problems
    assert "'missing'" in problems


def test_plan_errors(kit, backend_root, tmp_path):
    with pytest.raises(be.PlanError, match="needs a draft"):
        be.plan(options(kit, tmp_path, backend_root, draft=tmp_path / "nope"))
    bad = tmp_path / "draft"
    shutil.copytree(kit / "draft", bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["vocab_size"] = 99
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(be.PlanError, match="vocab_size"):
        be.plan(options(kit, tmp_path, backend_root, draft=bad, methods=("draft",)))
    assert be.main(["--kit", str(kit), "--out", str(tmp_path), "--methods", "lookahead", "--dry-run"]) == 2
    assert be.medusa_rope_scaling({"rope_scaling": {"type": "linear", "factor": 2}}) == (
        "--rotary_scaling", "linear", "2.0")
    with pytest.raises(be.PlanError, match="llama3"):
        be.medusa_rope_scaling({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


# ------------------------------------------------------------------------------------ staging

def test_untie_stores_lm_head(kit, tmp_path):
    from safetensors import safe_open

    dst = tmp_path / "untied"
    assert be.needs_untie(kit / "target")
    be.untie(kit / "target", dst)
    assert not be.needs_untie(dst)
    assert json.loads((dst / "config.json").read_text())["tie_word_embeddings"] is False
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert not (dst / "model.safetensors").exists()  # loaders must go through the index
    assert set(index) == set(be.weight_files(kit / "target")) | {"lm_head.weight"}
    with safe_open(str(dst / index["lm_head.weight"]), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        lm_head = f.get_tensor("lm_head.weight")
    with safe_open(str(dst / index["model.embed_tokens.weight"]), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    import torch

    assert lm_head.view(torch.int16).equal(embed.view(torch.int16))  # same bits (random bytes hold NaNs)
    assert (dst / "tokenizer.json").exists()


def test_prepare_eagle_adds_the_target_embedding(kit, tmp_path):
    dst = tmp_path / "eagle"
    be.prepare_eagle(kit / "eagle", kit / "target", dst)
    names = be.safetensors_names(dst / "model.safetensors")
    assert "embed_tokens.weight" in names and "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    assert be.read_tensor(dst / "model.safetensors", "embed_tokens.weight") == be.read_tensor(
        kit / "target" / "model.safetensors", "model.embed_tokens.weight")


def test_medusa_heads_as_pt(kit, tmp_path):
    torch = pytest.importorskip("torch")
    assert be.main(["_medusa-pt", str(kit / "medusa"), str(tmp_path / "m")]) == 0  # the helper's entry point
    state = torch.load(tmp_path / "m" / "medusa_lm_head.pt", weights_only=True)
    assert sorted(state) == sorted(be.safetensors_names(kit / "medusa" / "medusa_lm_head.safetensors"))
    assert tuple(state["2.1.weight"].shape) == (64, 16)


def test_safetensors_writer_round_trip(tmp_path):
    t = {"b": tensor((3, 2)), "a": ("I32", [2], struct.pack("<2i", 7, -1))}
    be.write_safetensors(tmp_path / "x.safetensors", t)
    assert sorted(be.safetensors_names(tmp_path / "x.safetensors")) == ["a", "b"]
    assert be.read_tensor(tmp_path / "x.safetensors", "a") == t["a"]
    header, base = be.safetensors_header(tmp_path / "x.safetensors")
    assert base % 8 == 0


# ---------------------------------------------------------------------------------------- GPU

@pytest.mark.skipif(shutil.which("trtllm-build") is None or not Path("/app/all_models").exists(),
                    reason="needs a GPU host with TensorRT-LLM and tensorrtllm_backend (the NGC trtllm image)")
def test_build_the_kit_on_a_gpu_host(tmp_path):  # pragma: no cover - GPU only
    kit = ROOT / "build" / "demo-kit"
    rc = subprocess.run([sys.executable, str(SCRIPT), "--kit", str(kit), "--out", str(tmp_path / "trt"),
                         "--trtllm-root", "/app", "--backend-root", "/app"]).returncode
    assert rc == 0
    assert be.verify_repository(tmp_path / "trt" / "model_repository") == []
