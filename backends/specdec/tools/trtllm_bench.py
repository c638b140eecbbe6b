"""Orchestrated vs in-process benchmark (not a test): streamed tok/s through one tritonserver of

- `spec_draft` / `baseline`: the rounds engine over the `tensorrt_llm`-contract models (BLS calls),
- `inproc_spec_draft` / `inproc_baseline`: the in-process engine (draft model proposer / none),

at each concurrency, on the same held-out prompts, greedy with ignore_eos (every request brings
exactly --max-tokens tokens; the orchestrated outputs must equal the baseline's). Models take turns
per repeat; `vs baseline` is the median of per-repeat ratios to the in-process baseline. At
concurrency 1 the per-round overhead of the inner calls is the wall time per round minus the inner
models' compute (their `specdec:contract_compute_seconds`); the prefix-cache hit rate is reused /
received input_ids tokens of each inner model.

    python -m specdec.tools.trtllm_bench --kit build/demo-kit --concurrency 1,8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from specdec.paths import DEMO_KIT
from specdec.serving.client import request_inputs, stream
from specdec.serving.repository import write_repository
from specdec.serving.server import TritonServer
from specdec.serving.trtllm_repository import write_contract_repository
from specdec.tools.prompts import heldout_prompts

MODELS = ["baseline", "spec_draft", "inproc_baseline", "inproc_spec_draft"]


def scrape(url: str) -> dict[tuple[str, str], float]:
    """(series, model) -> value, summed over the other labels."""
    values: dict[tuple[str, str], float] = {}
    with urllib.request.urlopen(url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("#") or "{" not in line:
                continue
            name, rest = line.split("{", 1)
            model = rest.split('model="', 1)[1].split('"', 1)[0] if 'model="' in rest else ""
            key = (name, model)
            values[key] = values.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def run(server: TritonServer, model: str, prompts: list[str], max_tokens: int, concurrency: int) -> tuple[float, list]:
    """tok/s over all prompts with `concurrency` streams at a time; the token ids per prompt."""
    ids: list = [None] * len(prompts)
    nxt = iter(range(len(prompts)))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            inputs = request_inputs(prompts[i], max_tokens=max_tokens, ignore_eos=True, stream=True,
                                    exclude_input_in_output=True)
            ids[i] = [t for chunk in stream(server.grpc_url, model, inputs) for t in chunk.token_ids]

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(map(len, ids)) / (time.perf_counter() - t0), ids


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specdec.tools.trtllm_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kit", default=str(DEMO_KIT))
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-draft-len", type=int, default=4)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    kit = Path(args.kit)
    prompts = heldout_prompts(args.prompts, "short", 0)
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="trtllm-bench-") as tmp:
        repo = Path(tmp) / "repo"
        write_contract_repository(repo, kit / "target", kit / "draft", absolute=True, max_draft_len=args.max_draft_len,
                                  max_batch=max(levels))
        write_repository(repo, kit / "target", draft=kit / "draft", models=["baseline", "spec_draft"], prefix="inproc_",
                         absolute=True, k=args.max_draft_len, max_batch=max(levels))
        server = TritonServer(repo, log_file=Path(tmp) / "tritonserver.log")
        with server:
            figures = measure(server, prompts, levels, args)
    print(report(figures, args))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


def measure(server: TritonServer, prompts: list[str], levels: list[int], args) -> dict:
    figures: dict = {"prompts": len(prompts), "max_tokens": args.max_tokens, "levels": {}}
    for c in levels:
        rates: dict[str, list[float]] = {m: [] for m in MODELS}
        outputs = {}
        overhead, hits = [], {}
        for r in range(args.repeats):
            order = MODELS[r % len(MODELS):] + MODELS[: r % len(MODELS)]  # take turns
            for model in order:
                before = scrape(server.metrics_url)
                t0 = time.perf_counter()
                rate, ids = run(server, model, prompts, args.max_tokens, c)
                wall = time.perf_counter() - t0
                after = scrape(server.metrics_url)
                rates[model].append(rate)
                outputs.setdefault(model, ids)
                if model == "spec_draft":
                    delta = lambda name, m: after.get((name, m), 0.0) - before.get((name, m), 0.0)  # noqa: E731
                    rounds = delta("specdec:spec_decode_num_drafts", "spec_draft")
                    compute = sum(delta("specdec:contract_compute_seconds", m) for m in ("target_trtllm", "draft_trtllm"))
                    if c == 1 and rounds:
                        overhead.append((wall - compute) / rounds)
                    for m in ("target_trtllm", "draft_trtllm"):
                        got = delta("specdec:contract_prompt_tokens", m)
                        if got:
                            hits.setdefault(m, []).append(delta("specdec:contract_reused_tokens", m) / got)
        same = {m: outputs[m] == outputs["inproc_baseline"] for m in MODELS}
        ratios = {m: statistics.median(a / b for a, b in zip(rates[m], rates["inproc_baseline"])) for m in MODELS}
        figures["levels"][c] = {
            "tok_s": {m: {"median": statistics.median(v), "min": min(v), "max": max(v)} for m, v in rates.items()},
            "vs_inproc_baseline": ratios, "same_tokens_as_baseline": same,
            "round_overhead_ms": 1000 * statistics.median(overhead) if overhead else None,
            "prefix_hit_rate": {m: statistics.median(v) for m, v in hits.items()},
        }
    return figures


def report(figures: dict, args) -> str:
    lines = [f"{figures['prompts']} held-out prompts x {figures['max_tokens']} greedy tokens, {args.repeats} repeats, "
             f"max_draft_len {args.max_draft_len}"]
    for c, f in figures["levels"].items():
        lines.append(f"\nconcurrency {c}")
        lines.append(f"  {'model':20s} {'tok/s median':>12s} {'min..max':>15s} {'vs inproc_baseline':>19s} same tokens")
        for m in MODELS:
            t = f["tok_s"][m]
            lines.append(f"  {m:20s} {t['median']:12.1f} {t['min']:7.1f}..{t['max']:<7.1f} "
                         f"{f['vs_inproc_baseline'][m]:19.2f} {f['same_tokens_as_baseline'][m]}")
        if f["round_overhead_ms"] is not None:
            lines.append(f"  per-round overhead of the inner calls (wall - inner compute): {f['round_overhead_ms']:.1f} ms")
        lines.append("  prefix-cache hit rate (reused / received input tokens): "
                     + ", ".join(f"{m} {v:.0%}" for m, v in f["prefix_hit_rate"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
