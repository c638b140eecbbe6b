"""The load matrix's report: report.json (every figure, every trial, each ratio's interval, the
setup, the guardrails, the A/A check, a revision's comparison and the verdicts), report.md (the
trust checks first, then tables with intervals, plots, verdicts) and PNG plots with error bars
(matplotlib, Agg backend)."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

from specdec.tools.loadtest.guardrails import AA_FIGURES, Guardrails, aa_check, verdicts
from specdec.tools.loadtest.intervals import CONFIDENCE, life_ratios
from specdec.tools.loadtest.matrix import balanced_orders
from specdec.tools.loadtest.noise import FOREIGN_LOAD_CORES
from specdec.tools.loadtest.revision import FIGURES as REVISION_FIGURES, revision_ratios, short

# (key, column title, scale, format): the tables' figures; times in ms
TABLE = [
    ("ttft_p50", "TTFT p50 ms", 1000, "{:.0f}"), ("ttft_p95", "TTFT p95 ms", 1000, "{:.0f}"),
    ("itl_p50", "ITL p50 ms", 1000, "{:.1f}"), ("itl_p95", "ITL p95 ms", 1000, "{:.1f}"),
    ("tpot_p50", "TPOT p50 ms", 1000, "{:.1f}"), ("e2e_p50", "E2E p50 ms", 1000, "{:.0f}"),
    ("e2e_p95", "E2E p95 ms", 1000, "{:.0f}"),
    ("output_tokens_per_s", "out tok/s", 1, "{:.1f}"), ("completed_rps", "req/s", 1, "{:.2f}"),
    ("error_rate", "errors", 100, "{:.1f}%"), ("mean_accepted_length", "accepted len", 1, "{:.2f}"),
    ("acceptance_rate", "accept rate", 1, "{:.2f}"), ("rss_mb", "RSS MB", 1, "{:.0f}"),
    ("queue_wait_mean", "queue ms", 1000, "{:.1f}"), ("cpu_ms_per_token", "CPU ms/tok", 1, "{:.2f}"),
    ("foreign_cores", "foreign cores", 1, "{:.2f}"),
]
RATIO_COLUMNS = ["output_tokens_per_s", "tpot_p50", "tpot_p95", "ttft_p50", "ttft_p95", "itl_p50", "itl_p95",
                 "cpu_ms_per_token"]


# the engine-time table's phase columns (shares of the engine thread's busy time); "rest" is the other phases
ENGINE_COLUMNS = ["prefill", "draft", "forward", "verify"]


def fmt(value, scale=1, pattern="{:.3g}") -> str:
    if value is None:
        return "-"
    return pattern.format(value * scale)


def build(report: dict, g: Guardrails) -> dict:
    report = dict(report)
    aa = report["setup"].get("aa_model")
    report["guardrails"] = g.to_dict()
    report["verdicts"] = verdicts([c for c in report["cells"] if not c["figures"].get("by_served_model")], g,
                                  skip=(aa,) if aa else ())
    if report.get("canary_cells"):
        report["canary_verdicts"] = verdicts(report["canary_cells"], g)
    if aa:
        report["aa_check"] = aa_check(report["cells"], aa)
    if report["setup"].get("revision"):
        report["revision"] = revision_ratios(report["cells"], report["setup"]["revision"])
    trials = [t for c in report["cells"] for t in c["trials"]]
    report["noise"] = {"trials": len(trials), "threshold_cores": FOREIGN_LOAD_CORES,
                       "foreign_load_trials": sum(1 for t in trials if t["cpu"]["foreign_load"]),
                       "foreign_cores_mean": (sum(t["cpu"]["foreign_cores"] for t in trials) / len(trials)
                                              if trials else None),
                       "foreign_cores_max": max((t["cpu"]["foreign_cores"] for t in trials), default=None)}
    report["engine_time"] = engine_time(report["cells"], report["setup"]["baseline"])
    report["generated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report["environment"] = {"host": platform.node(), "python": platform.python_version(),
                             "machine": platform.machine(), "cpus": _cpus()}
    return report


def engine_time(cells: list[dict], baseline: str) -> list[dict]:
    """Per model and level, where the engine thread's time went (server counters, the whole level)
    and two ratios to the baseline's: decode ms per token (what speculation changes) and engine ms
    per output token (the tokens/s ratio an engine-bound server would show: prefill, the same work
    for every method, dilutes the decode gain). Beside the served tokens/s ratio they say where a
    gain went: a served ratio well under the engine's was lost outside the engine."""
    base = {(c["workload"], c["concurrency"]): c["figures"] for c in cells if c["model"] == baseline}
    rows = []
    for c in cells:
        f = c["figures"]
        if not f.get("engine_seconds"):
            continue
        b = base.get((c["workload"], c["concurrency"]), {})

        def speedup(key):
            return b[key] / f[key] if b.get(key) and f.get(key) else None

        total = sum(f["engine_seconds"].values())
        rows.append({"workload": c["workload"], "model": c["model"], "concurrency": c["concurrency"],
                     "shares": {p: v / total for p, v in f["engine_seconds"].items()},
                     "mean_batch": f.get("mean_batch"),
                     "engine_ms_per_token": f["engine_ms_per_token"], "decode_ms_per_token": f["decode_ms_per_token"],
                     "decode_speedup": speedup("decode_ms_per_token"), "engine_speedup": speedup("engine_ms_per_token"),
                     "served_speedup": (c.get("ratios", {}).get("output_tokens_per_s") or {}).get("value")})
    return rows


def engine_time_lines(rows: list[dict]) -> list[str]:
    """The engine-time table of one workload (see `engine_time`)."""
    if not rows:
        return []
    lines = ["### Where the engine's time went (server counters, every trial of the level)", "",
             "Shares of the engine thread's busy time (`specdec:engine_seconds`); rest = schedule, policy, inputs, "
             "compact, commit, output and other. Speculation shrinks only decode time; prefill is the same work for "
             "every method (plus the drafter's own prefill). decode x base = the baseline's decode ms per token over "
             "the model's; engine x base = the same for engine ms per output token, prefill included: the tokens/s "
             "ratio a server bound by its engine would show. A served ratio well under it lost the gain outside the "
             "engine (response path, tritonserver, the load generator, idle gaps between requests). mean batch = "
             "requests running, sampled every 0.2 s while any run (`specdec:batch_size`): a step's cost per token "
             "falls as it grows, so a model whose users kept fewer requests running pays more per token.", "",
             "| model | conc | " + " | ".join(f"{p} %" for p in ENGINE_COLUMNS) + " | rest % | mean batch | "
             "engine ms/tok | decode ms/tok | decode x base | engine x base | served tok/s x base |",
             "|---|---:|" + "---:|" * (len(ENGINE_COLUMNS) + 7)]
    for r in rows:
        shares = [r["shares"].get(p, 0.0) for p in ENGINE_COLUMNS]
        lines.append(f"| {r['model']} | {r['concurrency']} | "
                     + " | ".join(f"{100 * x:.0f}" for x in shares) + f" | {100 * (1 - sum(shares)):.0f} | "
                     f"{fmt(r.get('mean_batch'), 1, '{:.2f}')} | {fmt(r['engine_ms_per_token'], 1, '{:.2f}')} | {fmt(r['decode_ms_per_token'], 1, '{:.2f}')} | "
                     + " | ".join(fmt(r[k], 1, "{:.2f}x") for k in ("decode_speedup", "engine_speedup", "served_speedup"))
                     + " |")
    return lines + [""]


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def write_report(report: dict, g: Guardrails, out: str | Path) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = build(report, g)
    plots = write_plots(report, out)
    report["plots"] = [str(p.relative_to(out)) for p in plots]
    (out / "report.json").write_text(json.dumps(report, indent=1, default=_json_default))
    (out / "report.md").write_text(markdown(report))
    return {"json": out / "report.json", "md": out / "report.md", "plots": plots, "report": report,
            "verdict_table": verdict_table(report)}


def _json_default(x):
    if isinstance(x, Path):
        return str(x)
    raise TypeError(type(x))


# ---- text -------------------------------------------------------------------------------------------
STATUS = {"pass": "pass", "fail": "FAIL", "inconclusive": "?"}


def fmt_ratio(d: dict | None) -> str:
    """`1.23x [1.10, 1.38]`: the paired ratio and its interval."""
    if not d:
        return "-"
    if d["lo"] == d["hi"]:
        return f"{d['value']:.2f}x"
    hi = "inf" if d["hi"] == float("inf") else f"{d['hi']:.2f}"
    return f"{d['value']:.2f}x [{d['lo']:.2f}, {hi}]"


def trust_lines(report: dict) -> list[str]:
    """What the reader must know before believing a verdict: the A/A check and the machine's noise."""
    lines = []
    aa = report.get("aa_check")
    if aa:
        if aa["passed"]:
            lines.append(f"A/A check passed: `{aa['model']}` (the baseline under a second name) shows no difference "
                         f"beyond +-{aa['margin']:.0%} at any level.")
        elif not any(lv["differences"] for lv in aa["levels"]):
            missing = ", ".join(f"c={lv['concurrency']}" for lv in aa["levels"] if lv["result"] == "no baseline")
            lines.append(f"**A/A check not made** at {missing}: the baseline did not run there beside `{aa['model']}` "
                         "(add it to --models); the verdicts there compare nothing.")
        else:
            bad = "; ".join(f"c={lv['concurrency']}: {', '.join(lv['differences'])}" for lv in aa["levels"]
                            if lv["differences"])
            lines.append(f"**A/A CHECK FAILED**: `{aa['model']}` (the baseline under a second name) differs from the "
                         f"baseline ({bad}). The machine's noise beat the design: do not trust this run's verdicts.")
    n = report.get("noise") or {}
    if n.get("trials"):
        lines.append(f"Foreign load: {n['foreign_load_trials']} of {n['trials']} trials ran while processes other than "
                     f"tritonserver and the load generator used more than {n['threshold_cores']:g} cores "
                     f"(mean {n['foreign_cores_mean']:.2f}, max {n['foreign_cores_max']:.2f} cores). "
                     + ("Interleaving spreads that load over every model of a round; compare CPU ms per token, "
                        "which contention barely moves." if n["foreign_load_trials"] else "The machine was quiet."))
    return lines


def life_lines(cells: list[dict], baseline: str, lives: int) -> list[str]:
    """Each model's output tokens/s over the baseline's in each server life (the geometric mean of
    that life's paired rounds): how far the instances' luck moved a comparison that the rounds of
    one life all share."""
    base = {c["concurrency"]: c for c in cells if c["model"] == baseline}
    lines = ["", "### Output tokens/s ratio to baseline by server life", "",
             "| model | conc | " + " | ".join(f"life {i}" for i in range(lives)) + " |", "|---|---:|" + "---:|" * lives]
    for c in cells:
        b = base.get(c["concurrency"])
        if c["model"] == baseline or not b:
            continue
        ratios = life_ratios(c["trials"], b["trials"], "output_tokens_per_s", lives)
        lines.append(f"| {c['model']} | {c['concurrency']} | "
                     + " | ".join(f"{r:.3f}" if r is not None else "-" for r in ratios) + " |")
    return lines


def verdict_table(report: dict) -> str:
    all_verdicts = report["verdicts"] + report.get("canary_verdicts", [])
    first = (all_verdicts or [{}])[0]
    rows = [("workload", "method", *[f"c={lv['concurrency']}" for lv in first.get("levels", [])], "verdict")]
    for v in report["verdicts"]:
        rows.append((v["workload"], v["model"], *[STATUS[lv["status"]] for lv in v["levels"]], v["verdict"]))
    for v in report.get("canary_verdicts", []):
        rows.append((v["workload"], f"{v['model']} (canary)", *[STATUS[lv["status"]] for lv in v["levels"]],
                     v["verdict"]))
    rows = [r for r in rows if len(r) == len(rows[0])]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    reasons = [f"  {v['model']} ({v['workload']}): {v['reason']}" for v in all_verdicts]
    return "\n".join(trust_lines(report) + lines + ["(? = inconclusive)", "reasons:"] + reasons)


def markdown(report: dict) -> str:
    s = report["setup"]
    conf = f"{CONFIDENCE:.0%}"
    lives = s.get("servers", 1)
    over = ("server lives: each life's geometric mean is one value, or the rounds within the lives where those "
            "agree as well as their rounds predict" if lives > 1 else "rounds")
    lines = ["# Load matrix report", "",
             f"Generated {report['generated']} on {report['environment']['host']} "
             f"({report['environment']['cpus']} CPUs). Baseline: `{s['baseline']}`.", ""]
    lines += [f"> {t}" for t in trust_lines(report)] + [""]
    lines += ["## Setup (held fixed across models)", "",
              f"- models: {', '.join(f'`{m}`' for m in s['models'])}",
              f"- concurrency (closed-loop Locust users): {', '.join(map(str, s['concurrency']))}",
              f"- interleaved trials: {s['rounds']} rounds per load level"
              + (f", split over {lives} server lives (a fresh tritonserver for each share, with warm-up rounds of "
                 f"its own)" if lives > 1 else "")
              + f", after {s.get('warmup_rounds', 0)} "
              f"unmeasured warm-up round(s); in each round every model runs one trial "
              f"({s['warmup_s']:g} s warm-up, then {s['duration_s']:g} s measured; requests in flight drain before "
              f"the next trial), in a Williams design's orders (over every {len(balanced_orders(len(s['models'])))} "
              f"rounds each model takes every position, and follows every other model, equally often)",
              f"- protocol: {s['protocol']}; prompts per workload: {s['prompts']} "
              f"(files: {', '.join(s['prompt_files'])}), seed {s['seed']}"]
    for w in s["workloads"]:
        spread = w.get("max_tokens_spread", 0.0)  # (reports before it: every request asked max_tokens)
        lines.append(f"- workload `{w['name']}`: max_tokens {w['max_tokens']}"
                     + (f" (each request +-{spread:.0%}, drawn per request)" if spread else "")
                     + f", temperature {w['temperature']}, top_p {w['top_p']}")
    lines += ["", "Definitions: TTFT = request sent to first token; ITL = every gap between consecutive tokens "
              "(tokens in one response arrive together, gap 0); TPOT = (E2E - TTFT) / (tokens - 1) per request; "
              "accepted len = 1 + accepted draft tokens per verification round that drafted (server counters); "
              "RSS = resident memory of the model's backend process at the end of each trial (the largest shown); "
              "queue = time waiting for a KV slot (server histogram); CPU ms/tok = CPU time of the model's backend "
              "process per output token; foreign cores = CPU used by processes other than the server and the load "
              "generator during the trials (mean). Figures pool every trial of a model. Ratios are to the baseline "
              f"at the same workload and load level: the geometric mean of the per-round paired ratios with its "
              f"{conf} interval (Student's t over {over}) in brackets.", ""]
    for wname in dict.fromkeys(c["workload"] for c in report["cells"]):
        cells = [c for c in report["cells"] if c["workload"] == wname]
        lines += [f"## Workload `{wname}`", "", "### Figures (all trials pooled)", "",
                  "| model | conc | " + " | ".join(t for _, t, _, _ in TABLE) + " | trials under foreign load |",
                  "|---|---:|" + "---:|" * (len(TABLE) + 1)]
        for c in cells:
            f = c["figures"]
            lines.append(f"| {c['model']} | {c['concurrency']} | "
                         + " | ".join(fmt(f.get(k), sc, p) for k, _, sc, p in TABLE)
                         + f" | {f.get('foreign_load_trials', 0)} of {f.get('trials', 0)} |")
        lines += ["", f"### Ratio to baseline ({conf} interval over paired rounds{' by server life' if lives > 1 else ''})",
                  "", "| model | conc | " + " | ".join(RATIO_COLUMNS) + " |", "|---|---:|" + "---|" * len(RATIO_COLUMNS)]
        for c in cells:
            if c["model"] == s["baseline"]:
                continue
            lines.append(f"| {c['model']} | {c['concurrency']} | "
                         + " | ".join(fmt_ratio(c["ratios"].get(k)) for k in RATIO_COLUMNS) + " |")
        if lives > 1:
            lines += life_lines(cells, s["baseline"], lives)
        lines += ["", "### Trials (wall-clock figures beside CPU ms per token and the machine's foreign load)", "",
                  "| conc | round | model | out tok/s | TPOT p50 ms | ITL p95 ms | CPU ms/tok | foreign cores | flag |",
                  "|---:|---:|---|---:|---:|---:|---:|---:|---|"]
        for c in sorted(cells, key=lambda c: c["concurrency"]):
            for t in c["trials"]:
                f = t["figures"]
                where = f" (life {t['life']})" if "life" in t else ""
                lines.append(f"| {c['concurrency']} | {t['round']}{where} | {c['model']} | "
                             f"{fmt(f.get('output_tokens_per_s'), 1, '{:.0f}')} | {fmt(f.get('tpot_p50'), 1000, '{:.1f}')} | "
                             f"{fmt(f.get('itl_p95'), 1000, '{:.1f}')} | {fmt(f.get('cpu_ms_per_token'), 1, '{:.2f}')} | "
                             f"{t['cpu']['foreign_cores']:.2f} | {'foreign load' if t['cpu']['foreign_load'] else ''} |")
        lines += ["", "### Acceptance per draft position (server counters: accepted at position p / verification rounds)",
                  "", "| model | conc | per position |", "|---|---:|---|"]
        for c in cells:
            pos = c["figures"].get("acceptance_per_position") or []
            if pos:
                lines.append(f"| {c['model']} | {c['concurrency']} | {' '.join(f'{x:.2f}' for x in pos)} |")
        lines += [""] + engine_time_lines([r for r in report.get("engine_time", []) if r["workload"] == wname])
        lines += ["### Consistency", "",
                  "| model | conc | requests (all) | tokens streamed (all) | server generated | match | "
                  "abandoned (no response by the end of a trial's drain) |",
                  "|---|---:|---:|---:|---:|---|---:|"]
        for c in cells:
            f = c["figures"]
            lines.append(f"| {c['model']} | {c['concurrency']} | {f.get('cell_requests_all')} | "
                         f"{f.get('client_output_tokens_all')} | {fmt(f.get('server_output_tokens'), 1, '{:.0f}')} | "
                         f"{f.get('tokens_match_server')} | {f.get('abandoned_requests', 0)} |")
        lines.append("")
    if report.get("canary_cells"):
        lines += ["## Canary: live traffic split by the router", "",
                  "The same requests, split by the model that served them, trial by trial (rates depend on the share "
                  "and are left out; ratios are to the baseline's share of the same traffic in the same trial).", "",
                  "| router | conc | served by | requests | TTFT p50 ms | ITL p95 ms | TPOT p50 ms | errors | "
                  "accept rate | TPOT x base | ITL p95 x base |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
        for c in report["canary_cells"]:
            f, r = c["figures"], c["ratios"]
            lines.append(f"| {c['router']} | {c['concurrency']} | {c['model']} | {f['requests']} | "
                         f"{fmt(f.get('ttft_p50'), 1000, '{:.0f}')} | {fmt(f.get('itl_p95'), 1000, '{:.1f}')} | "
                         f"{fmt(f.get('tpot_p50'), 1000, '{:.1f}')} | {fmt(f.get('error_rate'), 100, '{:.1f}%')} | "
                         f"{fmt(f.get('acceptance_rate'), 1, '{:.2f}')} | {fmt_ratio(r.get('tpot_p50'))} | "
                         f"{fmt_ratio(r.get('itl_p95'))} |")
        lines += [""] + [f"- canary verdict for `{v['model']}` ({v['workload']}): **{v['verdict']}** - {v['reason']}"
                         for v in report.get("canary_verdicts", [])] + [""]
    if report.get("aa_check"):
        aa = report["aa_check"]
        lines += ["## A/A check", "", f"`{aa['model']}` serves the baseline's config under a second name. A difference "
                  f"is a {aa['confidence']:.1%} interval (all its checks together) wholly outside "
                  f"[{1 - aa['margin']:.2f}, {1 / (1 - aa['margin']):.2f}] for any of {', '.join(AA_FIGURES)}.", "",
                  "| workload | conc | result |", "|---|---:|---|"]
        lines += [f"| {lv['workload']} | {lv['concurrency']} | {lv['result']}"
                  f"{': ' + ', '.join(lv['differences']) if lv['differences'] else ''} |" for lv in aa["levels"]]
        lines.append("")
    if report.get("revision"):
        sha = report["setup"]["revision"]
        lines += [f"## This checkout against {short(sha)}", "",
                  f"Every model is served twice in the same rounds: by this checkout and, as `<model>_{short(sha)}`, by "
                  f"commit {sha} (its own Triton backend). Each figure of a model over its twin's, paired by round "
                  f"({conf} interval): above 1 for tokens/s, below 1 for TPOT and TTFT, this checkout is faster.", "",
                  "| workload | conc | model | " + " | ".join(REVISION_FIGURES) + " |",
                  "|---|---:|---|" + "---|" * len(REVISION_FIGURES)]
        lines += [f"| {r['workload']} | {r['concurrency']} | {r['model']} | "
                  + " | ".join(fmt_ratio(r["ratios"].get(k)) for k in REVISION_FIGURES) + " |" for r in report["revision"]]
        lines.append("")
    if report.get("plots"):
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in report["plots"]] + [""]
    levels = (report["verdicts"] or [{}])[0].get("levels", [])
    lines += ["## Verdict", "", "Guardrails: " + _guardrails_text(report["guardrails"]) + ".", "",
              f"A bound decides only when its whole {conf} interval lies on one side of it (pass, **fail**); otherwise "
              f"the level is inconclusive (?) and the reason says how many {'server lives' if lives > 1 else 'rounds'} "
              "would likely decide it.", "",
              "| workload | method | " + " | ".join(f"c={lv['concurrency']}" for lv in levels) + " | verdict | reason |",
              "|---|---|" + "---|" * (len(levels) + 2)]
    for v in report["verdicts"]:
        lines.append(f"| {v['workload']} | {v['model']} | "
                     + " | ".join({"pass": "pass", "fail": "**fail**", "inconclusive": "?"}[lv["status"]]
                                  for lv in v["levels"])
                     + f" | **{v['verdict']}** | {v['reason']} |")
    return "\n".join(lines) + "\n"


def _guardrails_text(g: dict) -> str:
    def rule(r):
        parts = [f"{k.replace('_', ' ')} {r[k]:g}" for k in ("max", "min", "ratio_max", "ratio_min") if k in r]
        return f"{r['figure']} " + ", ".join(parts) + (" (at peak)" if r.get("at") == "peak" else "")
    text = "; ".join(rule(r) for r in g["rollback"])
    if g.get("improve"):
        text += f"; must improve: {rule(g['improve'])}"
    return text


# ---- plots ------------------------------------------------------------------------------------------
def write_plots(report: dict, out: Path) -> list[Path]:
    """Per workload: latency and throughput per model (error bars: the interval over trials), the
    ratios to the baseline with their intervals and the guardrail thresholds, and acceptance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.3, "font.size": 10,
                         "axes.spines.top": False, "axes.spines.right": False})
    base = report["setup"]["baseline"]
    thresholds = _ratio_thresholds(report["guardrails"])
    paths = []
    workloads = list(dict.fromkeys(c["workload"] for c in report["cells"]))
    for wi, wname in enumerate(workloads):
        cells = [c for c in report["cells"] if c["workload"] == wname]
        models = list(dict.fromkeys(c["model"] for c in cells))
        levels = sorted({c["concurrency"] for c in cells})
        xs = list(range(len(levels)))  # evenly spaced load levels (1, 4, 16 read like a log axis)
        tag = f"w{wi}"
        colors = {m: f"C{i}" for i, m in enumerate(m for m in models if m != base)}
        colors[base] = "black"
        shift = {m: (i - (len(models) - 1) / 2) * 0.06 for i, m in enumerate(models)}  # bars side by side

        def bars(ax, model, table, key, scale=1.0):
            by = {c["concurrency"]: (c.get(table) or {}).get(key) for c in cells if c["model"] == model}
            ys, lo, hi = [], [], []
            for lv in levels:
                d = by.get(lv)
                ok = d is not None and d["lo"] != float("-inf") and d["hi"] != float("inf")
                ys.append(d["value"] * scale if d else float("nan"))
                lo.append((d["value"] - d["lo"]) * scale if ok else 0.0)
                hi.append((d["hi"] - d["value"]) * scale if ok else 0.0)
            style = dict(linestyle="--", linewidth=2) if model == base else {}
            ax.errorbar([x + shift[model] for x in xs], ys, yerr=[lo, hi], marker="o", capsize=3, label=model,
                        color=colors[model], **style)

        def axes_for(ax, ylabel, title):
            ax.set_xticks(xs, [str(lv) for lv in levels])
            ax.set_xlim(-0.4, len(xs) - 0.6)
            ax.set_xlabel("concurrent users")
            ax.set_ylabel(ylabel)
            ax.set_title(title, fontsize=10)

        conf = f"{CONFIDENCE:.0%}"
        for name, title, panels in [
            ("itl", "Latency between tokens (lower is better)",
             [("itl_p50", "ms", "ITL p50"), ("itl_p95", "ms", "ITL p95"), ("tpot_p50", "ms", "TPOT p50")]),
            ("ttft", "Time to first token (lower is better)", [("ttft_p50", "ms", "TTFT p50"), ("ttft_p95", "ms", "TTFT p95")]),
            ("throughput", "Throughput and CPU cost",
             [("output_tokens_per_s", "tokens/s", "Output tokens/s (higher is better)"),
              ("cpu_ms_per_token", "CPU ms", "Backend CPU ms per output token")]),
        ]:
            fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 4.2))
            for ax, (key, unit, sub) in zip(axes, panels):
                for m in models:
                    bars(ax, m, "means", key, 1000 if unit == "ms" else 1)
                axes_for(ax, unit, sub)
                ax.set_ylim(bottom=0)
            axes[0].legend(fontsize=8)
            fig.suptitle(f"{title} - {wname}; bars: {conf} interval over trials")
            paths.append(_save(fig, out / f"{tag}-{name}.png"))

        ratio_panels = [("output_tokens_per_s", "Output tokens/s"), ("tpot_p50", "TPOT p50"),
                        ("ttft_p95", "TTFT p95"), ("itl_p95", "ITL p95")]
        fig, axes = plt.subplots(1, len(ratio_panels), figsize=(18, 4.2))
        for ax, (key, sub) in zip(axes, ratio_panels):
            for m in models:
                if m != base:
                    bars(ax, m, "ratios", key)
            ax.axhline(1.0, color="black", linestyle="--", linewidth=1.5, label="baseline")
            for t in thresholds.get(key, []):
                ax.axhline(t, color="red", linestyle=":", linewidth=1, label=f"guardrail {t:g}x")
            axes_for(ax, "x baseline", f"{sub} vs baseline")
        axes[0].legend(fontsize=8)
        fig.suptitle(f"Ratio to the baseline, paired by round - {wname}; bars: {conf} interval")
        paths.append(_save(fig, out / f"{tag}-ratios.png"))

        spec = [m for m in models if m != base]
        low = levels[0] if levels else None
        accept = {c["model"]: c["figures"].get("acceptance_per_position") or [] for c in cells
                  if c["concurrency"] == low and c["model"] in spec}
        if any(accept.values()):
            fig, ax = plt.subplots(figsize=(8, 4.2))
            width = 0.8 / max(1, len(spec))
            for i, m in enumerate(spec):
                ys = accept.get(m) or [0.0]  # a zero bar keeps the legend's colour for a model that drafted nothing
                ax.bar([p + i * width for p in range(len(ys))], ys, width=width, color=colors[m],
                       label=m if accept.get(m) else f"{m} (nothing drafted)")
            depth = max(len(v) for v in accept.values())
            ax.set_xticks([p + 0.4 - width / 2 for p in range(depth)], [str(p + 1) for p in range(depth)])
            ax.set_xlabel("draft position")
            ax.set_ylabel("accepted / verification rounds")
            ax.set_ylim(0, 1)
            ax.set_title(f"Acceptance per position at concurrency {low} - {wname}")
            ax.legend(fontsize=8)
            paths.append(_save(fig, out / f"{tag}-acceptance.png"))
    return paths


def _ratio_thresholds(g: dict) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in g["rollback"] + ([g["improve"]] if g.get("improve") else []):
        for k in ("ratio_max", "ratio_min"):
            if k in r:
                out.setdefault(r["figure"], []).append(r[k])
    return out


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
