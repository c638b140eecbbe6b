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


# ------------------------------------------------ the real templates' tensor lists (copied)

# all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt of triton-inference-server/tensorrtllm_backend
# at tag v0.18.0 (the pinned version): every input, (data_type, dims). draft_logits, context_logits and
# generation_logits are typed ${logits_datatype} there (TYPE_FP32 as build_engines.py fills it).
TENSORRT_LLM_INPUTS = {
    "input_ids": ("TYPE_INT32", "[-1]"), "encoder_input_features": ("${encoder_input_features_data_type}", "[-1, -1]"),
    "encoder_output_lengths": ("TYPE_INT32", "[1]"), "input_lengths": ("TYPE_INT32", "[1]"),
    "request_output_len": ("TYPE_INT32", "[1]"), "num_return_sequences": ("TYPE_INT32", "[1]"),
    "draft_input_ids": ("TYPE_INT32", "[-1]"), "decoder_input_ids": ("TYPE_INT32", "[-1]"),
    "decoder_input_lengths": ("TYPE_INT32", "[1]"), "draft_logits": ("TYPE_FP32", "[-1, -1]"),
    "draft_acceptance_threshold": ("TYPE_FP32", "[1]"), "end_id": ("TYPE_INT32", "[1]"),
    "pad_id": ("TYPE_INT32", "[1]"), "stop_words_list": ("TYPE_INT32", "[2, -1]"),
    "bad_words_list": ("TYPE_INT32", "[2, -1]"), "embedding_bias": ("TYPE_FP32", "[-1]"),
    "beam_width": ("TYPE_INT32", "[1]"), "temperature": ("TYPE_FP32", "[1]"), "runtime_top_k": ("TYPE_INT32", "[1]"),
    "runtime_top_p": ("TYPE_FP32", "[1]"), "runtime_top_p_min": ("TYPE_FP32", "[1]"),
    "runtime_top_p_decay": ("TYPE_FP32", "[1]"), "runtime_top_p_reset_ids": ("TYPE_INT32", "[1]"),
    "len_penalty": ("TYPE_FP32", "[1]"), "early_stopping": ("TYPE_BOOL", "[1]"),
    "repetition_penalty": ("TYPE_FP32", "[1]"), "min_length": ("TYPE_INT32", "[1]"),
    "beam_search_diversity_rate": ("TYPE_FP32", "[1]"), "presence_penalty": ("TYPE_FP32", "[1]"),
    "frequency_penalty": ("TYPE_FP32", "[1]"), "random_seed": ("TYPE_UINT64", "[1]"),
    "return_log_probs": ("TYPE_BOOL", "[1]"), "return_context_logits": ("TYPE_BOOL", "[1]"),
    "return_generation_logits": ("TYPE_BOOL", "[1]"), "return_kv_cache_reuse_stats": ("TYPE_BOOL", "[1]"),
    "exclude_input_in_output": ("TYPE_BOOL", "[1]"), "stop": ("TYPE_BOOL", "[1]"), "streaming": ("TYPE_BOOL", "[1]"),
    "prompt_embedding_table": ("TYPE_FP16", "[-1, -1]"), "prompt_table_extra_ids": ("TYPE_UINT64", "[-1]"),
    "prompt_vocab_size": ("TYPE_INT32", "[1]"), "cross_attention_mask": ("TYPE_BOOL", "[-1, -1]"),
    "lora_task_id": ("TYPE_UINT64", "[1]"), "lora_weights": ("TYPE_FP16", "[-1, -1]"),
    "lora_config": ("TYPE_INT32", "[-1, 3]"), "context_phase_params": ("TYPE_UINT8", "[-1]"),
    "skip_cross_attn_blocks": ("TYPE_BOOL", "[1]"), "retention_token_range_starts": ("TYPE_INT32", "[-1]"),
    "retention_token_range_ends": ("TYPE_INT32", "[-1]"), "retention_token_range_priorities": ("TYPE_INT32", "[-1]"),
    "retention_token_range_durations_ms": ("TYPE_INT32", "[-1]"), "retention_decode_priority": ("TYPE_INT32", "[1]"),
    "retention_decode_duration_ms": ("TYPE_INT32", "[1]"),
}
# the same file's outputs (generation_logits / context_logits typed ${logits_datatype})
TENSORRT_LLM_OUTPUTS = {
    "output_ids": ("TYPE_INT32", "[-1, -1]"), "sequence_length": ("TYPE_INT32", "[-1]"),
    "cum_log_probs": ("TYPE_FP32", "[-1]"), "output_log_probs": ("TYPE_FP32", "[-1, -1]"),
    "context_logits": ("TYPE_FP32", "[-1, -1]"), "generation_logits": ("TYPE_FP32", "[-1, -1, -1]"),
    "batch_index": ("TYPE_INT32", "[1]"), "sequence_index": ("TYPE_INT32", "[1]"),
    "context_phase_params": ("TYPE_UINT8", "[-1]"), "kv_cache_alloc_new_blocks": ("TYPE_INT32", "[1]"),
    "kv_cache_reused_blocks": ("TYPE_INT32", "[1]"), "kv_cache_alloc_total_blocks": ("TYPE_INT32", "[1]"),
}
# all_models/inflight_batcher_llm/ensemble/config.pbtxt at v0.18.0: the client inputs of spec_medusa / spec_eagle
ENSEMBLE_INPUTS = {
    "text_input", "decoder_text_input", "max_tokens", "num_return_sequences", "bad_words", "stop_words",
    "exclude_input_in_output", "end_id", "pad_id", "top_k", "top_p", "temperature", "length_penalty",
    "repetition_penalty", "min_length", "presence_penalty", "frequency_penalty", "random_seed", "return_log_probs",
    "return_context_logits", "return_generation_logits", "return_kv_cache_reuse_stats", "beam_width", "stream",
    "prompt_embedding_table", "prompt_table_extra_id", "prompt_vocab_size", "embedding_bias_words",
    "embedding_bias_weights", "lora_task_id", "lora_weights", "lora_config",
}


def tensor_list(tensors: dict[str, tuple[str, str]]) -> str:
    return ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: {d} optional: true }}' for n, (t, d) in tensors.items())


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
                    + "input [\n" + tensor_list(TENSORRT_LLM_INPUTS) + "\n]\noutput [\n"
                    + tensor_list(TENSORRT_LLM_OUTPUTS).replace(" optional: true", "") + "\n]\n"
                    'instance_group [ { count: 1 kind : KIND_CPU } ]\n'
                    + "".join(PARAM.format(key=k) for k in (
                        "max_beam_width", "batching_strategy", "engine_dir", "kv_cache_free_gpu_mem_fraction",
                        "enable_kv_cache_reuse", "exclude_input_in_output", "enable_chunked_context",
                        "decoding_mode", "medusa_choices", "eagle_choices", "gpu_device_ids",
                        "lookahead_window_size")),
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
    assert text.count("trtllm-build ") == 4  # target (external drafts, baseline shares it), draft, medusa, eagle
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
    assert "build target engine" not in builds  # baseline serves the external-draft target engine
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
    assert names.index("convert target") < names.index("build target engine for external draft tokens")
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
    assert names == ["preprocessing", "postprocessing", "baseline", "target_trtllm", "spec_draft", "draft_trtllm",
                     "spec_medusa", "spec_medusa_trtllm", "spec_eagle", "spec_eagle_trtllm"]
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
    # spec_draft and baseline: specdec's orchestrator over the models the CPU repository has too
    spec, base = by_name["spec_draft"], by_name["baseline"]
    assert spec.template == base.template == "specdec"
    assert (spec.params["target_model"], spec.params["draft_model"]) == ("target_trtllm", "draft_trtllm")
    assert (base.params["target_model"], base.params["draft_model"]) == ("target_trtllm", "none")
    assert spec.params["max_draft_len"] == str(opts.draft_len) and spec.params["tokenizer"] == str(kit / "target")
    # the target engine takes external drafts up to max_draft_len; baseline shares it
    assert by_name["target_trtllm"].params["engine_dir"] == str(opts.engines / "target-draft-tokens-external")
    for name in ("target_trtllm", "draft_trtllm"):  # the orchestrator streams and re-sends prefixes
        assert by_name[name].params["decoupled_mode"] == "True"
        assert by_name[name].params["enable_kv_cache_reuse"] == "True"
    for name in ("spec_medusa_trtllm", "spec_eagle_trtllm"):  # streamed via the ensemble
        assert by_name[name].params["decoupled_mode"] == "True"
    fractions = [float(m.params["kv_cache_free_gpu_mem_fraction"]) for m in models if m.template == "tensorrt_llm"]
    assert len(fractions) == 4 and sum(fractions) <= 0.9


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
    assert set(configs) == {"preprocessing", "postprocessing", "baseline", "target_trtllm", "spec_draft",
                            "draft_trtllm", "spec_medusa", "spec_medusa_trtllm", "spec_eagle", "spec_eagle_trtllm"}
    steps_of = {n: [s.model_name for s in c.ensemble_scheduling.step] for n, c in configs.items() if c.platform}
    assert steps_of == {"spec_medusa": ["preprocessing", "spec_medusa_trtllm", "postprocessing"],
                        "spec_eagle": ["preprocessing", "spec_eagle_trtllm", "postprocessing"]}
    for served in ("baseline", "spec_draft", "spec_medusa", "spec_eagle"):  # the client tensor names
        c = configs[served]
        assert {"text_input", "max_tokens", "stream", "temperature", "top_p", "top_k"} <= {i.name for i in c.input}
        assert "text_output" in {o.name for o in c.output}
    for served in ("baseline", "spec_draft"):
        c = configs[served]
        assert c.backend == "specdec" and c.model_transaction_policy.decoupled
        assert c.parameters["target_model"].string_value == "target_trtllm"
    assert configs["spec_draft"].parameters["draft_model"].string_value == "draft_trtllm"
    medusa = configs["spec_medusa_trtllm"]
    assert medusa.backend == "tensorrtllm" and medusa.model_transaction_policy.decoupled
    assert medusa.parameters["medusa_choices"].string_value == be.choices_string(be.filter_tree(be.MC_SIM_7B_63, 3))
    assert medusa.parameters["engine_dir"].string_value == str(opts.engines / "medusa")
    assert medusa.parameters["lookahead_window_size"].string_value == "${lookahead_window_size}"  # optional: unset
    for name in ("target_trtllm", "draft_trtllm"):
        c = configs[name]
        assert c.model_transaction_policy.decoupled and c.parameters["enable_kv_cache_reuse"].string_value == "True"
        declared = {i.name: i for i in c.input}
        assert set(declared) == set(TENSORRT_LLM_INPUTS)  # the real list came through the fill
        for name_, array in orchestrator_requests():  # what the rounds engine sends, by the real declaration
            for key, value in array.items():
                i = declared[key]
                assert model_config_pb2.DataType.Name(i.data_type) == NP_TO_TRITON[value.dtype.name], (name_, key)
                assert len(value.shape) == len(i.dims) + 1  # + the batch dimension (max_batch_size > 0)


NP_TO_TRITON = {"int32": "TYPE_INT32", "float32": "TYPE_FP32", "uint64": "TYPE_UINT64", "bool": "TYPE_BOOL"}


def orchestrator_requests():
    """The inner requests specdec's rounds engine builds: draft call, greedy and sampled verification
    (with drafts), streaming target-only generation."""
    from specdec.core.sampling import SamplingParams
    from specdec.core.sequence import Sequence
    from specdec.serving.rounds import RoundsConfig, RoundsEngine

    class Tok:
        eos_ids = [0]

    engine = RoundsEngine(RoundsConfig(tokenizer="unused"), inner=None, tokenizer=Tok())
    greedy = Sequence("a", [5, 6, 7], SamplingParams(max_tokens=8), print, tokens=[5, 6, 7])
    sampled_params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=20, seed=3, min_tokens=2)
    sampled = Sequence("b", [5, 6], sampled_params, print, generator=sampled_params.generator(), tokens=[5, 6])
    return [("draft", engine._inputs(greedy, 4, drafting=True)),
            ("verify greedy", engine._inputs(greedy, 5, draft=[1, 2, 3, 4])),
            ("verify sampled", engine._inputs(sampled, 3, draft=[1, 2])),
            ("baseline", engine._inputs(sampled, 8, streaming=True))]


def test_the_orchestrators_requests_use_only_inputs_of_the_real_template():
    for name, inputs in orchestrator_requests():
        for key, value in inputs.items():
            assert key in TENSORRT_LLM_INPUTS, (name, key)
            assert NP_TO_TRITON[value.dtype.name] == TENSORRT_LLM_INPUTS[key][0], (name, key)
    names = {key for _, inputs in orchestrator_requests() for key in inputs}
    assert {"draft_input_ids", "random_seed", "runtime_top_p", "min_length", "streaming"} <= names


def test_the_cpu_contract_model_declares_the_real_names_types_and_dims():
    from specdec.serving.trtllm_contract import INPUTS, OUTPUTS

    squash = lambda dims: dims.replace(" ", "")  # noqa: E731
    for name, (dtype, dims, _) in INPUTS.items():
        assert (dtype, squash(dims)) == (TENSORRT_LLM_INPUTS[name][0], squash(TENSORRT_LLM_INPUTS[name][1])), name
    for name, (dtype, dims) in OUTPUTS.items():
        assert (dtype, squash(dims)) == (TENSORRT_LLM_OUTPUTS[name][0], squash(TENSORRT_LLM_OUTPUTS[name][1])), name


def test_medusa_and_eagle_ensembles_take_the_clients_greedy_request():
    """specdec client / load tests (greedy) send these to spec_medusa and spec_eagle, the NVIDIA ensemble."""
    from specdec.serving.client import request_inputs

    sent = request_inputs("def f():", max_tokens=16, stream=True, exclude_input_in_output=True, temperature=0.0,
                          top_p=1.0, top_k=0)
    assert set(sent) <= ENSEMBLE_INPUTS


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
