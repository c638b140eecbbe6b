"""Interleaved A/B of one model's forward: this checkout against an earlier commit, in one process.

    python -m specdec.tools.forward_ab --rev 4807f05 --model target --threads 1

A whole-command timing cannot separate a faster forward from the machine's drift, and timed unit
tests prove nothing; this imports the earlier commit's `specdec` package under another name beside
the current one, loads the same checkpoint into both, and times them call by call in alternating
order (400 pairs per shape by default), so each ratio compares calls made a few milliseconds apart.
Both must pick the same tokens (argmax of the logits), or the comparison stops.
"""

from __future__ import annotations

import argparse
import importlib
import io
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from specdec.paths import DEMO_KIT, REPO_ROOT

SHAPES = "1x1,1x2,1x5,8x1,8x5"


def import_revision(rev: str, into: Path) -> str:
    """Unpack `rev`'s backends/specdec as package specdec_<rev> under `into`; return its name."""
    name = "specdec_" + re.sub(r"\W", "_", rev)
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", rev, "backends/specdec"],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    package = into / name
    (into / "backends" / "specdec").rename(package)
    for source in package.rglob("*.py"):
        text = source.read_text()
        source.write_text(re.sub(r"\bspecdec\.", f"{name}.", text).replace("from specdec import", f"from {name} import"))
    sys.path.insert(0, str(into))
    return name


def time_pairs(forwards: dict[str, callable], calls: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in forwards}
    order = list(forwards)
    for r in range(calls):
        for k in (order if r % 2 else order[::-1]):
            t0 = time.perf_counter()
            forwards[k]()
            times[k].append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="git revision to compare against (e.g. a commit before a change)")
    ap.add_argument("--model", default="target", help="checkpoint folder under the kit (target, draft) (default: target)")
    ap.add_argument("--kit", default=str(DEMO_KIT), help="folder with the checkpoints (default: demo kit)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shapes", default=SHAPES, help=f"batch x new tokens per forward (default: {SHAPES})")
    ap.add_argument("--calls", type=int, default=400, help="paired calls per shape (default: 400)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = str(Path(args.kit) / args.model)
    with tempfile.TemporaryDirectory() as tmp:
        old = importlib.import_module(import_revision(args.rev, Path(tmp)) + ".core.models.checkpoint")
        from specdec.core.models.checkpoint import load_model
        models = {args.rev: old.load_model(folder), "this checkout": load_model(folder)}
    caches = {k: m.new_cache(8, 512) for k, m in models.items()}
    print(f"{folder}, {args.threads} thread(s), {args.calls} alternating pairs per shape; "
          f"speedup = {args.rev} time / this checkout's time, per pair")
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            B, T = map(int, shape.split("x"))
            tokens = torch.randint(0, models[args.rev].config.vocab_size, (B, T), generator=torch.Generator().manual_seed(B * 100 + T))
            starts = [100 + b % 3 for b in range(B)]  # rows at different lengths, as in a running batch
            positions = torch.tensor(starts)[:, None] + torch.arange(T)
            forwards = {k: (lambda m=m, c=caches[k]: m.logits(m(tokens, positions, c, list(range(B)), starts)).argmax(-1).tolist())
                        for k, m in models.items()}
            picks = {k: f() for k, f in forwards.items()}
            if len(set(map(str, picks.values()))) > 1:
                raise SystemExit(f"B={B} T={T}: the two forwards pick different tokens")
            times = time_pairs(forwards, args.calls)
            ratios = sorted(a / b for a, b in zip(*times.values()))
            q = len(ratios) // 4
            print(f"B={B} T={T}: {args.rev} {statistics.median(times[args.rev]) * 1e3:.3f} ms, this checkout "
                  f"{statistics.median(times['this checkout']) * 1e3:.3f} ms; speedup median {statistics.median(ratios):.2f}x "
                  f"(quartiles {ratios[q]:.2f}-{ratios[-q - 1]:.2f})")


if __name__ == "__main__":
    main()
