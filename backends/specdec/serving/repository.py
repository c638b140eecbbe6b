"""Write a Triton model repository for a set of Hugging Face checkpoints (`specdec build-repo`).

One model per configuration, side by side for A/B: `baseline` (no speculation), `spec_draft`,
`spec_medusa`, `spec_eagle` (EAGLE-1 chain; `--eagle-tree` serves the EAGLE-2 dynamic tree),
`spec_ngram`. Each is a `config.pbtxt` for the decoupled specdec backend whose parameters name the
checkpoint folders (relative to the config's folder when they can be) and the engine settings, plus
an empty version folder `1/`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from specdec.serving.request import INPUTS, OUTPUTS

# model name -> (method, checkpoint folders it needs besides the target)
MODELS = {
    "baseline": ("baseline", ()),
    "spec_draft": ("draft", ("draft",)),
    "spec_medusa": ("medusa", ("medusa",)),
    "spec_eagle": ("eagle", ("eagle",)),  # EAGLE-1: beat EAGLE-2 on CPU at batch 1 and 8 (README)
    "spec_ngram": ("ngram", ()),
}
ENGINE_DEFAULTS = {"k": 4, "policy": "adaptive", "max_batch": 8, "max_context": 1024, "queue_timeout_s": 60.0,
                   "dtype": "float32", "device": "cpu", "threads": 1, "stream_interval": 1}


def config_pbtxt(name: str, parameters: dict[str, object], instances: int = 1) -> str:
    """The device parameter picks the instance kind: on KIND_GPU Triton gives each instance a GPU
    and the backend moves the engine to it (`config.placed`)."""
    kind = "KIND_GPU" if str(parameters.get("device", "cpu")).startswith("cuda") else "KIND_CPU"
    def tensor(f, is_input: bool) -> str:
        opt = "\n    optional: true" if is_input and f.optional else ""
        return f'  {{\n    name: "{f.name}"\n    data_type: {f.dtype}\n    dims: {f.dims}{opt}\n  }}'

    params = ",\n".join(f'  {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in parameters.items())
    return (
        f'# Written by `specdec build-repo`; the parameters configure the specdec engine.\n'
        f'name: "{name}"\nbackend: "specdec"\nmax_batch_size: 0  # the engine batches continuously itself\n'
        f'model_transaction_policy {{ decoupled: true }}\n'
        f'input [\n{",".join(chr(10) + tensor(f, True) if i else tensor(f, True) for i, f in enumerate(INPUTS))}\n]\n'
        f'output [\n{",".join(chr(10) + tensor(f, False) if i else tensor(f, False) for i, f in enumerate(OUTPUTS))}\n]\n'
        f'instance_group [ {{ count: {instances} kind: {kind} }} ]\n'
        f'parameters [\n{params}\n]\n'
    )


def write_repository(
    out: str | Path, target: str | Path, draft: str | Path | None = None, medusa: str | Path | None = None,
    eagle: str | Path | None = None, models: list[str] | None = None, prefix: str = "", absolute: bool = False,
    **engine: object,
) -> list[str]:
    """Write one model folder per configuration whose checkpoints are given; returns the names."""
    out = Path(out)
    unknown = set(engine) - set(ENGINE_DEFAULTS) - {"medusa_tree", "eagle_tree", "ngram_min", "ngram_max", "adaptive"}
    if unknown:
        raise ValueError(f"unknown engine settings: {', '.join(sorted(unknown))}")
    if "adaptive" in engine:
        engine["policy"] = "adaptive" if engine.pop("adaptive") else "fixed"
    settings = {**ENGINE_DEFAULTS, **{k: v for k, v in engine.items() if v is not None}}
    folders = {"target": target, "draft": draft, "medusa": medusa, "eagle": eagle}
    wanted = models or [m for m, (_, needs) in MODELS.items() if all(folders[n] for n in needs)]
    written = []
    for model in wanted:
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
        method, needs = MODELS[model]
        if method == "eagle" and settings.get("eagle_tree"):  # a tree asks for EAGLE-2
            method = "eagle2"
        missing = [n for n in needs if not folders[n]]
        if missing:
            raise ValueError(f"{model} needs --{missing[0]}")
        name = prefix + model
        model_dir = out / name
        (model_dir / "1").mkdir(parents=True, exist_ok=True)
        (model_dir / "1" / ".gitkeep").touch()
        params: dict[str, object] = {"method": method}
        for key in ("target", *needs):
            params[key] = _path(folders[key], model_dir, absolute)
        params.update(settings)
        (model_dir / "config.pbtxt").write_text(config_pbtxt(name, params))
        written.append(name)
    return written


def _path(folder: str | Path, model_dir: Path, absolute: bool) -> str:
    folder = Path(folder).resolve()
    if absolute:
        return str(folder)
    return os.path.relpath(folder, model_dir.resolve())


def main(argv: list[str] | None = None) -> int:
    from specdec.serving.trtllm_repository import RUNTIMES, main as contract_main, split_runtime

    runtime, argv = split_runtime(sys.argv[1:] if argv is None else argv)
    if runtime not in RUNTIMES:
        print(f"error: --runtime {runtime!r}: choose {' or '.join(RUNTIMES)}", file=sys.stderr)
        return 2
    if runtime == "trtllm-contract":
        return contract_main(argv)
    ap = argparse.ArgumentParser(prog="specdec build-repo",
                                 description="Write a Triton model repository (one model per method) for HF checkpoints.")
    ap.add_argument("--target", required=True, help="target model folder (HF layout)")
    ap.add_argument("--draft", help="draft model folder -> spec_draft")
    ap.add_argument("--medusa", help="Medusa heads folder -> spec_medusa")
    ap.add_argument("--eagle", help="EAGLE head folder -> spec_eagle")
    ap.add_argument("--out", default="model_repository")
    ap.add_argument("--models", nargs="*", help=f"subset of {', '.join(MODELS)} (default: all the checkpoints allow)")
    ap.add_argument("--prefix", default="", help="prefix for the model names")
    ap.add_argument("--k", type=int, default=ENGINE_DEFAULTS["k"], help="draft tokens per step (max)")
    ap.add_argument("--policy", choices=["adaptive", "fixed"], default="adaptive")
    ap.add_argument("--max-batch", type=int, default=ENGINE_DEFAULTS["max_batch"], help="KV slots per instance")
    ap.add_argument("--max-context", type=int, default=ENGINE_DEFAULTS["max_context"])
    ap.add_argument("--queue-timeout-s", type=float, default=ENGINE_DEFAULTS["queue_timeout_s"])
    ap.add_argument("--dtype", default=ENGINE_DEFAULTS["dtype"], help="float32, bfloat16 or float16 (GPU)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=ENGINE_DEFAULTS["device"],
                    help="cuda: KIND_GPU instances, the engine on the GPU Triton assigns")
    ap.add_argument("--threads", type=int, default=ENGINE_DEFAULTS["threads"], help="torch threads per instance")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="tokens per streamed response at least (1 = every engine step)")
    ap.add_argument("--medusa-tree", help="JSON list of top-k index paths (default mc_sim_7b_63)")
    ap.add_argument("--eagle-tree", help="serve spec_eagle as EAGLE-2 with this top_k,depth,total_tokens tree (e.g. 4,5,24)")
    ap.add_argument("--absolute", action="store_true", help="write absolute checkpoint paths")
    args = ap.parse_args(argv)
    for key in ("target", "draft", "medusa", "eagle"):
        path = getattr(args, key)
        if path and not Path(path).is_dir():
            print(f"error: --{key} {path}: no such folder", file=sys.stderr)
            return 2
    try:
        names = write_repository(
            args.out, args.target, args.draft, args.medusa, args.eagle, args.models, args.prefix, args.absolute,
            k=args.k, policy=args.policy, max_batch=args.max_batch, max_context=args.max_context,
            queue_timeout_s=args.queue_timeout_s, dtype=args.dtype, device=args.device, threads=args.threads,
            stream_interval=args.stream_interval,
            medusa_tree=args.medusa_tree, eagle_tree=args.eagle_tree)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(names)} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
