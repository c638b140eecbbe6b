"""Prompt lookup decoding: propose what followed the latest earlier occurrence of the current suffix.

No model at all; the draft is deterministic (one-hot q), so it verifies exactly under sampling too.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from torch import Tensor

from specdec.core.config import EngineConfig
from specdec.core.errors import ConfigurationError
from specdec.core.proposers.registry import Target, register
from specdec.core.sequence import Sequence
from specdec.core.verify import Draft


def lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """What followed an earlier match of the longest suffix n-gram (max_n..min_n).

    The most recent match that still has k tokens after it wins; without one, the match with the
    longest continuation. (In a repeating span the most recent match sits right before the suffix
    and would offer a single token.) Vectorized: this runs for every sequence at every step.
    """
    L = len(tokens)
    arr = np.asarray(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        windows = sliding_window_view(arr[: L - 1], n)  # window i = tokens[i : i + n], i <= L - n - 1
        matches = np.flatnonzero((windows == arr[L - n :]).all(axis=1))
        if matches.size:
            full = matches[matches + n + k <= L]
            i = int(full[-1] if full.size else matches[0])
            return tokens[i + n : i + n + k]
    return []


class NgramProposer:
    def __init__(self, k: int = 4, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ConfigurationError(f"ngram needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_k, self.min_n, self.max_n = k, min_n, max_n

    def depth_for(self, k: int) -> int:
        return min(k, self.max_k)  # a chain

    def allocate(self, num_slots: int, capacity: int) -> None:
        pass

    def prefill(self, seqs: list[Sequence], features: list[Tensor]) -> None:
        pass

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        return [Draft.chain(lookup(s.tokens, k, self.min_n, self.max_n)) if k > 0 else Draft.empty()
                for s, k in zip(seqs, ks)]

    def commit(self, seq: Sequence, path: list[int], features: Tensor) -> None:
        pass

    def release(self, slot: int) -> None:
        pass


@register("ngram")
def build(cfg: EngineConfig, target: Target) -> NgramProposer:
    p = cfg.proposer
    return NgramProposer(p.k, p.ngram_min, p.ngram_max)
