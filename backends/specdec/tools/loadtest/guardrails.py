"""Guardrails: rollback thresholds (YAML or TOML) -> a verdict per speculative method and load level.

File format (see loadtest/guardrails.yaml for the documented defaults):

    baseline: baseline            # the model every ratio is taken against
    improve:                      # what speculation must improve at a load level to be worth keeping
      figure: tpot_p50
      ratio_max: 0.95             # <= 0.95x baseline (for a higher-is-better figure use ratio_min)
    rollback:                     # a load level fails if any rule fails
      - {figure: itl_p95, ratio_max: 2.0}
      - {figure: output_tokens_per_s, ratio_min: 0.95}
      - {figure: completed_rps, ratio_min: 0.95, at: peak}    # only at the highest load level
      - {figure: error_rate, max: 0.01}
      - {figure: acceptance_rate, min: 0.2}

A rule has a `figure` (a name from report.json's figures) and one or more of `max`, `min` (on the
figure) or `ratio_max`, `ratio_min` (on figure / baseline figure at the same load), optionally
`at: peak` and a `reason`. Per method and workload, load levels are checked from low to high:
- every level passes                     -> keep
- the lowest level fails                 -> roll back (with the failing rules)
- levels pass up to some N, then fail    -> keep below concurrency N (at N the reason is given)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

BOUNDS = ("max", "min", "ratio_max", "ratio_min")


@dataclass
class Rule:
    figure: str
    max: float | None = None
    min: float | None = None
    ratio_max: float | None = None
    ratio_min: float | None = None
    at: str = "all"  # "all" | "peak"
    reason: str = ""

    def check(self, figures: dict, ratios: dict) -> list[str]:
        """Failure messages (empty when the rule holds). A missing figure does not fail a rule."""
        fails = []
        value, r = figures.get(self.figure), ratios.get(self.figure)
        why = f" ({self.reason})" if self.reason else ""
        if self.max is not None and _num(value) and value > self.max:
            fails.append(f"{self.figure} {_fmt(value)} > {_fmt(self.max)}{why}")
        if self.min is not None and _num(value) and value < self.min:
            fails.append(f"{self.figure} {_fmt(value)} < {_fmt(self.min)}{why}")
        if self.ratio_max is not None and _num(r) and r > self.ratio_max:
            fails.append(f"{self.figure} {r:.2f}x baseline > {self.ratio_max:g}x{why}")
        if self.ratio_min is not None and _num(r) and r < self.ratio_min:
            fails.append(f"{self.figure} {r:.2f}x baseline < {self.ratio_min:g}x{why}")
        return fails


@dataclass
class Guardrails:
    baseline: str = "baseline"
    improve: Rule | None = None
    rollback: list[Rule] = field(default_factory=list)

    def to_dict(self) -> dict:
        def rule(r: Rule) -> dict:
            return {k: v for k, v in r.__dict__.items() if v not in (None, "", "all")}
        return {"baseline": self.baseline, "improve": rule(self.improve) if self.improve else None,
                "rollback": [rule(r) for r in self.rollback]}


def parse_guardrails(data: dict) -> Guardrails:
    if not isinstance(data, dict):
        raise ValueError("expected a mapping with baseline, improve, rollback")
    unknown = set(data) - {"baseline", "improve", "rollback"}
    if unknown:
        raise ValueError(f"unknown keys: {', '.join(sorted(unknown))}")

    def rule(d, where) -> Rule:
        if not isinstance(d, dict) or "figure" not in d:
            raise ValueError(f"{where}: a rule needs a 'figure'")
        bad = set(d) - {"figure", "at", "reason", *BOUNDS}
        if bad:
            raise ValueError(f"{where}: unknown keys {', '.join(sorted(bad))}")
        if not any(k in d for k in BOUNDS):
            raise ValueError(f"{where}: give at least one of {', '.join(BOUNDS)}")
        if d.get("at", "all") not in ("all", "peak"):
            raise ValueError(f"{where}: 'at' must be 'all' or 'peak'")
        return Rule(**{k: (float(v) if k in BOUNDS else v) for k, v in d.items()})

    rules = data.get("rollback") or []
    if not isinstance(rules, list):
        raise ValueError("rollback must be a list of rules")
    return Guardrails(
        baseline=str(data.get("baseline", "baseline")),
        improve=rule(data["improve"], "improve") if data.get("improve") else None,
        rollback=[rule(r, f"rollback[{i}]") for i, r in enumerate(rules)],
    )


def load_guardrails(path: str | Path) -> Guardrails:
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".toml":
        import tomllib

        return parse_guardrails(tomllib.loads(text))
    import yaml

    return parse_guardrails(yaml.safe_load(text) or {})


def level_check(g: Guardrails, figures: dict, ratios: dict, peak: bool) -> list[str]:
    """Why this load level fails (empty: it passes)."""
    fails = []
    if figures.get("error") and not figures.get("requests"):
        return [f"no measurement: {figures['error']}"]
    for r in g.rollback:
        if r.at == "peak" and not peak:
            continue
        fails += r.check(figures, ratios)
    if g.improve is not None:
        missed = g.improve.check(figures, ratios)
        if missed:
            fails.append("no gain: " + "; ".join(missed))
    return fails


def verdicts(cells: list[dict], g: Guardrails) -> list[dict]:
    """One verdict per (workload, method) with the per-level results, from report cells
    ({workload, concurrency, model, figures, ratios})."""
    out = []
    groups: dict[tuple[str, str], list[dict]] = {}
    for c in cells:
        if c["model"] != g.baseline:
            groups.setdefault((c["workload"], c["model"]), []).append(c)
    for (workload, model), group in groups.items():
        group.sort(key=lambda c: c["concurrency"])
        peak = group[-1]["concurrency"]
        levels = []
        for c in group:
            fails = level_check(g, c["figures"], c.get("ratios", {}), c["concurrency"] == peak)
            levels.append({"concurrency": c["concurrency"], "pass": not fails, "reasons": fails})
        out.append({"workload": workload, "model": model, "levels": levels, **decide(levels)})
    return out


def decide(levels: list[dict]) -> dict:
    """keep / keep below concurrency N / roll back, from levels sorted by concurrency."""
    first_fail = next((i for i, lv in enumerate(levels) if not lv["pass"]), None)
    if first_fail is None:
        top = levels[-1]["concurrency"] if levels else 0
        return {"verdict": "keep", "keep_below": None,
                "reason": f"passes every guardrail at every load level (up to concurrency {top})"}
    failing = levels[first_fail]
    why = "; ".join(failing["reasons"])
    if first_fail == 0:
        return {"verdict": "roll back", "keep_below": None,
                "reason": f"at concurrency {failing['concurrency']}: {why}"}
    n = failing["concurrency"]
    later = [lv["concurrency"] for lv in levels[first_fail + 1:] if lv["pass"]]
    note = f" (passes again at {', '.join(map(str, later))}; not trusted above a failure)" if later else ""
    return {"verdict": f"keep below concurrency {n}", "keep_below": n,
            "reason": f"at concurrency {n}: {why}{note}"}


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x))


def _fmt(x: float) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)
