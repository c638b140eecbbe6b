"""`specdec bench`: baseline vs every method, side by side in one run, on the same checkpoints and prompts.

Runs are interleaved: within a repeat every method (and peer) runs each batch of prompts (the
batch size's slice of them; under arrivals, the whole load) before any runs the next, in an order
shuffled for every batch, so machine noise hits all methods alike; speedups are medians of per-repeat ratios,
beside the 90% interval of their geometric mean (Student's t over repeats, as the load test's
verdicts use), so a run says whether a ratio clears a line such as 0.95x. Besides tokens/s it prints what
explains them: mean accepted length, acceptance per position, and the analytic bound (`bound`:
the speedup if a step cost only its proposal and its target forward, from the same repeat's
figures), so a gap between measured and possible speedup (engine overhead) is visible. Greedy outputs are compared with the
baseline's token for token; a divergence is reported with the baseline's logit margin where it
happened (fp32 batch shapes can flip a near-tie).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec.core.engine import PHASES, Engine, EngineMetrics
from specdec.core.config import EngineConfig
from specdec.core.cost_model import doubling_counts
from specdec.core.engine_config import build_engine, freeze_heap
from specdec.tools.arrivals import arrivals, repeated
from specdec.tools.kit.evaluate import distinct_n
from specdec.tools.loadtest.intervals import paired_ratio
from specdec.tools.loadtest.matrix import aa_name
from specdec.tools.peer_hf import PAIRS, HFPeer
from specdec.core.sampling import SamplingParams


@dataclass
class MethodFigures:
    method: str
    batch: int  # the engine's batch: every prompt admitted at once, or at most `in_flight` of them
    in_flight: int  # requests kept in flight, each finished one submitting the next (`tools.arrivals`); 0: none
    policy: str  # the draft-length policy it ran under (the baseline drafts nothing under either)
    label: str  # as the tables name it: the method, or `method/policy` where a run compares policies
    tokens_per_s: float
    speedup: float
    speedup_range: tuple[float, float]  # lowest and highest per-repeat ratio: the machine's noise
    # the 90% interval of the per-repeat ratios' geometric mean; None with one repeat (no spread to read)
    speedup_interval: tuple[float, float] | None
    mean_accepted_length: float
    acceptance_rate: float
    accepted_per_position: list[float]
    mean_draft_tokens: float
    identical_share: float
    analytic_bound: float
    distinct_4: float  # mean distinct-4 of this method's outputs: low values mean loops, which inflate acceptance
    divergence_margins: list[float] = field(default_factory=list)
    # one decode step's time by phase (ms, median over repeats; "other": what no phase covers)
    step_ms: dict[str, float] = field(default_factory=dict)
    # peers (--peer hf) only: specdec's same method's tok/s over the peer's, median and range over repeats
    specdec_over_peer: tuple[float, float, float] | None = None


def ratio_interval(ratios: list[float]) -> tuple[float, float] | None:
    """The 90% interval of per-repeat ratios' geometric mean (`intervals.paired_ratio`), or None
    below two repeats. A median and a range alone left a paused method's 0.94x in one 6-repeat
    run and 0.98x in the next undecided against a 0.95x line."""
    iv = paired_ratio(ratios, [1.0] * len(ratios))
    return (iv.lo, iv.hi) if iv is not None and iv.n >= 2 else None


def kit_paths(kit: str | Path) -> dict[str, str]:
    kit = Path(kit)
    return {name: str(kit / name) for name in ("target", "draft", "medusa", "eagle") if (kit / name).is_dir()}


def available_methods(paths: dict[str, str]) -> list[str]:
    methods = ["baseline", "ngram"]
    methods += ["draft"] if "draft" in paths else []
    methods += ["medusa"] if "medusa" in paths else []
    methods += ["eagle", "eagle2"] if "eagle" in paths else []
    return methods


def run_once(engine: Engine, prompts: list[str], params: SamplingParams, in_flight: int = 0) -> tuple[float, list[list[int]], list]:
    t0 = time.perf_counter()
    results = arrivals(engine, params, prompts, in_flight) if in_flight else engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    return seconds, [r.token_ids for r in results], [r.stats for r in results]


def divergence_margin(engine: Engine, prompt: str, ref: list[int], got: list[int]) -> float:
    """top1 - top2 logit of the target where `got` first leaves `ref` (a plain full forward)."""
    i = next(i for i, (a, b) in enumerate(zip(ref, got)) if a != b)
    tokens = torch.tensor([engine.tokenizer.encode(prompt) + ref[:i]], device=engine.device)
    with torch.inference_mode():
        top2 = torch.topk(engine.target.logits(engine.target(tokens))[0, -1].float(), 2).values
    return float(top2[0] - top2[1])


def verify_cost_curve(engine: Engine, max_tokens: int = 64, repeats: int = 5) -> dict[int, float]:
    """Target forward time over n tokens of one sequence relative to one token: the price of
    verifying a draft (the engine's start-up probe spreads tokens over its slots; this is one
    row). Timed as the bench's steps run: through the call its greedy steps take
    (`Engine.probe_forward`), each count the fastest of `repeats` forwards that follow as many of
    its own. Timed through the separate forward, head and argmax, each count once per round of
    `CostModel.measure` (one token right after 64, which had evicted what it reads, took 0.55-0.9
    ms against 0.2 ms after one, on the demo kit on AVX2), the curve printed 4 tokens at
    1.17-1.4x one where the bench's steps over 5 took 2.2-2.9x.

    Speculation pays when this stays near 1 (memory-bound decoding, as on GPUs); where it grows
    almost linearly (small models whose weights sit in CPU cache) every rejected token costs.
    """
    bound = max(1, min(max_tokens, engine.max_context // 2))  # the probe starts at half the context at most
    counts = doubling_counts(bound)
    seconds = []
    for n in counts:
        fastest = float("inf")
        for i in range(2 * repeats):
            t0 = time.perf_counter()
            engine.probe_forward(n, rows=1)
            if i >= repeats:
                fastest = min(fastest, time.perf_counter() - t0)
        seconds.append(fastest)
    return {n: s / seconds[0] for n, s in zip(counts, seconds)}


def forward_rate(m: EngineMetrics, sequences: int) -> float:
    """Tokens a run's decode steps committed per second of proposing and target forwards alone.

    Over the whole run, not per full step: at batch 8 the rows of a speculative batch finish at
    different steps, so its last steps run few rows (ngram on the kit: 5.2 rows a step on
    average against the baseline's 8). tau * t_target / (t_propose + t_verify), the bound this
    replaces, compared a full batch's step with one of fewer rows and put prompt lookup's bound
    at 2.2x where its proposals and forwards allowed 1.4x."""
    seconds = m.propose_seconds + m.verify_seconds
    return (m.output_tokens - sequences) / seconds if seconds else 0.0  # (prefill gives each its first)


def drafting_totals(runs: list[EngineMetrics]) -> EngineMetrics:
    """The repeats' drafting counters added up (drafts, draft and accepted tokens, accepted tokens
    per position): the acceptance a table reports. The adaptive policy drafts differently from
    repeat to repeat; read from the last repeat alone, adaptive prompt lookup in one run showed
    its fourth position accepted in 0.13 of its drafts (3.1 tokens a draft), where traced
    in-process it drafted 4 tokens in ~93% of its picks."""
    total = EngineMetrics()
    for m in runs:
        total.drafts += m.drafts
        total.draft_tokens += m.draft_tokens
        total.accepted_tokens += m.accepted_tokens
        total.accepted_per_position += [0] * (len(m.accepted_per_position) - len(total.accepted_per_position))
        for i, a in enumerate(m.accepted_per_position):
            total.accepted_per_position[i] += a
    return total


def step_profile(runs: list[EngineMetrics]) -> dict[str, float]:
    """Milliseconds per decode step: each phase, what no phase covers ("other") and the whole
    ("step"), and the tokens a step commits ("tokens"), each the median over the repeats (the
    machine is shared: one preempted run moves a mean, not a median)."""

    def per_step(m: EngineMetrics) -> dict[str, float]:
        steps = max(m.steps, 1)
        busy = m.busy_seconds()
        out = {p: 1000 * busy[p] / steps for p in (*PHASES, "other")}
        out["step"] = 1000 * m.decode_seconds / steps
        out["tokens"] = m.output_tokens / steps  # committed per decode step, whole batch (+ prefill's firsts)
        return out

    rows = [per_step(m) for m in runs]
    return {name: statistics.median(r[name] for r in rows) for name in rows[0]}


def turns(requests: int, batch: int, in_flight: int = 0) -> list[range]:
    """The requests' indices, turn by turn: every engine compared runs a turn before any runs the
    next. One batch of prompts a turn: at batch 1 a method's whole run (8 prompts, ~0.4 s) let
    the machine's drift over seconds into every ratio (a baseline copy 0.98x-1.19x the baseline
    over 12 repeats, a 90% interval 0.053 wide); taking turns prompt by prompt, 0.97x-1.03x,
    0.017 wide (reports/benchmarks-log.md, "Interleaved prompt by prompt"). Under arrivals the
    whole load is one turn: its requests must keep arriving."""
    step = requests if in_flight else batch
    return [range(i, min(i + step, requests)) for i in range(0, requests, step)]


def variants(methods: list[str], policies: list[str]) -> dict[str, tuple[str, str]]:
    """Label -> (method, policy) of the engines one run compares: every method under each policy,
    labelled by the method alone when there is one policy, as `method/policy` when there are more
    (the baseline once: it drafts nothing under either)."""
    return {(m if len(policies) == 1 or m == "baseline" else f"{m}/{p}"): (m, p)
            for m in methods for p in (policies[:1] if m == "baseline" else policies)}


def bench(
    base: EngineConfig, methods: list[str], prompts: list[str], batch_sizes: list[int], max_tokens: int,
    repeats: int, log=print, peer: str | None = None, policies: list[str] | None = None, aa: bool = False,
    seed: int = 0, in_flight: list[int] = (),
) -> list[MethodFigures]:
    """`in_flight`: after the batch sizes, runs that keep each of these many requests in flight
    (the prompts repeated, `tools.arrivals`): the batch changes as requests finish, as a served
    engine's does, and the adaptive policy searches at every change (no peers there).

    `policies` (default: the base config's): with more than one, every speculative method runs
    under each, interleaved in the same repeats, so adaptive and fixed k are compared side by side
    (two runs, one per policy, each against its own baseline, differed by more than the machine's
    drift lets two runs be compared: 1.19x against 1.55x for the draft model at batch 1).

    `aa`: a second baseline engine (`baseline_aa`) runs as a method too, an A/A pair whose ratio
    shows what two identical engines differ by in this run: on a 2-core EPYC, five baseline
    engines at batch 8 read 0.98-1.04x each other (one interval [1.01, 1.09]), as much as a paused
    method's whole cost. `seed` orders each repeat's runs (a fresh shuffle per repeat: rotating one
    order put every method after the same neighbour in every repeat)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    figures: list[MethodFigures] = []
    policies = policies or [base.scheduler.policy]
    labels = variants(methods, policies)
    if aa:
        labels = {"baseline": labels["baseline"], aa_name("baseline"): ("baseline", policies[0]),
                  **{k: v for k, v in labels.items() if k != "baseline"}}
    order = random.Random(seed)
    loads = [(batch, 0) for batch in batch_sizes] + [(n, n) for n in in_flight]
    for batch, flying in loads:
        requests = repeated(prompts) if flying else prompts
        load = f"{flying} in flight" if flying else f"batch {batch}"
        engines = {label: build_engine(base.with_(method=m, max_batch=batch, policy=p)) for label, (m, p) in labels.items()}
        freeze_heap()
        if (batch, flying) == loads[0]:
            curve = verify_cost_curve(engines["baseline"])
            log("target forward time vs tokens (relative to 1): "
                + ", ".join(f"{n}: {r:.2f}" for n, r in curve.items()))
        for eng in engines.values():  # warm-up: first calls allocate and fill caches
            eng.generate(prompts[:batch], SamplingParams(max_tokens=8, ignore_eos=True))
        seconds: dict[str, list[float]] = {m: [] for m in labels}
        outputs: dict[str, list[list[int]]] = {}
        stats: dict[str, list] = {m: [] for m in labels}  # every repeat's requests' counters
        runs: dict[str, list[EngineMetrics]] = {m: [] for m in labels}
        hf = HFPeer(kit_of(base), getattr(torch, base.runtime.dtype), base.proposer.k) if peer == "hf" and not flying else None
        peers = hf.methods(batch) if hf else []
        peer_seconds: dict[str, list[float]] = {p: [] for p in peers}
        peer_outputs: dict[str, list[list[int]]] = {}
        prompt_ids = [engines["baseline"].tokenizer.encode(p) for p in prompts]
        for p in peers:  # warm-up
            hf.run(p, prompt_ids[:batch], batch, 8)
        chunks = turns(len(requests), batch, flying)
        for r in range(repeats):
            for eng in engines.values():
                eng.metrics = EngineMetrics()
            took: dict[str, float] = dict.fromkeys([*engines, *peers], 0.0)
            made: dict[str, list[list[int]]] = {n: [] for n in took}
            made_stats: dict[str, list] = {n: [] for n in engines}
            for chunk in chunks:
                # a fresh order every time: a method always run right after the baseline (or always
                # first, or always after the same neighbour) would carry whatever the machine does there
                names = list(took)
                order.shuffle(names)
                for n in names:
                    if n in engines:
                        s, tokens, chunk_stats = run_once(engines[n], [requests[i] for i in chunk], params, flying)
                        made_stats[n] += chunk_stats
                    else:
                        s, tokens = hf.run(n, [prompt_ids[i] for i in chunk], batch, max_tokens)
                    took[n] += s
                    made[n] += tokens
            for n, s in took.items():
                if n in engines:
                    seconds[n].append(s)
                    outputs[n] = made[n]
                    stats[n] += made_stats[n]
                    runs[n].append(engines[n].metrics)
                else:
                    peer_seconds[n].append(s)
                    peer_outputs[n] = made[n]
                log(f"  {load} repeat {r + 1}/{repeats} {n:9s} {sum(map(len, made[n])) / s:8.1f} tok/s")
        base_rates = [forward_rate(run, len(requests)) for run in runs["baseline"]]
        for m, (method, policy) in labels.items():
            mt = drafting_totals(runs[m])
            tokens = sum(map(len, outputs[m]))
            ratios = [seconds["baseline"][r] / seconds[m][r] for r in range(repeats)]
            rounds = sum(st.steps - 1 for st in stats[m])
            tau = sum(st.output_tokens - 1 for st in stats[m]) / max(rounds, 1)
            bounds = [forward_rate(run, len(requests)) / base for run, base in zip(runs[m], base_rates)]
            identical = [a == b for a, b in zip(outputs[m], outputs["baseline"])]
            margins = [divergence_margin(engines[m], p, ref, got)
                       for p, ref, got, same in zip(requests, outputs["baseline"], outputs[m], identical) if not same]
            figures.append(MethodFigures(
                method=method, batch=batch, in_flight=flying, policy=policy, label=m, tokens_per_s=tokens / statistics.median(seconds[m]),
                speedup=statistics.median(ratios), speedup_range=(min(ratios), max(ratios)),
                speedup_interval=ratio_interval(ratios), mean_accepted_length=tau,
                acceptance_rate=mt.accepted_tokens / mt.draft_tokens if mt.draft_tokens else 0.0,
                accepted_per_position=[a / mt.drafts for a in mt.accepted_per_position] if mt.drafts else [],
                mean_draft_tokens=mt.draft_tokens / mt.drafts if mt.drafts else 0.0,
                identical_share=sum(identical) / len(identical),
                analytic_bound=statistics.median(bounds),
                distinct_4=statistics.mean(distinct_n(o, 4) for o in outputs[m]),
                divergence_margins=sorted(margins), step_ms=step_profile(runs[m]),
            ))
        for p in peers:
            pair = next((label for label, (m, _) in labels.items() if m == PAIRS[p]), None)  # under the first policy
            ratios = [seconds["baseline"][r] / peer_seconds[p][r] for r in range(repeats)]
            versus = ([peer_seconds[p][r] / seconds[pair][r] for r in range(repeats)] if pair in seconds else [])
            identical = [a == b for a, b in zip(peer_outputs[p], outputs["baseline"])]
            figures.append(MethodFigures(
                method=p, batch=batch, in_flight=0, policy="", label=p, tokens_per_s=sum(map(len, peer_outputs[p])) / statistics.median(peer_seconds[p]),
                speedup=statistics.median(ratios), speedup_range=(min(ratios), max(ratios)),
                speedup_interval=ratio_interval(ratios), mean_accepted_length=0.0,
                acceptance_rate=0.0, accepted_per_position=[], mean_draft_tokens=0.0,
                identical_share=sum(identical) / len(identical), analytic_bound=0.0,
                distinct_4=statistics.mean(distinct_n(o, 4) for o in peer_outputs[p]),
                specdec_over_peer=(statistics.median(versus), min(versus), max(versus)) if versus else None,
            ))
        del engines
    return figures


def load_cell(f: MethodFigures) -> str:
    """A table's first column: the batch size, or the requests kept in flight."""
    return f"{f.in_flight} in flight" if f.in_flight else str(f.batch)


def kit_of(cfg: EngineConfig) -> dict[str, str]:
    return {name: getattr(cfg.checkpoints, name) for name in ("target", "draft") if getattr(cfg.checkpoints, name)}


def table(figures: list[MethodFigures]) -> str:
    head = ("| batch | method | tok/s | speedup | range | 90% interval | bound | speedup/bound | mean acc. len | acc. rate | "
            "draft tok/round | acc. per position | distinct-4 | greedy identical |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for f in figures:
        if f.method in PAIRS:
            continue
        pos = " ".join(f"{a:.2f}" for a in f.accepted_per_position[:6])
        eff = f"{f.speedup / f.analytic_bound:.0%}" if f.analytic_bound else "-"
        ident = f"{f.identical_share:.0%}"
        if f.divergence_margins:
            ident += f" (margins {', '.join(f'{m:.3f}' for m in f.divergence_margins[:3])})"
        lines.append(
            f"| {load_cell(f)} | {f.label} | {f.tokens_per_s:.1f} | {f.speedup:.2f}x | "
            f"{f.speedup_range[0]:.2f}-{f.speedup_range[1]:.2f} | {interval_text(f.speedup_interval)} | "
            f"{f.analytic_bound:.2f}x | {eff} | "
            f"{f.mean_accepted_length:.2f} | {f.acceptance_rate:.2f} | {f.mean_draft_tokens:.1f} | {pos} | "
            f"{f.distinct_4:.2f} | {ident} |"
        )
    return "\n".join(lines)


def interval_text(iv: tuple[float, float] | None) -> str:
    return f"[{iv[0]:.2f}, {iv[1]:.2f}]" if iv else "-"


def peer_table(figures: list[MethodFigures]) -> str:
    """Peers (--peer hf) next to specdec: tok/s, ratio to specdec's baseline, and specdec's same
    method over the peer (> 1: specdec is faster), medians and ranges over the interleaved repeats."""
    head = ("| batch | peer | tok/s | x specdec baseline | range | specdec same method / peer | range | "
            "greedy identical to specdec |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for f in figures:
        if f.method not in PAIRS:
            continue
        versus = f"{f.specdec_over_peer[0]:.2f}x ({PAIRS[f.method]}) | {f.specdec_over_peer[1]:.2f}-{f.specdec_over_peer[2]:.2f}" \
            if f.specdec_over_peer else "- | -"
        lines.append(f"| {f.batch} | {f.method} | {f.tokens_per_s:.1f} | {f.speedup:.2f}x | "
                     f"{f.speedup_range[0]:.2f}-{f.speedup_range[1]:.2f} | {versus} | {f.identical_share:.0%} |")
    return "\n".join(lines)


def profile_table(figures: list[MethodFigures]) -> str:
    """Where one decode step's time goes, per method and batch size (ms per step, median of repeats)."""
    names = list(PHASES) + ["other"]
    head = "| batch | method | step ms | tokens/step | " + " | ".join(names) + " |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for f in figures:
        if f.method in PAIRS:
            continue
        ms = f.step_ms
        cells = " | ".join(f"{ms[n]:.2f} ({ms[n] / ms['step']:.0%})" for n in names)
        lines.append(f"| {load_cell(f)} | {f.label} | {ms['step']:.2f} | {ms['tokens']:.2f} | {cells} |")
    return "\n".join(lines)


def write_json(figures: list[MethodFigures], path: str | Path, setup: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"setup": setup, "figures": [asdict(f) for f in figures]}, indent=2) + "\n")
