"""How many tokens to draft this step, per sequence: fixed, or adaptive to acceptance and batch load.

Adaptive: each sequence keeps an estimate alpha of its per-token acceptance (the geometric MLE
accepted / (accepted + rejections), smoothed). A draft of depth d then commits on average
(1 - alpha^(d+1)) / (1 - alpha) tokens. The step's cost is the target's verify time for the
batch's total tokens (measured once at start-up over token counts) plus the proposer's time,
fixed + per_level * depth, fitted online by least squares over recent proposals (a proposal
also catches up on the tokens committed since the last one, which costs the same whatever k is). The policy picks the k that maximizes committed tokens per second over the
batch, so at high load, where verify time grows with every extra token, k falls, down to 0
(speculation off). A sequence whose alpha collapses gets k = 0 on its own; its alpha then
drifts back towards the engine-wide acceptance, so it is retried later. New sequences start at
the engine-wide acceptance (acceptance is mostly a property of the proposer and the workload),
so a well-measured proposer is not switched off for every newcomer.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .sequence import Sequence

PRIOR_ALPHA = 0.6
SMOOTHING = 0.3
COLLAPSE_ALPHA = 0.15
RECOVERY_PER_STEP = 0.01
PROBE_EVERY = 16  # sequences not speculating draft a little every this many engine steps times the
PROBE_K = 2  # batch size (a probe costs more in a big batch), all on the same step (a batch is
# padded to its longest draft), so acceptance stays measured and speculation can come back


def expected_tokens(alpha: float, depth: int) -> float:
    if alpha >= 0.999:
        return depth + 1.0
    return (1 - alpha ** (depth + 1)) / (1 - alpha)


@dataclass
class CostModel:
    """Seconds for a target forward over n tokens (interpolated) and for a proposal of some depth."""

    token_counts: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    draft_fixed: float = 0.0
    draft_per_level: float = 0.0
    draft_samples: deque = field(default_factory=lambda: deque(maxlen=64))

    def draft(self, depth: int) -> float:
        return self.draft_fixed + self.draft_per_level * depth if depth > 0 else 0.0

    def observe_draft(self, depth: int, seconds: float) -> None:
        """Refit fixed + per_level * depth. A sample counts at most 3x the current prediction:
        one proposal that caught up on a whole prompt must not switch speculation off for good
        (while it is off there are no new samples to correct the estimate)."""
        predicted = self.draft(depth)
        self.draft_samples.append((depth, min(seconds, 3 * predicted) if predicted > 0 else seconds))
        depths = [d for d, _ in self.draft_samples]
        times = [t for _, t in self.draft_samples]
        mean_d, mean_t = sum(depths) / len(depths), sum(times) / len(times)
        var = sum((d - mean_d) ** 2 for d in depths)
        if var > 0:
            slope = sum((d - mean_d) * (t - mean_t) for d, t in self.draft_samples) / var
            self.draft_per_level = max(slope, 0.0)
            self.draft_fixed = max(mean_t - self.draft_per_level * mean_d, 0.0)
        elif predicted > 0:  # one depth seen so far: keep the shape, match the level
            scale = mean_t / self.draft(int(mean_d))
            self.draft_fixed *= scale
            self.draft_per_level *= scale

    def verify(self, n: int) -> float:
        i = bisect_left(self.token_counts, n)
        if i == 0:
            return self.seconds[0]
        if i == len(self.token_counts):
            return self.seconds[-1] * n / self.token_counts[-1]
        n0, n1 = self.token_counts[i - 1], self.token_counts[i]
        s0, s1 = self.seconds[i - 1], self.seconds[i]
        return s0 + (s1 - s0) * (n - n0) / (n1 - n0)

    @classmethod
    def measure(cls, forward: Callable[[int], None], max_tokens: int, repeats: int = 3) -> "CostModel":
        counts = [1]
        while counts[-1] < max_tokens:
            counts.append(min(counts[-1] * 2, max_tokens))
        seconds = []
        for n in counts:
            forward(n)  # warm-up
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                forward(n)
                best = min(best, time.perf_counter() - t0)
            seconds.append(best)
        for i in range(1, len(seconds)):  # more tokens never cost less: smooth out timer noise
            seconds[i] = max(seconds[i], seconds[i - 1])
        # until proposals are timed: a proposer step costs a tenth of a target step
        return cls(counts, seconds, draft_fixed=0.1 * seconds[0], draft_per_level=0.1 * seconds[0])


class Policy:
    def __init__(self, max_k: int, adaptive: bool, depth_for: Callable[[int], int]) -> None:
        self.max_k, self.adaptive, self.depth_for = max_k, adaptive, depth_for
        self.cost: CostModel | None = None
        self.alpha = PRIOR_ALPHA  # engine-wide acceptance over recent rounds
        self.steps = 0
        self.candidates = sorted({0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, max_k} & set(range(max_k + 1)))

    def cap(self, seq: Sequence) -> int:
        k = seq.params.num_draft_tokens
        return self.max_k if k is None else min(k, self.max_k)

    def choose(self, seqs: list[Sequence]) -> list[int]:
        caps = [self.cap(s) for s in seqs]
        if not self.adaptive or self.cost is None or self.max_k == 0:
            return caps
        self.steps += 1
        on = [s.acceptance_ema >= COLLAPSE_ALPHA for s in seqs]
        best_k, best_rate = 0, 0.0
        for k in self.candidates:
            ks = [min(k, c) if o else 0 for c, o in zip(caps, on)]
            depth_cost = self.depth_for(max(ks)) if max(ks) > 0 else 0
            seconds = self.cost.verify(sum(1 + kk for kk in ks)) + self.cost.draft(depth_cost)
            tokens = sum(expected_tokens(s.acceptance_ema, self.depth_for(kk)) if kk else 1.0
                         for s, kk in zip(seqs, ks))
            if tokens / seconds > best_rate:
                best_k, best_rate = k, tokens / seconds
        ks = [min(best_k, c) if o else 0 for c, o in zip(caps, on)]
        if self.steps % (PROBE_EVERY * len(seqs)) == 0:
            ks = [k or min(PROBE_K, c) for k, c in zip(ks, caps)]
        return ks

    def admit(self, seq: Sequence) -> None:
        seq.acceptance_ema = self.alpha

    def observe(self, seq: Sequence, depth_drafted: int, accepted: int) -> None:
        """Update a sequence's acceptance after a round that drafted to depth `depth_drafted`."""
        if depth_drafted == 0:  # not drafting: a collapsed estimate drifts back up
            if seq.acceptance_ema < self.alpha:
                seq.acceptance_ema = min(self.alpha, seq.acceptance_ema + RECOVERY_PER_STEP)
            return
        rejections = 0 if accepted >= depth_drafted else 1
        sample = accepted / (accepted + rejections) if accepted + rejections else seq.acceptance_ema
        seq.acceptance_ema += SMOOTHING * (sample - seq.acceptance_ema)
        self.alpha += SMOOTHING / 4 * (sample - self.alpha)

    def observe_draft_time(self, seconds: float, depth: int) -> None:
        if self.cost is not None and depth > 0:
            self.cost.observe_draft(depth, seconds)
