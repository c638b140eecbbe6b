"""Command line: `build` trains/resumes and exports a kit, `evaluate` recomputes an exported kit's figures."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdec.tools.kit.build import build_kit
from specdec.tools.kit.evaluate import evaluate_kit
from specdec.tools.kit.export import write_checksums
from specdec.tools.kit.profiles import PROFILES, STAGE_ORDER


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m specdec.tools.kit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="train (or resume) the kit's models, export them and evaluate")
    b.add_argument("--profile", choices=sorted(PROFILES), default="demo")
    b.add_argument("--out", type=Path, required=True, help="kit folder to write (target/, draft/, medusa/, eagle/)")
    b.add_argument("--minutes", type=float, help="total training time budget, split across stages by the profile")
    b.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    b.add_argument("--cache", type=Path, help="checkpoint/cache folder (default ~/.cache/specdec/kit/<profile>)")
    b.add_argument("--threads", type=int, help="torch CPU threads (1 keeps a core free on a shared 2-core box)")
    b.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the training steps (profile default: demo yes, tiny no)")
    b.add_argument("--stages", type=lambda v: v.split(","), default=list(STAGE_ORDER),
                   help="comma-separated stages to train now (others load from the cache; no export unless all)")
    e = sub.add_parser("evaluate", help="recompute held-out figures of an exported kit into its kit.json")
    e.add_argument("kit", type=Path)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    if args.command == "build":
        if args.device == "cuda":
            torch.set_float32_matmul_precision("high")
        unknown = set(args.stages) - set(STAGE_ORDER)
        if unknown:
            raise SystemExit(f"unknown stages {sorted(unknown)}; choose from {', '.join(STAGE_ORDER)}")
        kit = build_kit(PROFILES[args.profile], args.out, args.cache, args.minutes, args.device, args.compile, args.stages)
        if kit is None:
            return 0
    else:
        evaluate_kit(args.kit)
        write_checksums(args.kit)
        kit = json.loads((args.kit / "kit.json").read_text())
    print(json.dumps(kit["eval"], indent=2))
    return 0
