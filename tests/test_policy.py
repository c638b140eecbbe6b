"""The adaptive policy: speculate deeply when verification is nearly free and drafts are accepted,
turn it off where it would lose (compute-bound batch, collapsed acceptance), and come back."""

from __future__ import annotations

import itertools
import random
import statistics
from typing import Callable

import pytest

from specdec.core import cost_model, policy
from specdec.core.cost_model import PAIR_GAP, PLAIN_SETTLE, CostModel, ProposalFit
from specdec.core.policy import (COLLAPSE_ALPHA, DRAFTING_RECHECK, LONGEST_PROBE_GAP, MAX_PROBE_GAP, PAUSED_RECHECK, PAUSED_RECHECK_MAX, PROBE_BUDGET,
                                 PROBE_EVERY, Policy, SlotState, StepRecord, expected_tokens)
from specdec.core.rate_guard import GUARD_MIN_PLAIN
from specdec.core.sampling import SamplingParams
from specdec.core.sequence import Sequence

SLOTS = itertools.count()


def seqs(p: Policy, n: int, alpha: float, **params) -> list[Sequence]:
    """n running sequences the policy knows, each with 20 trials of evidence for acceptance alpha."""
    out = []
    for i in range(n):
        s = Sequence(f"r{i}", [1, 2], SamplingParams(**params), lambda o: None, slot=next(SLOTS))
        p.slots[s.slot] = SlotState(alpha, alpha, accepted_n=20 * alpha, rejected_n=20 * (1 - alpha),
                                    later_accepted_n=20 * alpha, later_rejected_n=20 * (1 - alpha))
        out.append(s)
    return out


def round_(p: Policy, seq: Sequence, depth: int, accepted: int) -> None:
    """One decode step of `seq` alone that drafted to `depth` and accepted `accepted` tokens."""
    p.observe(StepRecord([seq], [depth], [depth], [accepted], [1 if depth else 0]))


def memory_bound() -> CostModel:
    """Verify time nearly flat up to 64 tokens (a GPU or small batch): extra tokens are cheap, and
    so are proposals (per drafting row)."""
    return CostModel([1, 8, 64, 512], [1.0, 1.05, 1.3, 8.0], proposals=ProposalFit(0.01, 0.01))


def compute_bound() -> CostModel:
    """Every token costs the same (a saturated CPU): verifying rejected tokens is pure loss."""
    return CostModel([1, 512], [1.0, 512.0], proposals=ProposalFit(0.05, 0.05))


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12
    assert expected_tokens(1.0, 4) == 5.0


def test_deep_speculation_when_verification_is_cheap_and_acceptance_high():
    p = Policy(max_k=8, adaptive=True, depth_for=lambda k: k)
    p.cost = memory_bound()
    assert p.choose(seqs(p, 1, 0.8)) == [8]


def test_speculation_off_at_high_load_when_compute_bound():
    p = Policy(max_k=8, adaptive=True, depth_for=lambda k: k)
    p.cost = compute_bound()
    assert p.choose(seqs(p, 32, 0.6)) == [0] * 32
    p.cost = memory_bound()
    assert max(p.choose(seqs(p, 2, 0.6))) > 0


def test_collapsed_sequence_turns_off_alone_and_recovers():
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = memory_bound()
    good, bad = seqs(p, 1, 0.8)[0], seqs(p, 1, 0.8)[0]
    p.admit(bad)  # a newcomer whose drafts all fail
    for _ in range(12):
        round_(p, bad, 4, 0)
    assert p.acceptance(bad) < COLLAPSE_ALPHA
    assert p.choose([good, bad]) == [4, 0]
    p.steps = 2 * PROBE_EVERY - 1  # an occasional probe keeps its estimate current
    assert p.choose([good, bad]) == [4, 4]
    steps = 0
    while p.choose([good, bad])[1] == 0:
        round_(p, bad, 0, 0)
        steps += 1
    assert 0 < steps < 100  # retried after a while


def test_request_cap_and_fixed_policy():
    p = Policy(max_k=6, adaptive=False, depth_for=lambda k: k)
    assert p.choose(seqs(p, 1, 0.1) + seqs(p, 1, 0.9, num_draft_tokens=2)) == [6, 2]


def test_cost_model_interpolates_and_extrapolates():
    c = CostModel([1, 3], [1.0, 2.0])
    assert c.verify(2) == 1.5 and c.verify(6) == 4.0 and c.verify(1) == 1.0


def test_idle_high_acceptance_is_kept_and_one_slow_proposal_cannot_switch_speculation_off():
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = memory_bound()
    s = seqs(p, 1, 0.9)[0]
    round_(p, s, 0, 0)  # an idle round: the estimate drifts towards the engine-wide 0.6, slowly
    assert 0.8 < p.acceptance(s) < 0.9
    p.observe_draft_time(100.0, 4)  # e.g. a first proposal that caught up on a long prompt
    assert p.cost.draft(4) < 1.0
    assert p.choose([s]) == [4]


def test_draft_cost_fit_separates_fixed_and_per_level_cost():
    c = memory_bound()
    for _ in range(30):  # early samples are clipped to 3x the prediction; they leave the window
        for depth in (1, 2, 4):
            c.observe_draft(depth, 0.3 + 0.1 * depth)
    assert abs(c.proposals.fixed - 0.3) < 1e-9 and abs(c.proposals.per_level - 0.1) < 1e-9


def test_drafts_right_or_wrong_as_a_whole_are_drafted_deep():
    """Prompt lookup's drafts are right or wrong as a whole: here the first token is accepted in 4
    rounds of 5, and then every later one. One geometric acceptance, fitted on the shorter drafts it
    picked, under-rated deeper ones: it settled on 3 tokens in 60 of the last 100 steps here (on
    prompt lookup's real drafts, on 1-2); the first-token and later-token acceptances rate them at
    what they commit, and once probes have measured the later tokens, k = 4 is the pick (the
    other picks below: every other probe of a drafting batch runs plain, an anchor of
    PLAIN_SETTLE + 1 steps, longer while the rate guard has too few plain steps: the first two)."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = CostModel([1, 2, 3, 5], [1.0, 1.09, 1.45, 2.2], proposals=ProposalFit(0.01, 0.01))
    s = Sequence("r", [1, 2], SamplingParams(max_tokens=10**6), lambda o: None, slot=next(SLOTS))
    p.admit(s)
    picks = []
    for step in range(200):
        [k] = p.choose([s])
        accepted = k if step % 5 else 0
        p.observe(StepRecord([s], [k], [k], [accepted], [1 if k else 0], step_seconds=p.cost.verify(1 + k), tokens=1 + k))
        picks.append(k)
    assert p.acceptance(s) == pytest.approx(0.8, abs=0.1) and p.later_acceptance(s) > 0.9
    anchors = 100 // (2 * PROBE_EVERY) + 1
    assert picks[100:].count(4) + picks[100:].count(0) == 100 and picks[100:].count(0) <= (PLAIN_SETTLE + 1) * anchors


def test_newcomers_start_at_the_engine_wide_acceptance():
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = memory_bound()
    veteran = seqs(p, 1, 0.6)[0]
    for _ in range(40):
        round_(p, veteran, 4, 4)
    newcomer = seqs(p, 1, 0.0)[0]
    p.admit(newcomer)
    assert p.acceptance(newcomer) > 0.9



def test_greedy_and_sampled_requests_keep_their_own_proposal_costs_and_acceptances():
    """A greedy batch's proposal is one native call where a sampled row's draws each token from
    its q in the drafter's Python (the draft model at batch 1: 4-6x dearer at k = 4), and a
    sampled draft is accepted by rejection sampling, less often than a greedy one matches. Learned
    together, a stretch of sampled requests left greedy drafting priced at the sampled path's cost
    and greedy newcomers starting at the sampled acceptance: paused. Each path keeps its own
    proposal fit (`CostModel.use_path`) and engine-wide acceptances (`Policy.wide`)."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = CostModel([1, 2, 4, 8], [1.0, 1.05, 1.3, 2.2], proposals=ProposalFit(0.1, 0.05))
    greedy, sampled = SamplingParams(max_tokens=10**6), SamplingParams(max_tokens=10**6, temperature=1.0)

    def requests(params: SamplingParams, propose: float, accepted: int) -> None:
        for _ in range(3):
            s = Sequence("r", [1, 2], params, lambda o: None, slot=next(SLOTS))
            p.admit(s)
            for _ in range(20):
                p.observe(StepRecord([s], [4], [4], [accepted], [1], propose_seconds=propose, depth=4,
                                     step_seconds=1.3, tokens=5))
            p.release(s.slot)

    requests(greedy, 0.3, 4)
    requests(sampled, 1.5, 0)
    greedy_newcomer, sampled_newcomer = (Sequence("n", [1, 2], params, lambda o: None, slot=next(SLOTS))
                                         for params in (greedy, sampled))
    p.admit(greedy_newcomer)
    p.admit(sampled_newcomer)
    assert p.acceptance(greedy_newcomer) > 0.9 and p.acceptance(sampled_newcomer) < 0.1
    p.choose([greedy_newcomer])  # prices its proposals on the greedy path's fit
    greedy_proposal = p.cost.proposals.seconds(4)
    assert not p.cost.sampled_path
    p.choose([sampled_newcomer])
    assert p.cost.sampled_path and p.cost.proposals.seconds(4) / greedy_proposal == pytest.approx(1.5 / 0.3, rel=0.1)

def test_one_rejected_round_after_many_accepted_keeps_speculating():
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = CostModel([1, 8], [1.0, 1.6], proposals=ProposalFit(0.4, 0.15))
    s = seqs(p, 1, 0.6)[0]
    p.admit(s)
    for _ in range(10):
        round_(p, s, 4, 4)
    round_(p, s, 4, 0)
    assert p.acceptance(s) > 0.7  # the last rounds weigh most (DECAY), ten accepted ones still outweigh one
    assert p.choose([s]) == [4]


def test_measured_steps_correct_a_bad_calibration():
    """A calibration where 2+ tokens looked 4x the cost of 1 (one preempted timing) turns
    speculation off; the timings of real steps, probes included, bring the curve back."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = CostModel([1, 2, 4, 8], [1.0, 4.0, 4.0, 4.0], proposals=ProposalFit(0.1, 0.1))
    s = seqs(p, 1, 0.8)[0]
    assert p.choose([s]) == [0]
    for _ in range(40):
        for seconds, tokens in ((1.0, 1), (1.2, 3), (1.3, 5)):
            p.observe(StepRecord([], [], [], [], [], step_seconds=seconds, tokens=tokens))
    assert abs(p.cost.verify(5) - 1.3) < 0.1
    assert p.choose([s])[0] >= 3


def test_calibration_caps_a_preempted_timing_instead_of_carrying_it_up(monkeypatch):
    clock = [0.0]
    costs = {1: 1.0, 2: 9.0, 4: 1.2, 8: 1.4}  # n=2 was preempted on every repeat

    def forward(n: int) -> None:
        clock[0] += costs[n]

    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: clock[0])
    c = CostModel.measure(forward, 8)
    assert c.token_counts == [1, 2, 4, 8]
    assert c.seconds == pytest.approx([1.0, 1.2, 1.2, 1.4])


def test_calibration_rounds_spread_a_busy_spell_over_every_count(monkeypatch):
    """A spell that slows every forward for as long as one count's repeats take (another model
    calibrating on the same cores) must not make that count look dearer than the rest."""
    clock, calls = [0.0], [0]
    costs = {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4}

    def forward(n: int) -> None:
        busy = 6 <= calls[0] < 12  # six calls: a count's warm-up and five repeats, timed back to back
        clock[0] += costs[n] * (5.0 if busy else 1.0)
        calls[0] += 1

    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: clock[0])
    c = CostModel.measure(forward, 8)
    assert c.seconds == pytest.approx([1.0, 1.1, 1.2, 1.4])


def test_draft_cost_ignores_catch_up_and_preempted_proposals():
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = memory_bound()
    before = p.cost.draft(4)
    p.observe_draft_time(2.0, 4, backlogs=[30])  # a proposal after a pause fed 30 tokens first
    assert p.cost.draft(4) == before
    for i in range(40):
        p.observe_draft_time(0.5 if i % 5 else 1.5, 4, backlogs=[3])  # one in five preempted
    assert abs(p.cost.draft(4) - 0.5) < 1e-9


def test_preempted_first_proposals_are_undone_by_a_shallower_one():
    """Three proposals at depth 4 preempted in a row (10x their cost) make depth 4 look dear and
    speculation stops; a paused policy's probes draft 2 deep. Under the fit's model a depth-4
    proposal costs at most twice a depth-2 one, so the first probes' timings bound it, and the
    policy drafts again."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = CostModel([1, 2, 4, 8], [1.0, 1.05, 1.1, 1.2], proposals=ProposalFit(0.1, 0.1))
    for _ in range(3):
        p.observe_draft_time(2.5, 4, backlogs=[3])
    assert p.cost.draft(4) > 2.0 and p.best([4], [0.8], [0.8], [False]) == (0, set())
    for _ in range(2):
        p.observe_draft_time(0.15, 2, backlogs=[3])
    assert p.cost.draft(2) == pytest.approx(0.15) and p.cost.draft(4) == pytest.approx(0.3)
    assert p.best([4], [0.8], [0.8], [False])[0] >= 2


def test_consistent_medians_believe_the_lower_side():
    assert cost_model.consistent([(2, 0.15, 8), (4, 2.5, 3)]) == [(2, 0.15, 8), (4, 0.3, 3)]  # at most 4/2 times
    assert cost_model.consistent([(1, 0.9, 2), (3, 0.3, 5)]) == [(1, 0.3, 2), (3, 0.3, 5)]  # at least the shallower
    ok = [(1, 0.1, 4), (2, 0.15, 4), (4, 0.25, 4)]
    assert cost_model.consistent(ok) == ok


def test_a_catch_up_is_fitted_per_entry_apart_from_the_proposal_cost():
    """A proposal that first fed entries beyond the steady ones (accepted tokens and bonus) times
    the catch-up: what it took past the fitted proposal, per entry, as the median of recent ones
    (one preempted catch-up does not move it); the proposal's own fit is left alone, and a
    catch-up too short to time is neither."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = memory_bound()
    draft = p.cost.draft(4)
    for i in range(9):  # 40 and 60 entries past the steady 5, at 0.01 each; one preempted
        extra = 100.0 if i == 4 else 0.01 * (40 if i % 2 else 60)
        p.observe_draft_time(draft + extra, 4, backlogs=[p.steady + (40 if i % 2 else 60), 2])
    assert p.cost.catch_up_per_entry == pytest.approx(0.01) and p.cost.draft(4) == draft
    p.observe_draft_time(draft + 5.0, 4, backlogs=[p.steady + policy.CATCH_UP_MIN_ENTRIES - 1])
    assert p.cost.catch_up_per_entry == pytest.approx(0.01) and p.cost.draft(4) == draft


def test_a_resume_is_charged_its_catch_up_over_the_steps_the_sequence_has_left():
    """Drafting pays a little (a cheap verify, a modest acceptance): a sequence in sync drafts, one
    whose drafter must first catch up on 200 entries does not if it has 30 tokens left (a catch-up
    of 10 steps' worth for about 15% more tokens per step over 15 steps), and does if it has 3000."""
    backlogs = {}
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k, backlog=lambda s: backlogs[s.slot])
    p.cost = CostModel([1, 8], [1.0, 1.2], proposals=ProposalFit(0.4, 0.05), catch_up_per_entry=0.05)
    for backlog, max_tokens, drafts in ((1, 30, True), (200, 30, False), (200, 3000, True)):
        [s] = seqs(p, 1, 0.5, max_tokens=max_tokens)
        backlogs[s.slot] = backlog
        assert (p.choose([s]) != [0]) == drafts, (backlog, max_tokens)
    p.cost.catch_up_per_entry = 0.0  # not measured yet: nothing charged
    [s] = seqs(p, 1, 0.5, max_tokens=30)
    backlogs[s.slot] = 200
    assert p.choose([s]) != [0]


@pytest.mark.parametrize("cost, free", [(compute_bound, 0), (memory_bound, 4)])
def test_seeded_sampled_requests_keep_their_cap_under_load(cost, free):
    """A seeded sampled request keeps its cap whatever the load (its output depends on its k
    schedule): the `num_draft_tokens` it asked, none where it asked none (a schedule the policy
    cannot pause is not the model's k by default). The other rows draft what the policy picks
    (`free`: none where compute-bound, the cap where verification is nearly free)."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = cost()
    batch = seqs(p, 6, 0.9) + seqs(p, 1, 0.9, temperature=0.8, seed=3) + seqs(p, 1, 0.9, temperature=0.8, seed=4,
                                                                       num_draft_tokens=2)
    batch += seqs(p, 1, 0.9, temperature=0.8) + seqs(p, 1, 0.9, seed=5)  # unseeded sampling; seeded greedy
    assert p.choose(batch) == [free] * 6 + [0, 2, free, free]
    fixed = Policy(max_k=4, adaptive=False, depth_for=lambda k: k)
    assert fixed.choose(batch) == [4] * 7 + [2, 4, 4]  # the fixed policy: every cap, the model's k


def test_probes_go_one_candidate_deeper_than_the_pick_and_at_least_two():
    """A probe of a paused batch drafts 2 tokens, not 1: one token measures neither beta nor how
    the proposal's cost grows with depth, and a draft model paused from its start at batch 1 then
    never learned that k = 4 paid (adaptive 1.03x where fixed k = 4 ran 1.21x)."""
    p = Policy(max_k=61, adaptive=True, depth_for=lambda k: min(k, 5))  # a 61-node tree
    p.cost = compute_bound()
    batch = seqs(p, 8, 0.6)
    assert p.choose(batch) == [0] * 8
    p.steps = 2 * PROBE_EVERY - 1
    assert p.choose(batch) == [2] * 8  # not 61 nodes each: a probe must stay cheap at high load


def test_while_the_batch_drafts_every_other_probe_runs_it_plain():
    """An anchor: the curve's points are set against plain steps, which a batch drafting at every
    step would otherwise never measure; it runs PLAIN_SETTLE + 1 steps, the last one settled
    (`test_the_anchor_is_a_settled_plain_step`), or, while the rate guard holds too few plain steps
    (here none: nothing is observed), GUARD_SETTLE + GUARD_ANCHOR_SAMPLES
    (`test_rate_guard.test_long_anchors_time_the_plain_rate_after_drafting_has_worn_off`); the
    probes in between still go one candidate deeper."""
    p = Policy(max_k=8, adaptive=True, depth_for=lambda k: k)
    p.cost = CostModel([1, 8, 64, 512], [1.0, 1.05, 1.3, 8.0], proposals=ProposalFit(0.025, 0.15))  # per row
    batch = seqs(p, 2, 0.6)
    picks = [p.choose(batch) for _ in range(4 * PROBE_EVERY)]
    pick = picks[0]
    assert 0 < pick[0] < 8 and pick[0] == pick[1]
    deeper = p.candidates[p.candidates.index(pick[0]) + 1]
    probes = {step: ks for step, ks in enumerate(picks, 1) if ks != pick}
    anchors = {step + i: [0, 0] for step in (2 * PROBE_EVERY, 4 * PROBE_EVERY)
               for i in range(policy.GUARD_SETTLE + policy.GUARD_ANCHOR_SAMPLES)}
    assert probes == {PROBE_EVERY: [deeper] * 2, 3 * PROBE_EVERY: [deeper] * 2} | {
        step: ks for step, ks in anchors.items() if step <= 4 * PROBE_EVERY}


def test_probes_back_off_while_speculation_stays_off_and_return_when_it_pays():
    """A batch where speculation never pays probes ever more rarely (each probe of a paused model
    drafter catches up on every pair since the last one); once it pays, probes resume every
    PROBE_EVERY steps."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = compute_bound()
    batch = seqs(p, 8, 0.6)
    probes = [step for step in range(1, 1001) if any(p.choose(batch))]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes[0] == PROBE_EVERY and gaps == sorted(gaps) and gaps[-1] == MAX_PROBE_GAP
    assert len(probes) <= 3 + 1000 // MAX_PROBE_GAP  # 16 at a fixed pace

    p.cost = memory_bound()  # the machine frees up: speculation pays, and probes return to their pace
    assert p.probe_gap == MAX_PROBE_GAP
    # at the next search of the paused batch (searches back off, up to PAUSED_RECHECK_MAX steps apart)
    assert any(min(p.choose(batch)) > 0 and p.probe_gap == PROBE_EVERY for _ in range(PAUSED_RECHECK_MAX))
    assert p.next_probe - p.steps <= PROBE_EVERY


def plain_until_drafting(p: Policy, batch: list[Sequence], step_seconds: float) -> list[int]:
    """Observe plain steps of `batch` (each `step_seconds`) until the policy drafts; that step's ks."""
    n = len(batch)
    while not any(ks := p.choose(batch)):
        p.observe(StepRecord(batch, ks, [0] * n, [0] * n, [0] * n, step_seconds=step_seconds, tokens=n))
    return ks


def probe_step(p: Policy, batch: list[Sequence], propose_seconds: float, fed: int = 1, step_seconds: float = 0.0) -> list[int]:
    """Run the policy to its next probe and report that probe's proposal time, which fed each
    drafting row `fed` entries first, and its step's (verification and the rest), then the
    follow-up that drafts the caught-up rows again (in sync, at the probe's time); the probe's ks."""
    while True:
        ks = p.choose(batch)
        if any(ks):
            p.observe(StepRecord(batch, ks, [min(k, 1) for k in ks], [0] * len(ks), [fed if k else 0 for k in ks],
                                 propose_seconds=propose_seconds, depth=1, tokens=len(batch) + sum(ks),
                                 step_seconds=step_seconds))
            if p.follow_up is not None:
                again = p.choose(batch)
                assert again == ks  # the same rows, as deep
                p.observe(StepRecord(batch, again, [min(k, 1) for k in again], [0] * len(again),
                                     [1 if k else 0 for k in again], propose_seconds=propose_seconds, depth=1,
                                     tokens=len(batch) + sum(again)))
            return ks


def test_a_probe_that_costs_more_than_its_budget_narrows_the_next_to_one_sequence():
    """While speculation is off, an expensive probe (a model drafter catching every row up on
    everything since the last one) makes the next probe draft only the best-accepting sequence; a
    cheap one keeps probing every row, so a batch can still learn that drafting pays."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = compute_bound()  # speculation stays off; one step of 8 tokens costs 8 units
    batch = seqs(p, 3, 0.6) + seqs(p, 1, 0.7) + seqs(p, 4, 0.6)
    step = p.cost.verify(len(batch))
    cheap = 0.5 * PROBE_BUDGET * step * PROBE_EVERY  # half the budget over the first gap
    assert probe_step(p, batch, cheap) == [2] * 8
    expensive = 1.5 * PROBE_BUDGET * step * 2 * PROBE_EVERY  # 1.5x the budget over the second gap
    assert probe_step(p, batch, expensive) == [2] * 8  # every row still: the last probe was within budget
    # that one went over the budget: the next probe drafts only the best-accepting row,
    assert probe_step(p, batch, expensive / 8) == [0, 0, 0, 2, 0, 0, 0, 0]
    # and is judged as if it had drafted every row: 8 x expensive / 8 over twice the steps, within
    assert probe_step(p, batch, 0.0) == [2] * 8


def test_a_probe_whose_catch_up_would_cost_more_than_its_budget_drafts_one_sequence():
    """While speculation is off, a probe drafts every row only where their catch-up fits the
    budget at the fitted cost per entry; before any catch-up was timed, rows with a backlog
    (a fresh batch's prompts) are probed one at a time. Rows in sync are probed together."""
    backlogs = {}
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k, backlog=lambda s: backlogs[s.slot])
    p.cost = compute_bound()
    batch = seqs(p, 3, 0.6) + seqs(p, 1, 0.7) + seqs(p, 4, 0.6)
    for s in batch:
        backlogs[s.slot] = 100
    assert probe_step(p, batch, 0.0) == [0, 0, 0, 2, 0, 0, 0, 0]  # no catch-up timed yet
    budget = PROBE_BUDGET * p.cost.verify(len(batch)) * p.probe_gap  # the next probe's, over its gap
    excess = 8 * (100 - p.steady)
    p.cost.catch_up_samples.append(0.5 * budget / excess)
    p.cost.catch_up_per_entry = 0.5 * budget / excess
    assert probe_step(p, batch, 0.0) == [2] * 8  # half the budget
    p.cost.catch_up_per_entry = 2.0 * PROBE_BUDGET * p.cost.verify(len(batch)) * p.probe_gap / excess
    assert probe_step(p, batch, 0.0) == [0, 0, 0, 2, 0, 0, 0, 0]  # twice it
    for s in batch:
        backlogs[s.slot] = 1
    assert probe_step(p, batch, 0.0) == [2] * 8  # in sync


def test_a_probe_of_the_best_sequence_alone_is_its_evidence_not_the_engine_wides():
    """A narrowed probe (and its follow-up) drafts the best-accepting sequence only: its rounds
    move that sequence's acceptances, not the engine-wide ones a newcomer starts at. A paused draft
    model's narrow probes of its best row lifted the engine-wide alpha to 0.88-0.96 at batch 8,
    and every fresh batch of 8 then drafted on it at once, catching up on its prompts. A probe of
    every row still moves it."""
    backlogs = {}
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k, backlog=lambda s: backlogs[s.slot])
    p.cost = compute_bound()  # speculation stays off
    batch = seqs(p, 3, 0.6) + seqs(p, 1, 0.7) + seqs(p, 4, 0.6)
    for s in batch:
        backlogs[s.slot] = 100
    before, best = p.alpha, p.acceptance(batch[3])

    def all_accepted(ks: list[int]) -> None:
        p.observe(StepRecord(batch, ks, ks, ks, [backlogs[s.slot] if k else 0 for s, k in zip(batch, ks)],
                             propose_seconds=0.0, depth=max(ks), tokens=len(batch) + sum(ks)))

    ks = plain_until_drafting(p, batch, step_seconds=8.0)
    assert ks == [0, 0, 0, 2, 0, 0, 0, 0]  # narrowed: no catch-up timed yet
    all_accepted(ks)
    assert p.choose(batch) == ks  # the follow-up, in sync
    backlogs[batch[3].slot] = 3
    all_accepted(ks)
    assert p.alpha == before and p.beta == before
    assert p.acceptance(batch[3]) > best
    newcomer = Sequence("new", [1, 2], SamplingParams(), lambda o: None, slot=next(SLOTS))
    p.admit(newcomer)
    assert p.acceptance(newcomer) == before
    for s in batch:  # in sync: the next probe drafts every row
        backlogs[s.slot] = 1
    ks = plain_until_drafting(p, batch, step_seconds=8.0)
    assert ks == [2] * 8
    all_accepted(ks)
    assert p.alpha > before


def test_a_probe_over_budget_at_batch_1_spaces_the_next_as_far_as_the_budget_needs():
    """At batch 1 a probe cannot be narrowed: one that cost more than its budget (EAGLE catching up
    on a whole prompt and output) moves the next probe out, past MAX_PROBE_GAP, to where its cost
    spread over the steps fits PROBE_BUDGET, at once and up to LONGEST_PROBE_GAP; when speculation
    pays again, probes return to their pace and the next pause is measured afresh."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = compute_bound()
    batch = seqs(p, 1, 0.6)
    probe_step(p, batch, 0.0)
    first = p.steps
    probe_step(p, batch, 300 * PROBE_BUDGET * p.cost.verify(1))  # fits the budget over 300 steps
    assert p.probe_gap == 300 and p.next_probe == p.steps + 300
    probe_step(p, batch, 0.0)
    assert p.steps == first + 2 * PROBE_EVERY + 300
    probe_step(p, batch, 5000 * PROBE_BUDGET * p.cost.verify(1))
    assert p.probe_gap == LONGEST_PROBE_GAP
    p.cost = memory_bound()
    assert min(p.choose(batch)) > 0 and p.probe_gap == PROBE_EVERY and p.affordable_gap == 0


def test_a_probes_verification_beyond_a_plain_step_counts_against_its_budget(monkeypatch):
    """A probe costs its proposal and its verification beyond a plain step: Medusa's proposal is a
    tenth of a plain step and its tree's verification 2-3x one. Here the proposal takes 100 steps'
    budget and the verification 200 more: the next probe goes 300 steps on, not 100 (which at
    MAX_PROBE_GAP put probes at 4% of a paused Medusa's steps at batch 1)."""
    monkeypatch.setattr(cost_model, "LOAD_RATE", 0.0)  # the probes' steps leave the load alone
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = compute_bound()
    batch = seqs(p, 1, 0.6)
    plain = p.cost.verify(1)
    budget = PROBE_BUDGET * plain
    probe_step(p, batch, 0.0, step_seconds=plain)
    probe_step(p, batch, 100 * budget, fed=0, step_seconds=plain + 200 * budget)
    assert p.probe_gap == 300 and p.next_probe == p.steps + 300


@pytest.mark.parametrize("per_entry, gap", [(0.5, 200), (10.0, 10 * policy.CATCH_UP_WINDOW + 100)])
def test_the_next_probe_is_spaced_for_the_catch_up_its_gap_will_cost(per_entry, gap, monkeypatch):
    """A probe's catch-up grows with the gap before it, an entry a step up to CATCH_UP_WINDOW: the
    next probe goes where its own drafting (here 100 steps' budget) and that catch-up, at the
    fitted cost per entry (here 0.5x and 10x a step's budget), fit the budget. Scaled from a
    probe alone (as if its 20 entries were all it will ever feed), the next would come 110 or 300
    steps on."""
    monkeypatch.setattr(cost_model, "LOAD_RATE", 0.0)  # the probes' untimed steps leave the load alone
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = compute_bound()
    batch = seqs(p, 1, 0.6)
    budget = PROBE_BUDGET * p.cost.verify(1)
    p.cost.catch_up_per_entry = per_entry * budget
    probe_step(p, batch, 0.0)
    probe_step(p, batch, 100 * budget + 20 * p.cost.catch_up_per_entry, fed=20)
    assert p.probe_gap == gap and p.next_probe == p.steps + gap


def counted_searches(p: Policy, monkeypatch, probes: bool = False) -> list[int]:
    """The step numbers at which `p` searches from now on (`best`); without `probes`, no probes."""
    if not probes:
        p.next_probe = 10**6
    searches: list[int] = []
    best = p.best
    monkeypatch.setattr(p, "best", lambda *a: searches.append(p.steps) or best(*a))
    return searches


def test_while_speculation_is_off_the_search_runs_every_few_steps_or_for_a_new_batch(monkeypatch):
    """Between probes a paused batch's inputs only drift, so the search (`best`) runs every
    PAUSED_RECHECK steps, at once for a new batch, and speculation resumes within those steps
    of starting to pay."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = compute_bound()
    batch = seqs(p, 2, 0.6)
    searches = counted_searches(p, monkeypatch, probes=True)
    for _ in range(PROBE_EVERY - 1):
        assert p.choose(batch) == [0, 0]
    assert searches == list(range(1, PROBE_EVERY, PAUSED_RECHECK))
    assert p.choose(seqs(p, 1, 0.6)) == [2] and searches[-1] == p.steps  # a new batch (a probe step: 2 deep)
    p.cost = memory_bound()
    resumed = next(n for n in range(1, PAUSED_RECHECK + 2) if min(p.choose(batch)) > 0)
    assert resumed <= PAUSED_RECHECK


def test_a_row_joining_or_leaving_a_paused_batch_keeps_its_schedule(monkeypatch):
    """A newcomer starts at the engine-wide acceptance a paused row drifts to: a paused batch that
    a row joins or leaves, the others running on, searches when its schedule says, not at once
    (users' requests come and go every few steps), and its newcomer runs plain until then."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = compute_bound()
    batch = seqs(p, 3, 0.6)
    searches = counted_searches(p, monkeypatch)
    assert p.choose(batch) == [0, 0, 0] and searches == [p.steps]
    newcomer = Sequence("new", [1, 2], SamplingParams(), lambda o: None, slot=next(SLOTS))
    changes = [batch[:2], batch[:2] + [newcomer], batch[1:] + [newcomer]]
    p.admit(newcomer)
    for rows in changes:
        assert p.choose(rows) == [0] * len(rows)
    assert searches == [p.steps - len(changes)]
    while len(searches) == 1:
        p.choose(changes[-1])
    assert searches[-1] == searches[0] + PAUSED_RECHECK


def test_searches_of_a_paused_batch_back_off_until_it_is_replaced_or_drafts(monkeypatch):
    """Each search that finds the same batch still off doubles the gap to the next, up to
    PAUSED_RECHECK_MAX; a new batch, or a step that drafted (a probe), searches at once and
    starts the gaps again."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = compute_bound()
    batch = seqs(p, 2, 0.6)
    searches = counted_searches(p, monkeypatch)
    for _ in range(300):
        assert p.choose(batch) == [0, 0]
    gaps = [b - a for a, b in zip(searches, searches[1:])]
    assert gaps[:4] == [PAUSED_RECHECK, 2 * PAUSED_RECHECK, 4 * PAUSED_RECHECK, 8 * PAUSED_RECHECK]
    assert max(gaps) == PAUSED_RECHECK_MAX and gaps == sorted(gaps)
    fresh = seqs(p, 1, 0.6)
    p.choose(fresh)  # a new batch: searched at once, and its gaps start again
    assert searches[-1] == p.steps
    searched = len(searches)
    for _ in range(PAUSED_RECHECK):
        p.choose(fresh)
    assert searches[searched:] == [p.steps]
    p.observe(StepRecord(fresh, [1], [1], [1], [1], propose_seconds=1e-4, depth=1, step_seconds=1e-3, tokens=2))
    p.choose(fresh)  # after a step that drafted
    assert searches[-1] == p.steps


def test_speculation_turns_off_per_sequence_where_its_gain_does_not_pay_its_verify_tokens():
    """At a moderate load the sequences that accept well draft, the others do not; and no choice of
    k and subset of sequences commits more tokens per second than the policy's pick (brute force)."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = CostModel([1, 8, 16, 64], [1.0, 1.2, 1.6, 9.0], proposals=ProposalFit(0.025, 0.0125))  # per row
    batch = seqs(p, 4, 0.9) + seqs(p, 4, 0.25)
    ks = p.choose(batch)
    assert min(ks[:4]) > 0 and ks[4:] == [0] * 4

    def rate(ks: list[int]) -> float:
        tokens = sum(expected_tokens(p.acceptance(s), k) for s, k in zip(batch, ks))
        return tokens / (p.cost.verify(sum(1 + k for k in ks)) + p.cost.draft(max(ks), sum(1 for k in ks if k)))

    for k in p.candidates:
        for subset in itertools.product([0, 1], repeat=len(batch)):
            assert rate(ks) >= rate([k * on for on in subset]) - 1e-12


def test_a_busy_spell_at_the_chosen_token_count_does_not_switch_speculation_off():
    """Other processes slow the machine 3x while the batch runs at the policy's pick: target and
    proposer costs rise alike (the load factor), so the pick stays. (Correcting only the curve's
    point at that count made it look 3x dearer than one token, and speculation stopped.)"""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = CostModel([1, 2, 4, 8], [1.0, 1.1, 1.3, 1.6], proposals=ProposalFit(0.1, 0.1))
    s = seqs(p, 1, 0.8)[0]
    [k] = p.choose([s])
    assert k == 4
    for _ in range(60):
        p.observe(StepRecord([s], [k], [k], [k], [1], propose_seconds=3 * 0.5, depth=k,
                             step_seconds=3 * 1.4, tokens=k + 1))
    p.observe_unobserved()  # the drafting batch's steps wait for its next search (DRAFTING_RECHECK)
    assert p.cost.load == pytest.approx(3.0, rel=0.05)
    assert p.choose([s]) == [4]


def test_the_curve_takes_its_shape_from_recent_steps_at_each_count_against_plain_ones():
    """A calibration that puts 5 tokens at 1.1x one token, and real steps that show 2x, in turns
    as a paused-and-probing policy runs them (plain steps settled: PLAIN_SETTLE): once each count
    has SHAPE_SAMPLES fresh steps the curve says 2x, whatever the load did (here it swings 1-3x);
    stale steps are not evidence."""
    c = CostModel([1, 2, 4, 8], [1.0, 1.05, 1.1, 1.2])
    for i in range(cost_model.SHAPE_SAMPLES):
        load = 1 + 2 * (i % 2)
        for n, seconds in [(1, 1.0)] * (PLAIN_SETTLE + 1) + [(5, 2.0)]:
            c.observe_verify(n, seconds * load, plain=1)
    # the medians: 1.0 x load and 2.0 x load over the same loads
    assert c.verify_at_calibration(5) / c.verify_at_calibration(1) == pytest.approx(2.0, rel=1e-6)
    assert c.verify_at_calibration(1) == 1.0  # the plain count is the anchor: contrasts never move it
    stale = CostModel([1, 8], [1.0, 1.1])
    for n in [1] * (PLAIN_SETTLE + cost_model.SHAPE_SAMPLES) + [9] * cost_model.SHAPE_FRESH + [8] * cost_model.SHAPE_SAMPLES:
        stale.observe_shape(n, 3.0 if n == 8 else 1.0, plain=1)
    assert stale.seconds[stale.token_counts.index(8)] == 1.1  # the plain steps are too old to compare with


def test_each_step_pairs_once():
    """A probe's 5-token step between settled plain steps is one pair, with the plain step before
    it, not one more with each settled plain step within PAIR_GAP after it; a step with no settled
    plain step before it pairs with the first after it."""
    c = CostModel([1, 2, 4, 8], [1.0, 1.05, 1.1, 1.2])
    for n in [1] * (PLAIN_SETTLE + 1) + [5] + [1] * PAIR_GAP:
        c.observe_verify(n, 2.0 if n == 5 else 1.0, plain=1)
    assert len(c.pairs[5]) == 1
    c = CostModel([1, 2, 4, 8], [1.0, 1.05, 1.1, 1.2])
    for n in [5] + [1] * PAIR_GAP:
        c.observe_verify(n, 2.0 if n == 5 else 1.0, plain=1)
    assert len(c.pairs[5]) == 1


def test_a_point_set_by_steps_follows_the_probes_pairs_once_its_batch_pauses():
    """A 5-token point set at 2x a plain step (15 drafting rounds in a busy spell), then the batch
    pauses and only probes run 5 tokens, one in 100 steps, at 1.5x: never SHAPE_SAMPLES of them
    within SHAPE_FRESH, yet the point follows their pairs to 1.5x (it stayed at 2x, and the
    policy paused on it for good)."""
    c = CostModel([1, 2, 4, 8], [1.0, 1.05, 1.1, 1.2])
    for _ in range(cost_model.SHAPE_SAMPLES):
        for n, seconds in [(1, 1.0)] * (PLAIN_SETTLE + 1) + [(5, 2.0)]:
            c.observe_verify(n, seconds, plain=1)
    assert c.verify_at_calibration(5) == pytest.approx(2.0)
    for _ in range(cost_model.SHAPE_SAMPLES):
        for n, seconds in [(1, 1.0)] * 100 + [(5, 1.5)]:
            c.observe_verify(n, seconds, plain=1)
    assert not c.fresh(5)
    assert c.seconds[c.token_counts.index(5)] == pytest.approx(1.5)


def test_a_few_accepted_probes_lift_the_engine_wide_acceptance_from_its_prior():
    """The engine-wide acceptances are counts with the prior's weight (PRIOR_TRIALS), not an EMA
    that starts at the prior with the weight of ~13 rounds: three fully accepted 4-token rounds
    (a paused draft model's probes) take alpha from 0.6 past 0.8 and beta past 0.85 (the EMA: 0.69)."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    s = Sequence("r", [1, 2], SamplingParams(), lambda o: None, slot=next(SLOTS))
    p.admit(s)
    assert p.alpha == p.beta == policy.PRIOR_ALPHA
    for _ in range(3):
        p.observe_round(p.slots[s.slot], 4, 4)
    assert p.alpha > 0.8 and p.beta > 0.85
    alpha, own = p.alpha, p.acceptance(s)
    p.observe_round(p.slots[s.slot], 0, 0)  # a round without a draft decays the sequence's evidence only
    assert p.alpha == alpha and p.acceptance(s) < own


@pytest.mark.parametrize("accepted, alpha, beta", [(4, 1.0, 1.0), (0, 0.0, policy.PRIOR_ALPHA), (2, 1.0, 0.5)])
def test_the_engine_wide_prior_fades_with_the_evidence(accepted, alpha, beta):
    """The start-up prior (PRIOR_TRIALS at PRIOR_ALPHA) decays with the engine-wide counts, so 100
    drafting rounds that all accepted `accepted` of 4 tokens set the estimates (beta keeps the
    prior where no round reached a second token). Kept at full weight beside counts of ~13 rounds,
    it held 13% for good (every round accepted: alpha 0.95; replayed real rounds were predicted
    6.4-9.0% too low). 20000 rounds do not wear it down to 0 / 0."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    [s] = seqs(p, 1, 0.5)
    for _ in range(100):
        p.observe_round(p.slots[s.slot], 4, accepted)
    assert p.alpha == pytest.approx(alpha, abs=0.005) and p.beta == pytest.approx(beta, abs=0.005)
    for _ in range(20000):
        p.observe_round(p.slots[s.slot], 1, 0)
    assert p.alpha == pytest.approx(0.0, abs=0.005) and 0.0 <= p.beta <= 1.0



def test_engine_wide_evidence_ages_with_the_steps_nothing_drafted_in():
    """While a batch is paused only probes add engine-wide rounds, hundreds of steps apart: the
    evidence before them decays once per PROBE_EVERY steps without a round (down to PRIOR_TRIALS),
    so after a hard stretch (every first token rejected) three accepted probes 2000 steps apart lift
    alpha past 0.6, where the same three rounds back to back leave it below 0.3; each probe moves it
    by about a third at most (its own round decays the rest once more)."""
    def hard_then_probes(gap: int) -> list[float]:
        p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
        [s] = seqs(p, 1, 0.5)
        for n in range(1, 21):
            p.observe_step(n, StepRecord([s], [4], [4], [0], [0]))
        alphas = [p.alpha]
        for n in range(21 + gap, 21 + 4 * gap, gap):
            p.observe_step(n, StepRecord([s], [4], [4], [4], [0]))
            alphas.append(p.alpha)
        return alphas

    aged, back_to_back = hard_then_probes(2000), hard_then_probes(1)
    assert aged[0] == back_to_back[0] < 0.1
    assert aged[-1] > 0.6 and back_to_back[-1] < 0.3
    assert all(after - before <= 0.36 * (1 - before) for before, after in zip(aged, aged[1:]))

def test_a_proposal_for_more_rows_costs_a_share_of_a_row_per_extra_row():
    """A proposal for m rows is predicted at 1 + share * (m - 1) one-row proposals: costs timed with
    one user do not make a batch of four look as cheap to draft for as one (charged once for four
    rows, the draft model served 4 users at 0.83-0.90x the baseline), nor as dear as four (charged
    per row, a batch of 8 paused where fixed k = 4 ran 1.25x). Once two row counts were timed, the
    share is the one that fits them."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = CostModel([1, 8, 64], [1.0, 1.05, 1.3], proposals=ProposalFit(0.3, 0.3))
    assert p.choose(seqs(p, 1, 0.9)) == [4]
    assert p.choose(seqs(p, 4, 0.9)) == [0] * 4
    assert p.cost.draft(4, rows=4) == pytest.approx(1.5 * (1 + 3 * cost_model.ROW_SHARE))
    c = CostModel([1, 8, 64], [1.0, 1.05, 1.3], proposals=ProposalFit(0.1, 0.1))
    for _ in range(8):
        for depth in (2, 4):
            c.observe_draft(depth, 0.1 + 0.05 * depth, rows=1)
            c.observe_draft(depth, (0.1 + 0.05 * depth) * (1 + 0.3 * 7), rows=8)
    assert c.proposals.row_share == pytest.approx(0.3)
    assert c.draft(4) == pytest.approx(0.3) and c.draft(4, rows=8) == pytest.approx(0.3 * 3.1)
    only_eight = CostModel([1, 8, 64], [1.0, 1.05, 1.3], proposals=ProposalFit(0.1, 0.1))
    for _ in range(8):
        only_eight.observe_draft(4, 2.0, rows=8)  # one row count: the share stays, the level follows
    assert only_eight.proposals.row_share == cost_model.ROW_SHARE and only_eight.draft(4, rows=8) == pytest.approx(2.0)

def test_proposals_timed_before_serving_start_the_fit():
    """The engine times proposals for one row and a full batch before serving: the fit starts
    from them (one-row fixed and per-level cost, and the rows' share), not from the guess."""
    c = CostModel([1, 8, 64], [1.0, 1.05, 1.3], proposals=ProposalFit(0.1, 0.1))
    c.proposals.start([(1, 2, 0.2), (1, 4, 0.3), (8, 2, 0.2 * 3.1), (8, 4, 0.3 * 3.1)])
    assert c.proposals.fixed == pytest.approx(0.1) and c.proposals.per_level == pytest.approx(0.05)
    assert c.proposals.row_share == pytest.approx(0.3)
    c.proposals.start([])  # nothing timed (no proposer drafted): the guess stays
    assert c.proposals.fixed == pytest.approx(0.1)


def test_the_curve_reads_its_points_non_decreasing():
    """Points real steps set between the start-up counts come from a few steps' medians and can
    dip (at batch 8: 14 tokens 5.2 ms, 16 4.2); the curve reads the closest non-decreasing
    points (pooled), so the policy does not chase the dips; a start-up point yields to a
    measured one (5 tokens measured at 2.0 lift the start-up 8 tokens' 1.5)."""
    measured = [1.0] * 8
    assert cost_model.rising([1.0, 2.0, 5.2, 4.2, 6.3, 7.7, 6.1, 7.1], measured) == pytest.approx(
        [1.0, 2.0, 4.7, 4.7, 6.3, 6.9, 6.9, 7.1])
    assert cost_model.rising([1.0, 2.0, 1.5], [1e-9, 1.0, 1e-9]) == pytest.approx([1.0, 2.0, 2.0])
    c = CostModel([8, 14, 16, 17], [2.0, 5.2, 4.2, 6.3], measured={14, 16})
    assert c.verify_at_calibration(14) == pytest.approx(4.7) and c.verify_at_calibration(16) == pytest.approx(4.7)
    assert c.seconds == [2.0, 5.2, 4.2, 6.3]  # the points themselves stay what the steps said


def test_a_paused_batchs_probe_that_caught_up_drafts_again_in_sync_and_times_the_proposal():
    """A probe of a paused batch whose rows first caught up is timed as a catch-up, not as a
    proposal; the next step drafts the same rows again, now in sync, which is: a proposal cost
    over-rated at start-up (timed under contention) is corrected while paused, as an under-rated
    one is by drafting."""
    backlogs = {}
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k, backlog=lambda s: backlogs[s.slot])
    p.cost = CostModel([1, 2, 4, 8], [1.0, 1.1, 1.3, 1.6], proposals=ProposalFit(5.0, 5.0))  # off
    [s] = seqs(p, 1, 0.9)
    backlogs[s.slot] = 60
    ks = plain_until_drafting(p, [s], step_seconds=1.0)
    p.observe(StepRecord([s], ks, [ks[0]], [ks[0]], [60], propose_seconds=0.5, depth=ks[0], step_seconds=1.2,
                         tokens=1 + ks[0]))
    assert p.cost.proposals.seen == 0  # a catch-up: not a proposal sample
    backlogs[s.slot] = 1 + ks[0]
    assert p.choose([s]) == ks  # the follow-up
    p.observe(StepRecord([s], ks, [ks[0]], [ks[0]], [1 + ks[0]], propose_seconds=0.2, depth=ks[0],
                         step_seconds=1.2, tokens=1 + ks[0]))
    assert p.cost.proposals.seen == 1 and p.cost.draft(ks[0]) == pytest.approx(0.2)


def test_the_servers_cost_per_row_and_step_makes_fewer_steps_worth_more():
    """A draft that loses on the engine's costs alone (4.5 tokens a step for 5 plain steps' time)
    pays once every row's response costs as much as a plain step: drafting makes fewer steps,
    and so fewer responses, for the same tokens."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = CostModel([1, 5], [1.0, 2.0], proposals=ProposalFit(0.6, 0.6))
    [s] = seqs(p, 1, 0.95)
    assert p.best([4], [0.95], [0.95], [False]) == (0, set())
    p.cost.observe_output(1.0)
    assert p.cost.output_plain == p.cost.output_drafting == 1.0  # the first sample sets both regimes
    assert p.best([4], [0.95], [0.95], [False])[0] > 0
    p.cost.observe_output(3.0)  # recent responses, averaged
    assert 1.0 < p.cost.output_plain < 3.0 and p.cost.output_drafting == 1.0


def test_each_regime_pays_its_own_output_cost():
    """Where a drafting batch's outputs cost more a row and step than a plain batch's (served at
    4 and 16 users plain steps' outputs leave together, drafting steps' alone), drafting is
    priced at its own: the draft that paid at one shared cost no longer does."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = CostModel([1, 5], [1.0, 2.0], proposals=ProposalFit(0.6, 0.6))
    seqs(p, 1, 0.95)
    p.cost.observe_output(1.0)
    assert p.best([4], [0.95], [0.95], [False])[0] > 0  # 4.52 tokens for 6 against 1 for 2
    for _ in range(60):
        p.cost.observe_output(6.0, drafting=True)
    assert p.cost.output_plain == 1.0 and p.cost.output_drafting > 4.6
    assert p.best([4], [0.95], [0.95], [False]) == (0, set())  # 4.52 for more than 10 against 1 for 2


def test_no_anchor_where_plain_steps_come_anyway():
    """Prompt lookup drafts nothing where the suffix matched nothing earlier: those steps are
    plain, and in runs (the next suffixes have no match either), so the curve has its settled
    anchor and every probe of the drafting batch drafts (without the plain steps, every other probe
    runs plain: `test_while_the_batch_drafts_every_other_probe_runs_it_plain`)."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = memory_bound()
    [s] = seqs(p, 1, 0.8)
    picks = []
    for step in range(24 * PROBE_EVERY):
        [k] = p.choose([s])
        depth = 0 if step % (4 * (PLAIN_SETTLE + 1)) <= PLAIN_SETTLE else k  # a quarter of the lookups find nothing
        p.observe(StepRecord([s], [k], [depth], [depth], [1 if k else 0], step_seconds=1.0 + 0.2 * depth,
                             tokens=1 + depth, depth=depth, propose_seconds=1e-3))
        picks.append(k)
    assert picks[12 * PROBE_EVERY:].count(0) == 0 and picks[-1] == 4  # once SHAPE_SAMPLES settled ones came (180 steps)


def test_a_busy_spell_during_a_rare_counts_steps_does_not_price_it_above_the_common_ones():
    """Steps are compared at the load of the steps before them: a count the batch ran mostly
    during a spell when the machine was 3x slower (prompt lookup's short matches at batch 1, say),
    then twice after it, is not set at 3x its cost against the quiet plain steps after the spell,
    and does not drag the common count above it up with it (the curve reads non-decreasing)."""
    true = [1.0 + 0.15 * (n - 1) for n in range(9)]  # seconds of n tokens, n >= 1
    c = CostModel([1, 2, 4, 8], [true[1], true[2], true[4], true[8]])
    settled = [1] * (PLAIN_SETTLE + 1)  # plain steps, the last settled
    quiet = [n for _ in range(100) for n in (*settled, 5)]
    busy = [n for _ in range(cost_model.SHAPE_SAMPLES - 1) for n in (*settled, 5, 4)]  # the rare count's steps, but one
    later = [n for _ in range(2) for n in [*settled, 5] * 5 + [4]]  # ... and two more once the spell is over
    for load, counts in ((1.0, quiet), (3.0, busy), (1.0, later)):
        for n in counts:
            c.observe_verify(n, true[n] * load, plain=1)
    plain = c.verify_at_calibration(1)
    assert c.verify_at_calibration(5) / plain == pytest.approx(true[5], rel=0.05)  # set from the spell: 2.25
    assert c.verify_at_calibration(4) <= c.verify_at_calibration(5)


def simulated_rate(seed: int, spell_load: float, adaptive: bool = True, steps: int = 3000) -> float:
    """Tokens per second of true time of one prompt-lookup-like sequence under a policy: a step of
    n tokens costs 1 + 0.15 (n - 1) (batch 1 on this CPU), a quarter of the lookups find nothing,
    in runs (after a miss the next lookup misses too 60% of the time: on the demo kit, fixed k = 4,
    26% of the steps were plain, in runs of 2.7 on average), a tenth of the others find 2-3 tokens, a draft's first token is accepted 80% of the time and each next
    95%; the timings the policy sees carry 10% jitter and, 1% of steps, a spell of 5-40 steps at
    `spell_load` times the cost (another process on the cores). Fixed k = 4 is the best pick here."""
    rng = random.Random(seed)
    cost = lambda n: 1.0 + 0.15 * (n - 1)  # noqa: E731
    p = Policy(max_k=4, adaptive=adaptive, depth_for=lambda k: k)
    p.cost = CostModel([1, 2, 4, 8], [cost(1), cost(2), cost(4), cost(8)], proposals=ProposalFit(0.005, 0.001))
    s = Sequence("r", [1, 2], SamplingParams(max_tokens=10**7), lambda o: None, slot=next(SLOTS))
    p.admit(s)
    spell, miss = 0, False
    tokens = seconds = 0.0
    for _ in range(steps):
        spell = rng.randint(5, 40) if not spell and rng.random() < 0.01 else max(spell - 1, 0)
        load = spell_load if spell else 1.0
        [k] = p.choose([s])
        miss = rng.random() < (0.6 if miss else 0.4 / 3)  # 0.25 of the lookups: 0.4 / 3 / (0.4 / 3 + 0.4)
        r = rng.random()
        depth = 0 if miss else min(k, 2) if r < 0.05 else min(k, 3) if r < 0.1 else k
        accepted = 0
        if depth and rng.random() < 0.8:
            accepted = 1
            while accepted < depth and rng.random() < 0.95:
                accepted += 1
        p.observe(StepRecord([s], [k], [depth], [accepted], [1 if k else 0], propose_seconds=0.005 * load if depth else 0.0,
                             depth=depth, step_seconds=cost(1 + depth) * load * rng.lognormvariate(0, 0.1), tokens=1 + depth))
        tokens += 1 + accepted
        seconds += cost(1 + depth)
    return tokens / seconds


@pytest.mark.parametrize("spell_load, share", [(1.0, 0.975), (2.0, 0.96)])
def test_noisy_timings_cost_the_adaptive_policy_a_few_percent_at_most(spell_load, share):
    """Where fixed k = 4 is the best pick, the adaptive policy, reading jittery timings and busy
    spells, commits at least `share` of its tokens per second (median of 8 runs; 98.5% and 97.4%,
    97.2% with spells at 3x). With its misses in runs, the policy before pairs and settled plain
    steps (see `test_a_batch_drafting_every_step_keeps_the_true_shape_against_settled_plain_steps`)
    kept 99.7%, 97.9% and 96.0%: its anchors were one plain step, the pairs' are three. Before each
    step was set against the load of its time, over 15 steps a count, not 5, and points weighed by
    how often and how lately their count ran (and with an anchor every 32 steps where plain steps
    came anyway), it kept 96.5% and 93.6% here (misses not in runs); with spells at 3x, 95.3%."""
    adaptive = statistics.median(simulated_rate(seed, spell_load) for seed in range(8))
    fixed = statistics.median(simulated_rate(seed, spell_load, adaptive=False) for seed in range(8))
    assert adaptive / fixed >= share


def draft_model_rate(seed: int, adaptive: bool = True, steps: int = 4000, first: float = 0.92, later: float = 0.93) -> float:
    """Tokens per second of true time of a draft-model-like method at batch 1, as a share of the
    plain rate: requests of 128 tokens after a 100-token prompt; a step of n tokens costs
    1 + 0.45 (n - 1), a proposal 0.55 + 0.15 a level and 0.065 an entry it catches up on past its
    steady feed (a newcomer's prompt, a resume's pause: the demo kit's draft model at batch 1); a
    draft's first token is accepted with `first`, each next with `later`, the one before it
    accepted; the timings the policy sees carry 10% jitter. At 0.92 and 0.93 fixed k = 4 gains
    1.09x (the demo kit's 1.15x)."""
    rng = random.Random(seed)
    cost = lambda n: 1.0 + 0.45 * (n - 1)  # noqa: E731
    fed: dict[int, int] = {}  # slot -> tokens its drafter has seen
    p = Policy(max_k=4, adaptive=adaptive, depth_for=lambda k: k, backlog=lambda s: len(s.tokens) - fed[s.slot])
    p.cost = CostModel([1, 2, 4, 8], [1.0, 1.05, 1.3, 2.2], proposals=ProposalFit(0.1, 0.1))  # a calibration's
    tokens = seconds = 0.0
    s = None
    for _ in range(steps):
        if s is None or len(s.output_ids) >= 128:
            if s is not None:
                p.release(s.slot)
            s = Sequence("r", list(range(100)), SamplingParams(max_tokens=128), lambda o: None, slot=next(SLOTS))
            fed[s.slot] = 0
            p.admit(s)
        [k] = p.choose([s])
        backlog = len(s.tokens) - fed[s.slot] if k else 0
        accepted = 0
        if k and rng.random() < first:
            accepted = 1
            while accepted < k and rng.random() < later:
                accepted += 1
        propose = 0.55 + 0.15 * k + 0.065 * max(backlog - p.steady, 0) if k else 0.0
        p.observe(StepRecord([s], [k], [k], [accepted], [backlog], propose_seconds=propose * rng.lognormvariate(0, 0.1),
                             depth=k, step_seconds=cost(1 + k) * rng.lognormvariate(0, 0.1), tokens=1 + k))
        s.tokens += [0] * (accepted + 1)
        s.output_ids += [0] * (accepted + 1)
        if k:
            fed[s.slot] = len(s.tokens) - 1
        tokens += 1 + accepted
        seconds += cost(1 + k) + propose
    return tokens / seconds


def test_where_drafting_paid_a_noisy_model_does_not_pause_it(monkeypatch):
    """A draft model at batch 1 whose drafting pays 1.09x: the model's ratio is noisy near the
    threshold (one rejected first token moves a sequence's acceptance from 0.92 to 0.6-0.8, a
    newcomer's prompt is charged to its first steps), and every pause costs the resume's catch-up.
    Where the guard saw drafting pay, the policy drafts on while its model rates drafting at
    least DRAFTING_FLOOR of plain: 97-99% of fixed k = 4's rate; pausing on the model's word, 93-96%
    (96% since each step pairs once in the curve's shape, `CostModel.observe_shape`; 95% before).
    Where drafting loses, the guard never says it paid, and the policy stays near the plain rate."""
    fixed = [draft_model_rate(seed, adaptive=False) for seed in range(6)]
    ratio = lambda rates: statistics.median(r / f for r, f in zip(rates, fixed))  # noqa: E731
    floored = ratio([draft_model_rate(seed) for seed in range(6)])
    assert floored >= 0.97
    losing = [draft_model_rate(seed, first=0.7, later=0.8) for seed in range(3)]
    assert statistics.median(losing) >= 0.97 and max(draft_model_rate(seed, adaptive=False, first=0.7, later=0.8)
                                                      for seed in range(3)) < 0.8
    monkeypatch.setattr(policy, "DRAFTING_FLOOR", float("inf"))
    assert ratio([draft_model_rate(seed) for seed in range(6)]) < floored - 0.015


def test_a_batch_drafting_every_step_takes_its_curve_from_its_anchors():
    """Where every step drafts, the only plain steps are the anchors (one in 2 * PROBE_EVERY
    steps): SHAPE_FRESH must hold SHAPE_SAMPLES of them, or the curve is never set from steps. A
    calibration that says 5 tokens cost 1.1x one, and steps that cost 2x: the curve follows the
    steps (with the window at 256 steps and 15 samples it stayed at 1.32x)."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = CostModel([1, 2, 4, 8], [1.0, 1.02, 1.06, 1.1], proposals=ProposalFit(0.01, 0.01))
    [s] = seqs(p, 1, 0.95)
    cost = lambda n: 1.0 + 0.25 * (n - 1)  # noqa: E731
    for _ in range(2 * PROBE_EVERY * (cost_model.SHAPE_SAMPLES + 2)):
        [k] = p.choose([s])
        p.observe(StepRecord([s], [k], [k], [k], [1 if k else 0], propose_seconds=0.01, depth=k,
                             step_seconds=cost(1 + k), tokens=1 + k))
    assert p.cost.verify_at_calibration(5) / p.cost.verify_at_calibration(1) == pytest.approx(cost(5), rel=0.1)


def test_a_batch_drafting_every_step_keeps_the_true_shape_against_settled_plain_steps():
    """A batch of one drafting k = 4 at every step on a machine of steady speed: a step of n
    tokens costs 1 + 0.25 (n - 1), and the first and second plain steps after drafted ones 1.13x
    and 1.04x a settled one (in-process at batch 8). From a calibration that says 5 tokens cost
    1.8x one, the curve reads 2x within 1000 steps and keeps it. Its steps set against the load
    (which follows the curve they set) and against an anchor's first plain step, 5 tokens read
    2.67x after 1000 steps (1.66x with that residue), drifting back over thousands; with the
    anchors kept fresh, they swung to the curve's bounds (1.0-3.6x)."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = CostModel([1, 2, 4, 8], [1.0, 1.2, 1.6, 2.4], proposals=ProposalFit(0.01, 0.01))
    [s] = seqs(p, 1, 0.95)
    residue = [1.13, 1.04]  # the first and second plain step after a drafted one
    since_draft, ratios = 0, []
    for step in range(1, 5001):
        [k] = p.choose([s])
        since_draft = 0 if k else since_draft + 1
        seconds = 1 + 0.25 * k if k else residue[since_draft - 1] if since_draft <= len(residue) else 1.0
        p.observe(StepRecord([s], [k], [k], [k], [1 if k else 0], propose_seconds=0.01, depth=k,
                             step_seconds=seconds, tokens=1 + k))
        if step % 1000 == 0:
            ratios.append(p.cost.verify_at_calibration(5) / p.cost.verify_at_calibration(1))
    assert ratios == pytest.approx([2.0] * 5, rel=0.03)


def batch_run(observe_at_once: bool, cost: Callable[[], CostModel] = compute_bound,
              step_time: Callable[[int], float] = float, steps: int = 3000) -> tuple[list[list[int]], tuple, int]:
    """A batch of 8 under `cost`, its steps of n tokens taking step_time(n) with 10% jitter (by
    default speculation does not pay: the batch is paused but for its probes), and a row replaced
    by a newcomer every 150 steps: the ks chosen at each step, the policy's state at the end and
    the most steps it left unobserved at once."""
    rng = random.Random(3)
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = cost()
    if observe_at_once:
        p.observe = lambda step: p.observe_step(p.steps, step)
    new = lambda slot: Sequence(f"r{slot}", [1, 2], SamplingParams(max_tokens=10**7), lambda o: None, slot=slot)  # noqa: E731
    batch = [new(slot) for slot in range(8)]
    for s in batch:
        p.admit(s)
    trace, held = [], 0
    for step in range(steps):
        if step % 150 == 149:  # a row ends, a newcomer takes its slot
            i = step // 150 % 8
            p.release(batch[i].slot)
            batch[i] = new(batch[i].slot)
            p.admit(batch[i])
        ks = p.choose(batch)
        accepted = [rng.randint(0, k) for k in ks]
        n = len(batch) + sum(ks)
        p.observe(StepRecord(batch, ks, list(ks), accepted, [1 if k else 0 for k in ks],
                             propose_seconds=0.05 * (1 + max(ks)) if any(ks) else 0.0, depth=max(ks),
                             step_seconds=step_time(n) * rng.lognormvariate(0, 0.1), tokens=n))
        trace.append(ks)
        held = max(held, len(p.unobserved) + len(p.coasted))
    p.observe_unobserved()
    c, g = p.cost, p.guard.batches[8, False]
    state = (c.load, c.seconds, c.plain_run, c.steps, {m: list(r.ordered) for m, r in c.plain_steps.items()},
             {slot: (st.acceptance, st.later) for slot, st in p.slots.items()}, (p.alpha, p.beta),
             list(g.plain.steps), list(g.drafting.steps), p.probe_gap, p.next_probe, p.recheck_at)
    return trace, state, held


def test_a_release_within_a_step_leaves_the_plain_steps_for_the_next_search():
    """A sequence finishes within a step (its output phase): observing the paused batch's plain
    steps there would put the policy's time into the step's, which the cost model reads as the
    target's. They wait for the next search, which skips the finished sequence's rounds."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = compute_bound()
    p.next_probe = 10**6
    batch = seqs(p, 2, 0.6)
    for _ in range(PAUSED_RECHECK // 2):
        ks = p.choose(batch)
        p.observe(StepRecord(batch, ks, ks, [0, 0], [0, 0], step_seconds=2e-3, tokens=2))
    held = len(p.coasted)
    p.release(batch[1].slot)
    assert held and len(p.coasted) == held
    evidence = p.slots[batch[0].slot].accepted_n
    p.recheck_at = p.steps + 1  # a search due: it observes the steps first
    p.choose(batch[:1])
    assert not p.coasted and p.slots[batch[0].slot].accepted_n == pytest.approx(evidence * policy.DECAY ** held)


def test_a_paused_batchs_plain_steps_observed_later_leave_the_policy_as_observed_at_once(monkeypatch):
    """While `choose` coasts (a paused batch, nothing to search), its plain steps are observed
    together at the next search, probe or admission: the policy must choose the same ks at every
    step and end in the same state as one that observed each step at once, exactly where every
    plain step is timed; where only the latest PLAIN_TIMED of a run are, the same but for what
    the others' times would have moved: the load and the curve by under 1%, and the guard's
    plain window, which holds a subset of the steps."""
    at_once = batch_run(observe_at_once=True)
    later = batch_run(observe_at_once=False)
    assert later[0] == at_once[0] and any(map(any, later[0]))  # the same ks, probes among them
    assert later[2] >= PAUSED_RECHECK and at_once[2] == 0  # steps were left unobserved, then observed
    (load, curve, *counts, plain, drafting, probe_gap, next_probe, recheck_at), exact = later[1], at_once[1]
    assert load == pytest.approx(exact[0], rel=0.01) and load != exact[0]
    assert curve == pytest.approx(exact[1], rel=0.01)
    assert counts == list(exact[2:7])  # plain run, steps, the plain point's samples, acceptances
    assert set(plain) < set(exact[7]) and len(plain) >= GUARD_MIN_PLAIN
    assert (drafting, probe_gap, next_probe, recheck_at) == tuple(exact[8:])
    monkeypatch.setattr(policy, "PLAIN_TIMED", 10**9)
    assert batch_run(observe_at_once=False)[1] == exact


def test_a_coasting_paused_batch_is_handed_what_a_checked_choose_would_hand_it(monkeypatch):
    """Between searches `choose` hands a paused batch of plain rows its kept ks for `coast_left`
    steps without its checks: the ks at every step and the state after are those of a policy
    that checks every step, through probes, newcomers and releases."""
    choose, coasted = Policy.choose, []

    def counted(self, seqs):
        coasted.append(self.coast_left > 0)
        return choose(self, seqs)

    def checked(self, seqs):
        self.coast_left = 0
        return choose(self, seqs)

    monkeypatch.setattr(Policy, "choose", counted)
    fast = batch_run(observe_at_once=False)
    assert sum(coasted) > len(coasted) // 2  # most steps coasted
    monkeypatch.setattr(Policy, "choose", checked)
    assert batch_run(observe_at_once=False)[:2] == fast[:2]


def test_a_drafting_batchs_steps_observed_later_leave_the_policy_as_observed_at_once():
    """A drafting batch keeps its ks for DRAFTING_RECHECK steps and its steps are observed together
    at the next search: the same ks at every step, and the same state after, as a policy that
    observed each step at once (its searches read the same observations either way)."""
    flat = lambda n: 8 + n / 8  # noqa: E731  (verification nearly free: the batch drafts)
    later, at_once = batch_run(False, memory_bound, flat), batch_run(True, memory_bound, flat)
    drafted = sum(1 for ks in later[0] if any(ks))
    assert later[0] == at_once[0] and drafted > len(later[0]) // 2
    assert later[1] == at_once[1]
    assert later[2] >= DRAFTING_RECHECK and at_once[2] == 0


def test_a_drafting_batch_searches_again_after_drafting_recheck_steps_or_a_new_batch(monkeypatch):
    """While the same batch drafts, `best` searches every DRAFTING_RECHECK steps (the ks in between
    are its last pick's); a changed batch searches at once."""
    p = Policy(max_k=4, adaptive=True, depth_for=lambda k: k)
    p.cost = memory_bound()
    batch = seqs(p, 2, 0.9)
    searches = counted_searches(p, monkeypatch)
    picks = []
    for _ in range(5 * DRAFTING_RECHECK):
        picks.append(p.choose(batch))
        p.observe(StepRecord(batch, picks[-1], picks[-1], picks[-1], [1, 1], propose_seconds=1e-4,
                             depth=max(picks[-1]), step_seconds=1e-3, tokens=2 + sum(picks[-1])))
    assert min(map(min, picks)) > 0
    assert searches == list(range(1, 5 * DRAFTING_RECHECK, DRAFTING_RECHECK))
    assert len(p.unobserved) == DRAFTING_RECHECK  # observed at the next search
    p.choose(batch[:1])
    assert searches[-1] == p.steps and not p.unobserved
