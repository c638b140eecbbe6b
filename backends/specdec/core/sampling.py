"""Per-request sampling parameters and the logits -> probabilities transform shared by target and draft.

The same transform (min-tokens EOS mask, temperature, top-k, top-p) must be applied to the
target's and the proposer's logits before the accept test, or rejection sampling would target
the wrong distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdec.core.errors import InvalidRequest


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    num_draft_tokens: int | None = None  # per-request cap on speculation (0 = none)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, max_new_tokens: int | None = None) -> None:
        """Raise InvalidRequest naming the first bad argument."""
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if max_new_tokens is not None and self.max_tokens > max_new_tokens:
            raise InvalidRequest(f"max_tokens {self.max_tokens} exceeds the limit of {max_new_tokens}")
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or t < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0.0 < p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidRequest(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequest(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        k = self.num_draft_tokens
        if k is not None and (not isinstance(k, int) or k < 0):
            raise InvalidRequest(f"num_draft_tokens must be an integer >= 0, got {k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequest(f"seed must be a non-negative integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty strings")

    def generator(self) -> torch.Generator | None:
        """A per-request (CPU) generator: seeded requests reproduce, whatever else shares the batch."""
        if self.greedy:
            return None
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        return g


def mask_eos(logits: Tensor, eos_ids: list[int], rows_needing_more: Tensor) -> Tensor:
    """Forbid EOS on the rows that would end the output before min_tokens."""
    if not eos_ids or not bool(rows_needing_more.any()):
        return logits
    logits = logits.clone()
    rows = rows_needing_more.to(logits.device)
    for eos in eos_ids:
        logits[rows, eos] = float("-inf")
    return logits


def probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Rows of logits [N, V] -> the distribution a sample is drawn from.

    Computed on the CPU in float64 whatever the model's device: sampling then uses the request's
    CPU generator, so a seeded request gives the same tokens on any device and batch.
    """
    logits = logits.detach().to("cpu", torch.float64)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(p, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        sorted_p = sorted_p.masked_fill(before >= params.top_p, 0.0)
        p = torch.zeros_like(p).scatter(-1, order, sorted_p)
        p = p / p.sum(-1, keepdim=True)
    return p


def sample(p: Tensor, generator: torch.Generator | None) -> int:
    """One draw from `p` (weights over the vocabulary, [V], normalized or not): its cumulative sum
    inverted at one uniform from `generator`. `torch.multinomial` took ~80 us a draw over the demo
    kit's 2048 tokens, this ~16: a sampled step draws once a row, and once more per draft token a
    sampled drafter proposes (the draft model at batch 1, k = 4: 1328 draws, 0.13 s of a 0.95 s
    run). A token of weight 0 is never drawn (the first index whose sum exceeds the uniform)."""
    cumulative = torch.cumsum(p, 0)
    u = torch.rand((), generator=generator, dtype=cumulative.dtype) * cumulative[-1]
    i = int(torch.searchsorted(cumulative, u, right=True))
    # u < the total but for rounding, where the last token of nonzero weight is the one
    return i if i < len(cumulative) else int(torch.nonzero(p)[-1])
