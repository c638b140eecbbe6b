"""Per-request samples (JSON lines from the Locust users) -> the figures of one matrix cell.

Definitions (all client-side, from what was streamed):
- TTFT: request sent -> first response carrying a token.
- ITL: every gap between consecutive output tokens. Tokens that arrive in one response arrive
  together: the first token of a response gets the gap since the previous response, the others 0.
  So a speculative step that commits 3 tokens contributes (gap, 0, 0).
- TPOT: per request, (end-to-end - TTFT) / (tokens - 1): the mean time per token after the first.
- output tokens/s: tokens that arrived inside the measurement windows / their total length (one
  window per trial; a model's pooled figures use all its trials' windows).
- completed requests/s: requests that finished (without error) inside the windows / their length.
- latency percentiles, error rate and acceptance: over requests sent inside the windows.
- tokens per response: output tokens per streamed response after the first.
- mean accepted length (server counters, `server_figures`): 1 + accepted draft tokens per
  verification round that drafted (the bonus token included); None when nothing was drafted.
- acceptance rate: accepted / proposed draft tokens (the server's per-request outputs, summed).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

# the figures every trial measures: each gets an interval over trials, and a paired ratio to the baseline's
TRIAL_FIGURES = ("ttft_p50", "ttft_p95", "itl_p50", "itl_p95", "tpot_p50", "tpot_p95", "e2e_p50", "e2e_p95",
                 "output_tokens_per_s", "completed_rps", "error_rate", "acceptance_rate", "rss_mb", "cpu_ms_per_token")


def load_samples(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def token_gaps(sample: dict) -> list[float]:
    """Inter-token gaps of one request (see the module docstring); empty for < 2 tokens."""
    gaps: list[float] = []
    prev = None
    for at, n in sample["chunks"]:
        n = int(n)
        if n == 0:
            continue
        if prev is None:
            gaps.extend([0.0] * (n - 1))  # the first response's extra tokens came with the first token
        else:
            gaps.append(at - prev)
            gaps.extend([0.0] * (n - 1))
        prev = at
    return gaps


def tpot(sample: dict) -> float | None:
    if sample["tokens"] < 2 or sample.get("ttft") is None or sample.get("e2e") is None:
        return None
    return (sample["e2e"] - sample["ttft"]) / (sample["tokens"] - 1)


def figures(samples: list[dict], windows: list[tuple[float, float]]) -> dict:
    """The figures of a set of requests over disjoint measurement windows [w0, w1) (wall clock)."""
    def inside(t: float) -> bool:
        return any(w0 <= t < w1 for w0, w1 in windows)

    measured = [s for s in samples if inside(s["start"])]
    ok = [s for s in measured if not s.get("error")]
    length = sum(w1 - w0 for w0, w1 in windows)
    tokens_in_window = sum(int(n) for s in samples for at, n in s["chunks"] if inside(s["start"] + at))
    completed = sum(1 for s in samples if not s.get("error") and inside(s["start"] + (s["e2e"] or 0.0)))
    gaps = [g for s in ok for g in token_gaps(s)]
    ttfts = [s["ttft"] for s in ok if s.get("ttft") is not None]
    e2es = [s["e2e"] for s in ok]
    tpots = [t for t in (tpot(s) for s in ok) if t is not None]
    decode_tokens = sum(s["tokens"] - _first_tokens(s) for s in ok)
    decode_responses = sum(max(0, sum(1 for _, n in s["chunks"] if int(n) > 0) - 1) for s in ok)
    drafted = sum(s["draft_tokens"] for s in ok)
    accepted = sum(s["accepted_tokens"] for s in ok)
    return {
        "requests": len(measured),
        "errors": len(measured) - len(ok),
        "error_rate": (len(measured) - len(ok)) / len(measured) if measured else None,
        "ttft_p50": percentile(ttfts, 50), "ttft_p95": percentile(ttfts, 95),
        "itl_p50": percentile(gaps, 50), "itl_p95": percentile(gaps, 95),
        "tpot_p50": percentile(tpots, 50), "tpot_p95": percentile(tpots, 95),
        "e2e_p50": percentile(e2es, 50), "e2e_p95": percentile(e2es, 95),
        "output_tokens": sum(s["tokens"] for s in ok),
        "output_tokens_in_window": tokens_in_window,
        "output_tokens_per_s": tokens_in_window / length if length > 0 else None,
        "completed_requests_in_window": completed,
        "completed_rps": completed / length if length > 0 else None,
        "tokens_per_response": decode_tokens / decode_responses if decode_responses else None,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "window_s": length,
    }


def _first_tokens(sample: dict) -> int:
    for _, n in sample["chunks"]:
        if int(n) > 0:
            return int(n)
    return 0


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None:
        return None
    if base == 0:
        return None if value != 0 else 1.0
    return value / base


# ---- Prometheus text format (Triton's metrics port) ------------------------------------------------
def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    """{(name, sorted label pairs): value} for every sample line."""
    import re

    out: dict[tuple[str, tuple], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([^{\s]+)(?:\{(.*)\})?\s+(\S+)", line)
        if not m:
            continue
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            continue
    return out


def metric_delta(before: dict, after: dict, name: str, **labels) -> float:
    """Sum over series of `name` whose labels include `labels` of (after - before)."""
    total = 0.0
    for (n, lab), value in after.items():
        if n != name:
            continue
        d = dict(lab)
        if all(d.get(k) == v for k, v in labels.items()):
            total += value - before.get((n, lab), 0.0)
    return total


def histogram_quantile(before: dict, after: dict, name: str, q: float, **labels) -> float | None:
    """Quantile of the observations added between two scrapes (linear within a bucket, like PromQL)."""
    buckets: dict[float, float] = {}
    for (n, lab), value in after.items():
        if n != f"{name}_bucket":
            continue
        d = dict(lab)
        if not all(d.get(k) == v for k, v in labels.items()):
            continue
        le = float("inf") if d["le"] in ("+Inf", "inf") else float(d["le"])
        buckets[le] = buckets.get(le, 0.0) + value - before.get((n, lab), 0.0)
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for b in bounds:
        if buckets[b] >= rank:
            if math.isinf(b):
                return prev_bound
            span = buckets[b] - prev_count
            return prev_bound + (b - prev_bound) * ((rank - prev_count) / span if span > 0 else 0.0)
        prev_bound, prev_count = b, buckets[b]
    return prev_bound


def engine_figures(before: dict, after: dict, model: str, tokens: float, requests: float) -> dict:
    """Where the engine thread's time went (`specdec:engine_seconds` by phase): seconds per phase,
    the prefill share, and engine ms per output token, whole and decode only (a request's first
    token comes from its prefill). Empty where the model exports no engine time (the rounds engine
    over tensorrt_llm models: its time is the inner models')."""
    phases = sorted({dict(lab)["phase"] for n, lab in after if n == "specdec:engine_seconds"
                     and dict(lab).get("model") == model and "phase" in dict(lab)})
    busy = {p: metric_delta(before, after, "specdec:engine_seconds", model=model, phase=p) for p in phases}
    total = sum(busy.values())
    if total <= 0:
        return {}
    decode_tokens = tokens - requests
    return {
        "engine_seconds": busy,
        "prefill_share": busy.get("prefill", 0.0) / total,
        "engine_ms_per_token": 1000 * total / tokens if tokens else None,
        "decode_ms_per_token": 1000 * (total - busy.get("prefill", 0.0)) / decode_tokens if decode_tokens > 0 else None,
    }


def server_figures(before: dict, after: dict, model: str) -> dict:
    """The server's own counters for one cell (the whole cell, warm-up included)."""
    def d(name, **labels):
        return metric_delta(before, after, name, model=model, **labels)

    drafts = d("specdec:spec_decode_num_drafts")
    per_pos = []
    for p in range(64):
        key = [k for k in after if k[0] == "specdec:spec_decode_num_accepted_tokens_per_pos"
               and dict(k[1]).get("model") == model and dict(k[1]).get("position") == str(p)]
        if not key:
            break
        per_pos.append(d("specdec:spec_decode_num_accepted_tokens_per_pos", position=str(p)))
    qcount = d("specdec:request_queue_time_seconds_count")
    tokens = d("specdec:generation_tokens")
    batches = d("specdec:batch_size_count")
    return {
        # running requests, sampled every flush while any run: per-token engine costs fall with it
        "mean_batch": d("specdec:batch_size_sum") / batches if batches else None,
        **engine_figures(before, after, model, tokens, qcount),
        "server_output_tokens": tokens,
        "server_drafts": drafts,
        "server_draft_tokens": d("specdec:spec_decode_num_draft_tokens"),
        "server_accepted_tokens": d("specdec:spec_decode_num_accepted_tokens"),
        "acceptance_per_position": [x / drafts for x in per_pos] if drafts else [],
        "mean_accepted_length": 1 + d("specdec:spec_decode_num_accepted_tokens") / drafts if drafts else None,
        "queue_wait_mean": d("specdec:request_queue_time_seconds_sum") / qcount if qcount else None,
        "queue_wait_p95": histogram_quantile(before, after, "specdec:request_queue_time_seconds", 0.95, model=model),
        "server_requests": qcount,
    }
