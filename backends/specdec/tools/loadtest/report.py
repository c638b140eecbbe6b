"""The load matrix's report: report.json (every figure and ratio, the setup, the guardrails and the
verdicts), report.md (tables, plots, verdicts) and PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

from specdec.tools.loadtest.guardrails import Guardrails, verdicts

# (key, column title, scale, format): the tables' figures; times in ms
TABLE = [
    ("ttft_p50", "TTFT p50 ms", 1000, "{:.0f}"), ("ttft_p95", "TTFT p95 ms", 1000, "{:.0f}"),
    ("itl_p50", "ITL p50 ms", 1000, "{:.1f}"), ("itl_p95", "ITL p95 ms", 1000, "{:.1f}"),
    ("tpot_p50", "TPOT p50 ms", 1000, "{:.1f}"), ("e2e_p50", "E2E p50 ms", 1000, "{:.0f}"),
    ("e2e_p95", "E2E p95 ms", 1000, "{:.0f}"),
    ("output_tokens_per_s", "out tok/s", 1, "{:.1f}"), ("completed_rps", "req/s", 1, "{:.2f}"),
    ("error_rate", "errors", 100, "{:.1f}%"), ("mean_accepted_length", "accepted len", 1, "{:.2f}"),
    ("acceptance_rate", "accept rate", 1, "{:.2f}"), ("rss_mb", "RSS MB", 1, "{:.0f}"),
    ("queue_wait_mean", "queue ms", 1000, "{:.1f}"),
]
RATIO_COLUMNS = ["ttft_p50", "itl_p50", "itl_p95", "tpot_p50", "e2e_p50", "output_tokens_per_s", "completed_rps"]


def fmt(value, scale=1, pattern="{:.3g}") -> str:
    if value is None:
        return "-"
    return pattern.format(value * scale)


def build(report: dict, g: Guardrails) -> dict:
    report = dict(report)
    report["guardrails"] = g.to_dict()
    report["verdicts"] = verdicts([c for c in report["cells"] if not c["figures"].get("by_served_model")], g)
    if report.get("canary_cells"):
        report["canary_verdicts"] = verdicts(report["canary_cells"], g)
    report["generated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report["environment"] = {"host": platform.node(), "python": platform.python_version(),
                             "machine": platform.machine(), "cpus": _cpus()}
    return report


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
def verdict_table(report: dict) -> str:
    first = (report["verdicts"] or report.get("canary_verdicts") or [{}])[0]
    rows = [("workload", "method", *[f"c={lv['concurrency']}" for lv in first.get("levels", [])], "verdict")]
    for v in report["verdicts"]:
        rows.append((v["workload"], v["model"], *["pass" if lv["pass"] else "FAIL" for lv in v["levels"]],
                     v["verdict"]))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for v in report.get("canary_verdicts", []):
        rows.append((v["workload"], f"{v['model']} (canary)", *["pass" if lv["pass"] else "FAIL" for lv in v["levels"]],
                     v["verdict"]))
    rows = [r for r in rows if len(r) == len(rows[0])]
    reasons = [f"  {v['model']} ({v['workload']}): {v['reason']}"
               for v in report["verdicts"] + report.get("canary_verdicts", [])]
    return "\n".join(lines + ["reasons:"] + reasons)


def markdown(report: dict) -> str:
    s = report["setup"]
    lines = ["# Load matrix report", "",
             f"Generated {report['generated']} on {report['environment']['host']} "
             f"({report['environment']['cpus']} CPUs). Baseline: `{s['baseline']}`.", "",
             "## Setup (held fixed across models)", "",
             f"- models: {', '.join(f'`{m}`' for m in s['models'])}",
             f"- concurrency (closed-loop Locust users): {', '.join(map(str, s['concurrency']))}",
             f"- protocol: {s['protocol']}; per cell: "
             + (f"{s['requests']} requests after {s['warmup_requests']} warm-up requests" if s.get("requests")
                else f"{s['warmup_s']:g} s warm-up, then {s['duration_s']:g} s measured"),
             f"- prompts per workload: {s['prompts']} (files: {', '.join(s['prompt_files'])}), seed {s['seed']}"]
    for w in s["workloads"]:
        lines.append(f"- workload `{w['name']}`: max_tokens {w['max_tokens']}, temperature {w['temperature']}, "
                     f"top_p {w['top_p']}")
    lines += ["", "Definitions: TTFT = request sent to first token; ITL = every gap between consecutive tokens "
              "(tokens in one response arrive together, gap 0); TPOT = (E2E - TTFT) / (tokens - 1) per request; "
              "accepted len = 1 + accepted draft tokens per verification round that drafted (server counters); "
              "RSS = peak resident memory of the model's backend process; queue = time waiting for a KV slot "
              "(server histogram). Ratios are to the baseline at the same workload and concurrency, in this run.",
              ""]
    for wname in dict.fromkeys(c["workload"] for c in report["cells"]):
        cells = [c for c in report["cells"] if c["workload"] == wname]
        lines += [f"## Workload `{wname}`", "", "### Figures", "",
                  "| model | conc | " + " | ".join(t for _, t, _, _ in TABLE) + " |",
                  "|---|---:|" + "---:|" * len(TABLE)]
        for c in cells:
            f = c["figures"]
            lines.append(f"| {c['model']} | {c['concurrency']} | "
                         + " | ".join(fmt(f.get(k), sc, p) for k, _, sc, p in TABLE) + " |")
        lines += ["", "### Ratio to baseline (same load, same run)", "",
                  "| model | conc | " + " | ".join(RATIO_COLUMNS) + " |", "|---|---:|" + "---:|" * len(RATIO_COLUMNS)]
        for c in cells:
            if c["model"] == s["baseline"]:
                continue
            lines.append(f"| {c['model']} | {c['concurrency']} | "
                         + " | ".join(fmt(c["ratios"].get(k), 1, "{:.2f}x") for k in RATIO_COLUMNS) + " |")
        lines += ["", "### Acceptance per draft position (server counters: accepted at position p / verification rounds)",
                  "", "| model | conc | per position |", "|---|---:|---|"]
        for c in cells:
            pos = c["figures"].get("acceptance_per_position") or []
            if pos:
                lines.append(f"| {c['model']} | {c['concurrency']} | {' '.join(f'{x:.2f}' for x in pos)} |")
        lines += ["", "### Consistency", "",
                  "| model | conc | requests (all) | tokens streamed (all) | server generated | match |",
                  "|---|---:|---:|---:|---:|---|"]
        for c in cells:
            f = c["figures"]
            lines.append(f"| {c['model']} | {c['concurrency']} | {f.get('cell_requests_all')} | "
                         f"{f.get('client_output_tokens_all')} | {fmt(f.get('server_output_tokens'), 1, '{:.0f}')} | "
                         f"{f.get('tokens_match_server')} |")
        lines.append("")
    if report.get("canary_cells"):
        lines += ["## Canary: live traffic split by the router", "",
                  "The same requests, split by the model that served them (rates depend on the share and are "
                  "left out; ratios are to the baseline's share of the same traffic).", "",
                  "| router | conc | served by | requests | TTFT p50 ms | ITL p95 ms | TPOT p50 ms | E2E p50 ms | "
                  "errors | accept rate | TPOT x base | ITL p95 x base |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for c in report["canary_cells"]:
            f, r = c["figures"], c["ratios"]
            lines.append(f"| {c['router']} | {c['concurrency']} | {c['model']} | {f['requests']} | "
                         f"{fmt(f.get('ttft_p50'), 1000, '{:.0f}')} | {fmt(f.get('itl_p95'), 1000, '{:.1f}')} | "
                         f"{fmt(f.get('tpot_p50'), 1000, '{:.1f}')} | {fmt(f.get('e2e_p50'), 1000, '{:.0f}')} | "
                         f"{fmt(f.get('error_rate'), 100, '{:.1f}%')} | {fmt(f.get('acceptance_rate'), 1, '{:.2f}')} | "
                         f"{fmt(r.get('tpot_p50'), 1, '{:.2f}x')} | {fmt(r.get('itl_p95'), 1, '{:.2f}x')} |")
        lines += [""] + [f"- canary verdict for `{v['model']}` ({v['workload']}): **{v['verdict']}** - {v['reason']}"
                         for v in report.get("canary_verdicts", [])] + [""]
    if report.get("plots"):
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in report["plots"]] + [""]
    lines += ["## Verdict", "", "Guardrails: " + _guardrails_text(report["guardrails"]), "",
              "| workload | method | " + " | ".join(
                  f"c={lv['concurrency']}" for lv in (report["verdicts"] or [{}])[0].get("levels", [])) + " | verdict | reason |",
              "|---|---|" + "---|" * (len((report["verdicts"] or [{}])[0].get("levels", [])) + 2)]
    for v in report["verdicts"]:
        lines.append(f"| {v['workload']} | {v['model']} | "
                     + " | ".join("pass" if lv["pass"] else "**fail**" for lv in v["levels"])
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.3, "font.size": 10,
                         "axes.spines.top": False, "axes.spines.right": False})
    paths = []
    workloads = list(dict.fromkeys(c["workload"] for c in report["cells"]))
    for wi, wname in enumerate(workloads):
        cells = [c for c in report["cells"] if c["workload"] == wname]
        models = list(dict.fromkeys(c["model"] for c in cells))
        levels = sorted({c["concurrency"] for c in cells})
        xs = list(range(len(levels)))  # evenly spaced load levels (1, 4, 16 read like a log axis)
        tag = f"w{wi}"
        colors = {m: f"C{i}" for i, m in enumerate(m for m in models if m != report["setup"]["baseline"])}

        def series(model, key, scale=1.0):
            by = {c["concurrency"]: c["figures"].get(key) for c in cells if c["model"] == model}
            return [None if by.get(lv) is None else by[lv] * scale for lv in levels]

        def lines(ax, key, scale, ylabel, title):
            for m in models:
                ys = series(m, key, scale)
                style = dict(color="black", linestyle="--", linewidth=2) if m == report["setup"]["baseline"] \
                    else dict(color=colors[m])
                ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", label=m, **style)
            ax.set_xticks(xs, [str(lv) for lv in levels])
            ax.set_xlim(-0.3, len(xs) - 0.7)
            ax.set_xlabel("concurrent users")
            ax.set_ylabel(ylabel)
            ax.set_title(title)
            ax.set_ylim(bottom=0)

        fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
        lines(axes[0], "itl_p50", 1000, "ms", "Inter-token latency p50")
        lines(axes[1], "itl_p95", 1000, "ms", "Inter-token latency p95")
        lines(axes[2], "tpot_p50", 1000, "ms", "Time per output token p50")
        axes[0].legend(fontsize=8)
        fig.suptitle(f"Latency between tokens - {wname} (lower is better)")
        paths.append(_save(fig, out / f"{tag}-itl.png"))

        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        lines(axes[0], "output_tokens_per_s", 1, "tokens/s", "Output tokens/s (higher is better)")
        base = report["setup"]["baseline"]
        for m in models:
            if m == base:
                continue
            rs = {c["concurrency"]: c["ratios"].get("output_tokens_per_s") for c in cells if c["model"] == m}
            axes[1].plot(xs, [float("nan") if rs.get(lv) is None else rs[lv] for lv in levels], marker="o", label=m,
                         color=colors[m])
        axes[1].axhline(1.0, color="black", linestyle="--", linewidth=1.5, label="baseline")
        axes[1].axhline(0.95, color="red", linestyle=":", linewidth=1, label="0.95x")
        axes[1].set_xticks(xs, [str(lv) for lv in levels])
        axes[1].set_xlim(-0.3, len(xs) - 0.7)
        axes[1].set_xlabel("concurrent users")
        axes[1].set_ylabel("x baseline")
        axes[1].set_title("Output tokens/s vs baseline")
        axes[0].legend(fontsize=8)
        axes[1].legend(fontsize=8)
        fig.suptitle(f"Throughput - {wname}")
        paths.append(_save(fig, out / f"{tag}-throughput.png"))

        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        lines(axes[0], "ttft_p50", 1000, "ms", "TTFT p50")
        lines(axes[1], "ttft_p95", 1000, "ms", "TTFT p95")
        axes[0].legend(fontsize=8)
        fig.suptitle(f"Time to first token - {wname} (lower is better)")
        paths.append(_save(fig, out / f"{tag}-ttft.png"))

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


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
