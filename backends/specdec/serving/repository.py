"""Write a Triton model repository for a set of Hugging Face checkpoints (`specdec build-repo`).

One model per configuration, side by side for A/B: `baseline` (no speculation), `spec_draft`,
`spec_medusa`, `spec_eagle` (EAGLE-1 chain; `--eagle-tree` serves the EAGLE-2 dynamic tree),
`spec_ngram`. Each is a `config.pbtxt` for the decoupled specdec backend whose parameters name the
checkpoint folders (relative to the config's folder when they can be) and the engine settings
(`specdec.core.config`), plus an empty version folder `1/`. Each config's first line is the
command that wrote it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from specdec.core.config import PATH_KEYS, SETTINGS, add_arguments, given, to_strings
from specdec.serving.config import BACKEND_SETTINGS, PARAMETERS
from specdec.serving.interface import INPUTS, OUTPUTS

# model name -> (method, checkpoint folders it needs besides the target)
MODELS = {
    "baseline": ("baseline", ()),
    "spec_draft": ("draft", ("draft",)),
    "spec_medusa": ("medusa", ("medusa",)),
    "spec_eagle": ("eagle", ("eagle",)),  # EAGLE-1: beat EAGLE-2 on CPU at batch 1 and 8 (docs/benchmarks.md)
    "spec_ngram": ("ngram", ()),
}
# written into every config (defaults included), so a served model states how it runs; the other
# settings (trees, n-gram sizes, typical acceptance) only when given
ALWAYS = ("k", *(k for k, s in SETTINGS.items() if s.section in ("scheduler", "runtime")), *BACKEND_SETTINGS)
# what build-repo sets per model or takes as its own arguments
OWN = ("method", *PATH_KEYS)
FLAGS = [k for k in PARAMETERS if k not in OWN]


def config_pbtxt(name: str, parameters: dict[str, object], command: str = "specdec build-repo",
                 instances: int = 1) -> str:
    """The device parameter picks the instance kind: on KIND_GPU Triton gives each instance a GPU
    and the backend moves the engine to it (`config.placed`)."""
    kind = "KIND_GPU" if str(parameters.get("device", "cpu")).startswith("cuda") else "KIND_CPU"
    def tensor(f, is_input: bool) -> str:
        opt = "\n    optional: true" if is_input and f.optional else ""
        return f'  {{\n    name: "{f.name}"\n    data_type: {f.dtype}\n    dims: {f.dims}{opt}\n  }}'

    params = ",\n".join(f'  {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in parameters.items())
    return (
        f'# Written by `{command}`; the parameters configure the specdec engine.\n'
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
    **settings: object,
) -> list[str]:
    """Write one model folder per configuration whose checkpoints are given; returns the names.
    `settings` are typed values by key (`k=3, policy="fixed", eagle_tree=(3, 3, 8)`); those not
    given are written with their defaults (`ALWAYS`) or left out."""
    out = Path(out)
    unknown = sorted(set(settings) - set(FLAGS))
    if unknown:
        raise ValueError(f"unknown engine settings: {', '.join(unknown)}")
    settings = {k: v for k, v in settings.items() if v is not None}
    written_settings = {k: settings.get(k, PARAMETERS[k].default) for k in ALWAYS}
    written_settings |= {k: v for k, v in settings.items() if k not in ALWAYS}
    folders = {"target": target, "draft": draft, "medusa": medusa, "eagle": eagle}
    wanted = models or [m for m, (_, needs) in MODELS.items() if all(folders[n] for n in needs)]
    command = command_line(out, folders, models, prefix, absolute, settings)
    written = []
    for model in wanted:
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
        method, needs = MODELS[model]
        if method == "eagle" and "eagle_tree" in settings:  # a tree asks for EAGLE-2
            method = "eagle2"
        missing = [n for n in needs if not folders[n]]
        if missing:
            raise ValueError(f"{model} needs --{missing[0]}")
        name = prefix + model
        model_dir = out / name
        (model_dir / "1").mkdir(parents=True, exist_ok=True)
        (model_dir / "1" / ".gitkeep").touch()
        params = {"method": method}
        for key in ("target", *needs):
            params[key] = _path(folders[key], model_dir, absolute)
        params |= to_strings(written_settings, PARAMETERS)
        (model_dir / "config.pbtxt").write_text(config_pbtxt(name, params, command))
        written.append(name)
    return written


def command_line(out: Path, folders: dict, models: list[str] | None, prefix: str, absolute: bool,
                 settings: dict[str, object]) -> str:
    """The `specdec build-repo` command that writes these configs (in each config's first line)."""
    argv = ["specdec", "build-repo"]
    for key in PATH_KEYS:
        if folders[key]:
            argv += [f"--{key}", str(folders[key])]
    argv += ["--out", str(out)]
    argv += ["--models", *models] if models else []
    argv += ["--prefix", prefix] if prefix else []
    argv += ["--absolute"] if absolute else []
    for key, value in settings.items():
        argv += [PARAMETERS[key].flag, PARAMETERS[key].to_text(value)]
    return shlex.join(argv)


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
    ap.add_argument("--eagle", help="EAGLE head folder -> spec_eagle (EAGLE-1; with --eagle-tree: EAGLE-2)")
    ap.add_argument("--out", default="model_repository")
    ap.add_argument("--models", nargs="*", help=f"subset of {', '.join(MODELS)} (default: all the checkpoints allow)")
    ap.add_argument("--prefix", default="", help="prefix for the model names")
    ap.add_argument("--absolute", action="store_true", help="write absolute checkpoint paths")
    add_arguments(ap.add_argument_group("engine and backend settings (written into every config)"), FLAGS,
                  PARAMETERS, given_only=True)
    args = ap.parse_args(argv)
    for key in PATH_KEYS:
        path = getattr(args, key)
        if path and not Path(path).is_dir():
            print(f"error: --{key} {path}: no such folder", file=sys.stderr)
            return 2
    try:
        names = write_repository(args.out, args.target, args.draft, args.medusa, args.eagle, args.models,
                                 args.prefix, args.absolute, **given(args, FLAGS))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(names)} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
