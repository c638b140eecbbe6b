"""Interleaved A/B against an earlier commit, in one process: one model's forward, or whole engines.

    python -m specdec.tools.forward_ab --rev 4807f05 --model target --threads 1
    python -m specdec.tools.forward_ab --rev 43e8d00 --method eagle2 --batch 8
    python -m specdec.tools.forward_ab --rev 9d7df4d --method eagle --batch 8 --policy adaptive
    python -m specdec.tools.forward_ab --rev d47dbba --method eagle --batch 8 --policy adaptive --in-flight 4 --max-tokens 32
    python -m specdec.tools.forward_ab --rev 990f673~1 --method draft --batch 8 --in-flight 16 --max-tokens 64 --prompts 32
    python -m specdec.tools.forward_ab --eager --method draft --batch 8
    python -m specdec.tools.forward_ab --rev HEAD --method draft --policy adaptive --engines 4 --rounds 12
    python -m specdec.tools.forward_ab --rev 0a27ed4 --method draft --policy adaptive --engines 2 --sampled-first 1.0

`--eager` compares this checkout with itself, its decoder layers eager (`SPECDEC_NATIVE=0`) on the
A side: what the native decoder gains on this machine.

A whole-command timing cannot separate a faster forward from the machine's drift, and timed unit
tests prove nothing; this imports the earlier commit's `specdec` package under another name beside
the current one, loads the same checkpoints into both, and times them in alternating order: per
call (400 pairs per shape by default) for a forward, per batch of prompts (8 held-out prompts x 128
greedy tokens by default, taken `--batch` at a time, a round's time their sum; fixed k unless
`--policy adaptive`; with `--in-flight`, the whole load, that many requests always in flight, as
a served engine sees them; `--prompts 32`, the load test's prompts, up to 165 tokens where the
first 8 stop at 102) for `--method`, so each ratio compares runs made moments apart. Both must
pick the same tokens, or the comparison stops (greedy output does not depend on the policy).
`--sampled-first T` shifts the traffic under adaptive engines: each turn's prompts run sampled at
temperature T (unseeded) before they run greedy, each phase timed and reported on its own.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import itertools
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from specdec.core.models import native
from specdec.paths import DEMO_KIT, REPO_ROOT
from specdec.tools.arrivals import ARRIVALS, arrivals, repeated
from specdec.tools.prompts import BANDS

SHAPES = "1x1,1x2,1x5,8x1,8x5"


def import_revision(rev: str, into: Path) -> str:
    """Unpack `rev`'s backends/specdec as a package under `into`; return its name (unique to
    `into`: a second comparison in the same process must not find the first one's modules)."""
    name = "specdec_" + re.sub(r"\W", "_", f"{rev}_{into.name}")
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


def time_pairs(forwards: dict[str, Callable[[], object]], calls: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in forwards}
    order = list(forwards)
    for r in range(calls):
        for k in (order if r % 2 else order[::-1]):
            t0 = time.perf_counter()
            forwards[k]()
            times[k].append(time.perf_counter() - t0)
    return times


@contextlib.contextmanager
def eager_layers():
    """Engines built inside run every forward eager (`SPECDEC_NATIVE=0`, read when a model is prepared)."""
    saved = os.environ.get("SPECDEC_NATIVE")
    os.environ["SPECDEC_NATIVE"] = "0"
    native.library.cache_clear()
    try:
        yield
    finally:
        if saved is None:
            del os.environ["SPECDEC_NATIVE"]
        else:
            os.environ["SPECDEC_NATIVE"] = saved
        native.library.cache_clear()


def engines_ab(package: str | None, args: argparse.Namespace) -> None:
    """Whole engines of one method, the earlier commit's (or, package None, this checkout's with
    eager layers) against this checkout's."""
    from specdec.core.config import EngineConfig
    from specdec.core.engine_config import build_engine, freeze_heap
    from specdec.core.sampling import SamplingParams
    from specdec.tools.bench import kit_paths, ratio_interval, turns
    from specdec.tools.prompts import heldout_prompts

    settings = dict(**kit_paths(args.kit), method=args.method, max_batch=args.batch, policy=args.policy, threads=args.threads)
    if package is None:
        def build_rev():
            with eager_layers():
                return build_engine(EngineConfig.of(**settings)), SamplingParams
    else:
        old_config = importlib.import_module(package + ".core.config")
        old_build = importlib.import_module(package + ".core.engine_config").build_engine
        old_params = importlib.import_module(package + ".core.sampling").SamplingParams

        def build_rev():
            return old_build(old_config.EngineConfig.of(**settings)), old_params
    engines = {}
    for i in range(args.engines):  # (rev, i) and ("this checkout", i): each side's engines, built in turn
        engines[args.rev, i] = build_rev()
        engines["this checkout", i] = (build_engine(EngineConfig.of(**settings)), SamplingParams)
    freeze_heap()
    prompts = heldout_prompts(args.prompts, args.band)
    requests = repeated(prompts)  # with --in-flight

    def run(engine, params, chunk: list[str], temperature: float = 0.0) -> list[list[int]]:
        p = params(max_tokens=args.max_tokens, ignore_eos=True, temperature=temperature)
        if args.in_flight:
            return [r.token_ids for r in arrivals(engine, p, chunk, args.in_flight)]
        return [r.token_ids for r in engine.generate(chunk, p)]

    for e, P in engines.values():
        e.generate(prompts[:1], P(max_tokens=8, ignore_eos=True))  # warm-up
    whole = requests if args.in_flight else prompts
    if len({str(run(e, P, whole)) for e, P in engines.values()}) > 1:
        raise SystemExit(f"{args.method}: the two engines' greedy outputs differ")
    # a round runs every engine on each turn's prompts (`bench.turns`) before any runs the next,
    # in alternating order (`time_pairs`: each call is one turn, every engine's next chunk); with
    # --sampled-first, each turn twice: sampled, then greedy
    temperatures = [args.sampled_first, 0.0] if args.sampled_first else [0.0]
    chunks = [([whole[i] for i in turn], t) for turn in turns(len(whole), args.batch, args.in_flight) for t in temperatures]

    def turn_by_turn(engine, params) -> Callable[[], object]:
        chunk = itertools.cycle(chunks)
        return lambda: run(engine, params, *next(chunk))

    calls = time_pairs({k: turn_by_turn(*ep) for k, ep in engines.items()}, args.rounds * len(chunks))
    n = len(chunks)
    shift = f", each turn after its prompts sampled at temperature {args.sampled_first:g}" if args.sampled_first else ""
    for phase, temperature in enumerate(temperatures):  # the greedy phase last
        # a round's time per side: its engines' runs summed (an adaptive engine's state carries from
        # one run to the next, and one engine may stay paused through a run where another drafts)
        times = {k: [sum(t[r * n + phase : (r + 1) * n : len(temperatures)]) for r in range(args.rounds)]
                 for k, t in calls.items()}
        sides = {side: [sum(times[side, i][r] for i in range(args.engines)) for r in range(args.rounds)]
                 for side in (args.rev, "this checkout")}
        ratios = sorted(a / b for a, b in zip(*sides.values()))
        interval = ratio_interval(ratios)
        tokens = f"sampled tokens at temperature {temperature:g}" if temperature else "greedy tokens"
        load = (f"{len(requests)} x {args.max_tokens} {tokens}, {args.in_flight} in flight" if args.in_flight
                else f"{len(prompts)} x {args.max_tokens} {tokens}") + f" ({args.band} prompts)" + ("" if temperature else shift)
        print(f"{args.method}, batch {args.batch}, {args.policy} policy, {args.threads} thread(s), {args.engines} engine(s) a side, "
              f"{args.rounds} alternating rounds of {load}: {args.rev} {statistics.median(sides[args.rev]):.2f} s, this checkout "
              f"{statistics.median(sides['this checkout']):.2f} s; speedup median {statistics.median(ratios):.2f}x "
              f"(range {ratios[0]:.2f}-{ratios[-1]:.2f}"
              + (f", 90% interval [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")
              + ("" if temperature else "); identical outputs") + (")" if temperature else ""))


def forwards_ab(package: str, args: argparse.Namespace) -> None:
    """One checkpoint's forward, the earlier commit's against this checkout's, shape by shape."""
    from specdec.core.models.checkpoint import load_model

    folder = str(Path(args.kit) / args.model)
    old = importlib.import_module(package + ".core.models.checkpoint")
    models = {args.rev: old.load_model(folder), "this checkout": load_model(folder)}
    shapes = [tuple(map(int, shape.split("x"))) for shape in args.shapes.split(",")]
    capacity = args.context + 2 + max(T for _, T in shapes)
    caches = {k: m.new_cache(max(B for B, _ in shapes), capacity) for k, m in models.items()}
    print(f"{folder}, {args.threads} thread(s), {args.calls} alternating pairs per shape; "
          f"speedup = {args.rev} time / this checkout's time, per pair")
    with torch.inference_mode():
        for B, T in shapes:
            tokens = torch.randint(0, models[args.rev].config.vocab_size, (B, T), generator=torch.Generator().manual_seed(B * 100 + T))
            starts = [args.context + b % 3 for b in range(B)]  # rows at different lengths, as in a running batch
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", help="git revision to compare against (e.g. a commit before a change)")
    ap.add_argument("--eager", action="store_true", help="--method: compare against this checkout with eager layers")
    ap.add_argument("--model", default="target", help="checkpoint folder under the kit (target, draft) (default: target)")
    ap.add_argument("--kit", default=str(DEMO_KIT), help="folder with the checkpoints (default: demo kit)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shapes", default=SHAPES, help=f"batch x new tokens per forward (default: {SHAPES})")
    ap.add_argument("--calls", type=int, default=400, help="paired calls per shape (default: 400)")
    ap.add_argument("--context", type=int, default=100,
                    help="committed tokens before a forward's new ones (rows at this + 0, 1, 2) (default: 100)")
    ap.add_argument("--method", help="A/B whole engines of this method (baseline, ngram, draft, medusa, eagle, eagle2)")
    ap.add_argument("--batch", type=int, default=1, help="--method: KV slots, so sequences decoded together (default: 1)")
    ap.add_argument("--rounds", type=int, default=6, help="--method: alternating generations of each (default: 6)")
    ap.add_argument("--engines", type=int, default=1,
                    help="--method: engines a side, each run once a round (default: 1); an adaptive engine's state "
                         "carries over, and one engine may stay paused through runs where another drafts")
    ap.add_argument("--policy", choices=("fixed", "adaptive"), default="fixed", help="--method: the engines' policy (default: fixed)")
    ap.add_argument("--max-tokens", type=int, default=128, help="--method: greedy tokens per prompt (default: 128)")
    ap.add_argument("--prompts", type=int, default=8,
                    help="--method: held-out prompts (default: 8); the load test's are its first 32, up to 165 tokens")
    ap.add_argument("--band", choices=sorted(BANDS), default="short",
                    help="--method: the prompts' length band (default: short; long: 800-2000 characters, where "
                         "attention weighs more)")
    ap.add_argument("--in-flight", type=int, default=0,
                    help=f"--method: keep this many requests in flight over at least {ARRIVALS} (the prompts "
                         "repeated), each finished one submitting the next, the first ones' lengths staggered "
                         "(`tools.arrivals`; default: 0, all prompts at once)")
    ap.add_argument("--sampled-first", type=float, default=0.0, metavar="TEMPERATURE",
                    help="--method: run each turn's prompts sampled at this temperature (unseeded) before they run "
                         "greedy, each phase timed apart: traffic that shifts under adaptive engines (default: 0, none)")
    args = ap.parse_args(argv)
    if bool(args.rev) == args.eager or (args.eager and not args.method):
        ap.error("give --rev REV, or --eager with --method")
    if args.sampled_first < 0 or args.sampled_first != args.sampled_first:
        ap.error(f"--sampled-first must be a temperature >= 0, got {args.sampled_first}")
    torch.set_num_threads(args.threads)
    native.set_threads(args.threads)  # this checkout's native pool; an earlier one's follows its own rules
    if args.eager:
        args.rev = "eager"
        engines_ab(None, args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        package = import_revision(args.rev, Path(tmp))
        (engines_ab if args.method else forwards_ab)(package, args)


if __name__ == "__main__":
    main()
