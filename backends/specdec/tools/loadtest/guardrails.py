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
`at: peak` and a `reason`.

Every decision here respects the evidence: a bound is checked against the figure's confidence
interval over the interleaved trials (`intervals`), never against a point estimate alone. A bound
*fails* when the whole interval lies on its wrong side, *passes* when the whole interval lies on its
right side, and is *undecided* otherwise (with the rounds that would likely decide it). A verdict
stands on every bound at every level, and any one failing bound can fail it, so each interval is
taken at the Bonferroni confidence `family_confidence(bounds)`: all of them together hold with
CONFIDENCE (90%), and a method that truly sits on its thresholds is wrongly kept or rolled back at
most 5% of the time either way, however many rules and levels there are. A figure
that is measured once per level (server counters such as mean_accepted_length) has no interval and
is compared as a point. A load level fails if any rule fails (and, with an `improve` rule, if the
interval shows the gain missed), passes if every rule passes, and is inconclusive otherwise. Per
method and workload, load levels are checked from low to high:
- every level passes                             -> keep
- the lowest level fails                         -> roll back (with the failing rules)
- levels pass up to some N, then fail at N       -> keep below concurrency N (at N the reason is given)
- the first level that does not pass is inconclusive -> inconclusive (what was undecided, and how
  many rounds would likely decide it)
The canary comparison and the A/A check (`aa_check`) go through the same intervals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from specdec.tools.loadtest.intervals import CONFIDENCE, Interval, family_confidence, rounds_to_clear

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

    def bounds(self) -> int:
        return sum(getattr(self, b) is not None for b in BOUNDS)

    def check(self, cell: dict, confidence: float) -> list[dict]:
        """One outcome per bound, on the interval at `confidence`: {status: pass | fail | undecided,
        detail, rounds}. A figure the cell does not have (nothing drafted, no local server) passes."""
        why = f" ({self.reason})" if self.reason else ""
        out = []
        for bound, kind in (("max", "mean"), ("min", "mean"), ("ratio_max", "ratio"), ("ratio_min", "ratio")):
            threshold = getattr(self, bound)
            if threshold is None:
                continue
            iv = _interval(cell, self.figure, kind)
            if iv is None:
                continue
            iv = iv.at(confidence)
            upper = bound.endswith("max")
            fails, passes = (iv.above(threshold), iv.below(threshold)) if upper else (iv.below(threshold), iv.above(threshold))
            unit = "x baseline" if kind == "ratio" else ""
            op = (">" if fails else "<" if passes else "vs") if upper else ("<" if fails else ">" if passes else "vs")
            detail = f"{self.figure} {_fmt_iv(iv, unit)} {op} {threshold:g}{'x' if kind == 'ratio' else ''}{why}"
            status = "fail" if fails else "pass" if passes else "undecided"
            out.append({"status": status, "detail": detail,
                        "rounds": rounds_to_clear(iv, threshold) if status == "undecided" else None})
        return out


def _interval(cell: dict, figure: str, kind: str) -> Interval | None:
    """The figure's interval from the cell (ratios or means), or a point for a once-per-level figure."""
    table = cell.get("ratios" if kind == "ratio" else "means") or {}
    if figure in table:
        return Interval(**table[figure]) if table[figure] else None
    if kind == "ratio":
        return None  # ratios exist only for the figures every trial measures
    value = (cell.get("figures") or {}).get(figure)
    if not _num(value):
        return None
    return Interval(value, value, value, 2, 0.0, CONFIDENCE, "mean")  # measured once: compared as a point


def _fmt_iv(iv: Interval, unit: str) -> str:
    if _fmt(iv.lo) == _fmt(iv.hi):  # no spread (to the digits shown)
        return f"{_fmt(iv.value)}{unit}"
    return f"{_fmt(iv.value)}{unit} [{_fmt(iv.lo)}, {_fmt(iv.hi)}]"


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


def level_rules(g: Guardrails, peak: bool) -> list[Rule]:
    return [r for r in g.rollback if r.at == "all" or peak] + ([g.improve] if g.improve else [])


def level_check(g: Guardrails, cell: dict, peak: bool, confidence: float = CONFIDENCE) -> dict:
    """{status: pass | fail | inconclusive, reasons, undecided, rounds} for one load level, each bound
    judged on its interval at `confidence`."""
    f = cell.get("figures") or {}
    if f.get("error") and not f.get("requests"):
        return {"status": "fail", "reasons": [f"no measurement: {f['error']}"], "undecided": [], "rounds": None}
    outcomes = []
    for r in level_rules(g, peak):
        prefix = "gain: " if r is g.improve else ""
        outcomes += [{**o, "detail": prefix + o["detail"]} for o in r.check(cell, confidence)]
    fails = [o["detail"] for o in outcomes if o["status"] == "fail"]
    undecided = [o for o in outcomes if o["status"] == "undecided"]
    if fails:
        return {"status": "fail", "reasons": fails, "undecided": [o["detail"] for o in undecided], "rounds": None}
    if undecided:
        needed = [o["rounds"] for o in undecided]
        return {"status": "inconclusive", "reasons": [o["detail"] for o in undecided], "undecided":
                [o["detail"] for o in undecided], "rounds": None if None in needed else max(needed)}
    return {"status": "pass", "reasons": [], "undecided": [], "rounds": None}


def verdicts(cells: list[dict], g: Guardrails, skip: tuple[str, ...] = ()) -> list[dict]:
    """One verdict per (workload, method) with the per-level results, from report cells
    ({workload, concurrency, model, figures, ratios, means, trials}); `skip`: models that are not
    methods (an A/A copy of the baseline)."""
    out = []
    groups: dict[tuple[str, str], list[dict]] = {}
    for c in cells:
        if c["model"] != g.baseline and c["model"] not in skip:
            groups.setdefault((c["workload"], c["model"]), []).append(c)
    for (workload, model), group in groups.items():
        group.sort(key=lambda c: c["concurrency"])
        peak = group[-1]["concurrency"]
        # every bound at every level may decide the verdict: together they hold with CONFIDENCE
        confidence = family_confidence(sum(r.bounds() for c in group for r in level_rules(g, c["concurrency"] == peak)))
        levels = []
        for c in group:
            check = level_check(g, c, c["concurrency"] == peak, confidence) if compared(c) else unjudged(g.baseline)
            levels.append({"concurrency": c["concurrency"], "rounds_run": _rounds(c), "lives_run": _lives(c), **check})
        out.append({"workload": workload, "model": model, "confidence": confidence, "levels": levels,
                    **decide(levels)})
    return out


def compared(cell: dict) -> bool:
    """Has the cell a ratio to the baseline (`add_intervals`)? None where the baseline did not run
    at its level: then neither a verdict (`unjudged`) nor the A/A check (`aa_check`) has anything to
    judge."""
    return any((cell.get("ratios") or {}).values())


def unjudged(baseline: str) -> dict:
    """A level without the baseline's trials: no ratio exists, so no bound on one can pass (a run
    of `--models spec_draft` alone once read "keep" at every level, having compared nothing)."""
    return {"status": "inconclusive", "undecided": [], "rounds": None,
            "reasons": [f"no trials of the baseline `{baseline}` at this level to compare with (add it to --models)"]}


def _rounds(cell: dict) -> int:
    return len({t["round"] for t in cell.get("trials", [])})


def _lives(cell: dict) -> int:
    """Server lives the cell's trials ran in (`loadtest --servers`); its intervals are over lives when > 1."""
    return len({t.get("life", 0) for t in cell.get("trials", [])}) or 1


def decide(levels: list[dict]) -> dict:
    """keep / keep below concurrency N / roll back / inconclusive, from levels sorted by concurrency."""
    first = next((i for i, lv in enumerate(levels) if lv["status"] != "pass"), None)
    if first is None:
        top = levels[-1]["concurrency"] if levels else 0
        return {"verdict": "keep", "keep_below": None,
                "reason": f"passes every guardrail at every load level (up to concurrency {top})"}
    level = levels[first]
    n = level["concurrency"]
    why = "; ".join(level["reasons"])
    passed = f"passes below concurrency {n}; " if first else ""
    if level["status"] == "inconclusive" and not level.get("undecided"):  # nothing compared (`unjudged`)
        return {"verdict": "inconclusive", "keep_below": None, "reason": f"{passed}at concurrency {n}: {why}"}
    if level["status"] == "inconclusive":
        unit, ran = (("server lives", level["lives_run"]) if level.get("lives_run", 1) > 1
                     else ("rounds", level["rounds_run"]))
        more = (f"about {level['rounds']} {unit} in all would likely decide it ({ran} ran)"
                if level["rounds"] else f"the ratio sits on a threshold: more {unit} may never decide it")
        return {"verdict": "inconclusive", "keep_below": None,
                "reason": f"{passed}at concurrency {n} the intervals do not clear the guardrails: {why}; {more}"}
    if first == 0:
        return {"verdict": "roll back", "keep_below": None, "reason": f"at concurrency {n}: {why}"}
    later = [lv["concurrency"] for lv in levels[first + 1:] if lv["status"] == "pass"]
    note = f" (passes again at {', '.join(map(str, later))}; not trusted above a failure)" if later else ""
    return {"verdict": f"keep below concurrency {n}", "keep_below": n, "reason": f"at concurrency {n}: {why}{note}"}


# ---- the A/A self-check ---------------------------------------------------------------------------------
AA_FIGURES = ("output_tokens_per_s", "tpot_p50", "ttft_p95", "itl_p95")  # the ratios the shipped guardrails judge
AA_MARGIN = 0.05  # the smallest margin the shipped guardrails act on (0.95x): a difference they would see


def aa_check(cells: list[dict], aa_model: str, margin: float = AA_MARGIN) -> dict:
    """The baseline against its A/A copy (the same model under two names): a difference is an interval
    that lies wholly outside [1 - margin, 1 / (1 - margin)] for any of AA_FIGURES at any level, i.e.
    one the guardrails would act on. Such a run's verdicts cannot be trusted: the machine's noise
    beat the design (it is flagged in the report)."""
    lo, hi = 1 - margin, 1 / (1 - margin)
    mine = sorted((c for c in cells if c["model"] == aa_model), key=lambda c: (c["workload"], c["concurrency"]))
    confidence = family_confidence(len(AA_FIGURES) * len(mine))  # like a verdict: all checks together
    levels = []
    for c in mine:
        if not compared(c):
            levels.append({"workload": c["workload"], "concurrency": c["concurrency"], "result": "no baseline",
                           "differences": []})
            continue
        diffs = []
        for k in AA_FIGURES:
            d = (c.get("ratios") or {}).get(k)
            iv = Interval(**d).at(confidence) if d else None
            if iv and (iv.above(hi) or iv.below(lo)):
                diffs.append(f"{k} {_fmt_iv(iv, 'x')}")
        levels.append({"workload": c["workload"], "concurrency": c["concurrency"],
                       "result": "difference" if diffs else "no difference", "differences": diffs})
    ok = bool(levels) and all(lv["result"] == "no difference" for lv in levels)
    return {"model": aa_model, "margin": margin, "confidence": confidence, "passed": ok, "levels": levels}


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x))


def _fmt(x: float) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)
