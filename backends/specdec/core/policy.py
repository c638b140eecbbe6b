"""How many tokens to draft this step, per sequence: fixed, or adaptive to acceptance and batch load.

Adaptive: the policy keeps, per slot, two estimates of its sequence's acceptance: alpha, of a
draft's first token, and beta, of each later token given the one before it was accepted; each
the MLE accepted / (accepted + rejections) over its recent rounds (counts decay 30% per round) plus
a prior of PRIOR_TRIALS pseudo-trials at the engine-wide estimate. (An average of per-round
ratios, used before, let one fully rejected round after ten accepted ones switch a sequence off.)
A draft of depth d then commits on average 1 + alpha (1 - beta^d) / (1 - beta) tokens. One
geometric alpha for every position, used before, under-rated drafts that are right or wrong as a
whole: prompt lookup's first tokens were accepted 0.79-0.84 of the time, each next one 0.90-0.99,
and an alpha fitted on the 1-2 token drafts it then picked kept it there (adaptive 1.28x against
fixed k = 4's 1.46x at batch 1).
The engine hands the policy one StepRecord per decode step; what a step costs, the target's forward
over its tokens and the proposer's, is `cost_model.CostModel`'s estimate. Model drafters keep the
sequences the policy paused in sync whenever they run (in the same batched catch-up forward) while a
sequence's backlog is short (`proposers.base.catch_up_rows`), so it resumes without feeding its
pause; after a longer pause, and for a newcomer's prompt, the first proposal does catch up. That is
not a sample of the proposal cost (counting it made every pause longer than the last): it is fitted
on its own, as seconds per caught-up entry, and a sequence's resume is charged its drafter's backlog
at that rate, spread over the steps it has left (`catch_up_charges`). For each candidate k the
policy adds sequences best acceptance first and keeps the k and the set of drafting sequences that
maximize committed tokens per second over the batch: at high load, where verify time grows with
every extra token, k falls and the sequences that accept least stop drafting, down to none
(speculation off for the batch). A sequence whose alpha collapses gets k = 0 on its own; its alpha
then drifts back towards the engine-wide acceptance, so it is retried later. New sequences start at
the engine-wide acceptance of their path, greedy or sampled (acceptance is mostly a property of the
proposer and the workload), so a well-measured proposer is not switched off for every newcomer (a
probe narrowed to the best-accepting sequence is that sequence's evidence only: it samples the best,
not a newcomer's expectation). Seeded sampled requests keep their cap (the request's
num_draft_tokens; none where it asks none): their random numbers are drawn per draft position, so
only a fixed schedule makes a seed reproduce under load, and a fixed draft length the policy cannot
pause may lose. Where the fitted model rates drafting above what it realizes, `rate_guard.RateGuard`
vetoes it from timed steps alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import ceil
from typing import Callable

from specdec.core.cost_model import PAIR_GAP, PLAIN_SETTLE, CostModel
from specdec.core.proposers.base import CATCH_UP_WINDOW
from specdec.core.rate_guard import RateGuard
from specdec.core.sequence import Sequence

PRIOR_ALPHA = 0.6
PRIOR_TRIALS = 2.0  # weight of the engine-wide acceptance in each sequence's estimate
DECAY = 0.7  # per round, on a sequence's counts (also in rounds without a draft: the prior regains weight).
# A sequence's acceptance moves within a request (a run of boilerplate, then a hard line), so its
# last few rounds predict its next one best: replayed by `tools.acceptance_fit` (k = 4, batch 8,
# 16 prompts), the tokens a round accepts were predicted 10% (draft model), 17% (prompt lookup)
# and 7% (EAGLE) too low at 0.95, kept before, and 5.5%, 4% and 5% at 0.7, with a lower error
# (rms 1.26 -> 1.19, 1.46 -> 1.35, 1.14 -> 1.07 tokens). Under-predicted, adaptive batches of 8
# drafted for subsets of their rows and trailed fixed k = 4 (draft model 1.12x against 1.29x, prompt
# lookup 0.95x against 1.21x; 1.24x and 1.12x at 0.7, one interleaved run)
ENGINE_DECAY = 0.925  # per drafting round of any sequence, on the engine-wide acceptance's
# counts (the last ~13 rounds weigh) and on its start-up prior's PRIOR_TRIALS at PRIOR_ALPHA. An
# EMA of per-round samples with this weight, kept before, started at PRIOR_ALPHA with the weight of
# 13 rounds: a paused draft model probed once in 16-128 steps at batch 1 moved it 7.5% a probe,
# and adaptive stayed off (1.03x) where fixed k = 4 ran 1.21x the baseline. A prior that kept its
# weight beside counts capped at ~13 rounds kept 13% of it for good: replayed (`tools.acceptance_fit`),
# the engine-wide estimate predicted 6.4-9.0% too few accepted tokens per round (draft model, prompt
# lookup, EAGLE; batch 1 and 8), each sequence's, drawn towards it, 1.4-5.5% too few; decaying
# with the counts, -1.9% to +0.5% and +1.0% to -3.2%. The same decay also runs once per
# PROBE_EVERY steps in which no sequence drafted (`EngineWide.age`), down to PRIOR_TRIALS of
# evidence: while a batch is paused only probes add rounds, one in hundreds or thousands of steps,
# and per round alone the counts kept a hard stretch's acceptances for thousands of steps after it.
# In the policy's simulation of a draft model at batch 1 (tests/test_policy.py, `draft_model_rate`),
# 400 steps accepting half as often at 1.5x the drafting cost, then the easy prompts again: per
# round alone, 20 of 24 seeds stayed paused over 1000 steps after it (median 1700), the 3000 steps
# after it at 0.918x fixed k = 4's rate; aged so, 11 of 24 (median 670), 0.980x (the rest is the
# probes' spacing: PROBE_BUDGET put them 500-1900 steps apart there, each catching the drafter up on
# up to 256 tokens)
COLLAPSE_ALPHA = 0.15
POLICY_RATE = 0.05  # how far one drafting step moves the policy's mean time a drafting step
PROBE_EVERY = 16  # every this many steps, one step drafts every sequence one candidate k deeper
# than the policy's pick: it measures the acceptance of sequences that stopped, and the verify and
# proposal costs just beyond the pick, which the policy otherwise only guesses (so a cost or an
# acceptance under-estimated once can be corrected). Not scaled by the batch: at 16 x 8 steps a
# batch of 8 that switched off after its first unlucky rounds never probed within 128 tokens and
# stayed off where drafting would have paid 1.28x (draft model, demo kit); a probe one candidate
# deeper costs a few percent of one step in sixteen. While the batch drafts, every other probe runs
# it plain instead, an anchor: the curve's points are set against plain steps (`observe_shape`),
# and a batch drafting at every step never measured one; at batch 8 the draft model's curve put
# 8 x 2 tokens at 1.17x a plain step where they ran 1.47x, and it drafted at a loss (0.87x). (Not
# where plain steps come anyway, `CostModel.plain_lately`.)
DRAFTING_FLOOR = 0.8  # where the rate guard saw drafting pay (`RateGuard.paid`), the policy drafts
# (its best drafting pick) while its model rates that at least this share of the plain rate: the
# model's ratio is noisy where the real one sits near 1.1-1.2, and each pause costs more than its
# plain steps (the drafter's catch-up to resume, a probe to find out). At batch 1 the draft model
# (fixed k = 4: 1.16x the baseline) read 0.6-0.8 for a sequence's acceptance after one rejected
# first token (the next rounds accepted nearly as much as any), and in some runs 5 tokens at
# 3.2-3.4x a plain step where its steps took 2.5-2.8x; it paused every few steps, for good once no
# step came to correct the curve, and adaptive ran 0.99x the baseline. Drafting so is still
# drafting to the guard, which vetoes it all where it loses. Below 0.8 the model is rarely that
# wrong: prompt lookup after a miss reads 0.3-0.5, and accepts 0.8 tokens
GUARD_SETTLE = 4  # plain steps a plain step must follow to be the rate guard's plain sample. Served,
# a drafting step's responses (one an output: a drafting batch's sender keeps up) still compete
# with the plain steps after it, where a batch plain for a while sends fewer, coalesced ones: in
# one process with a sender that builds each response holding the GIL (120 us) and a CPU-bound
# process beside it, at 16 users the plain steps after fixed k = 3 at batch 8 took 1.27x, 1.23x,
# 1.18x, 1.10x, 1.06x and 1.05x a baseline engine's plain step. The guard, comparing with the third,
# saw the draft model drafting at 1.16x its plain rate where it ran 0.81x the baseline's (served,
# 16 users, 0.79x the baseline's tokens/s). The earlier plain steps are drafting's cost.
GUARD_ANCHOR_SAMPLES = 4  # ... so while the guard holds too few of them for a batch size, a drafting
# batch's anchor runs on until it has this many (`RateGuard.wants_plain`)
MAX_PROBE_GAP = 128  # while speculation is off for the whole batch, each probe that finds it
# still off doubles the gap to the next, up to this: a paused model drafter's first proposal
# catches up on every pair since its last (EAGLE-2 at batch 8: about two steps' worth), which
# every 16 steps cost 0.90x of the baseline where speculation never pays.
LONGEST_PROBE_GAP = 4096  # ... and past that, up to this, as far as a probe drafting one sequence
# needs to stay within PROBE_BUDGET: at batch 1 a probe cannot be narrowed, and EAGLE's first
# proposal after a pause catches its head up on the whole prompt and output so far (6-14 ms over
# 100-200 pairs, eager, against a 0.45-0.6 ms step): every 128 steps that was 13% of the run, and
# with the native step (0.25 ms) every 1024 steps still 4-6% (10-22 ms a probe).
PAUSED_RECHECK = 8  # while speculation is off for the batch, `best` searches again after this
# many steps, or for a new batch (no row of the last search's left), or after a step that drafted
# (a probe): in between only the sequences' acceptances move, drifting towards the engine-wide one
# at DECAY per round (their own evidence is 0.7^8 = 6% of what it was after 8), and the search
# every step was 5% of a 0.45 ms step at batch 1. Each search that finds the same batch still off
# doubles the gap to the next, up to PAUSED_RECHECK_MAX (nothing it reads moves until a probe
# drafts): every 8 steps the searches of a paused batch of one were still 1% of a 0.25 ms step. A
# row that joins or leaves a paused batch keeps its schedule: a newcomer starts at the engine-wide
# acceptance the paused rows drift to, and owes its drafter a catch-up on its prompt. Searched at
# each such change (every few steps with users' requests coming and going), the policy took 22-31
# us of a 0.5-0.65 ms step at 3 and 4 users in-process against the baseline's 6; 11-18 so
# (reports/engine-log.md, "A paused batch keeps its schedule when a row joins or leaves")
PAUSED_RECHECK_MAX = 64
PLAIN_TIMED = 16  # of a paused batch's plain steps observed together (`observe_unobserved`), only
# the last this many are timed (and any within PAIR_GAP + PLAIN_SETTLE steps of a drafted one, a
# probe's pairs); the others are counted. What their times move keeps the latest few: the load
# (LOAD_RATE: 0.8^16, 3% of it, is older), the plain point (SHAPE_SAMPLES), the guard's plain rate
# (fewer samples, over the same window). Timed, each was 2.5 us warm, ~4.5 in the engine: 2% of a
# paused EAGLE's 0.21 ms step at batch 1, where the whole policy cost it 4%
DRAFTING_RECHECK = 4  # while the same batch drafts, `best` searches again after this many steps (or
# when the batch changes, or a probe or anchor is due); the steps in between keep its pick and are
# observed together at the next search. Searched and observed at every step, each right after a
# target forward had evicted the caches, the policy took 58-65 us of a 0.6 ms prompt-lookup step
# at batch 1 (fixed k: 6), ~10%; every 4 steps, 35-38 us (every 8, 33: most of what is left is
# each step's own observation). A rejection waits up to 3 steps to lower the k it was picked at
CATCH_UP_MIN_ENTRIES = 16  # a catch-up of fewer entries beyond the steady ones is not timed: the
# proposal's own jitter (tens of microseconds) would dominate its per-entry cost
PROBE_BUDGET = 0.015  # a probe while speculation is off catches the probed rows' drafter up on
# everything since the last probe (at most `proposers.base.CATCH_UP_WINDOW` tokens a row: before
# that bound its cost grew with the gap, and backing off did not shrink it per step on long
# outputs). When the last such probe, scaled to every row and spread over the steps it covered,
# cost more than this share of a step, or this one's catch-up would (`catch_up_over_budget`), it
# drafts only the best-accepting sequence (one row's backlog): EAGLE's two-layer head at batch 8
# spent 17-31 ms per all-row probe (about a third of every step it covered); the small draft
# model's probes stay within budget, and drafting every row is how a batch of 8 learns that
# drafting pays (1.14-1.29x for the draft model). At a
# 10% budget, adaptive EAGLE and EAGLE-2 batches of 8 that drafted only in probes ran at 0.91-0.96x
# of the baseline (`specdec bench`, three runs); at 3% EAGLE's ran 1.06x faster than at 10%
# (forward_ab, 8 rounds), the draft model's 1.03x, Medusa's and EAGLE-2's the same. With the
# native step a paused method's other costs (policy, bookkeeping) are 2-3% of a step, and a
# method may cost at most 5% (the bench's never-lose target): probes get 1.5%.


def expected_tokens(alpha: float, depth: int, beta: float | None = None) -> float:
    """Tokens a draft of `depth` commits on average, the bonus token included: its first token is
    accepted with probability alpha, each later one, the one before it accepted, with beta
    (default alpha: the geometric model)."""
    beta = alpha if beta is None else beta
    later = float(depth) if beta >= 0.999 else (1 - beta**depth) / (1 - beta)
    return 1.0 + alpha * later


def is_pinned(seq: Sequence) -> bool:
    """A seeded sampled request draws its random numbers per draft position, so its output depends
    on its k schedule: it keeps its cap, and reproduces whatever the load. Under the adaptive
    policy that cap is 0 unless the request asks a `num_draft_tokens` (`Policy.cap`): pinned at the
    model's k = 4 whatever drafting paid, seeded requests at temperature 1 served at 0.49x-0.78x
    the baseline's tokens/s (`specdec loadtest --sampling t1.0`, which seeds every request; every
    method, 1 and 4 users), where the policy keeps unseeded ones at 0.93x-0.96x or above."""
    return seq.params.seed is not None and not seq.params.greedy


def drafting_ks(caps: list[int], pinned: list[bool], k: int, rows: set[int]) -> list[int]:
    """Each sequence's draft length: a pinned one (`is_pinned`) its cap, one of `rows` k within its
    cap, the others none. The one place a choice becomes the step's ks."""
    return [c if p else min(k, c) if i in rows else 0 for i, (c, p) in enumerate(zip(caps, pinned))]


def estimate(accepted: float, rejected: float, prior: float, trials: float = PRIOR_TRIALS) -> float:
    """An acceptance from (decayed) counts of trials, with `trials` pseudo-trials at `prior`."""
    return (accepted + trials * prior) / (accepted + rejected + trials)


@dataclass
class SlotState:
    """The policy's knowledge of one running sequence (and, as `EngineWide.state`, of all of them)."""

    acceptance: float  # alpha: estimated acceptance of a draft's first token
    later: float  # beta: of each later token, the one before it accepted
    accepted_n: float = 0.0  # alpha's evidence: accepted and rejected first tokens, decayed per round
    rejected_n: float = 0.0
    later_accepted_n: float = 0.0  # beta's: accepted later tokens, and rejections among them
    later_rejected_n: float = 0.0
    sampled: bool = False  # a sampled sequence's (its engine-wide prior is sampled sequences', `Policy.wide`)

    def decay(self, decay: float, rounds: int = 1) -> None:
        """Decay the evidence by `decay` once per round."""
        for _ in range(rounds):
            self.accepted_n *= decay
            self.rejected_n *= decay
            self.later_accepted_n *= decay
            self.later_rejected_n *= decay

    def count(self, decay: float, depth_drafted: int, accepted: int) -> None:
        """Decay the evidence, then add a round's trials: a draft's first token is a trial of
        alpha; the later ones, once it was accepted, of beta (no trials: it did not draft)."""
        self.decay(decay)
        if depth_drafted > 0:
            first = 1.0 if accepted else 0.0
            self.accepted_n += first
            self.rejected_n += 1.0 - first
            if accepted and depth_drafted > 1:
                self.later_accepted_n += accepted - 1
                self.later_rejected_n += 0 if accepted >= depth_drafted else 1


@dataclass
class EngineWide:
    """The acceptances of recent drafting rounds over all sequences of one path, greedy or sampled
    (`Policy.wide`): a newcomer's start, and every sequence's prior. Decayed counts (ENGINE_DECAY
    a round, and while nothing drafts once per PROBE_EVERY steps: `age`) with the start-up prior's
    PRIOR_TRIALS at PRIOR_ALPHA fading with them."""

    state: SlotState = field(default_factory=lambda: SlotState(PRIOR_ALPHA, PRIOR_ALPHA))
    prior: float = PRIOR_TRIALS  # the weight of PRIOR_ALPHA in the estimates, decaying with the counts
    drafted_at: int = 0  # the step of the latest round counted (`age`)

    def count(self, depth_drafted: int, accepted: int) -> None:
        """A drafting round of any sequence of this path."""
        self.state.count(ENGINE_DECAY, depth_drafted, accepted)
        self.estimate(ENGINE_DECAY)

    def age(self, number: int) -> None:
        """Before step `number`'s rounds: decay the evidence once per PROBE_EVERY steps since the
        latest round beyond the next (ENGINE_DECAY, as a round would), keeping at least PRIOR_TRIALS
        of it, so that evidence that old weighs what a probe's rounds weigh against it, and one
        probe moves the estimate by about a third at most."""
        idle = number - self.drafted_at - 1
        self.drafted_at = number
        if idle <= 0:
            return
        st = self.state
        weight = st.accepted_n + st.rejected_n + self.prior
        decay = max(ENGINE_DECAY ** (idle / PROBE_EVERY), min(PRIOR_TRIALS / weight, 1.0))
        st.decay(decay)
        self.estimate(decay)

    def estimate(self, decay: float) -> None:
        """The acceptances from their evidence, once its counts were decayed by `decay`: the
        start-up prior fades with them."""
        st = self.state
        # floored: after ~9000 rounds it would underflow to 0, and beta's estimate, where no
        # round drafted past one token, to 0 / 0
        self.prior = max(self.prior * decay, 1e-3 * PRIOR_TRIALS)
        st.acceptance = estimate(st.accepted_n, st.rejected_n, PRIOR_ALPHA, self.prior)
        st.later = estimate(st.later_accepted_n, st.later_rejected_n, PRIOR_ALPHA, self.prior)


@dataclass
class StepRecord:
    """What one decode step did: everything the policy learns from, handed over once per step."""

    seqs: list[Sequence]
    ks: list[int]  # draft lengths the policy chose
    depths: list[int]  # how deep each sequence's draft reached (0: none)
    accepted: list[int]  # accepted draft tokens per sequence
    backlogs: list[int]  # entries the drafter fed for each drafting sequence before drafting (0: did not draft)
    propose_seconds: float = 0.0
    depth: int = 0  # the deepest draft of the step: what the proposal's time grows with
    step_seconds: float = 0.0  # the rest of the step: inputs, target forward, verify, compact, output,
    # and the engine's loop since the step before (`Engine.loop_seconds`): every step pays it, so a step
    # that commits more tokens pays it less often. Left out, a plain step at batch 1 read ~8 us (5%)
    # cheaper than it ran against a drafting one, and the draft model, 1.11x the baseline at fixed k = 4,
    # drafted in fewer steps (adaptive 1.03x)
    tokens: int = 0  # tokens the target ran: each row's root and draft (the native decoder skips padding)
    policy_seconds: float = 0.0  # the adaptive policy's own time: this step's choice and its observation
    # of the step before. Drafting pays it where a paused batch does not (its search runs every step
    # and its observation walks every drafting row): at batch 8 under arrivals, 0.14-0.16 ms a
    # drafting step of ~2.4 ms against ~0.02 ms a plain one, which neither the proposal's time nor the
    # step's held: prompt lookup at 16 users in-process drafted at 0.94x its own plain rate, which
    # the guard, timing without it, read as 0.99x (within GUARD_RATIO), and the engine ran 0.96x the
    # baseline. It counts with the proposal's time (`proposal_seconds`).

    @classmethod
    def plain_step(cls, seqs: list[Sequence], step_seconds: float, proposal_seconds: float) -> "StepRecord":
        """The record of a step no sequence drafted in (a coasting paused batch's, `Policy.coasted`);
        `proposal_seconds`: its draft phase's and the policy's time, as `proposal_seconds` reads."""
        zeros = [0] * len(seqs)
        return cls(seqs, zeros, zeros, zeros, zeros, step_seconds=step_seconds, tokens=len(seqs),
                   policy_seconds=proposal_seconds)

    @property
    def plain(self) -> bool:
        """No sequence drafted, nor was asked to (a prompt-lookup row that found no match was)."""
        return self.tokens == len(self.seqs) and not any(self.ks)

    @property
    def proposal_seconds(self) -> float:
        """What drafting cost this step beyond the target's step: the proposal and the policy's own time."""
        return self.propose_seconds + self.policy_seconds


class Policy:
    def __init__(
        self, max_k: int, adaptive: bool, depth_for: Callable[[int], int],
        backlog: Callable[[Sequence], int] | None = None,
    ) -> None:
        self.max_k, self.adaptive = max_k, adaptive
        self.depth_of = [depth_for(k) for k in range(max_k + 1)]  # the draft depth of each k
        self.backlog = backlog or (lambda seq: 0)  # the proposer's: what a sequence's resume feeds first
        self.steady = self.depth_of[-1] + 1  # what a drafting sequence's proposal feeds: accepted + bonus
        self.cost: CostModel | None = None
        # engine-wide acceptances, of greedy sequences and of sampled ones (False, True): a greedy
        # draft is accepted where it matches the target's argmax, a sampled one by rejection
        # sampling (the draft model at batch 1: alpha 0.99 greedy, 0.75-0.8 sampled at temperature 1),
        # and a paused greedy newcomer after sampled requests started at theirs
        self.wide = {False: EngineWide(), True: EngineWide()}
        self.sampled_seen = False  # a sampled sequence was admitted: until then every path is greedy, unasked
        self.steps = 0
        self.probe_gap = self.next_probe = PROBE_EVERY
        self.probes = 0
        self.probing_off = 0  # steps covered by the probe now running while speculation is off (0: none)
        self.narrow_probes = False  # the last such probe cost more than PROBE_BUDGET: probe one sequence
        # when to search again, for which slots, and their ks meanwhile (a paused batch's gap doubles)
        self.recheck_at, self.recheck_gap, self.kept_batch, self.kept_ks = 0, PAUSED_RECHECK, [], []
        self.affordable_gap = 0.0  # steps over which a one-sequence probe, as the last one cost, fits PROBE_BUDGET
        # (slots, k): a paused batch's probe that caught its rows up drafts them again the next step,
        # in sync, so that a paused method's proposal cost is timed too (the probe's own time is a
        # catch-up's): priors that over-rate it (a start-up timing under contention) then correct
        # themselves as under-rating ones always did, by drafting
        self.follow_up: tuple[set[int], int] | None = None
        # this step (and its follow-up) is a probe of the best-accepting sequence alone: its round
        # is that sequence's evidence, not the engine-wide acceptances' (`observe_round`)
        self.best_only = False
        self.anchor_left = 0  # plain steps an anchor has still to run (PLAIN_SETTLE, GUARD_SETTLE)
        self.anchoring = False  # this step is an anchor's: its plain rounds are a timing, not the sequences' choice
        self.slots: dict[int, SlotState] = {}
        self.guard = RateGuard()  # vetoes drafting for a batch size whose drafting steps realized less than its plain ones
        self.drafting_regime = False  # the last search drafted (and was not vetoed)
        # the policy's own time a drafting step, averaged (POLICY_RATE): a proposal's cost with it. A
        # drafting batch searches once in DRAFTING_RECHECK steps, and the medians the proposal fit
        # takes (`CostModel.observe_draft`) would see only the steps without a search
        self.drafting_policy = 0.0
        # `best`'s best drafting pick: k, its rows, its rate over the plain one's (`DRAFTING_FLOOR`)
        self.best_drafting: tuple[int, list[int], float] = (0, [], 0.0)
        # what the coming step is a sample of for the guard: drafting's regime (True), a paused
        # batch's (False), or neither (None: a paused batch's probe and its follow-up)
        self.regime: bool | None = False
        # `choose` handed the batch its last pick without a search (a paused batch: nothing it reads
        # has moved; a drafting one: DRAFTING_RECHECK): the steps that follow are observed together,
        # in order, at the next call that reads or moves what they move (`observe_unobserved`).
        # Observed one by one, each right after a target forward had evicted the caches, a paused
        # batch's plain steps cost 13.7 us of a 0.39 ms plain step at batch 1 (warm, in a run,
        # 4.9 us): most of what a paused method paid beyond the baseline
        self.coasting = False
        self.unobserved: list[tuple[int, StepRecord]] = []  # a drafting batch's: (the policy's step number, the step)
        # a paused batch whose rows all run plain coasts cheaper still: `choose` hands it its ks for
        # `coast_left` more steps without a check (until a search or probe is due, an admission or
        # release changes the batch, or a step drafts), and its plain steps are kept as numbers,
        # not StepRecords (`observe_coasting`): (step number, sequences, step seconds, proposal
        # seconds). At batch 1 a paused EAGLE then ran 1.02x as fast, Medusa 1.01x
        # (reports/benchmarks-log.md, "A paused batch coasts without its checks")
        self.coasting_plain = False
        self.coast_left = 0
        self.coasted: list[tuple[int, list[Sequence], float, float]] = []
        self.drafted_at = 0  # the number of the last step observed that was not plain (PLAIN_TIMED)
        # slot -> (the last unobserved step then, state) of a sequence released with steps of it unobserved
        self.leaving: dict[int, tuple[int, SlotState]] = {}
        self.candidates = sorted({0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, max_k} & set(range(max_k + 1)))

    def cap(self, seq: Sequence) -> int:
        """The most a sequence may draft a step: its request's `num_draft_tokens`, else the model's
        k; under the adaptive policy a seeded sampled request that did not ask drafts none
        (`is_pinned`: it keeps its cap, and the policy cannot pause it where drafting loses)."""
        k = seq.params.num_draft_tokens
        if k is None and self.adaptive and is_pinned(seq):
            return 0
        return self.max_k if k is None else min(k, self.max_k)

    def ks_of(self, seqs: list[Sequence], k: int, rows: set[int]) -> list[int]:
        """`drafting_ks` for these sequences' caps and pins: where `choose` has not read them already."""
        return drafting_ks([self.cap(s) for s in seqs], [is_pinned(s) for s in seqs], k, rows)

    @property
    def alpha(self) -> float:
        """The engine-wide acceptance of a greedy draft's first token: a greedy newcomer's, and
        every greedy sequence's prior (a sampled one's: `wide[True]`)."""
        return self.wide[False].state.acceptance

    @property
    def beta(self) -> float:
        """The engine-wide acceptance of a later draft token, the one before it accepted."""
        return self.wide[False].state.later

    def acceptance(self, seq: Sequence) -> float:
        return self.slots[seq.slot].acceptance

    def later_acceptance(self, seq: Sequence) -> float:
        return self.slots[seq.slot].later

    def choose(self, seqs: list[Sequence]) -> list[int]:
        if self.coast_left and len(seqs) == len(self.kept_batch):  # `coasting_plain`: nothing below has moved
            self.coast_left -= 1
            self.steps += 1
            return self.kept_ks.copy()
        self.coasting = self.coasting_plain = False
        self.coast_left = 0
        if not self.adaptive or self.cost is None or self.max_k == 0:
            return [self.cap(s) for s in seqs]
        self.steps += 1
        self.regime = self.drafting_regime
        if self.follow_up is not None:
            slots, probe = self.follow_up
            self.follow_up = None
            self.regime = None
            return self.ks_of(seqs, probe, {i for i, s in enumerate(seqs) if s.slot in slots})
        self.best_only = False
        self.anchoring = self.anchor_left > 0
        if self.anchor_left:  # an anchor runs on until its last plain step is settled (PLAIN_SETTLE, GUARD_SETTLE)
            self.anchor_left -= 1
            return self.ks_of(seqs, 0, set())
        batch = [s.slot for s in seqs]
        kept = self.steps < self.recheck_at and batch == self.kept_batch
        if (not kept and self.steps < self.recheck_at and not self.drafting_regime
                and not set(batch).isdisjoint(self.kept_batch)):  # a paused batch a row joined or left
            kept, self.kept_batch = True, batch  # keeps its schedule (PAUSED_RECHECK)
            self.kept_ks = self.ks_of(seqs, 0, set())
        if kept and self.steps < self.next_probe:  # the same batch, not due for a search
            self.coasting = True
            if not self.drafting_regime and not any(self.kept_ks):
                self.coasting_plain = True
                self.coast_left = min(self.recheck_at, self.next_probe) - self.steps - 1
            return self.kept_ks.copy()
        paused = kept and not self.drafting_regime
        # (steps are left unobserved only after this return or a drafting search's, below: a
        # follow-up or an anchor, above, follows a probe, which never coasts)
        self.observe_unobserved()
        key = self.batch_key(seqs)
        self.cost.use_path(key[1])
        caps = [self.cap(s) for s in seqs]
        states = [self.slots[slot] for slot in batch]
        alphas = [st.acceptance for st in states]
        betas = [st.later for st in states]
        pinned = [is_pinned(s) for s in seqs]
        if paused:
            k, drafting = 0, set()
        else:
            k, drafting = self.best(caps, alphas, betas, pinned, self.catch_up_charges(seqs, caps, alphas, betas))
            if drafting and self.guard.vetoed(key, self.steps):
                k, drafting = 0, set()
            elif not drafting and self.best_drafting[2] >= DRAFTING_FLOOR and (
                    self.guard.paid(key, self.steps) or self.guard.retrial_due(key, self.steps)):
                k, drafting = self.best_drafting[0], set(self.best_drafting[1])
            same = batch == self.kept_batch and not self.drafting_regime
            self.regime = self.drafting_regime = bool(drafting)
            if drafting:
                self.recheck_at, self.kept_batch = 0, []
            else:  # off again for the same batch (nothing drafted since): search less often
                self.recheck_gap = min(2 * self.recheck_gap, PAUSED_RECHECK_MAX) if same else PAUSED_RECHECK
                self.recheck_at, self.kept_batch = self.steps + self.recheck_gap, batch
                self.kept_ks = drafting_ks(caps, pinned, 0, set())
        if drafting and self.probe_gap > PROBE_EVERY:  # speculation pays again: probe at the usual pace
            self.probe_gap, self.next_probe = PROBE_EVERY, min(self.next_probe, self.steps + PROBE_EVERY)
            self.affordable_gap = 0.0  # the drafter is kept in sync again: its next pause is measured afresh
        if self.steps >= self.next_probe:  # one candidate deeper
            self.probing_off = 0 if drafting else self.probe_gap
            self.probe_gap = PROBE_EVERY if drafting else max(min(2 * self.probe_gap, MAX_PROBE_GAP), self.budget_gap())
            self.next_probe = self.steps + self.probe_gap
            self.probes += 1
            if drafting and self.probes % 2 == 0:  # an anchor, unless plain steps came anyway
                if self.cost.plain_lately(len(seqs), 2 * PROBE_EVERY):
                    return drafting_ks(caps, pinned, k, drafting)
                long = self.guard.wants_plain(key, self.steps)
                self.anchor_left = GUARD_SETTLE + GUARD_ANCHOR_SAMPLES - 1 if long else PLAIN_SETTLE
                self.anchoring = True
                return drafting_ks(caps, pinned, 0, set())
            # at least 2 tokens deep: a probe of one measures neither beta nor how the proposal's
            # cost grows with depth, and a batch off since its start (k = 0) probed only 1 deep
            probe = self.candidates[min(max(self.candidates.index(k) + 1, 2), len(self.candidates) - 1)]
            free = [i for i, p in enumerate(pinned) if not p]
            narrow = not drafting and free and (self.narrow_probes or self.catch_up_over_budget(seqs, free))
            probing = {max(free, key=lambda i: alphas[i])} if narrow else set(free)
            self.best_only = len(probing) < len(free)
            if not drafting and any(self.catch_up_entries(self.backlog(seqs[i])) for i in probing):
                self.follow_up = ({seqs[i].slot for i in probing}, probe)
            if not drafting:
                self.regime = None
            return drafting_ks(caps, pinned, probe, probing)
        ks = drafting_ks(caps, pinned, k, drafting)
        if drafting:  # kept for DRAFTING_RECHECK steps, this one's observation with theirs
            self.recheck_at, self.kept_batch, self.kept_ks = self.steps + DRAFTING_RECHECK, batch, ks.copy()
            self.coasting = True
        return ks

    def batch_key(self, seqs: list[Sequence]) -> tuple[int, bool]:
        """A batch's size, and whether any of its rows samples: the rate guard's key, and the path
        its proposals are priced on (`CostModel.use_path`). A sampled row's step takes the target's
        logits and rejection sampling, its proposal the drafter's Python (the draft model at batch
        1: plain steps 0.45 against 0.28 ms, drafting steps 1.4 against 0.7); judged with the greedy
        ones, greedy drafting that paid let sampled requests draft at a loss (`paid`), 935 of 4900
        steps at 0.61 ms a token against 0.45 plain, where requests alternated greedy and sampled."""
        return len(seqs), self.sampled_seen and not all(s.params.greedy for s in seqs)

    def catch_up_entries(self, backlog: int) -> int:
        """Of a drafter's backlog, the entries that are a catch-up: past what a drafting sequence's
        proposal feeds every step anyway (its accepted tokens and bonus, in the proposal's cost)."""
        return max(backlog - self.steady, 0)

    def catch_up_over_budget(self, seqs: list[Sequence], rows: list[int]) -> bool:
        """Would a probe drafting every one of `rows` (speculation off) catch them up on more than
        PROBE_BUDGET of the steps it covers, at the fitted cost per entry? Before any catch-up was
        timed, a row with a backlog says yes: the first probe of a fresh EAGLE batch of 8 caught
        up on its 8 prompts (509 entries, 37 ms, a quarter of a 128-token bench run)."""
        excess = sum(self.catch_up_entries(self.backlog(seqs[i])) for i in rows)
        if not excess:
            return False
        if not self.cost.catch_up_samples:
            return True
        budget = PROBE_BUDGET * self.cost.verify(len(seqs)) * self.probing_off
        return self.cost.catch_up_per_entry * self.cost.load * excess > budget

    def budget_gap(self) -> int:
        """The fewest steps between probes while speculation is off over which the last probe's
        cost, for one sequence, stays within PROBE_BUDGET (at most LONGEST_PROBE_GAP)."""
        return min(ceil(self.affordable_gap), LONGEST_PROBE_GAP)

    def catch_up_charges(
        self, seqs: list[Sequence], caps: list[int], alphas: list[float], betas: list[float],
    ) -> list[float]:
        """Per sequence, what drafting costs it per step beyond the proposal, in calibration
        seconds: its drafter's catch-up (a paused sequence's backlog, a newcomer's prompt), paid
        once, spread over the steps it has left at its cap. A resume is worth it only if it repays
        that: with 4 users each getting 32 tokens, a changed batch made adaptive EAGLE resume for
        its newcomer 9 times in 1533 steps, each paying the prompt's catch-up (298 ms in a 7.2 s
        run) for a round or two of drafting. A sequence in sync (backlog within one proposal's
        own feed) is charged nothing."""
        per_entry = self.cost.catch_up_per_entry
        if not per_entry:
            return [0.0] * len(seqs)
        charges = []
        for s, cap, alpha, beta in zip(seqs, caps, alphas, betas):
            excess = self.catch_up_entries(self.backlog(s)) if cap else 0
            if not excess:
                charges.append(0.0)
                continue
            steps_left = (s.params.max_tokens - len(s.output_ids)) / expected_tokens(alpha, self.depth_of[cap], beta)
            charges.append(per_entry * excess / max(steps_left, 1.0))
        return charges

    def affordable_probe_gap(self, row_seconds: float, fed: float, budget: float) -> float:
        """Steps between probes while speculation is off over which a one-sequence probe fits
        `budget` seconds a step, the last one having cost `row_seconds` a row for `fed` entries of
        catch-up: the next one's catch-up grows with the gap (an entry a step, up to
        CATCH_UP_WINDOW) at the fitted cost per entry. Scaled from the last probe alone, a first
        probe 16 steps after a pause put the next 350 steps on at batch 1, where EAGLE's catch-up
        on 190 entries then cost 15 ms (4% of the steps it covered, against the 1.5% budget)."""
        per_entry = self.cost.catch_up_per_entry * self.cost.load
        base = max(row_seconds - per_entry * min(fed, CATCH_UP_WINDOW), 0.0)  # the probe's own drafting
        if per_entry < budget and base / (budget - per_entry) <= CATCH_UP_WINDOW:
            return base / (budget - per_entry)
        return (base + per_entry * CATCH_UP_WINDOW) / budget

    def best(
        self, caps: list[int], alphas: list[float], betas: list[float], pinned: list[bool],
        charges: list[float] | None = None,
    ) -> tuple[int, set[int]]:
        """The k, and the sequences that draft at it, that commit the most tokens per second.

        For each candidate k the sequences are added best acceptance first (for a given k, the
        ones that accept more repay their share of verification more), so speculation turns off
        per sequence (those whose expected gain does not pay their extra verify tokens and their
        catch-up, `charges`) and per batch (k = 0, or no sequence added), wherever the fitted
        costs say it loses. The best pick that drafts is kept too, with its rate over the plain
        one (`best_drafting`): where drafting paid, it may draft anyway (`DRAFTING_FLOOR`).
        """
        n = len(caps)
        charges = charges or [0.0] * n
        cost, depth_of = self.cost, self.depth_of
        if any(pinned):  # pinned sequences draft their cap
            held = [i for i, p in enumerate(pinned) if p and caps[i]]
            fixed_rows = len(held)
            fixed_extra = sum(caps[i] for i in held)
            fixed_tokens = n - fixed_rows + sum(expected_tokens(alphas[i], depth_of[caps[i]], betas[i]) for i in held)
            fixed_depth = max((depth_of[caps[i]] for i in held), default=0)
            free = [i for i, p in enumerate(pinned) if not p]
        else:
            fixed_rows = fixed_extra = fixed_depth = 0
            fixed_tokens, free = n, range(n)
        order = sorted([i for i in free if alphas[i] >= COLLAPSE_ALPHA and caps[i]], key=alphas.__getitem__, reverse=True)
        # this runs every step, a few dozen rates at batch 8, so each lookup is cheap: rates are
        # only compared with each other, so costs stay in calibration units (the load factor
        # scales them all alike), and the curve's points and the proposal costs are memoized
        # between steps (the curve's dict read here first: a method call per rate was a fifth of
        # the search at batch 1)
        draft_s, rows_factor = cost.proposals.table(depth_of[-1], n)
        verify, curve = cost.verify_at_calibration, cost.curve
        # every row's response, whatever the step commits, at its regime's cost (`observe_output`;
        # a batch with pinned rows drafts whatever the pick)
        output = cost.output_drafting * n
        plain_output = output if fixed_rows else cost.output_plain * n
        best_rate = fixed_tokens / (verify(n + fixed_extra) + draft_s[fixed_depth] * rows_factor[fixed_rows] + plain_output)
        best_k = best_m = 0
        plain_rate, best_drafting = best_rate, (0, 0, 0.0)
        for k in self.candidates[1:]:
            tokens, extra, depth, catch_up = fixed_tokens, fixed_extra, fixed_depth, 0.0
            for m, i in enumerate(order, 1):
                kk = k if k < caps[i] else caps[i]
                d = depth_of[kk]
                tokens += expected_tokens(alphas[i], d, betas[i]) - 1.0
                extra += kk
                catch_up += charges[i]
                if d > depth:
                    depth = d
                v = curve.get(n + extra)
                if v is None:
                    v = verify(n + extra)
                r = tokens / (v + draft_s[depth] * rows_factor[fixed_rows + m] + catch_up + output)
                if r > best_rate:
                    best_rate, best_k, best_m = r, k, m
                if r > best_drafting[2]:
                    best_drafting = (k, m, r)
        self.best_drafting = (best_drafting[0], order[: best_drafting[1]], best_drafting[2] / plain_rate)
        return best_k, set(order[:best_m])

    def admit(self, seq: Sequence) -> None:
        """A new sequence starts at the engine-wide acceptances of its path (greedy or sampled)."""
        self.coast_left = 0
        self.observe_unobserved()
        sampled = not seq.params.greedy
        self.sampled_seen |= sampled
        wide = self.wide[sampled].state
        self.slots[seq.slot] = SlotState(acceptance=wide.acceptance, later=wide.later, sampled=sampled)

    def release(self, slot: int) -> None:
        """Forget a finished sequence. The steps left unobserved stay so: a release comes within a
        step, in its output phase, and observing them there put the policy's time into the step's
        own, which the cost model and the guard read as the target's. Its rounds in them still
        count when they are observed (`leaving`); a step observed after this (the one it finished
        in) skips it, as observed at once."""
        self.coast_left = 0
        state = self.slots.pop(slot, None)
        if state is not None and self.unobserved:
            self.leaving[slot] = (self.unobserved[-1][0], state)

    def observe(self, step: StepRecord) -> None:
        """Learn from one decode step (`observe_step`), or, while coasting, later: a drafting
        batch's steps, a paused batch's plain ones (`observe_coasting`; a pinned row's draft moves
        what a search reads, and is observed at once). A fixed k and the baseline learn nothing:
        nothing reads what they would (their acceptances' bookkeeping was 5 us of the baseline's
        0.26 ms step at batch 1)."""
        if not self.adaptive:
            return
        if self.coasting_plain and step.plain:
            self.observe_coasting(step.seqs, step.step_seconds, step.proposal_seconds)
            return
        if self.coasting and self.drafting_regime:
            self.unobserved.append((self.steps, step))
            return
        self.observe_unobserved()
        self.observe_step(self.steps, step)

    def observe_coasting(self, seqs: list[Sequence], step_seconds: float, proposal_seconds: float) -> None:
        """A plain step of a paused batch coasting (`coasting_plain`), left for the next search:
        what the engine calls instead of `observe` then, building no StepRecord."""
        self.coasted.append((self.steps, seqs, step_seconds, proposal_seconds))

    def observe_unobserved(self) -> None:
        """Observe the steps left while coasting, in the order they ran. What they move (the
        load, the curve, the proposal's cost, the guard's rates, the acceptances) is read only
        by a search, a probe or an admission (its slot may be a released one's), each of which
        calls this first. A drafting batch's steps are observed as at once (`observe_step`); a
        paused batch's plain steps' rounds are counted together: each sequence's evidence decays
        once a step (the same multiplications as one by one), its estimates made once after
        (nothing reads them in between): observed round by round, they were 5.4 us of the 9.8 us a
        paused batch of 8 spent observing a plain step, and a paused method's observations 2% of
        its engine time. Of a long run of plain steps only the latest are timed (`PLAIN_TIMED`).
        Only one of the two lists holds steps at a time: the regime changes at a search, which
        observes them first."""
        if self.unobserved:
            steps, self.unobserved = self.unobserved, []
            for number, step in steps:
                self.observe_step(number, step)
            self.leaving.clear()
        if self.coasted:
            coasted, self.coasted = self.coasted, []
            rounds: dict[int, int] = {}  # slot -> the plain rounds it ran among them
            timed_from = len(coasted) - PLAIN_TIMED
            for i, (number, seqs, step_seconds, proposal_seconds) in enumerate(coasted):
                if i >= timed_from or number - self.drafted_at <= PAIR_GAP + PLAIN_SETTLE:
                    self.observe_timing(number, StepRecord.plain_step(seqs, step_seconds, proposal_seconds))
                elif self.cost is not None:
                    self.cost.pass_plain()
                for s in seqs:
                    rounds[s.slot] = rounds.get(s.slot, 0) + 1
            self.decay_rounds(rounds)

    def decay_rounds(self, rounds: dict[int, int]) -> None:
        """Each sequence's evidence decayed over its plain rounds (slot -> how many), its estimates
        made once after; a finished sequence's are skipped (its state is gone)."""
        for slot, n in rounds.items():
            state = self.slots.get(slot)
            if state is not None:  # not finished since
                state.decay(DECAY, n)
                self.estimate_own(state)

    def observe_step(self, number: int, step: StepRecord) -> None:
        """Learn from decode step `number`: proposal and step costs, then each sequence's acceptance.
        A plain step (no sequence drafted: a paused batch's) moves only the step's cost and the
        acceptances' decay; the proposal bookkeeping it skips cost 2 us a step at batch 1."""
        if not step.plain:
            self.observe_proposal(step)
            self.drafted_at = number
        self.observe_timing(number, step)
        # an anchor's plain rounds leave the sequences' evidence as it was: decayed at each of its
        # steps, a sequence drafting k = 4 came out of one estimating shorter drafts (k = 2 once)
        decay = 1.0 if self.anchoring else DECAY
        engine_wide = not self.best_only
        for s, depth, accepted in zip(step.seqs, step.depths, step.accepted):
            state = self.slots.get(s.slot)
            if state is None and s.slot in self.leaving:  # finished since this step, observed later
                last, state = self.leaving[s.slot]
                state = state if number <= last else None
            if state is not None:  # not finished in this step
                if depth and engine_wide:  # once a step and path: its rows' later calls find it aged
                    self.wide[state.sampled].age(number)
                self.observe_round(state, depth, accepted, decay, engine_wide)

    def observe_timing(self, number: int, step: StepRecord) -> None:
        """The step's time: the cost model's curve and load, and the guard's rates."""
        self.probing_off = 0
        if self.cost is not None and step.tokens:
            self.cost.observe_verify(step.tokens, step.step_seconds, len(step.seqs), self.anchoring)
            if self.adaptive:
                self.observe_rate(number, step)

    def observe_rate(self, number: int, step: StepRecord) -> None:
        """Hand the guard the step's committed tokens and engine seconds: a settled plain step's
        (after GUARD_SETTLE plain ones: the first plain steps after drafted ones still pay for
        them), or the drafting regime's (any other step of it, those first plain steps too)."""
        rows = len(step.seqs)
        settled = step.tokens == rows and self.cost.plain_run > GUARD_SETTLE
        if settled or self.regime:
            self.guard.add(self.batch_key(step.seqs), number, rows + sum(step.accepted),
                           step.proposal_seconds + step.step_seconds, not settled)

    def observe_proposal(self, step: StepRecord) -> None:
        """A step that drafted: what its probe cost, a search due, and the proposal's time."""
        drafted = [s for s, k in zip(step.seqs, step.ks) if k > 0 and s.slot in self.slots] if self.probing_off else []
        if drafted and self.cost is not None:  # a probe while speculation was off
            # what probing every row would have cost (a narrow probe drafted one), spread over the
            # steps since the last probe: while speculation stays off, all of it is overhead
            plain = self.cost.verify(len(step.seqs))
            budget = PROBE_BUDGET * plain  # per step covered
            # the probe's cost: its proposal and its verification beyond a plain step's (Medusa's
            # proposal is a tenth of a plain step, its 3-node tree's verification 2-3x one: counting
            # the proposal alone, probes every MAX_PROBE_GAP steps took 4% of a paused batch of one)
            cost = step.proposal_seconds + max(step.step_seconds - plain, 0.0)
            probe = cost * len(step.seqs) / len(drafted)
            self.narrow_probes = probe / self.probing_off > budget
            fed = [b for b, k in zip(step.backlogs, step.ks) if k > 0]
            self.affordable_gap = self.affordable_probe_gap(cost / len(drafted), sum(fed) / len(fed), budget)
            self.probe_gap = max(self.probe_gap, self.budget_gap())  # from this probe on, not the next
            self.next_probe = self.steps + self.probe_gap
        if step.tokens != len(step.seqs) and not self.drafting_regime:  # a paused batch's step with drafts
            self.recheck_at, self.kept_batch = 0, []  # moves costs and acceptances: search again
            self.coast_left = 0
        seconds = step.proposal_seconds
        if self.sampled_seen and self.cost is not None:
            self.cost.use_path(not all(s.params.greedy for s, k in zip(step.seqs, step.ks) if k > 0))
        if self.regime:  # its search's time lands on one step in DRAFTING_RECHECK: spread
            self.drafting_policy += POLICY_RATE * (step.policy_seconds - self.drafting_policy)
            seconds = step.propose_seconds + self.drafting_policy
        self.observe_draft_time(seconds, step.depth, step.backlogs, sum(1 for k in step.ks if k > 0))

    def observe_round(
        self, state: SlotState, depth_drafted: int, accepted: int, decay: float = DECAY, engine_wide: bool = True,
    ) -> None:
        """Update a sequence's acceptances after a round that drafted to depth `depth_drafted`
        (0: none), and the engine-wide ones after a round that drafted, unless not `engine_wide`:
        a probe narrowed to the best-accepting sequence samples the best, not a newcomer's
        expectation. A paused draft model's narrow probes at batch 8 (its best row, accepting
        2 of 2 each time) read the engine-wide alpha at 0.88-0.96; each fresh batch of 8 then
        drafted at once on it, catching up on its 8 prompts (6.5 ms beside a 1.3 ms plain step),
        accepted 0.6 of its first tokens and paused again: adaptive ran 0.95-0.97x the baseline
        where speculation never paid. `decay`: on the sequence's counts, the policy's own but for
        `tools.acceptance_fit`'s replays."""
        state.count(decay, depth_drafted, accepted)
        if depth_drafted > 0 and engine_wide:
            self.wide[state.sampled].count(depth_drafted, accepted)
        self.estimate_own(state)

    def estimate_own(self, state: SlotState) -> None:
        """A sequence's acceptances from its evidence, drawn towards the engine-wide ones of its path."""
        wide = self.wide[state.sampled].state
        state.acceptance = estimate(state.accepted_n, state.rejected_n, wide.acceptance)
        state.later = estimate(state.later_accepted_n, state.later_rejected_n, wide.later)

    def observe_draft_time(self, seconds: float, depth: int, backlogs: list[int] = (), rows: int = 1) -> None:
        """A proposal's time for `rows` drafting sequences; `backlogs`: what its drafter fed first
        for each sequence. One that fed a sequence more than its steady share (accepted tokens
        and bonus) caught up: it is a sample of the catch-up's cost per entry, not of the
        proposal's."""
        if self.cost is None or depth <= 0:
            return
        excess = sum(self.catch_up_entries(b) for b in backlogs)
        if not excess:
            self.cost.observe_draft(depth, seconds, rows)
        elif excess >= CATCH_UP_MIN_ENTRIES:
            self.cost.observe_catch_up(excess, seconds, depth, rows)
