#!/usr/bin/env python3
"""Hugging Face checkpoints -> TensorRT-LLM engines -> one Triton model repository (tensorrtllm_backend).

Runs on a GPU host inside the TensorRT-LLM Triton image (see README.md next to this file for the pinned
version). Standard library only, so that `--dry-run` works anywhere:

    python build/trtllm/build_engines.py --kit build/demo-kit --out trt_repo \
        --trtllm-root /app --backend-root /app --dry-run

The work is a plan: a list of Step(name, argv, cwd) built by small pure functions (`plan`), then run
one by one with subprocess (`run_plan`). Steps that need no external tool (staging checkpoints,
copying templates, checking the repository) call this same file with a `_helper` sub-command, so every
step is a command line that `--dry-run` can print and a person can rerun by hand.

Served model names are the PyTorch repository's (`baseline`, `spec_draft`, `spec_medusa`, `spec_eagle`),
each with the tensorrtllm_backend client tensors (text_input, max_tokens, stream, ... -> text_output).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

# The version this script was written against (commands and template parameters were checked against
# its documentation); see README.md. Other 0.1x versions mostly work: scripts are located by trying
# the known paths, and template parameters are only passed where the template has the placeholder.
PINNED_TRTLLM = "0.18.0"
PINNED_BACKEND = "v0.18.0"
PINNED_IMAGE = "nvcr.io/nvidia/tritonserver:25.03-trtllm-python-py3"

METHODS = ("baseline", "draft", "medusa", "eagle")
MODEL_NAMES = {"baseline": "baseline", "draft": "spec_draft", "medusa": "spec_medusa", "eagle": "spec_eagle",
               "eagle3": "spec_eagle3", "ngram": "spec_ngram"}

# TensorRT-LLM >= 1.x serves Hugging Face checkpoints through its LLM API (PyTorch backend, no engine
# build): one `tensorrt_llm` Python model per served name, configured by its 1/model.yaml, whose
# `speculative_config` picks the method (decoding_type as TensorRT-LLM's docs for the llmapi model spell it).
INTERFACES = ("inflight_batcher", "llmapi")
LLMAPI_METHODS = ("baseline", "draft", "eagle3", "ngram")
LLMAPI_DECODING_TYPES = {"draft": "Draft_Target", "eagle3": "Eagle3", "ngram": "NGram"}
LLMAPI_TEMPLATE = ("all_models/llmapi/tensorrt_llm", "triton_backend/all_models/llmapi/tensorrt_llm")
NGRAM_MATCH = 3  # max_matching_ngram_size: the longest suffix NGram looks up in the prompt and output
TARGET_MODEL, DRAFT_MODEL = "target_trtllm", "draft_trtllm"  # the models the orchestrator calls (as on CPU)

# Medusa's default sparse tree (FasterDecoding/Medusa medusa_choices.py, "mc_sim_7b_63"); TensorRT-LLM and
# our PyTorch engine use it by default too. Paths deeper than the number of heads are dropped.
MC_SIM_7B_63 = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0]]  # noqa: E501

# Candidate locations, newest layout last; the first that exists under the given root wins.
LLAMA_CONVERT = ("examples/llama/convert_checkpoint.py", "examples/models/core/llama/convert_checkpoint.py")
QWEN_CONVERT = ("examples/qwen/convert_checkpoint.py", "examples/models/core/qwen/convert_checkpoint.py")
MEDUSA_CONVERT = ("examples/medusa/convert_checkpoint.py",)
EAGLE_CONVERT = ("examples/eagle/convert_checkpoint.py",)
TEMPLATES = ("all_models/inflight_batcher_llm", "triton_backend/all_models/inflight_batcher_llm")
FILL_TEMPLATE = ("tools/fill_template.py", "triton_backend/tools/fill_template.py")

# Parameters the tensorrtllm_backend docs (docs/model_config.md) list as mandatory, per template.
MANDATORY = {
    "ensemble": ("triton_max_batch_size", "logits_datatype"),
    "preprocessing": ("triton_max_batch_size", "tokenizer_dir", "preprocessing_instance_count",
                      "max_queue_delay_microseconds", "max_queue_size"),
    "postprocessing": ("triton_max_batch_size", "tokenizer_dir", "postprocessing_instance_count"),
    "tensorrt_llm": ("triton_backend", "triton_max_batch_size", "decoupled_mode", "max_queue_delay_microseconds",
                     "max_queue_size", "engine_dir", "batching_strategy", "encoder_input_features_data_type",
                     "logits_datatype"),
    "specdec": ("tokenizer", "target_model", "draft_model", "max_draft_len"),  # written by specdec, no template
}

PLACEHOLDER = re.compile(r"\$\{(\w+)\}")


class PlanError(Exception):
    """The inputs cannot be built as asked (missing checkpoint, unsupported architecture, bad tree)."""


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]
    cwd: str | None = None
    creates: str | None = None  # skipped with --skip-existing when this path exists
    params: tuple[tuple[str, str], ...] = ()  # template parameters (fill steps), for --dry-run

    def command(self) -> str:
        return shlex.join(self.argv)


@dataclass(frozen=True)
class TritonModel:
    """One model directory of the repository, made from a tensorrtllm_backend template."""

    name: str
    template: str  # ensemble | preprocessing | postprocessing | tensorrt_llm | specdec (our orchestrator)
    params: dict[str, str]
    step_renames: dict[str, str] = field(default_factory=dict)  # ensemble step model_name old -> new


@dataclass
class Options:
    out: Path
    trtllm_root: Path
    backend_root: Path
    target: Path
    draft: Path | None = None
    medusa: Path | None = None
    eagle: Path | None = None
    eagle3: Path | None = None  # an EAGLE-3 draft head (llmapi interface only)
    methods: tuple[str, ...] = METHODS
    interface: str = "inflight_batcher"
    dtype: str = "float16"
    max_batch: int = 8
    max_input_len: int | None = None
    max_seq_len: int | None = None
    draft_len: int = 4
    medusa_choices: list[list[int]] | None = None
    eagle_choices: list[list[int]] | None = None
    kv_fraction: float | None = None
    layout: str = "single"
    python: str = "python3"
    script: str = field(default_factory=lambda: str(Path(__file__).resolve()))

    @property
    def engines(self) -> Path:
        return self.out / "engines"

    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"

    @property
    def staging(self) -> Path:
        return self.out / "staging"

    @property
    def repository(self) -> Path:
        return self.out / "model_repository"


# ---------------------------------------------------------------------------------------------- inputs

def read_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def model_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.exists():
        raise PlanError(f"{folder}: no config.json (expected a Hugging Face checkpoint folder)")
    return read_json(path)


def model_type(config: dict) -> str:
    kind = config.get("model_type")
    if not kind:
        arch = (config.get("architectures") or [""])[0].lower()
        kind = "qwen2" if arch.startswith("qwen2") else "mistral" if arch.startswith("mistral") else "llama"
    return kind


def convert_script_for(config: dict) -> tuple[str, ...]:
    kind = model_type(config)
    if kind in ("llama", "mistral"):
        return LLAMA_CONVERT
    if kind == "qwen2":
        return QWEN_CONVERT
    raise PlanError(f"model_type {kind!r}: only Llama, Mistral and Qwen2 checkpoints are planned here")


def rope_theta(config: dict) -> float:
    return float(config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)))


def locate(root: Path, candidates: tuple[str, ...]) -> Path:
    """The first candidate that exists under root; the pinned version's path when none does (dry run)."""
    for rel in candidates:
        if (root / rel).exists():
            return root / rel
    return root / candidates[0]


# ----------------------------------------------------------------------------------------------- trees

def filter_tree(paths: list[list[int]], max_depth: int) -> list[list[int]]:
    """Keep the paths at most max_depth deep; every kept path's parent must be kept before it."""
    kept = [list(p) for p in paths if 0 < len(p) <= max_depth]
    seen: set[tuple[int, ...]] = set()
    for p in kept:
        if min(p) < 0:
            raise PlanError(f"tree path {p} has a negative index")
        if len(p) > 1 and tuple(p[:-1]) not in seen:
            raise PlanError(f"tree path {p} comes before its parent {p[:-1]}")
        if tuple(p) in seen:
            raise PlanError(f"tree path {p} appears twice")
        seen.add(tuple(p))
    if not kept:
        raise PlanError("the tree is empty")
    return kept


def tree_depth(paths: list[list[int]]) -> int:
    return max(len(p) for p in paths)


def max_non_leaves_per_level(paths: list[list[int]]) -> int:
    """Most nodes with children on one level (the root counts on level 0), as EAGLE's converter wants."""
    parents = {tuple(p[:-1]) for p in paths}
    per_level: dict[int, int] = {}
    for node in parents:
        per_level[len(node)] = per_level.get(len(node), 0) + 1
    return max(per_level.values())


def choices_string(paths: list[list[int]]) -> str:
    """The backend's medusa_choices / eagle_choices format: "{0}, {0, 0}, {1}"."""
    return ", ".join("{" + ", ".join(str(i) for i in p) + "}" for p in paths)


def parse_tree(text: str) -> list[list[int]]:
    """A tree option: 'mc_sim_7b_63', 'chain:K' (one path of depth K) or a JSON list of paths."""
    if text == "mc_sim_7b_63":
        return [list(p) for p in MC_SIM_7B_63]
    if text.startswith("chain:"):
        depth = int(text.split(":", 1)[1])
        return [[0] * d for d in range(1, depth + 1)]
    value = json.loads(text)
    if not isinstance(value, list) or not all(isinstance(p, list) for p in value):
        raise PlanError(f"tree {text!r}: expected a JSON list of index paths")
    return value


# ------------------------------------------------------------------------------------------ safetensors
# Just enough of the format (8-byte little-endian header length, JSON header, raw data) to read one
# tensor and write a small file, so that staging needs neither torch nor safetensors.

def safetensors_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size


def safetensors_names(path: Path) -> list[str]:
    header, _ = safetensors_header(path)
    return [k for k in header if k != "__metadata__"]


def read_tensor(path: Path, name: str) -> tuple[str, list[int], bytes]:
    header, base = safetensors_header(path)
    entry = header[name]
    start, end = entry["data_offsets"]
    with open(path, "rb") as f:
        f.seek(base + start)
        return entry["dtype"], entry["shape"], f.read(end - start)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}  # transformers refuses files without it
    offset = 0
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in sorted(tensors):
            f.write(tensors[name][2])


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index when there is one."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return {k: folder / v for k, v in read_json(index)["weight_map"].items()}
    found: dict[str, Path] = {}
    for path in sorted(folder.glob("*.safetensors")):
        for name in safetensors_names(path):
            found[name] = path
    return found


def needs_untie(folder: Path) -> bool:
    """Tied embeddings without a stored lm_head.weight: TensorRT-LLM's Medusa/EAGLE converters read
    lm_head.weight by name, so such checkpoints get a staged copy that stores it."""
    config = model_config(folder)
    if not config.get("tie_word_embeddings", False):
        return False
    files = weight_files(folder)
    if not files:
        return False  # .bin checkpoints cannot be inspected without torch; used as they are
    return "lm_head.weight" not in files


# ------------------------------------------------------------------------------------------------ plan

def helper(opts: Options, name: str, *args: str) -> tuple[str, ...]:
    return (opts.python, opts.script, name, *args)


def trtllm_build(opts: Options, checkpoint: Path, engine: Path, max_seq: int, max_input: int,
                 spec_mode: str | None = None, max_draft_len: int | None = None) -> tuple[str, ...]:
    argv = [
        "trtllm-build", "--checkpoint_dir", str(checkpoint), "--output_dir", str(engine),
        "--gemm_plugin", opts.dtype, "--gpt_attention_plugin", opts.dtype,
        "--remove_input_padding", "enable", "--paged_kv_cache", "enable", "--context_fmha", "enable",
        "--use_paged_context_fmha", "enable",
        "--max_batch_size", str(opts.max_batch), "--max_input_len", str(max_input), "--max_seq_len", str(max_seq),
    ]
    if spec_mode:
        argv += ["--speculative_decoding_mode", spec_mode, "--max_draft_len", str(max_draft_len)]
    return tuple(argv)


def lengths(opts: Options, config: dict) -> tuple[int, int]:
    limit = int(config.get("max_position_embeddings", 2048))
    max_seq = min(opts.max_seq_len or limit, limit)
    max_input = opts.max_input_len or max(1, max_seq // 2)
    if max_input >= max_seq:
        raise PlanError(f"--max-input-len {max_input} must be below --max-seq-len {max_seq}")
    return max_seq, max_input


def medusa_rope_scaling(config: dict) -> tuple[str, ...]:
    """The Medusa converter takes RoPE settings from flags, not from config.json, and knows only linear and
    dynamic scaling: pass those on, refuse the others (llama3, yarn, ...) rather than build a wrong engine."""
    scaling = config.get("rope_scaling")
    if not scaling:
        return ()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in ("linear", "dynamic"):
        return ("--rotary_scaling", kind, repr(float(scaling["factor"])))
    raise PlanError(f"rope_scaling {kind!r}: TensorRT-LLM's Medusa converter supports only linear and dynamic")


def medusa_tree(opts: Options) -> tuple[list[list[int]], dict]:
    cfg = model_config(opts.medusa)
    heads = int(cfg["medusa_num_heads"])
    tree = filter_tree(opts.medusa_choices or MC_SIM_7B_63, heads)
    return tree, cfg


def eagle_tree(opts: Options) -> list[list[int]]:
    return filter_tree(opts.eagle_choices or MC_SIM_7B_63, 1 << 30)


def staged_checkpoint(opts: Options, folder: Path, label: str, steps: list[Step]) -> Path:
    """The folder to convert: the checkpoint itself, or a staged copy that stores lm_head.weight."""
    if not needs_untie(folder):
        return folder
    dst = opts.staging / f"{label}-untied"
    steps.append(Step(f"stage {label}: store lm_head.weight (tied embeddings)",
                      helper(opts, "_untie", str(folder), str(dst)), creates=str(dst / "config.json")))
    return dst


def engine_steps(opts: Options) -> list[Step]:
    steps: list[Step] = []
    py = opts.python
    tcfg = model_config(opts.target)
    max_seq, max_input = lengths(opts, tcfg)
    theta = rope_theta(tcfg)
    target = staged_checkpoint(opts, opts.target, "target", steps)
    target_ckpt = opts.checkpoints / "target"
    if {"baseline", "draft"} & set(opts.methods):
        convert = locate(opts.trtllm_root, convert_script_for(tcfg))
        steps.append(Step("convert target", (py, str(convert), "--model_dir", str(target), "--output_dir",
                                             str(target_ckpt), "--dtype", opts.dtype),
                          cwd=str(convert.parent), creates=str(target_ckpt / "config.json")))
    if "baseline" in opts.methods and "draft" not in opts.methods:  # else baseline shares target_trtllm
        engine = opts.engines / "target"
        steps.append(Step("build target engine", trtllm_build(opts, target_ckpt, engine, max_seq, max_input),
                          creates=str(engine / "config.json")))
    if "draft" in opts.methods:
        dcfg = model_config(opts.draft)
        if dcfg.get("vocab_size") != tcfg.get("vocab_size"):
            raise PlanError(f"draft vocab_size {dcfg.get('vocab_size')} != target {tcfg.get('vocab_size')}")
        engine = opts.engines / "target-draft-tokens-external"
        steps.append(Step("build target engine for external draft tokens",
                          trtllm_build(opts, target_ckpt, engine, max_seq, max_input,
                                       "draft_tokens_external", opts.draft_len),
                          creates=str(engine / "config.json")))
        draft = staged_checkpoint(opts, opts.draft, "draft", steps)
        draft_ckpt = opts.checkpoints / "draft"
        convert = locate(opts.trtllm_root, convert_script_for(dcfg))
        steps.append(Step("convert draft", (py, str(convert), "--model_dir", str(draft), "--output_dir",
                                            str(draft_ckpt), "--dtype", opts.dtype),
                          cwd=str(convert.parent), creates=str(draft_ckpt / "config.json")))
        engine = opts.engines / "draft"
        steps.append(Step("build draft engine", trtllm_build(opts, draft_ckpt, engine, max_seq, max_input),
                          creates=str(engine / "config.json")))
    if "medusa" in opts.methods:
        if model_type(tcfg) not in ("llama", "mistral"):
            raise PlanError("TensorRT-LLM's Medusa converter takes Llama-family targets only")
        tree, mcfg = medusa_tree(opts)
        heads = str(mcfg["medusa_num_heads"])
        layers = str(mcfg.get("medusa_num_layers", 1))
        medusa = opts.medusa
        if not (medusa / "medusa_lm_head.pt").exists():
            medusa = opts.staging / "medusa"
            steps.append(Step("stage medusa: medusa_lm_head.safetensors -> medusa_lm_head.pt",
                              helper(opts, "_medusa-pt", str(opts.medusa), str(medusa)),
                              creates=str(medusa / "medusa_lm_head.pt")))
        ckpt = opts.checkpoints / "medusa"
        convert = locate(opts.trtllm_root, MEDUSA_CONVERT)
        steps.append(Step("convert target + medusa heads", (
            py, str(convert), "--model_dir", str(target), "--medusa_model_dir", str(medusa),
            "--output_dir", str(ckpt), "--dtype", opts.dtype, "--num_medusa_heads", heads,
            "--num_medusa_layers", layers, "--max_medusa_token_len", str(len(tree)), "--rotary_base", repr(theta),
            *medusa_rope_scaling(tcfg),
        ), cwd=str(convert.parent), creates=str(ckpt / "config.json")))
        engine = opts.engines / "medusa"
        steps.append(Step("build medusa engine", trtllm_build(opts, ckpt, engine, max_seq, max_input, "medusa",
                                                              len(tree)), creates=str(engine / "config.json")))
    if "eagle" in opts.methods:
        if model_type(tcfg) not in ("llama", "mistral"):
            raise PlanError("TensorRT-LLM's EAGLE converter takes Llama-family targets only")
        tree = eagle_tree(opts)
        eagle = opts.staging / "eagle"
        steps.append(Step("stage eagle: add embed_tokens.weight from the target where missing",
                          helper(opts, "_prepare-eagle", str(opts.eagle), str(opts.target), str(eagle)),
                          creates=str(eagle / "config.json")))
        ckpt = opts.checkpoints / "eagle"
        convert = locate(opts.trtllm_root, EAGLE_CONVERT)
        steps.append(Step("convert target + eagle head", (
            py, str(convert), "--model_dir", str(target), "--eagle_model_dir", str(eagle),
            "--output_dir", str(ckpt), "--dtype", opts.dtype, "--max_draft_len", str(len(tree)),
            "--num_eagle_layers", str(tree_depth(tree)),
            "--max_non_leaves_per_layer", str(max_non_leaves_per_level(tree)), "--rotary_base", repr(theta),
        ), cwd=str(convert.parent), creates=str(ckpt / "config.json")))
        engine = opts.engines / "eagle"
        steps.append(Step("build eagle engine", trtllm_build(opts, ckpt, engine, max_seq, max_input, "eagle",
                                                             len(tree)), creates=str(engine / "config.json")))
    return steps


def trtllm_params(opts: Options, engine: Path, fraction: float, decoupled: bool, reuse: bool = False,
                  **extra: str) -> dict[str, str]:
    params = {
        "triton_backend": "tensorrtllm", "triton_max_batch_size": str(opts.max_batch),
        "decoupled_mode": str(decoupled), "max_beam_width": "1", "engine_dir": str(engine),
        "batching_strategy": "inflight_fused_batching", "max_queue_delay_microseconds": "0", "max_queue_size": "0",
        "kv_cache_free_gpu_mem_fraction": f"{fraction:.3f}", "enable_kv_cache_reuse": str(reuse),
        "exclude_input_in_output": "True", "enable_chunked_context": "False",
        "encoder_input_features_data_type": "TYPE_FP16", "logits_datatype": "TYPE_FP32",
        "prompt_embedding_table_data_type": "TYPE_FP16",
    }
    params.update(extra)
    return params


def ensemble(opts: Options, name: str, llm: str) -> TritonModel:
    return TritonModel(name, "ensemble", {"triton_max_batch_size": str(opts.max_batch), "logits_datatype": "TYPE_FP32"},
                       {"tensorrt_llm": llm})


def orchestrator(opts: Options, name: str, draft_model: str | None) -> TritonModel:
    """A model of specdec's own decoupled backend: its rounds engine calls target_trtllm (and
    draft_trtllm) through BLS, streaming every round; the request interface is specdec's."""
    return TritonModel(name, "specdec", {
        "tokenizer": str(opts.target), "target_model": TARGET_MODEL, "draft_model": draft_model or "none",
        "max_draft_len": str(opts.draft_len), "max_batch": str(opts.max_batch), "policy": "adaptive"})


def method_models(opts: Options, method: str, fraction: float) -> list[TritonModel]:
    """The Triton models one method needs, besides the shared preprocessing/postprocessing."""
    name = MODEL_NAMES[method]
    e = opts.engines
    # baseline and spec_draft share one target engine, built for external draft tokens when spec_draft
    # is built; decoupled (the orchestrator streams baseline), KV block reuse for the re-sent prefixes
    target_engine = e / ("target-draft-tokens-external" if "draft" in opts.methods else "target")
    target = TritonModel(TARGET_MODEL, "tensorrt_llm", trtllm_params(opts, target_engine, fraction, True, reuse=True))
    if method == "baseline":
        return [orchestrator(opts, name, None), target]
    if method == "medusa":
        tree, _ = medusa_tree(opts)
        llm = f"{name}_trtllm"
        return [ensemble(opts, name, llm),
                TritonModel(llm, "tensorrt_llm", trtllm_params(
                    opts, e / "medusa", fraction, True, decoding_mode="medusa", medusa_choices=choices_string(tree)))]
    if method == "eagle":
        llm = f"{name}_trtllm"
        return [ensemble(opts, name, llm),
                TritonModel(llm, "tensorrt_llm", trtllm_params(
                    opts, e / "eagle", fraction, True, decoding_mode="eagle",
                    eagle_choices=choices_string(eagle_tree(opts))))]
    if method == "draft":
        return [orchestrator(opts, name, DRAFT_MODEL), target,
                TritonModel(DRAFT_MODEL, "tensorrt_llm", trtllm_params(opts, e / "draft", fraction, True, reuse=True))]
    raise PlanError(f"unknown method {method!r}")


def shared_models(opts: Options) -> list[TritonModel]:
    common = {"triton_max_batch_size": str(opts.max_batch), "tokenizer_dir": str(opts.target),
              "tokenizer_type": "auto", "max_queue_delay_microseconds": "0", "max_queue_size": "0"}
    return [
        # our engine tokenizes without special tokens; the same prompt must give the same ids
        TritonModel("preprocessing", "preprocessing",
                    {**common, "preprocessing_instance_count": "1", "add_special_tokens": "False"}),
        TritonModel("postprocessing", "postprocessing",
                    {**common, "postprocessing_instance_count": "1", "skip_special_tokens": "True"}),
    ]


def repositories(opts: Options) -> dict[Path, list[TritonModel]]:
    """Repository folder -> its models. `single`: one repository serving every method (the A/B setup of
    the PyTorch repository); `per-method`: one repository per method, each loaded alone."""
    def count(methods):  # engines loaded: baseline and spec_draft share the target's
        return len({"target" if m in ("baseline", "draft") else m for m in methods}) + ("draft" in methods)

    def unique(models):
        return list({m.name: m for m in models}.values())

    if opts.layout == "single":
        fraction = opts.kv_fraction or round(0.85 / count(opts.methods), 3)
        models = shared_models(opts)
        for m in opts.methods:
            models += method_models(opts, m, fraction)
        return {opts.repository: unique(models)}
    repos = {}
    for m in opts.methods:
        fraction = opts.kv_fraction or round(0.85 / count([m]), 3)
        repos[opts.repository / MODEL_NAMES[m]] = unique(shared_models(opts) + method_models(opts, m, fraction))
    return repos


def template_placeholders(path: Path) -> set[str] | None:
    return set(PLACEHOLDER.findall(path.read_text())) if path.exists() else None


def escape_fill_value(value: str) -> str:
    """Escape a value for fill_template.py, which splits 'k:v,k:v' on ',' then on ':' and drops one level
    of backslash escapes each time: ',' needs one escape, ':' and '\\' need two levels."""
    if any(c in value for c in "\n\r"):
        raise PlanError(f"template value {value!r} has a line break")
    return value.replace("\\", "\\\\\\\\").replace(":", "\\\\:").replace(",", "\\,")


def fill_argument(params: dict[str, str]) -> str:
    return ",".join(f"{k}:{escape_fill_value(v)}" for k, v in params.items())


def repository_steps(opts: Options) -> list[Step]:
    steps: list[Step] = []
    templates = locate(opts.backend_root, TEMPLATES)
    fill = locate(opts.backend_root, FILL_TEMPLATE)
    for repo, models in repositories(opts).items():
        for model in models:
            dst = repo / model.name
            if model.template == "specdec":
                steps.append(Step(f"{model.name}: write the specdec orchestrator config",
                                  helper(opts, "_specdec-model", str(dst), model.name, json.dumps(model.params)),
                                  params=tuple(model.params.items())))
                continue
            renames = [f"{a}={b}" for a, b in model.step_renames.items()]
            steps.append(Step(f"{model.name}: copy {model.template} template",
                              helper(opts, "_copy-model", str(templates / model.template), str(dst), model.name,
                                     *renames)))
            present = template_placeholders(templates / model.template / "config.pbtxt")
            params = {k: v for k, v in model.params.items() if present is None or k in present}
            steps.append(Step(f"{model.name}: fill {model.template} parameters",
                              (opts.python, str(fill), "-i", str(dst / "config.pbtxt"), fill_argument(params)),
                              params=tuple(params.items())))
        steps.append(Step(f"check repository {repo}", helper(opts, "_verify-repo", str(repo))))
    return steps


def plan(opts: Options) -> list[Step]:
    allowed = LLMAPI_METHODS if opts.interface == "llmapi" else METHODS
    for m in opts.methods:
        if m not in allowed:
            raise PlanError(f"method {m!r} is not served by the {opts.interface} interface; "
                            f"choose from {', '.join(allowed)}")
    for method, folder in (("draft", opts.draft), ("medusa", opts.medusa), ("eagle", opts.eagle),
                           ("eagle3", opts.eagle3)):
        if method in opts.methods and (folder is None or not folder.is_dir()):
            raise PlanError(f"method {method!r} needs a {method} checkpoint folder (got {folder})")
    if not opts.target.is_dir():
        raise PlanError(f"target checkpoint folder {opts.target} does not exist")
    if opts.interface == "llmapi":
        return llmapi_steps(opts)
    return engine_steps(opts) + repository_steps(opts)


# ------------------------------------------------------------------------------------ llmapi models

def speculative_config(opts: Options, method: str) -> dict | None:
    """model.yaml's speculative_config for a method; None for baseline (the target alone)."""
    if method == "baseline":
        return None
    config: dict = {"decoding_type": LLMAPI_DECODING_TYPES[method], "max_draft_len": opts.draft_len}
    if method == "draft":
        config["speculative_model"] = str(opts.draft)
    elif method == "eagle3":
        config["speculative_model"] = str(opts.eagle3)
    elif method == "ngram":
        config["max_matching_ngram_size"] = NGRAM_MATCH
    return config


def llmapi_model_config(opts: Options, method: str) -> dict:
    """The whole model.yaml: LLM API arguments, then triton_config (decoupled, so clients can stream;
    max_batch_size 0 as the template asks: the LLM API batches requests itself)."""
    config: dict = {"model": str(opts.target), "backend": "pytorch", "tensor_parallel_size": 1,
                    "pipeline_parallel_size": 1, "max_batch_size": opts.max_batch}
    spec = speculative_config(opts, method)
    if spec is not None:
        config["speculative_config"] = spec
    config["triton_config"] = {"max_batch_size": 0, "decoupled": True}
    return config


def yaml_text(config: dict, indent: int = 0) -> str:
    """Block YAML for nested dicts of str/int/float/bool (strings JSON-quoted, which YAML reads as is)."""
    lines = []
    for key, value in config.items():
        if isinstance(value, dict):
            lines.append(f"{' ' * indent}{key}:\n{yaml_text(value, indent + 2)}")
        else:
            lines.append(f"{' ' * indent}{key}: {json.dumps(value)}\n")
    return "".join(lines)


def llmapi_steps(opts: Options) -> list[Step]:
    template = locate(opts.backend_root, LLMAPI_TEMPLATE)
    steps: list[Step] = []
    repos = ({opts.repository: list(opts.methods)} if opts.layout == "single" else
             {opts.repository / MODEL_NAMES[m]: [m] for m in opts.methods})
    for repo, methods in repos.items():
        for method in methods:
            dst, config = repo / MODEL_NAMES[method], llmapi_model_config(opts, method)
            steps.append(Step(f"{MODEL_NAMES[method]}: copy the llmapi tensorrt_llm template",
                              helper(opts, "_copy-model", str(template), str(dst), MODEL_NAMES[method])))
            steps.append(Step(f"{MODEL_NAMES[method]}: write 1/model.yaml",
                              helper(opts, "_write-text", str(dst / "1" / "model.yaml"), yaml_text(config)),
                              params=tuple((k, json.dumps(v)) for k, v in config.items())))
        steps.append(Step(f"check repository {repo}", helper(opts, "_verify-repo", str(repo))))
    return steps


# --------------------------------------------------------------------------------------------- helpers

def link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.symlink(src.resolve(), dst)
    except OSError:
        shutil.copy2(src, dst)


def untie(src: Path, dst: Path) -> None:
    """Stage a tied-embedding checkpoint with lm_head.weight stored (a small extra shard; the rest linked)."""
    files = weight_files(src)
    embed = files.get("model.embed_tokens.weight")
    if embed is None:
        raise PlanError(f"{src}: no model.embed_tokens.weight to tie lm_head.weight to")
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    config = model_config(src)
    config["tie_word_embeddings"] = False
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shards = sorted(set(files.values()))
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards) + 1:05d}.safetensors"
        link_or_copy(shard, dst / name)
        weight_map.update({k: name for k, v in files.items() if v == shard})
    extra = f"model-{len(shards) + 1:05d}-of-{len(shards) + 1:05d}.safetensors"
    write_safetensors(dst / extra, {"lm_head.weight": read_tensor(embed, "model.embed_tokens.weight")})
    weight_map["lm_head.weight"] = extra
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for other in src.iterdir():  # tokenizer files, generation_config.json, ...
        if other.is_file() and other.suffix not in (".safetensors", ".bin") and not (dst / other.name).exists() \
                and other.name != "model.safetensors.index.json":
            link_or_copy(other, dst / other.name)


def prepare_eagle(eagle: Path, target: Path, dst: Path) -> None:
    """Stage an EAGLE head for TensorRT-LLM's converter, which loads the head's embed_tokens.weight from the
    head's own folder (public SafeAILab checkpoints store a copy; heads that share the target's don't)."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    shutil.copy2(eagle / "config.json", dst / "config.json")
    files = weight_files(eagle)
    if not files:  # pytorch_model.bin: passed on as it is
        for other in eagle.iterdir():
            if other.is_file() and other.name != "config.json":
                link_or_copy(other, dst / other.name)
        return
    tensors = {name: read_tensor(path, name) for name, path in files.items()}
    if "embed_tokens.weight" not in tensors:
        source = weight_files(target).get("model.embed_tokens.weight")
        if source is None:
            raise PlanError(f"{target}: no model.embed_tokens.weight for the EAGLE head")
        tensors["embed_tokens.weight"] = read_tensor(source, "model.embed_tokens.weight")
    write_safetensors(dst / "model.safetensors", tensors)


def medusa_pt(src: Path, dst: Path) -> None:
    """medusa_lm_head.safetensors -> medusa_lm_head.pt (older converters read only the .pt); needs torch,
    so it runs with the image's Python."""
    import torch  # noqa: PLC0415 (only this helper needs it)
    from safetensors.torch import load_file  # noqa: PLC0415

    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / "config.json", dst / "config.json")
    torch.save(load_file(str(src / "medusa_lm_head.safetensors")), dst / "medusa_lm_head.pt")


def copy_model(src: Path, dst: Path, name: str, renames: list[str]) -> None:
    """Copy a template model folder, rename the model and (ensembles) the step models it calls."""
    if not (src / "config.pbtxt").exists():
        raise PlanError(f"{src}: no config.pbtxt (is --backend-root a tensorrtllm_backend checkout?)")
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    text = rename_config(read_text(dst / "config.pbtxt"), name, dict(r.split("=", 1) for r in renames))
    (dst / "config.pbtxt").write_text(text)


def read_text(path: Path) -> str:
    return path.read_text()


def rename_config(text: str, name: str, step_renames: dict[str, str]) -> str:
    text, n = re.subn(r'^name:\s*"[^"]*"', f'name: "{name}"', text, count=1, flags=re.M)
    if n == 0:
        text = f'name: "{name}"\n' + text
    for old, new in step_renames.items():
        text = re.sub(rf'(model_name:\s*)"{re.escape(old)}"', rf'\1"{new}"', text)
    return text


STRING_VALUE = re.compile(r'string_value:\s*"[^"]*"')


def verify_repository(repo: Path) -> list[str]:
    """Problems that would stop tritonserver from loading the repository; [] when none are found."""
    problems = []
    names = {p.name for p in repo.iterdir() if (p / "config.pbtxt").exists()}
    for model in sorted(names):
        text = read_text(repo / model / "config.pbtxt")
        m = re.search(r'^name:\s*"([^"]*)"', text, re.M)
        if m and m.group(1) != model:
            problems.append(f"{model}: config name {m.group(1)!r} differs from its folder")
        for key in PLACEHOLDER.findall(STRING_VALUE.sub("", text)):
            problems.append(f"{model}: ${{{key}}} left unfilled outside a parameter value")
        for step in re.findall(r'model_name:\s*"([^"]*)"', text):
            if step not in names:
                problems.append(f"{model}: ensemble step calls {step!r}, which is not in the repository")
        for key in ("tensorrt_llm_model_name", "tensorrt_llm_draft_model_name", "target_model", "draft_model"):
            m = re.search(rf'key:\s*"{key}"\s*value:\s*{{\s*string_value:\s*"([^"]*)"', text)
            if m and not m.group(1).startswith("${") and m.group(1) != "none" and m.group(1) not in names:
                problems.append(f"{model}: {key} {m.group(1)!r} is not in the repository")
        problems += parse_problems(model, text)
    return problems


def parse_problems(model: str, text: str) -> list[str]:
    """Parse with Triton's ModelConfig schema when tritonclient is installed (skipped otherwise)."""
    try:
        from google.protobuf import text_format  # noqa: PLC0415
        from tritonclient.grpc import model_config_pb2  # noqa: PLC0415
    except ImportError:
        return []
    try:
        text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        return [f"{model}: config.pbtxt does not parse as a ModelConfig: {e}"]
    return []


def specdec_model(dst: Path, name: str, params: dict[str, str]) -> None:
    """Write a specdec-backend model folder (specdec from this checkout: backends/ on the path)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backends"))
    from specdec.serving.repository import config_pbtxt  # noqa: PLC0415

    (dst / "1").mkdir(parents=True, exist_ok=True)
    (dst / "config.pbtxt").write_text(config_pbtxt(name, params))


HELPERS = {
    "_specdec-model": lambda a: specdec_model(Path(a[0]), a[1], json.loads(a[2])),
    "_untie": lambda a: untie(Path(a[0]), Path(a[1])),
    "_prepare-eagle": lambda a: prepare_eagle(Path(a[0]), Path(a[1]), Path(a[2])),
    "_medusa-pt": lambda a: medusa_pt(Path(a[0]), Path(a[1])),
    "_copy-model": lambda a: copy_model(Path(a[0]), Path(a[1]), a[2], list(a[3:])),
    "_write-text": lambda a: Path(a[0]).write_text(a[1]),
}


def run_helper(argv: list[str]) -> int:
    name, args = argv[0], argv[1:]
    if name == "_verify-repo":
        problems = verify_repository(Path(args[0]))
        for p in problems:
            print(f"repository problem: {p}", file=sys.stderr)
        return 1 if problems else 0
    if name not in HELPERS:
        print(f"unknown helper {name}", file=sys.stderr)
        return 2
    HELPERS[name](args)
    return 0


# ----------------------------------------------------------------------------------------------- main

def print_plan(steps: list[Step], out=None) -> None:
    out = out or sys.stdout
    for i, step in enumerate(steps, 1):
        print(f"# [{i}/{len(steps)}] {step.name}", file=out)
        if step.cwd:
            print(f"cd {shlex.quote(step.cwd)} && \\", file=out)
        print(step.command(), file=out)
        for key, value in step.params:
            print(f"#     {key} = {value}", file=out)
        print(file=out)


def run_plan(steps: list[Step], skip_existing: bool = False) -> None:
    for i, step in enumerate(steps, 1):
        if skip_existing and step.creates and Path(step.creates).exists():
            print(f"[{i}/{len(steps)}] {step.name}: exists, skipped", flush=True)
            continue
        print(f"[{i}/{len(steps)}] {step.name}\n  {step.command()}", flush=True)
        result = subprocess.run(step.argv, cwd=step.cwd)
        if result.returncode != 0:
            raise SystemExit(f"step failed ({result.returncode}): {step.name}")


def options_from_args(args: argparse.Namespace) -> Options:
    kit = Path(args.kit).resolve() if args.kit else None

    def pick(explicit, sub):
        if explicit:
            return Path(explicit).resolve()
        return kit / sub if kit else None

    target = pick(args.target, "target")
    if target is None:
        raise PlanError("give --kit or --target")
    default = LLMAPI_METHODS if args.interface == "llmapi" else METHODS
    methods = tuple(m.strip() for m in (args.methods or ",".join(default)).split(",") if m.strip())
    return Options(
        out=Path(args.out).resolve(), trtllm_root=Path(args.trtllm_root), backend_root=Path(args.backend_root),
        target=target, draft=pick(args.draft, "draft"), medusa=pick(args.medusa, "medusa"),
        eagle=pick(args.eagle, "eagle"), eagle3=pick(args.eagle3, "eagle3"), methods=methods,
        interface=args.interface, dtype=args.dtype, max_batch=args.max_batch,
        max_input_len=args.max_input_len, max_seq_len=args.max_seq_len, draft_len=args.draft_len,
        medusa_choices=parse_tree(args.medusa_choices) if args.medusa_choices else None,
        eagle_choices=parse_tree(args.eagle_choices) if args.eagle_choices else None,
        kv_fraction=args.kv_fraction, layout=args.layout, python=args.python,
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--kit", help="folder with target/, draft/, medusa/, eagle/ (Hugging Face layouts)")
    p.add_argument("--target", help="target checkpoint (overrides KIT/target)")
    p.add_argument("--draft", help="draft checkpoint (overrides KIT/draft)")
    p.add_argument("--medusa", help="Medusa heads folder (overrides KIT/medusa)")
    p.add_argument("--eagle", help="EAGLE-1 head folder (overrides KIT/eagle)")
    p.add_argument("--out", required=True, help="output folder: checkpoints/, engines/, model_repository/")
    p.add_argument("--trtllm-root", default="/app", help="TensorRT-LLM checkout (holds examples/)")
    p.add_argument("--backend-root", default="/app",
                   help="tensorrtllm_backend checkout (holds all_models/inflight_batcher_llm and tools/)")
    p.add_argument("--eagle3", help="EAGLE-3 draft head folder, llmapi interface (overrides KIT/eagle3)")
    p.add_argument("--interface", default="inflight_batcher", choices=INTERFACES,
                   help="inflight_batcher: engines + tensorrtllm_backend templates (TensorRT-LLM 0.x); "
                        "llmapi: TensorRT-LLM >= 1.x LLM API models (model.yaml, no engine build)")
    p.add_argument("--methods", help=f"comma list; inflight_batcher: {', '.join(METHODS)} (default all); "
                                     f"llmapi: {', '.join(LLMAPI_METHODS)} (default all)")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-input-len", type=int, help="default: half of --max-seq-len")
    p.add_argument("--max-seq-len", type=int, help="default: the target's max_position_embeddings")
    p.add_argument("--draft-len", type=int, default=4, help="max draft tokens per round for spec_draft")
    p.add_argument("--medusa-choices", help="'mc_sim_7b_63' (default, cut to the head count), 'chain:K' or JSON")
    p.add_argument("--eagle-choices", help="'mc_sim_7b_63' (default), 'chain:K' or JSON")
    p.add_argument("--kv-fraction", type=float,
                   help="kv_cache_free_gpu_mem_fraction per engine (default: 0.85 / engines per repository)")
    p.add_argument("--layout", default="single", choices=("single", "per-method"))
    p.add_argument("--python", default=sys.executable or "python3", help="Python that has tensorrt_llm")
    p.add_argument("--dry-run", action="store_true", help="print every command and template parameter")
    p.add_argument("--skip-existing", action="store_true", help="skip steps whose output already exists")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("_"):
        return run_helper(argv)
    args = parser().parse_args(argv)
    try:
        opts = options_from_args(args)
        steps = plan(opts)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        if opts.interface == "llmapi":
            print("# TensorRT-LLM >= 1.x LLM API models (no engine build; the PyTorch backend loads the checkpoints)")
        else:
            print(f"# TensorRT-LLM {PINNED_TRTLLM} / tensorrtllm_backend {PINNED_BACKEND} / {PINNED_IMAGE}")
        templates = locate(opts.backend_root, LLMAPI_TEMPLATE if opts.interface == "llmapi" else TEMPLATES)
        if not templates.exists():
            print(f"# note: no templates under {opts.backend_root}: every planned parameter is listed; a real run "
                  "passes fill_template.py only those its template has")
        print()
        print_plan(steps)
        return 0
    run_plan(steps, args.skip_existing)
    return 0


if __name__ == "__main__":
    sys.exit(main())
