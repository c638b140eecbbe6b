"""The rate guard: drafting is vetoed for a batch size whose drafting steps, as timed, commit
fewer tokens per second than its settled plain steps, wherever the policy's model says otherwise."""

from __future__ import annotations

import itertools
import random
import statistics
from typing import Hashable

import pytest

from specdec.core import policy, rate_guard
from specdec.core.cost_model import CostModel, ProposalFit
from specdec.core.policy import Policy, SlotState, StepRecord
from specdec.core.rate_guard import GUARD_HOLD, GUARD_MIN_DRAFTED, GUARD_MIN_PLAIN, RateGuard
from specdec.core.sampling import SamplingParams
from specdec.core.sequence import Sequence

SLOTS = itertools.count(1000)


def feed(guard: RateGuard, start: int, drafting_rate: float, plain_rate: float, rows: int = 8,
         key: Hashable = None) -> int:
    """Enough steps of both regimes of a batch of `rows` at these rates (tokens per second) to
    compare them, under `key` (default: `rows`; the policy's is `Policy.batch_key`); the next step."""
    key = rows if key is None else key
    step = start
    for _ in range(GUARD_MIN_PLAIN):
        guard.add(key, step, rows, rows / plain_rate, drafting=False)
        step += 1
    for _ in range(GUARD_MIN_DRAFTED):
        guard.add(key, step, 2 * rows, 2 * rows / drafting_rate, drafting=True)
        step += 1
    return step


def test_drafting_below_the_plain_rate_is_vetoed_for_that_batch_size_and_the_hold_doubles():
    guard = RateGuard()
    step = feed(guard, 0, drafting_rate=0.9, plain_rate=1.0)
    assert guard.vetoed(8, step) and not guard.vetoed(4, step)
    assert not guard.vetoed(8, step - 1 + GUARD_HOLD)  # the hold ends: a re-trial
    step = feed(guard, step - 1 + GUARD_HOLD, drafting_rate=0.9, plain_rate=1.0)
    assert guard.vetoed(8, step - 1 + GUARD_HOLD) and guard.batches[8].vetoes == 2  # held twice as long
    assert not guard.vetoed(8, step - 1 + 2 * GUARD_HOLD)
    feed(guard, step, drafting_rate=0.5, plain_rate=1.0, rows=4)
    assert guard.batches[4].vetoes == 1 and guard.vetoes == 3  # every batch size's: `specdec:drafting_vetoes`


@pytest.mark.parametrize("drafting_rate", [0.98, 1.3])
def test_drafting_at_par_or_better_is_not_vetoed(drafting_rate):
    guard = RateGuard()
    step = feed(guard, 0, drafting_rate=drafting_rate, plain_rate=1.0)
    assert not guard.vetoed(8, step)


def veto_after_par(guard: RateGuard, rows: int, key: Hashable = None) -> int:
    """Drafting judged at the plain rate, then at half of it until vetoed (as the policy drafts:
    nothing during the hold); the step after the veto."""
    key = rows if key is None else key
    step = feed(guard, 0, drafting_rate=1.0, plain_rate=1.0, rows=rows, key=key)
    while not guard.vetoed(key, step):
        guard.add(key, step, 2 * rows, 4.0 * rows, drafting=True)
        step += 1
    return step


def test_a_veto_of_drafting_that_had_paid_owes_a_re_trial_once_its_hold_ends():
    guard = RateGuard()
    step = feed(guard, 0, drafting_rate=0.9, plain_rate=1.0)  # never judged at par: nothing owed
    assert guard.vetoed(8, step) and not guard.retrial_due(8, guard.batches[8].until)
    guard = RateGuard()
    step = veto_after_par(guard, 8)
    until = guard.batches[8].until
    assert not guard.retrial_due(8, until - 1) and guard.retrial_due(8, until) and not guard.retrial_due(4, until)
    for step in range(until, until + rate_guard.PAID_MIN_DRAFTED):
        assert guard.retrial_due(8, step)
        guard.add(8, step, 16, 16.0, drafting=True)
    assert not guard.retrial_due(8, step + 1)  # had its say: `paid` reads it
    step = feed(guard, step + 1, drafting_rate=0.9, plain_rate=1.0)  # judged at a loss, nothing paid since
    assert guard.vetoed(8, step) and not guard.retrial_due(8, guard.batches[8].until)


def test_drafting_that_paid_within_the_window_lets_the_policy_draft_on():
    """`paid`: at least PAID_MIN_DRAFTED drafting steps at the plain rate or better, within the
    window and since the last veto."""
    guard = RateGuard()
    step = 0
    for _ in range(GUARD_MIN_PLAIN):
        guard.add(1, step, 1, 1.0, drafting=False)
        step += 1
    for _ in range(rate_guard.PAID_MIN_DRAFTED - 1):
        guard.add(1, step, 2, 1.5, drafting=True)
        step += 1
    assert not guard.paid(1, step)  # too few
    guard.add(1, step, 2, 1.5, drafting=True)
    assert guard.paid(1, step) and not guard.paid(8, step)
    assert not guard.paid(1, step + rate_guard.GUARD_WINDOW + 1)  # a spell older than the window
    guard = RateGuard()
    step = feed(guard, 0, drafting_rate=0.9, plain_rate=1.0, rows=1)
    assert guard.vetoed(1, step) and not guard.paid(1, step)  # vetoed: its steps were cleared
    guard = RateGuard()
    assert not guard.paid(1, feed(guard, 0, drafting_rate=0.98, plain_rate=1.0, rows=1))  # not vetoed, not paid


def test_paid_reads_the_plain_rate_of_the_window_as_of_its_step():
    """Both windows are trimmed to `paid`'s own step. The plain one was read as the batch size's
    last `add` had trimmed it, and plain steps older than GUARD_WINDOW (slow ones here) still
    pulled its rate down: drafting read as paid against a plain rate of steps long gone."""
    guard = RateGuard()
    for step in range(GUARD_MIN_PLAIN):  # old and slow: 0.5 tokens a second
        guard.add(1, step, 1, 2.0, drafting=False)
    start = rate_guard.GUARD_WINDOW // 2
    for step in range(start, start + GUARD_MIN_PLAIN):  # recent: 1 token a second
        guard.add(1, step, 1, 1.0, drafting=False)
    for step in range(start + GUARD_MIN_PLAIN, start + GUARD_MIN_PLAIN + rate_guard.PAID_MIN_DRAFTED):
        guard.add(1, step, 2, 2.5, drafting=True)  # 0.8 tokens a second
    assert guard.paid(1, step)  # the window holds both plain spells: 0.67 tokens a second
    assert not guard.paid(1, rate_guard.GUARD_WINDOW + GUARD_MIN_PLAIN)  # the recent one alone


def test_a_paused_batchs_plain_steps_stay_within_the_window():
    """A batch that never drafts again adds a plain step at every step and compares nothing:
    its window must still drop the steps older than GUARD_WINDOW (it held every one: a served
    engine paused for an hour at batch 1 kept millions)."""
    guard = RateGuard()
    steps = 3 * rate_guard.GUARD_WINDOW
    for step in range(steps):
        guard.add(1, step, 1, 1.0, drafting=False)
    plain = guard.batches[1].plain
    assert len(plain) == rate_guard.GUARD_WINDOW + 1 and plain.tokens == len(plain)


def test_too_few_plain_steps_say_nothing():
    guard = RateGuard()
    for step in range(10 * GUARD_MIN_DRAFTED):
        guard.add(8, step, 8, 100.0, drafting=True)
    assert not guard.vetoed(8, 10 * GUARD_MIN_DRAFTED)


def test_a_batch_whose_veto_ended_drafts_again_where_its_model_rates_drafting_near_plain():
    """A veto comes after drafting looked bad, when the acceptances are at their lowest, and a
    paused batch of one does not move them (probes aside). A draft model whose drafting had paid,
    then was vetoed with its acceptances at 0.8 (its model rates drafting 0.89x plain; at 0.95 it
    drafted, 1.14x) draws a re-trial once the hold ends (`retrial_due`); drafting that then
    realizes the plain rate is judged and resets the hold. Without the re-trial it stayed paused:
    the demo kit's draft model at batch 1 for 800 steps past a hold of 256."""
    import test_policy

    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = CostModel([1, 2, 4, 8], [1.0, 1.45, 2.35, 4.15], proposals=ProposalFit(0.55, 0.15))
    p.probe_gap = p.next_probe = 10**9  # no probes: nothing but the re-trial moves the acceptances
    p.wide[False].state = SlotState(0.8, 0.8)
    [s] = test_policy.seqs(p, 1, 0.8)
    key = p.batch_key([s])
    p.steps = veto_after_par(p.guard, 1, key)
    until = p.guard.batches[key].until
    regimes = []
    while p.steps < until + policy.PAUSED_RECHECK_MAX + 1 and not p.drafting_regime:
        [k] = p.choose([s])
        p.observe(StepRecord([s], [k], [k], [0], [0], step_seconds=1.0, tokens=1 + k))
        regimes.append((p.steps, p.drafting_regime))
    assert not any(drafting for step, drafting in regimes if step < until)  # held
    assert p.drafting_regime and p.guard.retrial_due(key, p.steps)  # the re-trial, best drafting pick
    drafted = 0
    while drafted < GUARD_MIN_DRAFTED:  # the re-trial's steps, then drafting on where they paid, until judged
        [k] = p.choose([s])
        assert k > 0 or p.anchoring  # drafting, but for its anchors' plain steps
        drafted += k > 0
        p.observe(StepRecord([s], [k], [k], [k], [1 if k else 0], propose_seconds=0.55 + 0.15 * k if k else 0.0,
                             depth=k, step_seconds=1.0 + 0.45 * k, tokens=1 + k))  # every draft token accepted
        assert p.guard.retrial_due(key, p.steps) == (drafted < rate_guard.PAID_MIN_DRAFTED)
    assert not p.guard.vetoed(key, p.steps) and p.guard.batches[key].hold == GUARD_HOLD


def test_greedy_and_sampled_batches_are_judged_apart():
    """A sampled row's steps take the target's logits and rejection sampling, its proposals the
    drafter's Python: drafting that paid for greedy batches says nothing of sampled ones. With
    requests alternating greedy and sampled (the draft model at batch 1), greedy drafting judged
    to pay let the sampled ones draft at the floor (`paid`, `DRAFTING_FLOOR`), at 0.61 ms a token
    against 0.45 plain. Each batch is judged under its size and path (`Policy.batch_key`)."""
    import test_policy

    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = CostModel([1, 2, 4, 8], [1.0, 1.45, 2.35, 4.15], proposals=ProposalFit(0.55, 0.15))
    p.probe_gap = p.next_probe = 10**9
    p.wide[False].state = p.wide[True].state = SlotState(0.8, 0.8)  # the model: drafting ~0.89x plain
    [greedy] = test_policy.seqs(p, 1, 0.8)
    sampled = Sequence("s", [1, 2], SamplingParams(temperature=1.0), lambda o: None, slot=next(SLOTS))
    p.admit(sampled)
    p.slots[sampled.slot] = SlotState(**{**vars(p.slots[greedy.slot]), "sampled": True})
    assert p.batch_key([greedy]) == (1, False) and p.batch_key([sampled]) == (1, True)
    assert p.batch_key([greedy, sampled]) == (2, True)
    p.steps = feed(p.guard, 0, drafting_rate=1.2, plain_rate=1.0, rows=1, key=(1, False))
    assert p.guard.paid((1, False), p.steps) and not p.guard.paid((1, True), p.steps)
    assert p.choose([greedy]) == [p.best_drafting[0]] and p.best_drafting[0] > 0  # drafts at the floor
    p.recheck_at = 0
    assert p.choose([sampled]) == [0]  # the same model's word, but sampled drafting never paid


AFTERMATH = (1.27, 1.23, 1.18, 1.10, 1.06, 1.05)  # the plain steps after drafted ones, as a share of a
# settled one: served-like, in one process with a GIL-holding sender and a CPU-bound process (16 users)


def over_rated_rate(seed: int, guarded: bool, rows: int = 8, steps: int = 6000, aftermath: tuple[float, ...] = (),
                    slope: float = 0.05) -> tuple[float, float]:
    """(tokens per second as a share of the plain rate, share of steps that drafted) of a batch
    whose policy over-rates drafting: it charges every step 0.5 of a plain step per row for
    output that costs nothing (as the server's output charge made plain steps look 1.7x dearer
    than they were, `make demo`'s EAGLE at 16 users). A step of n tokens costs 1 + slope (n - rows)
    with 10% jitter, the i-th plain step after a drafted one `aftermath[i - 1]` times that; each
    draft token is accepted with 0.6, the one before it accepted."""
    rng = random.Random(seed)
    cost = lambda n: 1.0 + slope * (n - rows)  # noqa: E731
    propose = lambda depth, m: 0.025 * (1 + depth) * (1 + 0.5 * (m - 1))  # noqa: E731
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    counts = [rows, 2 * rows, 3 * rows, 5 * rows]
    p.cost = CostModel(counts, [cost(n) for n in counts], proposals=ProposalFit(propose(0, 1), propose(1, 1) - propose(0, 1)))
    p.cost.output_plain = p.cost.output_drafting = 0.5
    if not guarded:
        p.guard.add = lambda *args, **kwargs: None
    batch = [Sequence(f"r{i}", [1, 2], SamplingParams(max_tokens=10**7), lambda o: None, slot=next(SLOTS)) for i in range(rows)]
    for s in batch:
        p.admit(s)
    tokens = seconds = 0.0
    drafted, since = 0, len(aftermath)
    for _ in range(steps):
        ks = p.choose(batch)
        accepted = []
        for k in ks:
            a = 0
            while a < k and rng.random() < 0.6:
                a += 1
            accepted.append(a)
        m = sum(1 for k in ks if k)
        propose_seconds = propose(max(ks), m) if m else 0.0
        n = rows + sum(ks)
        since = 0 if m else since + 1
        step_cost = cost(n) * (aftermath[since - 1] if 0 < since <= len(aftermath) else 1.0)
        p.observe(StepRecord(batch, ks, list(ks), accepted, [1 if k else 0 for k in ks], propose_seconds=propose_seconds,
                             depth=max(ks), step_seconds=step_cost * rng.lognormvariate(0, 0.1), tokens=n))
        tokens += rows + sum(accepted)
        seconds += step_cost + propose_seconds
        drafted += m > 0
    return tokens / seconds / rows, drafted / steps


def test_a_policy_that_over_rates_drafting_is_held_near_the_plain_rate():
    """Unguarded, the policy drafts 9 steps in 10 at 0.81x of the plain rate; guarded, it drafts
    in 9% of them (the first 260 steps until the window holds GUARD_MIN_PLAIN anchors, re-trials,
    probes) at 0.96x."""
    unguarded = statistics.median(over_rated_rate(seed, guarded=False)[0] for seed in range(3))
    runs = [over_rated_rate(seed, guarded=True) for seed in range(3)]
    assert unguarded < 0.85
    assert statistics.median(r for r, _ in runs) >= 0.95
    assert max(d for _, d in runs) < 0.15


def test_the_guard_leaves_a_policy_whose_drafting_pays_alone(monkeypatch):
    """Where drafting pays (prompt lookup at batch 1, `test_policy.simulated_rate`), the guard
    never vetoes: the rate is the same with it as without."""
    import test_policy

    guarded = [test_policy.simulated_rate(seed, 2.0, steps=1500) for seed in range(3)]
    monkeypatch.setattr(rate_guard, "GUARD_RATIO", 0.0)
    assert [test_policy.simulated_rate(seed, 2.0, steps=1500) for seed in range(3)] == guarded


def test_the_guard_times_a_step_with_the_policys_own_time():
    """The adaptive policy's search and observation run at every drafting step (0.14-0.16 ms of a
    ~2.4 ms step at batch 8 under arrivals, ~0.02 ms paused) outside the proposal's and the step's
    timers: the guard's rates count them (`StepRecord.proposal_seconds`); without them prompt lookup
    drafting at 0.94x its plain rate read as 0.99x."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = CostModel([8, 16], [1.0, 1.4], proposals=ProposalFit(0.01, 0.01))
    p.cost.plain_run = 5  # settled
    seen = []
    p.guard.add = lambda rows, step, tokens, seconds, drafting: seen.append(seconds)
    batch = [Sequence(f"r{i}", [1, 2], SamplingParams(max_tokens=64), lambda o: None, slot=next(SLOTS)) for i in range(8)]
    p.observe_rate(1, StepRecord(batch, [0] * 8, [0] * 8, [0] * 8, [0] * 8, propose_seconds=0.002, step_seconds=1.0,
                                 tokens=8, policy_seconds=0.15))
    assert seen == [pytest.approx(1.152)]


def test_long_anchors_time_the_plain_rate_after_drafting_has_worn_off(monkeypatch):
    """The plain steps right after drafted ones pay for them (AFTERMATH): a guard comparing drafting
    with the third of them, as the cost model's anchors settle, held the draft model drafting at
    0.81x the baseline's served rate (16 users) where its own steps said 1.16x. Its plain steps come
    after GUARD_SETTLE others, from anchors that run long while it has too few. Here drafting runs
    at 0.93x the plain rate: compared with the third plain step it was never vetoed."""
    runs = [over_rated_rate(seed, guarded=True, aftermath=AFTERMATH, slope=0.03) for seed in range(3)]
    assert statistics.median(r for r, _ in runs) >= 0.96
    monkeypatch.setattr(policy, "GUARD_SETTLE", policy.PLAIN_SETTLE)  # the third plain step, as before
    monkeypatch.setattr(policy, "GUARD_ANCHOR_SAMPLES", 1)
    before = [over_rated_rate(seed, guarded=True, aftermath=AFTERMATH, slope=0.03) for seed in range(3)]
    assert statistics.median(r for r, _ in before) < 0.95 and min(d for _, d in before) > 0.5
