"""Confidence intervals for "model figure / baseline figure" from interleaved, paired trials.

The load matrix runs every model once per round at a load level (in orders that balance positions
and neighbours), so a slow period of the machine lands on every model of that round alike. Each
round gives one paired ratio r_i = figure(model, round i) / figure(baseline, round i); the interval
is Student's t on the logs of those ratios (a ratio is multiplicative noise, and exp(mean log) is
the geometric mean):

    exp(mean(log r) +- t(1 - (1 - confidence) / 2, n - 1) * sd(log r) / sqrt(n))

Why this and not a bootstrap over requests: requests of one trial share that trial's machine
state, so they are not independent draws; a bootstrap over requests is far too narrow when the
machine's speed drifts. Why not a bootstrap over rounds: with 3-10 rounds its percentile interval
under-covers badly, while the t interval keeps its stated error rate for normal log ratios with any
n >= 2 (tests/test_loadtest_units.py checks that in a seeded simulation).

Rounds of one server life are not independent draws of a comparison either: a difference two
stubs keep for as long as their server runs is in every round of that life (docs/verdicts.md). A
run over several server lives (`loadtest --servers N`) therefore takes the interval over the
lives (`spread`): each life's mean log ratio is one value, and the t interval is over those
(n = lives), which holds both the rounds' noise and the instances' luck; but where the lives'
means agree at least as well as their rounds' own noise predicts (no sign of a difference a life
carries), the rounds' spread within their lives sets the interval, with its degrees of freedom.
Over two lives the first alone has one degree of freedom (t = 6.3 at 90%), and measured on this
machine the lives' means spread no more than their rounds predict (docs/verdicts.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from statistics import NormalDist

CONFIDENCE = 0.90  # two-sided: a one-sided claim (above or below a threshold) is wrong <= 5% of the time


def family_confidence(checks: int, confidence: float = CONFIDENCE) -> float:
    """Bonferroni: the confidence each of `checks` intervals needs so that all of them together
    hold with `confidence` (a verdict stands on many bounds at many load levels; any one of them
    can fail it, so each must be surer than the verdict)."""
    return 1 - (1 - confidence) / max(1, checks)


@dataclass(frozen=True)
class Interval:
    value: float  # a ratio: the geometric mean of the paired per-round ratios; else the mean per round
    lo: float
    hi: float
    n: int  # rounds (with both figures, for a ratio), or server lives where `unit` says so
    sd: float  # spread across rounds or lives (of log ratios for a ratio; 0 for n < 2)
    confidence: float
    kind: str = "ratio"  # "ratio" (figure / baseline figure) or "mean" (the figure itself)
    unit: str = "round"  # what n counts: "round", or "life" (one value per server life: `spread`)
    df: int | None = None  # the t quantile's degrees of freedom where they are not n - 1 (`spread`)

    def to_dict(self) -> dict:
        return asdict(self)

    def at(self, confidence: float) -> "Interval":
        """The same interval at another confidence (wider for a higher one)."""
        if self.n < 2 or self.sd == 0.0:
            return replace(self, confidence=confidence)  # unbounded, or no spread: the same interval
        half = t_quantile(1 - (1 - confidence) / 2, self.df or self.n - 1) * self.sd / math.sqrt(self.n)
        if self.kind == "ratio":
            centre = math.log(self.value)
            return replace(self, lo=math.exp(centre - half), hi=math.exp(centre + half), confidence=confidence)
        return replace(self, lo=self.value - half, hi=self.value + half, confidence=confidence)

    def above(self, threshold: float) -> bool:
        """The whole interval lies above the threshold."""
        return self.n >= 2 and self.lo > threshold

    def below(self, threshold: float) -> bool:
        return self.n >= 2 and self.hi < threshold


@lru_cache(maxsize=4096)
def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (bisection on the CDF, Simpson's rule on the density); no scipy needed."""
    if not 0.0 < p < 1.0 or df < 1:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df >= 1, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def t_cdf(t: float, df: int) -> float:
    if t < 0:
        return 1.0 - t_cdf(-t, df)
    # substitute x = atan(u): the density's heavy tail becomes a smooth integrand on [0, atan(t)]
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def f(x: float) -> float:
        u = math.tan(x)
        return math.exp(log_c - (df + 1) / 2 * math.log1p(u * u / df)) * (1 + u * u)

    b, steps = math.atan(t), 400
    h = b / steps
    s = f(0.0) + f(b) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, steps))
    return 0.5 + s * h / 3


def paired_ratio(values: list[float | None], base: list[float | None], confidence: float = CONFIDENCE,
                 lives: list[int] | None = None) -> Interval | None:
    """The interval for values / base, paired by position (round). Pairs with a missing or
    non-positive figure are left out; None when no pair is left. With one pair the interval is
    unbounded (0, inf): one round says nothing about its own spread. `lives`, by position: the
    server life of each round; over more than one, the interval is over the lives' mean log
    ratios (`spread`)."""
    kept = [(v, b, life) for v, b, life in zip(values, base, lives or [0] * len(values))
            if _positive(b) and isinstance(v, (int, float)) and v >= 0]
    if kept and all(v == 0 for v, _, _ in kept):  # e.g. ITL p50 when most tokens arrive several at a time
        return Interval(0.0, 0.0, 0.0, len(kept), 0.0, confidence)
    s = spread([(math.log(v / b), life) for v, b, life in kept if v > 0])
    if s is None:
        return None
    if s.n < 2:
        return Interval(math.exp(s.mean), 0.0, math.inf, s.n, 0.0, confidence, unit=s.unit)
    half = s.half(confidence)
    return Interval(math.exp(s.mean), math.exp(s.mean - half), math.exp(s.mean + half), s.n, s.sd, confidence,
                    unit=s.unit, df=s.df)


@dataclass(frozen=True)
class Spread:
    """What an interval is taken from: the mean, an sd whose sd / sqrt(n) is the mean's standard
    error, n (rounds, or server lives), the t quantile's degrees of freedom and what n counts."""

    mean: float
    sd: float
    n: int
    unit: str
    df: int | None = None  # None: n - 1

    def half(self, confidence: float) -> float:
        return t_quantile(1 - (1 - confidence) / 2, self.df or self.n - 1) * self.sd / math.sqrt(self.n)


def spread(values: list[tuple[float, int]]) -> Spread | None:
    """(value, server life) pairs as `Spread`: over the values while they all come from one life;
    over several, the mean of the lives' means (a life counts once however many rounds it ran),
    and its standard error from the lives' means' spread (G - 1 degrees of freedom, G lives), or,
    where that is smaller than the rounds' pooled spread within their lives predicts, from the
    latter (sum of rounds - 1 per life): lives that agree at least that well show no difference
    of their own, and the rounds say more of the noise than two or three lives' means can.
    (A test first, and a difference two lives hide by chance is missed: more lives make that
    rarer.)"""
    lives: dict[int, list[float]] = {}
    for x, life in values:
        lives.setdefault(life, []).append(x)
    xs = [x for x, _ in values]
    if not xs:
        return None
    if len(lives) < 2:
        n, mean = len(xs), sum(xs) / len(xs)
        sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
        return Spread(mean, sd, n, "round")
    groups = [g for _, g in sorted(lives.items())]
    means = [sum(g) / len(g) for g in groups]
    G, mean = len(means), sum(means) / len(means)
    between = sum((m - mean) ** 2 for m in means) / (G - 1) / G  # the mean's variance, from the lives
    within_df = sum(len(g) - 1 for g in groups)
    if within_df:
        pooled = sum((x - m) ** 2 for g, m in zip(groups, means) for x in g) / within_df
        within = pooled * sum(1 / len(g) for g in groups) / G ** 2  # ... from the rounds, no life effect
        if within > between:
            return Spread(mean, math.sqrt(within * G), G, "life", within_df)
    return Spread(mean, math.sqrt(between * G), G, "life")


def round_ratios(trials: list[dict], base: list[dict], keys) -> dict[str, dict | None]:
    """Per figure key, `paired_ratio` of one model's trials ({"round", "figures"}, as the load
    matrix records them) to another's, paired by round: a model against the baseline
    (`matrix.add_intervals`) or against its twin on another revision (`revision.revision_ratios`)."""
    mine = {t["round"]: t["figures"] for t in trials}
    theirs = {t["round"]: t["figures"] for t in base}
    rounds = sorted(set(mine) | set(theirs))
    life = round_lives(trials + base)
    ratios = {}
    for k in keys:
        iv = paired_ratio([mine.get(r, {}).get(k) for r in rounds], [theirs.get(r, {}).get(k) for r in rounds],
                          lives=[life.get(r, 0) for r in rounds])
        ratios[k] = iv.to_dict() if iv else None
    return ratios


def life_ratios(trials: list[dict], base: list[dict], key: str, lives: int) -> list[float | None]:
    """Per server life, the geometric mean of that life's paired ratios of `key` (None where it has none)."""
    out = []
    for life in range(lives):
        iv = round_ratios([t for t in trials if t.get("life", 0) == life], [t for t in base if t.get("life", 0) == life],
                          [key])[key]
        out.append(iv["value"] if iv else None)
    return out


def round_lives(trials: list[dict]) -> dict[int, int]:
    """Round -> the server life it ran in, for the rounds whose trials record one (a run over
    several lives; absent: life 0)."""
    return {t["round"]: t["life"] for t in trials if "life" in t}


def mean_interval(values: list[float | None], confidence: float = CONFIDENCE,
                  lives: list[int] | None = None) -> Interval | None:
    """The same t interval for a figure itself (error rate, acceptance rate), not a ratio; over
    server lives where `lives` (by position) names more than one (`spread`)."""
    s = spread([(float(v), life) for v, life in zip(values, lives or [0] * len(values))
                if isinstance(v, (int, float)) and math.isfinite(v)])
    if s is None:
        return None
    if s.n < 2:
        return Interval(s.mean, -math.inf, math.inf, s.n, 0.0, confidence, "mean", s.unit)
    half = s.half(confidence)
    return Interval(s.mean, s.mean - half, s.mean + half, s.n, s.sd, confidence, "mean", s.unit, s.df)


def rounds_to_clear(iv: Interval, threshold: float, limit: int = 1000) -> int | None:
    """Rounds (server lives, for an interval over lives) in all that would likely put the interval
    on one side of the threshold, if the mean and spread of the log ratios stay as measured; None
    when that would take more than `limit` (the ratio sits on the threshold) or cannot be said
    (fewer than 2)."""
    if iv.n < 2:
        return None
    if iv.kind == "ratio":
        if threshold <= 0 or iv.value <= 0:
            return None
        gap = abs(math.log(iv.value) - math.log(threshold))
    else:
        gap = abs(iv.value - threshold)
    if gap == 0.0:
        return None
    if iv.sd == 0.0:
        return iv.n
    p = 1 - (1 - iv.confidence) / 2
    z_rounds = int((NormalDist().inv_cdf(p) * iv.sd / gap) ** 2)  # t > z: no fewer rounds than this
    for n in range(max(iv.n, 2, z_rounds), limit + 1):
        if t_quantile(p, n - 1) * iv.sd / math.sqrt(n) < gap:
            return n
    return None


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and x > 0 and math.isfinite(x)
