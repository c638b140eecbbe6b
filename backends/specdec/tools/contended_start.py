"""The adaptive policy at a busy start (a developer's check, not a test): several engines of one
served model start at once on the same cores, as tritonserver starts a repository's models, and
each then serves requests one at a time, like a closed-loop user.

    python -m specdec.tools.contended_start --model spec_draft --engines 3 --requests 40

Each engine prints how many of its decode steps drafted and its proposal-cost fit. A policy that
a busy start misleads shows as engines that hardly draft (a few percent of their steps) where
the others draft in most: its costs were timed while the engines contended, and, speculation
off, no step came along to correct them (reports/benchmarks-log.md, "Where the engine's time
went, served").
Tokens/s are printed too, but the engines share the cores, so they are not a speedup.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time

from specdec.paths import MODEL_REPOSITORY


def serve_one_at_a_time(model: str, requests: int, max_tokens: int, repository: str, out) -> None:
    """Worker process: build the model's engine, run `requests` prompts one after another."""
    from specdec.core.engine_config import build_engine
    from specdec.core.sampling import SamplingParams
    from specdec.serving.config import engine_config_for
    from specdec.tools.arrivals import arrivals
    from specdec.tools.prompts import heldout_prompts

    engine = build_engine(engine_config_for(f"{repository}/{model}"))
    prompts = heldout_prompts(32, "short", seed=0)
    t0 = time.perf_counter()
    arrivals(engine, SamplingParams(max_tokens=max_tokens, temperature=0.0),
             [prompts[i % len(prompts)] for i in range(requests)], in_flight=1)
    wall = time.perf_counter() - t0
    m, cost = engine.metrics, engine.policy.cost
    out.put({"steps": m.steps, "drafts": m.drafts, "tokens_per_s": m.output_tokens / wall,
             "draft_fixed_ms": 1000 * cost.proposals.fixed if cost else None,
             "draft_per_level_ms": 1000 * cost.proposals.per_level if cost else None,
             "row_share": cost.proposals.row_share if cost else None,
             "catch_up_per_entry_ms": 1000 * cost.catch_up_per_entry if cost else None})


def run(model: str, engines: int, requests: int, max_tokens: int, repository: str) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=serve_one_at_a_time, args=(model, requests, max_tokens, repository, out))
             for _ in range(engines)]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="spec_draft", help="a model folder of the repository")
    ap.add_argument("--model-repository", default=str(MODEL_REPOSITORY))
    ap.add_argument("--engines", type=int, default=3, help="engines started at once (default: 3)")
    ap.add_argument("--requests", type=int, default=40, help="requests per engine, one at a time (default: 40)")
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args(argv)
    results = run(a.model, a.engines, a.requests, a.max_tokens, a.model_repository)
    print(f"{a.engines} engines of {a.model} started at once, {a.requests} requests of {a.max_tokens} tokens each, one at a time")
    print("| engine | drafted steps | tok/s (cores shared) | proposal fixed ms | per level ms | row share | catch-up ms/entry |")
    print("|---|---|---|---|---|---|---|")
    for i, r in enumerate(results):
        costs = " | ".join("-" if r[k] is None else f"{r[k]:.3f}"
                           for k in ("draft_fixed_ms", "draft_per_level_ms", "row_share", "catch_up_per_entry_ms"))
        print(f"| {i} | {r['drafts']} / {r['steps']} | {r['tokens_per_s']:.0f} | {costs} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
