"""The adaptive policy's last word on drafting: the rate each regime realized, as timed.

The policy picks k from a fitted model of costs (the target's curve, the proposal's cost, the
catch-ups, the server's output) and the acceptances. Wherever that model is wrong in drafting's
favour, the policy drafts at a loss and nothing it measures says so: served at 4 and 16 users
(`make demo`, 2 cores), adaptive EAGLE drafted nearly every step at 0.82-0.84x of the baseline's
tokens/s while its model rated drafting 1.23x the plain rate; the served throughput of every
method tracked its engine time per committed token. So the guard keeps, per batch size and path
(greedy, or with a sampled row: `Policy.batch_key`), the
committed tokens and engine seconds (proposal, the policy's own time, step:
`StepRecord.proposal_seconds`) of the recent steps of each regime:
drafting (every step the policy drafted by its own choice, with the catch-ups of newcomers and
resumes, the probes and anchors' first plain steps that drafting brings) and plain (plain steps
settled after `policy.GUARD_SETTLE` others: a paused batch's, and the last of a long anchor's,
which is where a drafting batch times them, `wants_plain`). When drafting's rate falls below
GUARD_RATIO of the plain rate over the same window, drafting is vetoed for that batch for
GUARD_HOLD steps, each veto doubling the next one's hold (up to GUARD_HOLD_MAX); a judgment
at or above the plain rate resets it. Where drafting had been judged at
the plain rate or above since the previous veto, the batch owes a re-trial of
PAID_MIN_DRAFTED drafting steps once the hold ends (`retrial_due`): the policy drafts its best
drafting pick where its model rates that at least `policy.DRAFTING_FLOOR` of plain, and drafts on
so where they paid (`paid`). The policy's model still decides where drafting looks best, the k
and the rows. Where drafting realized at least the plain rate, the guard also lets the policy go
on drafting where its model rates drafting a little below plain (`paid`,
`policy.DRAFTING_FLOOR`): those steps are drafting's, judged with it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Hashable

GUARD_WINDOW = 512  # steps: each regime's samples within the last this many (the policy's step count).
# A drafting batch times a settled plain step once in 2 * PROBE_EVERY steps (its anchors): 512
# steps hold 16 of them
GUARD_MIN_PLAIN = 8  # settled plain steps ...
GUARD_MIN_DRAFTED = 64  # ... and drafting steps in the window before the rates are compared
PAID_MIN_DRAFTED = 16  # drafting steps before `paid` reads their rate: the draft model at batch 1
# paused for good after 44 drafting steps at 1.22x the plain rate, before GUARD_MIN_DRAFTED
GUARD_RATIO = 0.97  # drafting is vetoed below this share of the plain rate: a margin for the
# window's noise, so that a method drafting at par (where a veto gains nothing) is rarely vetoed
GUARD_HOLD = 256  # steps a first veto holds; each veto doubles the next one's ...
GUARD_HOLD_MAX = 4096  # ... up to this


@dataclass
class Window:
    """Committed tokens and seconds of recent steps, summed."""

    steps: deque[tuple[int, int, float]] = field(default_factory=deque)  # (step, tokens, seconds)
    tokens: int = 0
    seconds: float = 0.0

    def add(self, step: int, tokens: int, seconds: float) -> None:
        self.steps.append((step, tokens, seconds))
        self.tokens += tokens
        self.seconds += seconds

    def trim(self, oldest: int) -> None:
        """Drop the steps before `oldest`."""
        while self.steps and self.steps[0][0] < oldest:
            _, tokens, seconds = self.steps.popleft()
            self.tokens -= tokens
            self.seconds -= seconds

    def clear(self) -> None:
        self.steps.clear()
        self.tokens, self.seconds = 0, 0.0

    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def __len__(self) -> int:
        return len(self.steps)


@dataclass
class BatchRates:
    """One batch's two regimes and its veto."""

    drafting: Window = field(default_factory=Window)
    plain: Window = field(default_factory=Window)
    hold: int = GUARD_HOLD  # steps the next veto holds
    until: int = 0  # drafting is vetoed before this step
    vetoes: int = 0
    retrial_left: int = 0  # drafting steps a re-trial still owes once the hold ends (`RateGuard.retrial_due`)
    paid_since_veto: bool = False  # drafting was judged at the plain rate or above since the last veto


class RateGuard:
    """Per batch (`Policy.batch_key`: its size, and whether a row samples), vetoes drafting while
    its realized rate trails the plain rate."""

    def __init__(self) -> None:
        self.batches: dict[Hashable, BatchRates] = {}  # by the policy's key: a batch's size and path
        self.vetoes = 0  # every batch's, since start (`specdec:drafting_vetoes`)

    def wants_plain(self, batch: Hashable, step: int) -> bool:
        """Are there fewer than GUARD_MIN_PLAIN settled plain steps of `batch` in the window? Then
        a drafting batch's next anchor runs long enough to add some (`policy.GUARD_SETTLE`)."""
        rates = self.batches.get(batch)
        if rates is None:
            return True
        rates.plain.trim(step - GUARD_WINDOW)
        return len(rates.plain) < GUARD_MIN_PLAIN

    def paid(self, batch: Hashable, step: int) -> bool:
        """Did drafting `batch` (at least PAID_MIN_DRAFTED steps within the window, since its last
        veto) realize at least the plain rate of the window (at least GUARD_MIN_PLAIN steps)? A
        drafting spell older than the window says nothing of the load now."""
        rates = self.batches.get(batch)
        if rates is None:
            return False
        rates.drafting.trim(step - GUARD_WINDOW)
        rates.plain.trim(step - GUARD_WINDOW)
        return (len(rates.drafting) >= PAID_MIN_DRAFTED and len(rates.plain) >= GUARD_MIN_PLAIN
                and rates.drafting.rate() >= rates.plain.rate())

    def vetoed(self, batch: Hashable, step: int) -> bool:
        rates = self.batches.get(batch)
        return rates is not None and step < rates.until

    def retrial_due(self, batch: Hashable, step: int) -> bool:
        """Has a veto's hold on `batch` ended, with fewer than PAID_MIN_DRAFTED drafting steps
        since, where drafting had been judged at the plain rate or above between that veto and
        the one before? Then the policy drafts those steps where its model rates drafting at least
        `policy.DRAFTING_FLOOR` of plain, and `paid` judges them. A veto comes after
        drafting looked bad, and the policy's acceptances are then at their lowest: at batch 1
        they stay so while the batch is paused (only a probe's rounds move them, one in hundreds
        of steps), and the model that picked drafting no longer does. Left to it, the demo kit's
        draft model, vetoed once at 0.96x of a plain rate its fixed k = 4 beats by 1.14x, stayed
        paused for 800 steps after its hold of 256 ended, and adaptive ran 1.01x the baseline. Owed
        after every veto, served at 16 users (batch sizes changing every few steps, each vetoed in
        turn, holds of ~0.6 s) the draft model read 0.94x / 0.89x / 0.94x the baseline in three
        load tests where the guard without re-trials read 1.02x / 0.94x / 0.99x in turn with
        them; only a veto of drafting that had paid since the one before is likely the noise's.
        Where drafting loses (a simulation at batch 1 accepting 0.7 and 0.8, `test_policy`) no
        re-trial is owed (0.979x the plain rate with and without; owed after every veto, 0.977x;
        lasting until the full judgment, 64 steps, 0.965x)."""
        rates = self.batches.get(batch)
        return rates is not None and rates.retrial_left > 0 and step >= rates.until

    def add(self, batch: Hashable, step: int, tokens: int, seconds: float, drafting: bool) -> None:
        """A step of `batch` that committed `tokens` in `seconds`: drafting's, or a
        settled plain one. After a drafting step, the regimes are compared."""
        rates = self.batches.get(batch)
        if rates is None:
            rates = self.batches[batch] = BatchRates()
        oldest = step - GUARD_WINDOW
        window = rates.drafting if drafting else rates.plain
        window.add(step, tokens, seconds)
        # trimmed as it grows, not only where the regimes are compared: a batch paused for good
        # adds a plain step at every step and compares nothing, and its window held every step
        # since the pause (3865 entries after 8 requests of 500 tokens at batch 1)
        window.trim(oldest)
        if not drafting:
            return
        if rates.retrial_left and step >= rates.until:
            rates.retrial_left -= 1  # at 0 the re-trial has had its say: `paid` reads it from here
        rates.plain.trim(oldest)
        if len(rates.drafting) < GUARD_MIN_DRAFTED or len(rates.plain) < GUARD_MIN_PLAIN:
            return
        drafted, plain = rates.drafting.rate(), rates.plain.rate()
        if drafted < GUARD_RATIO * plain:
            rates.until = step + rates.hold
            rates.hold = min(2 * rates.hold, GUARD_HOLD_MAX)
            rates.vetoes += 1
            self.vetoes += 1
            rates.retrial_left = PAID_MIN_DRAFTED if rates.paid_since_veto else 0
            rates.paid_since_veto = False
            rates.drafting.clear()  # a re-trial is judged on its own steps
        elif drafted >= plain:
            rates.hold = GUARD_HOLD
            rates.paid_since_veto = True
