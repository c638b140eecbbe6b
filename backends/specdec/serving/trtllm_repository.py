"""`specdec build-repo --runtime trtllm-contract`: the repository shape the GPU build (build/trtllm)
writes, with CPU `tensorrt_llm`-contract models standing in for the TensorRT-LLM engines:

- `target_trtllm`, `draft_trtllm`: contract models (`backend: "python"`, decoupled, batch dim),
  `1/model.py` importing `specdec.serving.trtllm_contract_model`;
- `spec_draft`: the specdec backend's rounds engine over those two (draft-then-verify through BLS);
- `baseline`: the same backend over `target_trtllm` alone.
The client-facing models keep specdec's request interface (serving/request.py), so clients and
load tests compare both runtimes by model name.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from specdec.serving.config import read_parameters
from specdec.serving.repository import config_pbtxt
from specdec.serving.rounds import is_rounds
from specdec.serving.trtllm_contract import INPUTS, OUTPUTS

RUNTIMES = ("specdec", "trtllm-contract")
CONTRACT_ENTRY = "from specdec.serving.trtllm_contract_model import TritonPythonModel  # noqa: F401\n"
DEFAULTS = {"max_draft_len": 4, "max_batch": 8, "max_context": 1024, "queue_timeout_s": 60.0, "policy": "adaptive",
            "dtype": "float32", "threads": 1, "tokens_per_block": 8, "stream_interval": 1}


def split_runtime(argv: list[str]) -> tuple[str, list[str]]:
    """`--runtime X` (or `--runtime=X`) out of a build-repo command line -> (X, the rest)."""
    rest, runtime, i = [], "specdec", 0
    while i < len(argv):
        if argv[i] == "--runtime" and i + 1 < len(argv):
            runtime, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith("--runtime="):
            runtime = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    return runtime, rest


def is_engine_model(model_dir: Path) -> bool:
    """A model folder whose config drives the in-process engine (not a contract model or orchestrator)."""
    text = (Path(model_dir) / "config.pbtxt").read_text()
    return 'backend: "specdec"' in text and not is_rounds(read_parameters(Path(model_dir) / "config.pbtxt"))


def contract_config(name: str, parameters: dict[str, object], max_batch: int) -> str:
    def tensor(tname: str, dtype: str, dims: str, optional: bool) -> str:
        opt = "\n    optional: true" if optional else ""
        return f'  {{\n    name: "{tname}"\n    data_type: {dtype}\n    dims: {dims}{opt}\n  }}'

    inputs = ",\n".join(tensor(n, t, d, o) for n, (t, d, o) in INPUTS.items())
    outputs = ",\n".join(tensor(n, t, d, False) for n, (t, d) in OUTPUTS.items())
    params = ",\n".join(f'  {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in parameters.items())
    return (
        "# Written by `specdec build-repo --runtime trtllm-contract`: a CPU model speaking the\n"
        "# tensorrt_llm contract (tensor names and shapes of tensorrtllm_backend v0.18.0).\n"
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: {max_batch}\n'
        "model_transaction_policy { decoupled: true }\n"
        f"input [\n{inputs}\n]\noutput [\n{outputs}\n]\n"
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
        f"parameters [\n{params}\n]\n"
    )


def write_contract_repository(out: str | Path, target: str | Path, draft: str | Path, absolute: bool = False,
                              prefix: str = "", **settings: object) -> list[str]:
    """Write target_trtllm, draft_trtllm, spec_draft and baseline; returns the model names."""
    unknown = set(settings) - set(DEFAULTS) - {"inner_exclude_input_in_output", "cache_slots"}
    if unknown:
        raise ValueError(f"unknown settings: {', '.join(sorted(unknown))}")
    s = {**DEFAULTS, **{k: v for k, v in settings.items() if v is not None}}
    out = Path(out)
    names = {"target": f"{prefix}target_trtllm", "draft": f"{prefix}draft_trtllm"}

    def folder(name: str) -> Path:
        (out / name / "1").mkdir(parents=True, exist_ok=True)
        return out / name

    def path(checkpoint, model_dir: Path) -> str:
        checkpoint = Path(checkpoint).resolve()
        return str(checkpoint) if absolute else os.path.relpath(checkpoint, model_dir.resolve())

    for role, checkpoint in (("target", target), ("draft", draft)):
        model_dir = folder(names[role])
        params = {"checkpoint": path(checkpoint, model_dir), "max_batch": s["max_batch"],
                  "max_context": s["max_context"] + s["max_draft_len"] + 1, "max_draft_len": s["max_draft_len"],
                  "tokens_per_block": s["tokens_per_block"], "dtype": s["dtype"], "threads": s["threads"]}
        if settings.get("cache_slots"):
            params["cache_slots"] = settings["cache_slots"]
        (model_dir / "config.pbtxt").write_text(contract_config(names[role], params, s["max_batch"]))
        (model_dir / "1" / "model.py").write_text(CONTRACT_ENTRY)
    written = [names["target"], names["draft"]]
    for model, draft_model in (("spec_draft", names["draft"]), ("baseline", "none")):
        name = prefix + model
        model_dir = folder(name)
        (model_dir / "1" / ".gitkeep").touch()
        params = {"tokenizer": path(target, model_dir), "target_model": names["target"], "draft_model": draft_model,
                  "max_draft_len": s["max_draft_len"], "max_batch": s["max_batch"], "max_context": s["max_context"],
                  "queue_timeout_s": s["queue_timeout_s"], "policy": s["policy"], "stream_interval": s["stream_interval"]}
        if "inner_exclude_input_in_output" in settings:
            params["inner_exclude_input_in_output"] = str(settings["inner_exclude_input_in_output"]).lower()
        (model_dir / "config.pbtxt").write_text(config_pbtxt(name, params, "specdec build-repo --runtime trtllm-contract"))
        written.append(name)
    return written


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="specdec build-repo --runtime trtllm-contract",
                                 description="Write spec_draft and baseline over tensorrt_llm-contract models.")
    ap.add_argument("--kit", help="a kit folder with target/ and draft/ (e.g. build/demo-kit)")
    ap.add_argument("--target", help="target checkpoint folder (instead of --kit)")
    ap.add_argument("--draft", help="draft checkpoint folder (instead of --kit)")
    ap.add_argument("--out", default="model_repository")
    ap.add_argument("--prefix", default="")
    ap.add_argument("--max-draft-len", type=int, default=DEFAULTS["max_draft_len"],
                    help="the most draft tokens per round (a TensorRT-LLM target's --max_draft_len)")
    ap.add_argument("--max-batch", type=int, default=DEFAULTS["max_batch"], help="orchestrated requests in flight")
    ap.add_argument("--max-context", type=int, default=DEFAULTS["max_context"])
    ap.add_argument("--queue-timeout-s", type=float, default=DEFAULTS["queue_timeout_s"])
    ap.add_argument("--policy", choices=["adaptive", "fixed"], default=DEFAULTS["policy"])
    ap.add_argument("--dtype", default=DEFAULTS["dtype"])
    ap.add_argument("--threads", type=int, default=DEFAULTS["threads"], help="torch threads per contract model")
    ap.add_argument("--tokens-per-block", type=int, default=DEFAULTS["tokens_per_block"])
    ap.add_argument("--absolute", action="store_true", help="write absolute checkpoint paths")
    args = ap.parse_args(argv)
    target = args.target or (args.kit and str(Path(args.kit) / "target"))
    draft = args.draft or (args.kit and str(Path(args.kit) / "draft"))
    for key, folder in (("target", target), ("draft", draft)):
        if not folder or not Path(folder).is_dir():
            print(f"error: the {key} checkpoint folder {folder!r} does not exist (give --kit or --{key})", file=sys.stderr)
            return 2
    names = write_contract_repository(
        args.out, target, draft, args.absolute, args.prefix, max_draft_len=args.max_draft_len, max_batch=args.max_batch,
        max_context=args.max_context, queue_timeout_s=args.queue_timeout_s, policy=args.policy, dtype=args.dtype,
        threads=args.threads, tokens_per_block=args.tokens_per_block)
    print(f"wrote {', '.join(names)} to {args.out}")
    return 0
