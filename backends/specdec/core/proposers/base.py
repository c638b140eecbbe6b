"""The one small interface every proposer implements (vLLM v1 style: proposers know nothing of
verification). The engine calls, per step: `propose` for the running sequences, then after
verification `commit` with the target's hidden states of the root and the accepted nodes."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from specdec.core.sequence import Sequence
from specdec.core.verify import Draft


class Proposer(Protocol):
    max_k: int  # the largest number of draft tokens (tree nodes) it proposes per step

    def depth_for(self, k: int) -> int:
        """How deep a draft of k tokens (tree nodes) reaches: what its proposal time grows with."""

    def allocate(self, num_slots: int, capacity: int) -> None:
        """Reserve per-slot state (a KV cache for model-based proposers)."""

    def prefill(self, seqs: list[Sequence], features: list[Tensor]) -> None:
        """New sequences were prefilled; features[b]: the target's hidden states over the prompt."""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """Up to ks[b] draft tokens below each sequence's last token (k = 0: an empty draft)."""

    def commit(self, seq: Sequence, path: list[int], features: Tensor) -> None:
        """seq.tokens gained the accepted path and the bonus token; features: target hidden of root + path."""

    def release(self, slot: int) -> None:
        """The slot's sequence left the batch."""
