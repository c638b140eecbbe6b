"""What a decode step costs, for the adaptive policy (`policy.Policy`) to weigh drafting against.

A step's cost is the time of a step without its proposal for the batch's total tokens (the target
forward, calibrated at start-up over token counts, then corrected by every real step's timing, which
also brings in what a forward-only calibration misses: inputs, verification, compaction, output,
the engine's loop between steps; one preempted calibration timing on a busy machine once made 2
tokens look 3x the cost of 1, and speculation never started; a count's point is the median of its
recent pairs, each a step at that count and a settled plain step (one token per row) at most
PAIR_GAP steps apart, whose ratio needs no load, at most SHAPE_BOUND from the start-up curve;
where points disagree, the one whose count ran more often and more lately prevails) plus the
proposer's time, (fixed + per_level * depth) * (1 + row_share * (rows - 1)), fitted online by least
squares over the median time per depth and row count of recent proposals (medians that disagree
with that model lowered: `consistent`; the rows' share from them once two row counts were timed),
started from proposals the engine times before serving (one row and a full batch), one such fit for
proposals with a sampled drafting row and one for greedy ones (`CostModel.use_path`).
"""

from __future__ import annotations

import statistics
import time
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

VERIFY_RATE = 0.1  # how far one measured step moves the verify-cost curve's shape
SHAPE_SAMPLES = 15  # recent pairs per token count whose median sets that count's point ...
SHAPE_FRESH = 512  # ... once it has that many, all within this many steps
# (a batch drafting every step has plain steps only from its anchors, one in 2 * PROBE_EVERY: the
# window must hold SHAPE_SAMPLES of them; at 256 with 15 samples it held 8, and such a batch's
# curve was never set by its steps) ...
SHAPE_TOLERANCE = 0.01  # ... moving a point already set only by more than this share of it. Each
# sample is a pair's ratio (`observe_shape`), which needs no load. Medians of 5 raw steps, kept
# before, wandered 10-20% with 10% jitter alone, and a count timed mostly in a busy spell was set
# at the spell's cost against the quiet plain steps after it: in a simulation with known costs
# where fixed k = 4 is the best pick (tests/test_policy.py, `simulated_rate`), adaptive prompt
# lookup at batch 1 kept 96.5% of its rate, 93.6% with busy spells; at 15 load-corrected steps
# 99.0% and 97.7%
SHAPE_BOUND = 2.0  # real steps may move a point of the curve this far from the start-up curve, either way
# (corrections seen: 1.26-1.4x). Medians of 5 steps on a machine whose steps jump between 1.2 and
# 5 ms (preempted) set 2-5 tokens at 4-5x a plain step where their medians over the run were
# 1.4x; speculation then stopped, no fresh step at those counts came to undo it, and the draft
# model, which gains 1.5x at c=1, drafted in 10% of its steps (3 runs of 3 engines sharing 2 cores)
LOAD_RATE = 0.2  # how far one measured step moves the machine's load factor
OUTPUT_RATE = 0.05  # how far one batch of sent responses moves the output cost per row and step
PAIR_GAP = 8  # a step and a settled plain step at most this many steps apart are a pair (`observe_shape`)
PLAIN_SETTLE = 2  # plain steps a plain step must follow to be timed at all (`observe_verify`) and
# be a pair's plain step (`observe_shape`); an anchor of a drafting batch runs it plain this many
# steps more. The first plain steps after drafted ones still pay for them: in-process at batch 8 (fixed
# k = 4, three plain steps forced every 8) the first cost 1.13-1.14x a baseline engine's plain step
# (its forward 1.11x, its output 1.25x), the second 1.04-1.05x, the third 1.00x; at batch 1, 1.03-1.04x,
# 1.01x, 1.00x. Set against first plain steps, a drafting batch of 8 priced drafting 13% low, and
# a paused one, timing settled steps, priced it right: two regimes, each consistent with its own steps
ROW_SHARE = 0.5  # each drafting row past the first adds this share of a one-row proposal, until two
# row counts were timed (the engine times one row and a full batch before serving). Measured at
# fixed k = 4: a proposal for 8 rows cost 4.1x one row's for the draft model (0.45 a row), 5.0x for
# EAGLE (0.57), 2.0x for Medusa, 3.2x for prompt lookup. Charged a whole proposal per row (1.0), a
# batch of 8 paused the draft model where fixed k = 4 ran 1.25x the baseline (adaptive 1.02x);
# charged one proposal for any rows (0), the draft model served 4 users at 0.83-0.90x
ROW_SHARES = [i / 20 for i in range(21)]  # the row shares a refit tries (0 .. 1: m rows never cost
# more than m one-row proposals)
DRAFT_REFIT_FIRST = 8  # the first proposals each refit the proposal-cost fit ...
DRAFT_REFIT_EVERY = 32  # ... later ones every this many: a refit (a least-squares fit per row share,
# over medians of 64 samples) took 75 us, and every 8th proposal it was a third of the policy's
# time a step at batch 1; the load factor follows the machine's speed between refits
CATCH_UP_SAMPLES = 16  # recent catch-ups whose median cost per entry the policy charges resumes with


@dataclass
class RecentSteps:
    """The last SHAPE_SAMPLES steps at one token count: their step numbers, and their seconds also
    kept sorted, so that `median` is a lookup. `observe_shape` reads two counts' medians every
    step: `statistics.median` sorted 15 samples twice a step, 2 of prompt lookup's 9 us of
    observation a step at batch 1."""

    numbers: deque = field(default_factory=lambda: deque(maxlen=SHAPE_SAMPLES))
    seconds: deque = field(default_factory=lambda: deque(maxlen=SHAPE_SAMPLES))
    ordered: list[float] = field(default_factory=list)

    def add(self, number: int, seconds: float) -> None:
        if len(self.seconds) == self.seconds.maxlen:
            del self.ordered[bisect_left(self.ordered, self.seconds[0])]
        self.numbers.append(number)
        self.seconds.append(seconds)
        insort(self.ordered, seconds)

    def __len__(self) -> int:
        return len(self.numbers)

    @property
    def oldest(self) -> int:
        return self.numbers[0]

    @property
    def newest(self) -> int:
        return self.numbers[-1]

    def median(self) -> float:
        """`statistics.median` of the seconds."""
        ordered, i = self.ordered, len(self.ordered) // 2
        return ordered[i] if len(ordered) % 2 else (ordered[i - 1] + ordered[i]) / 2


@dataclass
class ProposalFit:
    """One path's proposal cost at load 1 (`CostModel.use_path`): a proposal of depth d for m
    drafting rows takes (fixed + per_level * d) * (1 + row_share * (m - 1)), fitted by least
    squares over the median time per depth and row count of its recent samples."""

    fixed: float = 0.0  # a proposal for one row
    per_level: float = 0.0
    row_share: float = ROW_SHARE  # each drafting row past the first adds this share of a one-row proposal
    samples: deque = field(default_factory=lambda: deque(maxlen=64))  # (depth, rows, seconds at load 1)
    seen: int = 0  # proposals timed so far
    table_key: tuple = field(default=(), repr=False)  # what `table` was made for
    table_made: tuple[list[float], list[float]] = field(default=([], []), repr=False)

    def seconds(self, depth: int, rows: int = 1) -> float:
        """A proposal of `depth` for `rows` drafting rows."""
        return (self.fixed + self.per_level * depth) * self.rows_factor(rows) if depth > 0 else 0.0

    def rows_factor(self, rows: int) -> float:
        """A proposal for `rows` drafting rows, in one-row proposals: rows share the drafter's
        forwards (its weights are read once per forward), so a batch of 8 proposes in 4-5 rows'
        time, but not all of their cost (fitted on one user's proposals and charged once for four
        rows, the draft model served 4 users at 0.83-0.90x the baseline)."""
        return 1.0 + self.row_share * (rows - 1) if rows > 0 else 0.0

    def table(self, depths: int, rows: int) -> tuple[list[float], list[float]]:
        """`seconds` of depths 0..depths for one row and `rows_factor` of 0..rows, kept until the
        fit moves (a refit): `Policy.best` reads them every step."""
        key = (self.fixed, self.per_level, self.row_share, depths, rows)
        if self.table_key != key:
            self.table_key = key
            self.table_made = ([self.seconds(d) for d in range(depths + 1)], [self.rows_factor(m) for m in range(rows + 1)])
        return self.table_made

    def fork(self) -> "ProposalFit":
        """A fit for another path: this one's, without its samples."""
        return ProposalFit(self.fixed, self.per_level, self.row_share)

    def observe(self, depth: int, seconds: float, rows: int = 1) -> None:
        """Refit the one-row fixed + per_level * depth, and the rows' share once two row counts
        were timed: least squares over the median time of each depth and row count seen recently
        (medians, so that proposals preempted on a busy machine do not move it), the share the one
        of ROW_SHARES that fits best. A sample counts at most 3x the current prediction: one
        proposal that caught up on a whole prompt must not switch speculation off for good (while
        it is off no samples correct it). The first DRAFT_REFIT_FIRST samples refit it each, later
        ones every DRAFT_REFIT_EVERY-th: the refit, every step of a drafting batch, was 6 us of a
        0.33 ms prompt-lookup step at batch 1, and the medians of 64 samples move little in 32."""
        predicted = self.seconds(depth, rows)
        self.samples.append((depth, rows, min(seconds, 3 * predicted) if predicted > 0 else seconds))
        self.seen += 1
        if self.seen > DRAFT_REFIT_FIRST and self.seen % DRAFT_REFIT_EVERY:
            return
        self.refit()

    def start(self, timed: list[tuple[int, int, float]]) -> None:
        """Start the fit from (rows, depth, seconds) timed before serving, in place of the guess
        `CostModel.measure` starts with: each is one of the recent samples, so proposals timed
        while serving take over as they come (kept apart, the first in-sync probe, at twice the
        start-up time, replaced the whole fit and doubled a paused draft model's cost at batch 8)."""
        for m, d, t in timed:
            self.samples.append((d, m, t))
        if timed:
            self.refit()

    def refit(self) -> None:
        """Fit the one-row proposal over the median of each (rows, depth) among the recent
        samples, and the rows' share where two row counts are among them: the share of
        ROW_SHARES that fits them best."""
        cells: dict[int, dict[int, list[float]]] = {}  # rows -> depth -> seconds
        for d, m, t in self.samples:
            cells.setdefault(m, {}).setdefault(d, []).append(t)
        points = [(m, d, t, w) for m, by_depth in cells.items() for d, t, w in
                  consistent([(d, statistics.median(ts), len(ts)) for d, ts in sorted(by_depth.items())])]
        if len(cells) > 1:
            self.row_share = min(ROW_SHARES, key=lambda share: self.fit(points, share)[2])
        self.fixed, self.per_level, _ = self.fit(points, self.row_share)

    def fit(self, points: list[tuple[int, int, float, int]], share: float) -> tuple[float, float, float]:
        """(fixed, per_level, weighted squared relative error) of one-row proposals fitted to
        (rows, depth, median seconds, samples) at `share` per extra row. With one depth timed,
        the current fit's shape is kept and its level matched."""
        one_row = [(d, t / (1.0 + share * (m - 1)), w) for m, d, t, w in points]
        n = sum(w for _, _, w in one_row)
        mean_d = sum(d * w for d, _, w in one_row) / n
        mean_t = sum(t * w for _, t, w in one_row) / n
        var = sum(w * (d - mean_d) ** 2 for d, _, w in one_row)
        if var > 0:
            per_level = max(sum(w * (d - mean_d) * (t - mean_t) for d, t, w in one_row) / var, 0.0)
            fixed = max(mean_t - per_level * mean_d, 0.0)
        elif self.seconds(one_row[0][0]) > 0:
            scale = mean_t / self.seconds(one_row[0][0])
            fixed, per_level = self.fixed * scale, self.per_level * scale
        else:
            fixed, per_level = mean_t, 0.0
        error = sum(w * ((fixed + per_level * d) / t - 1.0) ** 2 for d, t, w in one_row if t > 0)
        return fixed, per_level, error


@dataclass
class CostModel:
    """Seconds for a step's target side over n tokens (interpolated) and for a proposal of some depth.

    On a shared machine every cost rises and falls together with the other processes' load: one
    factor, `load`, tracks that (fast, from every step), and the curve and the proposal fit are kept
    in calibration units (slowly corrected for what the load does not explain). A busy spell
    measured while the batch ran at one token count then no longer makes that count look dearer
    than the others, and the choice of k (a ratio of costs) does not swing with the machine's load.
    """

    token_counts: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # at load 1
    start: tuple[list[int], list[float]] = field(default=((), ()), repr=False)  # the curve as built (SHAPE_BOUND)
    proposals: ProposalFit = field(default_factory=ProposalFit)  # the fit of the path in use (`use_path`) ...
    sampled_path: bool = False  # ... whether that is sampled proposals' ...
    paths: dict[bool, ProposalFit] = field(default_factory=dict, repr=False)  # ... and each path's once left
    catch_up_per_entry: float = 0.0  # at load 1: a catch-up's cost past the proposal's, per entry fed
    catch_up_samples: deque = field(default_factory=lambda: deque(maxlen=CATCH_UP_SAMPLES))
    # at load 1: the server's cost outside the engine per row and step, of a batch plain and of one
    # drafting (`observe_output`); the first sample sets both
    output_plain: float = 0.0
    output_drafting: float = 0.0
    output_seen: bool = False
    load: float = 1.0  # how much slower than at calibration the machine runs now
    last_n: int = 0  # the token count of the last measured step (0: none yet)
    # verify_at_calibration by token count, kept until the curve's points move: the policy looks
    # up a few dozen counts every step, and the curve moves only after a step at a new count
    curve: dict[int, float] = field(default_factory=dict, repr=False)
    measured: set[int] = field(default_factory=set, repr=False)  # counts whose point real steps set (`observe_shape`)
    rising_seconds: list[float] = field(default_factory=list, repr=False)  # `rising(...)` of the points, made with `curve`
    # token count -> its recent pairs (`observe_shape`): each the point it implies, by step number
    pairs: dict[int, RecentSteps] = field(default_factory=dict, repr=False)
    plain_steps: dict[int, RecentSteps] = field(default_factory=dict, repr=False)  # plain count -> settled plain steps, not anchors
    last_plain: dict[int, tuple[int, float]] = field(default_factory=dict, repr=False)  # plain count -> (step, seconds)
    last_at: dict[int, tuple[int, float, int]] = field(default_factory=dict, repr=False)  # count -> (step, seconds, plain)
    paired: set[int] = field(default_factory=set, repr=False)  # counts the latest settled plain step is paired with
    fresh_until: float = float("inf")  # the step after which a point of the curve as read goes stale (`fresh_weights`)
    steps: int = 0
    plain_run: int = 0  # plain steps in a row up to the last one (PLAIN_SETTLE)

    def __post_init__(self) -> None:
        if not self.start[0]:
            self.start = (list(self.token_counts), list(self.seconds))

    def bounded(self, n: int, seconds: float) -> float:
        """`seconds` for n tokens, kept within SHAPE_BOUND of the start-up curve's."""
        built = interpolate(*self.start, n)
        return min(max(seconds, built / SHAPE_BOUND), built * SHAPE_BOUND)

    def draft(self, depth: int, rows: int = 1) -> float:
        """A proposal of `depth` for `rows` drafting rows at the current load."""
        return self.load * self.proposals.seconds(depth, rows)

    def observe_draft(self, depth: int, seconds: float, rows: int = 1) -> None:
        self.proposals.observe(depth, seconds / self.load, rows)

    def use_path(self, sampled: bool) -> None:
        """Make the proposal fit in use the one of proposals with a sampled drafting row, or of
        greedy ones. A greedy batch's proposal is one native call; a sampled row draws each token
        from its q, which rejection sampling needs, in the drafter's Python (the draft model at
        batch 1: fixed 96 and 38 us a level greedy; one fit over both paths read 135 and 129
        after 8 sampled requests, and greedy drafting, priced at that, stayed paused, 0.96x the
        baseline where fixed k = 4 ran 1.13x). A path's first use starts from the fit in use,
        its samples its own."""
        if sampled == self.sampled_path:
            return
        self.paths[self.sampled_path] = self.proposals
        self.proposals = self.paths.get(sampled) or self.proposals.fork()
        self.sampled_path = sampled

    def observe_catch_up(self, entries: int, seconds: float, depth: int, rows: int = 1) -> None:
        """A proposal for `rows` that first fed `entries` beyond the drafting sequences' own (a
        resume, a newcomer's prompt): what it took past the fitted proposal of its depth, per
        entry; the median of recent ones (a preempted proposal does not move it)."""
        extra = seconds / self.load - self.proposals.seconds(depth, rows)
        self.catch_up_samples.append(max(extra, 0.0) / entries)
        self.catch_up_per_entry = statistics.median(self.catch_up_samples)

    def observe_output(self, seconds: float, drafting: bool = False) -> None:
        """What the server spends outside the engine on one row's output of one step (its response:
        built, sent to tritonserver; measured as the sender thread's CPU time, nothing for an output
        that shared a response: `Engine.note_responses`), averaged over recent ones, apart for a
        batch that drafts and one that does not. Every step pays it for every row, so a step that
        commits more tokens a row makes fewer of them: served at one user, where responses cost
        the stub 0.17-0.3 ms CPU a step beside a 0.6-1.1 ms engine step on the same two cores,
        EAGLE gained 1.44x the baseline while drafting, and an engine whose policy saw its step
        alone judged that a loss and paused. Apart, because what one regime's outputs cost says
        little of the other's: at 4 and 16 users plain steps' outputs pile up behind the sender and
        leave together (nothing charged), drafting steps' are longer and leave alone, and one
        average, taken mostly while drafting, priced plain steps at drafting's cost. Served, the
        draft model read 1.04-1.06x / 0.95-1.04x / 0.96-1.00x the baseline's tokens/s at 1 / 4 /
        16 users priced apart, 1.09x / 0.88-0.89x / 0.90-0.93x at one average (two load tests;
        reports/benchmarks-log.md, "The server's output charge, per regime")."""
        x = seconds / self.load
        if not self.output_seen:
            self.output_plain = self.output_drafting = x
            self.output_seen = True
        elif drafting:
            self.output_drafting += OUTPUT_RATE * (x - self.output_drafting)
        else:
            self.output_plain += OUTPUT_RATE * (x - self.output_plain)

    def observe_verify(self, n: int, seconds: float, plain: int = 0, anchor: bool = False) -> None:
        """Move the load towards a measured step and the curve's shape (`observe_shape`: pairs of
        steps and settled plain ones; `plain` tokens is a step of one token per row; 0: unknown); where
        that did not set n's point, after a step at another count, also move the curve's points
        around n towards what the load does not explain (ratios clipped to 0.5-2x). Steps at one
        count cannot tell a busy machine from a wrong curve: they move the load only. A plain step
        that is not settled yet (PLAIN_SETTLE) is neither: it still pays for the drafted ones
        before it, and moving the load it set the settled step after it 8% low. `anchor`: the step
        is one the policy ran plain to time it (`plain_lately`)."""
        self.plain_run = self.plain_run + 1 if n == plain else 0
        if n == plain and self.plain_run <= PLAIN_SETTLE:
            return
        ratio = min(max(seconds / self.verify(n), 0.5), 2.0)
        self.load *= 1 + LOAD_RATE * (ratio - 1)
        # a contrast: only a step at another count than the last tells shape from load; the plain
        # count (one token per row) is the anchor `observe_shape` measures the others against
        if not self.observe_shape(n, seconds, plain, anchor) and self.last_n and n != self.last_n and n != plain:
            i = bisect_left(self.token_counts, n)
            if i < len(self.token_counts) and self.token_counts[i] == n:
                points = [i]
            else:
                points = [j for j in (i - 1, i) if 0 <= j < len(self.token_counts)]
            for j in points:
                self.seconds[j] = self.bounded(self.token_counts[j], self.seconds[j] * (1 + VERIFY_RATE * (ratio - 1)))
            self.curve.clear()
        self.last_n = n

    def pass_plain(self) -> None:
        """A plain step not timed (`PLAIN_TIMED`), counted as `observe_verify` counts one: the plain
        run (PLAIN_SETTLE) and, once settled, the steps (PAIR_GAP, SHAPE_FRESH)."""
        self.plain_run += 1
        if self.plain_run > PLAIN_SETTLE:
            self.steps += 1

    def observe_shape(self, n: int, seconds: float, plain: int, anchor: bool = False) -> bool:
        """Set the curve's point at n from real steps: the median of its recent pairs, each a step
        at n and a settled plain step (`plain` tokens: one per row) at most PAIR_GAP steps apart,
        their ratio times the plain point; each step at n pairs once (with the settled plain step
        before it, else with the first after it), and each settled plain step once per count. A
        step that paired with every settled plain step after it gave up to 7 pairs, so 15 pairs
        were 2-3 steps' (a paused batch's probes): served at one user, EAGLE's 5-token point swung
        between 1.6x and 4.6x a plain step within 3000 steps where its steps' medians ran 2.1-2.6x.
        True while real steps own n's point (a contrast at n would be overwritten by the next
        pair). A pair's two steps ran on the machine as it was within a few steps, so its ratio
        needs no load: set against the load, which follows the curve that the steps set, the
        shape fed back on itself, and a batch drafting every step whose anchors stayed fresh (one
        in 2 * PROBE_EVERY) drove 5 tokens to the curve's bounds (1.0-3.6x a plain step where
        they cost 2x, a simulation of steady costs). Contrasts alone
        (above) move the shape 10% at a time against a load that tracks whichever count runs, and
        with switches as rare as probes it did not converge: EAGLE's curve said a 5-token step
        cost 1.49x a plain one where its steps showed 2.09x. The curve's lookups are made again
        only where a point moved by more than SHAPE_TOLERANCE or a point went stale
        (`fresh_weights`): made again whenever a median moved, they were made in 84% of prompt
        lookup's steps at batch 1 (now 30-50%)."""
        self.steps += 1
        if self.steps > self.fresh_until:
            self.curve.clear()
        near = self.steps - PAIR_GAP
        if n == plain:  # pairs with the latest step at each other count of this batch's not paired yet
            if not anchor:
                at_plain = self.plain_steps.get(plain)
                if at_plain is None:
                    at_plain = self.plain_steps[plain] = RecentSteps()
                at_plain.add(self.steps, seconds)
            self.last_plain[plain], self.paired = (self.steps, seconds), set()
            for m, (step, s, p) in list(self.last_at.items()):
                if p == plain and step >= near:
                    self.pair(m, s / seconds, plain)
                    del self.last_at[m]
            return False
        step, s = self.last_plain.get(plain, (-PAIR_GAP - 1, 0.0))
        if step >= near and n not in self.paired:
            self.pair(n, seconds / s, plain)
            self.last_at.pop(n, None)
        else:
            self.last_at[n] = (self.steps, seconds, plain)
        return n in self.measured

    def pair(self, n: int, ratio: float, plain: int) -> None:
        """One more pair for n (its step's seconds over the settled plain step's); sets n's point
        once SHAPE_SAMPLES fresh ones are in, and from then on moves it with every pair, fresh or
        not: the point is the median of n's latest SHAPE_SAMPLES pairs (how fresh they are is its
        weight, `fresh_weights`). Moved only while fresh, a point set in a busy spell stayed there
        once the policy paused: served at one user, EAGLE's 5-token point was set at 3.4-3.6x a
        plain step, its batch paused, and the probes' pairs (one in 16-128 steps, never 15 within
        SHAPE_FRESH) could not move it over 21000 steps, where its steps ran 2.1-2.6x a plain
        one (medians of a served run's steps and pairs) and fixed k = 4 served 1.09x the baseline.
        With both rules, served beside the old code on three fresh servers (`specdec loadtest --rev`):
        the draft model 1.02x-1.06x at one user and 0.99x-1.04x at 4, EAGLE 0.94x-1.08x, where the
        baseline's own twin read 0.92x-1.02x."""
        self.paired.add(n)
        at_n = self.pairs.get(n)
        if at_n is None:
            at_n = self.pairs[n] = RecentSteps()
        was_fresh = self.fresh(n)
        at_n.add(self.steps, self.verify_at_calibration(plain) * ratio)
        if not (self.fresh(n) or n in self.measured and len(at_n) == SHAPE_SAMPLES):
            return
        point = self.bounded(n, at_n.median())
        i = bisect_left(self.token_counts, n)
        if i < len(self.token_counts) and self.token_counts[i] == n:
            if abs(point / self.seconds[i] - 1.0) <= SHAPE_TOLERANCE and n in self.measured:
                if not was_fresh and self.fresh(n):  # its weight in the curve as read is back (`fresh_weights`)
                    self.curve.clear()
                return
            self.seconds[i] = point
        else:
            self.token_counts.insert(i, n)
            self.seconds.insert(i, point)
        self.measured.add(n)
        self.curve.clear()

    def fresh(self, n: int) -> bool:
        """Has n SHAPE_SAMPLES pairs, all within the last SHAPE_FRESH steps?"""
        at_n = self.pairs.get(n)
        return at_n is not None and len(at_n) == SHAPE_SAMPLES and at_n.oldest >= self.steps - SHAPE_FRESH

    def fresh_weights(self) -> list[float]:
        """Each point's weight in the curve as read (`rising`): for a point real steps set, how
        often its count ran lately (SHAPE_SAMPLES over the steps since the oldest of its recent
        ones), so where two points disagree the one timed more often and more recently prevails;
        next to nothing for start-up points and points no step refreshed within SHAPE_FRESH. Each
        measured point weighed 1 before: at batch 1, prompt lookup's 3- and 4-token steps (short
        matches) are rare, five of them timed in a busy spell set those points at 1.9-2.2x a plain
        step where the 5-token steps of every other round read 1.6x, the curve pooled all three
        at 1.75-3.2x, and the policy, pricing deep drafts that high, drafted 1-2 tokens in 45% of
        a run's steps. Also sets when the next point goes stale (`fresh_until`)."""
        fresh = self.steps - SHAPE_FRESH
        weights, self.fresh_until = [], float("inf")
        for c in self.token_counts:
            if c not in self.measured:
                weights.append(1e-9)
            elif c not in self.pairs:  # set without steps (`measured` given): no age to weigh by
                weights.append(1.0)
            elif (oldest := self.pairs[c].oldest) < fresh:
                weights.append(1e-9)
            else:
                weights.append(SHAPE_SAMPLES / (self.steps - oldest + 1))
                self.fresh_until = min(self.fresh_until, oldest + SHAPE_FRESH)
        return weights

    def plain_lately(self, plain: int, within: int) -> bool:
        """Has a settled plain step (`plain` tokens: one per row) come of itself, not as an anchor,
        within the last `within` steps, with SHAPE_SAMPLES of them recent? Then `observe_shape` has
        its pairs without the policy's anchors: a prompt-lookup row whose suffix matched nothing
        earlier ran a quarter of its steps plain (at batch 1, fixed k = 4, in runs of 2.7), and an
        anchor every 2 * PROBE_EVERY steps cost it 3% of its steps as plain ones besides. Counted
        as coming of themselves, the anchors skipped every other anchor of a batch drafting every
        step, and its pairs went stale."""
        at_plain = self.plain_steps.get(plain)
        return at_plain is not None and len(at_plain) == SHAPE_SAMPLES and at_plain.newest > self.steps - within

    def verify(self, n: int) -> float:
        return self.load * self.verify_at_calibration(n)

    def verify_at_calibration(self, n: int) -> float:
        seconds = self.curve.get(n)
        if seconds is None:
            if not self.curve:  # the points moved since the last lookup
                self.rising_seconds = rising(self.seconds, self.fresh_weights())
            seconds = self.curve[n] = interpolate(self.token_counts, self.rising_seconds, n)
        return seconds

    @classmethod
    def measure(cls, forward: Callable[[int], None], max_tokens: int, repeats: int = 5) -> "CostModel":
        counts = doubling_counts(max_tokens)
        for n in counts:
            forward(n)  # warm-up
        # rounds over every count, the fastest of each count's repeats kept: a busy spell then slows
        # one round of every count alike, where timing one count's repeats back to back let a spell
        # as long as them raise that count alone. Six models of a repository calibrating at once on
        # two cores (tritonserver loads them in parallel) made 5 tokens look 3.6-4.7x the cost of 1
        # (1.5x on a quiet machine): the draft model and EAGLE then drafted in 29 and 6 of ~5600
        # steps of a served load matrix, where fixed k = 4 gains 1.5x, and, speculation off, no
        # real step at 5 tokens came along to correct the curve
        seconds = [float("inf")] * len(counts)
        for _ in range(repeats):
            for i, n in enumerate(counts):
                t0 = time.perf_counter()
                forward(n)
                seconds[i] = min(seconds[i], time.perf_counter() - t0)
        for i in reversed(range(len(seconds) - 1)):  # more tokens never cost less: timer noise is
            seconds[i] = min(seconds[i], seconds[i + 1])  # upward (preemption), so cap, don't carry up
        # until proposals are timed: a one-row proposer step costs a tenth of a one-token target step
        return cls(counts, seconds, proposals=ProposalFit(0.1 * seconds[0], 0.1 * seconds[0]))


def doubling_counts(max_tokens: int) -> list[int]:
    """The token counts a curve is timed at: 1, 2, 4, ... and `max_tokens` itself."""
    counts = [1]
    while counts[-1] < max_tokens:
        counts.append(min(counts[-1] * 2, max_tokens))
    return counts


def interpolate(counts: list[int], seconds: list[float], n: int) -> float:
    """A curve's seconds at n tokens: linear between its points, proportional past the last."""
    i = bisect_left(counts, n)
    if i == 0:
        return seconds[0]
    if i == len(counts):
        return seconds[-1] * n / counts[-1]
    n0, n1 = counts[i - 1], counts[i]
    s0, s1 = seconds[i - 1], seconds[i]
    return s0 + (s1 - s0) * (n - n0) / (n1 - n0)


def rising(seconds: list[float], weights: list[float]) -> list[float]:
    """The curve's points as read: the closest non-decreasing sequence (weighted pooled adjacent
    violators), since more tokens never cost less; points real steps set weigh 1, the others
    (start-up points, nudged by contrasts) next to nothing, so they yield where they disagree.
    The points real steps set between the start-up counts (batches with some rows drafting) each
    come from medians of 5 steps, and at batch 8 read 14 tokens 5.2 ms, 16 4.2, 17 6.3, 25 7.7,
    32 6.1: the policy's picks followed the dips, drafting for 2-4 of 8 rows where every row
    drafting committed the most."""
    blocks: list[list[float]] = []  # [weighted sum, weight, points] of pooled points
    for t, w in zip(seconds, weights):
        blocks.append([t * w, w, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, weight, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += weight
            blocks[-1][2] += count
    return [total / weight for total, weight, count in blocks for _ in range(count)]


def consistent(points: list[tuple[int, float, int]]) -> list[tuple[int, float, int]]:
    """(depth, median seconds, samples) of proposals, each median lowered where it disagrees with
    another depth's under the fit's own model (fixed >= 0 plus per level >= 0): a deeper proposal
    costs at least a shallower one and at most depth / depth' times it. Preemption only adds
    time, so the lower side is believed. Three proposals at depth 4 preempted in a row at a busy
    start (three engines starting together on two cores) set depth 4 at 2.8 ms a level where a
    level costs about 0.15 ms; the paused policy's probes then timed depth 2 only, and depth 4's
    medians, never timed again, kept the draft model off for the whole run."""
    seconds = {d: t for d, t, _ in points}
    for _ in range(len(points)):  # every bound only lowers a median, by a factor >= 1: a few passes settle
        lowered = {d: min([t] + [seconds[e] * d / e for e in seconds if 0 < e < d] + [seconds[e] for e in seconds if e > d])
                   for d, t in seconds.items()}
        if lowered == seconds:
            break
        seconds = lowered
    return [(d, seconds[d], w) for d, _, w in points]
