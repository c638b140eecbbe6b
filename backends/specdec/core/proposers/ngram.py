"""Prompt lookup decoding: propose what followed the latest earlier occurrence of the current suffix.

No model at all; the draft is deterministic (one-hot q), so it verifies exactly under sampling too.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from torch import Tensor

from specdec.core.config import EngineConfig, ProposerConfig
from specdec.core.errors import ConfigurationError
from specdec.core.proposers.registry import Target, register
from specdec.core.sequence import Sequence
from specdec.core.verify import Draft


@dataclass
class NgramIndex:
    """Where every n-gram (min_n..max_n tokens) of one sequence starts, extended as it grows.

    A lookup is then a dict probe and a bisection per n. Searching the whole context with numpy
    on every step cost 30-80 us per sequence on a 200-token context: a tenth of a plain step at
    batch 1, and at batch 8 a quarter of one."""

    min_n: int
    max_n: int
    starts: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # ascending
    indexed: int = 0  # the n-grams ending before this token are recorded

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """What followed an earlier match of the longest suffix n-gram (max_n..min_n).

        The most recent match that still has k tokens after it wins; without one, the match with
        the longest continuation. (In a repeating span the most recent match sits right before the
        suffix and would offer a single token.) `tokens` only grows between calls."""
        for end in range(self.indexed, len(tokens)):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.starts.setdefault(tuple(tokens[end - n + 1 : end + 1]), []).append(end - n + 1)
        L = self.indexed = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            found = self.starts.get(tuple(tokens[L - n :]), [])
            earlier = bisect_right(found, L - n - 1)  # matches that end before the suffix does
            if earlier:
                full = bisect_right(found, L - n - k, 0, earlier)  # ... and have k tokens after them
                i = found[full - 1] if full else found[0]
                return tokens[i + n : i + n + k]
        return []


def lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """`NgramIndex.lookup` on a fresh index: one sequence, once."""
    return NgramIndex(min_n, max_n).lookup(tokens, k)


class NgramProposer:
    commits_undrafted = False  # its index catches up on the tokens themselves (`backlog`)
    drafts_in = None  # no drafter model

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ConfigurationError(
                f"prompt lookup needs 1 <= ngram_min <= ngram_max, got ngram_min={min_n}, ngram_max={max_n} "
                f"(ngram_min defaults to {ProposerConfig.ngram_min}: a shorter ngram_max needs it set too)")
        self.max_k, self.min_n, self.max_n = k, min_n, max_n
        self.indexes: dict[int, NgramIndex] = {}  # per slot

    def depth_for(self, k: int) -> int:
        return min(k, self.max_k)  # a chain

    def allocate(self, num_slots: int, capacity: int) -> None:
        pass

    def prefill(self, seqs: list[Sequence], features: list[Tensor]) -> None:
        pass

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        return [Draft.chain(self.index(s).lookup(s.tokens, k)) if k > 0 else Draft.empty() for s, k in zip(seqs, ks)]

    def index(self, seq: Sequence) -> NgramIndex:
        index = self.indexes.get(seq.slot)
        if index is None:
            index = self.indexes[seq.slot] = NgramIndex(self.min_n, self.max_n)
        return index

    def backlog(self, seq: Sequence) -> int:
        # the tokens its index has not recorded yet (all of them, with no window: a lookup must see
        # the whole context); 1.5 us a token, which after a pause made a probe's proposal time
        # look 5-10x a drafting one's to the proposal-cost fit
        return len(seq.tokens) - self.index(seq).indexed

    def commit(self, seq: Sequence, path: list[int], hidden: Tensor, row: int) -> None:
        pass

    def release(self, slot: int) -> None:
        self.indexes.pop(slot, None)


@register("ngram")
def build(cfg: EngineConfig, target: Target) -> NgramProposer:
    p = cfg.proposer
    return NgramProposer(p.k, p.ngram_min, p.ngram_max)
