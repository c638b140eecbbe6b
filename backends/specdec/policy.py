"""How many tokens to draft this step, per sequence: fixed, or adaptive to acceptance and batch load.

Adaptive: each sequence keeps an estimate alpha of its per-token acceptance (the geometric MLE
accepted / (accepted + rejections), smoothed). A draft of depth d then commits on average
(1 - alpha^(d+1)) / (1 - alpha) tokens. The step's cost is the target's verify time for the
batch's total tokens (measured once at start-up over token counts) plus the proposer's time
(measured online). The policy picks the k that maximizes committed tokens per second over the
batch, so at high load, where verify time grows with every extra token, k falls, down to 0
(speculation off). A sequence whose alpha collapses gets k = 0 on its own; its alpha then
drifts back towards the prior, so it is retried later.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Callable

from .sequence import Sequence

PRIOR_ALPHA = 0.6
SMOOTHING = 0.3
COLLAPSE_ALPHA = 0.15
RECOVERY_PER_STEP = 0.01


def expected_tokens(alpha: float, depth: int) -> float:
    if alpha >= 0.999:
        return depth + 1.0
    return (1 - alpha ** (depth + 1)) / (1 - alpha)


@dataclass
class CostModel:
    """Seconds for a target forward over n tokens (interpolated) and for drafting one depth level."""

    token_counts: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    draft_seconds_per_level: float = 0.0

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
        return cls(counts, seconds, draft_seconds_per_level=0.1 * seconds[0])


class Policy:
    def __init__(self, max_k: int, adaptive: bool, depth_for: Callable[[int], int]) -> None:
        self.max_k, self.adaptive, self.depth_for = max_k, adaptive, depth_for
        self.cost: CostModel | None = None
        self.candidates = sorted({0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, max_k} & set(range(max_k + 1)))

    def cap(self, seq: Sequence) -> int:
        k = seq.params.num_draft_tokens
        return self.max_k if k is None else min(k, self.max_k)

    def choose(self, seqs: list[Sequence]) -> list[int]:
        caps = [self.cap(s) for s in seqs]
        if not self.adaptive or self.cost is None or self.max_k == 0:
            return caps
        on = [s.acceptance_ema >= COLLAPSE_ALPHA for s in seqs]
        best_k, best_rate = 0, 0.0
        for k in self.candidates:
            ks = [min(k, c) if o else 0 for c, o in zip(caps, on)]
            depth_cost = self.depth_for(max(ks)) if max(ks) > 0 else 0
            seconds = self.cost.verify(sum(1 + kk for kk in ks)) + depth_cost * self.cost.draft_seconds_per_level
            tokens = sum(expected_tokens(s.acceptance_ema, self.depth_for(kk)) if kk else 1.0
                         for s, kk in zip(seqs, ks))
            if tokens / seconds > best_rate:
                best_k, best_rate = k, tokens / seconds
        return [min(best_k, c) if o else 0 for c, o in zip(caps, on)]

    def observe(self, seq: Sequence, depth_drafted: int, accepted: int) -> None:
        """Update a sequence's acceptance after a round that drafted to depth `depth_drafted`."""
        if depth_drafted == 0:
            seq.acceptance_ema = min(PRIOR_ALPHA, seq.acceptance_ema + RECOVERY_PER_STEP)
            return
        rejections = 0 if accepted >= depth_drafted else 1
        sample = accepted / (accepted + rejections) if accepted + rejections else seq.acceptance_ema
        seq.acceptance_ema += SMOOTHING * (sample - seq.acceptance_ema)

    def observe_draft_time(self, seconds: float, depth: int) -> None:
        if self.cost is not None and depth > 0:
            per_level = seconds / depth
            self.cost.draft_seconds_per_level += SMOOTHING * (per_level - self.cost.draft_seconds_per_level)
