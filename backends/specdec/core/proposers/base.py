"""The one small interface every proposer implements (vLLM v1 style: proposers know nothing of
verification). The engine calls, per step: `propose` for the running sequences, then after
verification `commit` with the target's hidden states of the root and the accepted nodes."""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import Tensor

from specdec.core.sampling import mask_eos, probs, sample
from specdec.core.sequence import Sequence
from specdec.core.verify import Draft


class Proposer(Protocol):
    max_k: int  # the largest number of draft tokens (tree nodes) it proposes per step
    # does `commit` keep anything for a row that drafted nothing (EAGLE's and Medusa's target
    # features)? Where not (the draft model, prompt lookup), the engine skips it for such rows
    commits_undrafted: bool
    # the type its drafter's native matmuls took (`linear.narrow`: `draft_dtype` or the next wider
    # type this CPU has), or None where it has no drafter model (prompt lookup)
    drafts_in: str | None

    def depth_for(self, k: int) -> int:
        """How deep a draft of k tokens (tree nodes) reaches: what its proposal time grows with."""

    def allocate(self, num_slots: int, capacity: int) -> None:
        """Reserve per-slot state (a KV cache for model-based proposers)."""

    def prefill(self, seqs: list[Sequence], features: list[Tensor]) -> None:
        """New sequences were prefilled; features[b]: the target's hidden states over the prompt."""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """Up to ks[b] draft tokens below each sequence's last token (k = 0: an empty draft)."""

    def backlog(self, seq: Sequence) -> int:
        """Committed entries of seq its next proposal must feed first, its catch-up (a model
        drafter's at most CATCH_UP_WINDOW; prompt lookup's index has no window): 0 for proposers
        with no per-sequence state to keep in sync. The policy charges a resume with it."""

    def commit(self, seq: Sequence, path: list[int], hidden: Tensor, row: int) -> None:
        """seq.tokens gained the accepted path and the bonus token; `hidden` is the step's target
        hidden states [B, T, H], `row` the sequence's: the features of its root and path are
        `path_features(hidden, row, path)`, to be made when a proposal reads them (the draft
        model and prompt lookup need none; EAGLE and Medusa keep the three until then: slicing
        them every step of a paused drafter was 1.5-2% of a plain step at batch 1, and a closure
        per row and step that would slice them, kept by a paused EAGLE for every step of its
        catch-up window, 1-2% in the objects it kept alive)."""

    def release(self, slot: int) -> None:
        """The slot's sequence left the batch."""


def path_offsets(path: list[int] | tuple[int, ...] | range) -> list[int]:
    """Where a step's root and accepted nodes (`path`: their draft indices, in order) lie among
    its row's tokens: the root first, draft node i at i + 1."""
    return [0] + [i + 1 for i in path]


def path_features(hidden: Tensor, row: int, path: list[int] | tuple[int, ...] | range) -> Tensor:
    """The hidden states [1 + len(path), H] of a step's root and accepted nodes in `row` of its
    hidden states [B, T, H] (`path_offsets`): a view where they lie in order (a chain), else a
    gather."""
    states = hidden[row]
    if not path or path[-1] == len(path) - 1:
        return states[: 1 + len(path)]
    return states[path_offsets(path)]


def feature_addresses(hidden: Tensor, row: int, path: list[int] | tuple[int, ...] | range) -> list[int]:
    """Where each of `path_features(hidden, row, path)`'s rows lies in memory (a float32 `hidden`
    whose last dimension is contiguous, as every step's is): a native chain reads them there. Made
    as plain ints, the features of an EAGLE catch-up cost no tensor operations: sliced and joined
    into one tensor they were ~35 us of a ~0.7 ms proposal at batch 1 (the interpreter's caches
    cold after each forward)."""
    base, step = hidden.data_ptr() + row * hidden.stride(0) * 4, hidden.stride(1) * 4
    return [base + offset * step for offset in path_offsets(path)]


RIDE_ALONG_TOKENS = 8  # a paused row with at most this many pending tokens catches up with the drafting rows
CATCH_UP_WINDOW = 256  # a model drafter's catch-up feeds at most a sequence's latest this many
# tokens: further back, its cache restarts with them (at positions counted from the window's
# start: rotary attention sees only their differences) and the earlier ones are dropped. A
# catch-up's cost grew with the pause before it: after 900 tokens a paused EAGLE's probe at batch
# 1 took 46 ms, the head run on every pair, so spacing probes out saved nothing per step on a long
# output. Drafts then see at most this much context (verification keeps the output exact whatever
# they see); a sequence that drafts every step is never more than k + 1 behind.


def restart_at_window(fed: dict[int, int], shift: dict[int, int], slot: int, end: int) -> int:
    """Bring a slot's catch-up (its drafter holds what comes before `fed[slot]`, of `end`) within
    CATCH_UP_WINDOW of `end`: further back, the drafter's cache restarts there (`fed` and `shift`
    move to it). Returns how many pending entries that skips."""
    skipped = max(end - CATCH_UP_WINDOW - fed[slot], 0)
    if skipped:
        fed[slot] = shift[slot] = fed[slot] + skipped
    return skipped


def catch_up_length(end: int, fed: int) -> int:
    """How many of a slot's entries before `end` a catch-up feeds, the drafter holding those before `fed`."""
    return min(end - fed, CATCH_UP_WINDOW)


def window_positions(shift: dict[int, int], seqs: list[Sequence], positions: list[int]) -> list[int]:
    """Each sequence position as a drafter whose cache restarted `shift[slot]` positions in sees
    it: where its entry is written and what it attends to, and its rotary position (attention sees
    only the differences of those)."""
    return [p - shift[s.slot] for s, p in zip(seqs, positions)]


def catch_up_rows(
    seqs: list[Sequence], ks: list[int], backlog: Callable[[Sequence], int]
) -> tuple[list[Sequence], list[int]]:
    """The sequences a model drafter feeds to its catch-up forward this proposal (`backlog`: how
    many committed tokens the drafter has not seen yet for a sequence), and the row among them of
    each drafting sequence (k > 0), in order.

    The rows that draft must; a paused row rides along while its backlog is short (it costs
    little in the same batched forward, and a sequence that resumes then drafts at once instead of
    feeding its pause first). A long-paused row catches up only when it drafts again: when the
    policy drafts for a few sequences, the drafter must not prefill every paused row's backlog
    with them (at batch 8, EAGLE's catch-up on 16-48 steps of 8 rows took 17-31 ms, against a
    4.5 ms step)."""
    picked = [(s, k > 0) for s, k in zip(seqs, ks) if k > 0 or backlog(s) <= RIDE_ALONG_TOKENS]
    return [s for s, _ in picked], [i for i, (_, drafts) in enumerate(picked) if drafts]


def eos_until(seqs: list[Sequence], eos_ids: list[int]) -> list[int]:
    """Per sequence, the last draft depth (1 = right after the root) at which EOS is forbidden:
    its draft token there would still be owed to min_tokens (0: none)."""
    return [s.params.min_tokens - len(s.output_ids) if eos_ids else 0 for s in seqs]


def next_draft_tokens(
    seqs: list[Sequence], logits: Tensor, depth: int, eos_ids: list[int]
) -> tuple[list[int], list[Tensor | None]]:
    """Each row's draft token at `depth` (1 = right after the root), chosen the way the target will
    be sampled: greedy rows take the argmax (one host transfer for the whole batch), sampled rows
    draw from their own q, which rejection sampling needs. EOS is forbidden while a sequence still
    owes min_tokens. The one place chain drafters (draft model, EAGLE-1) pick their tokens."""
    owing = [depth <= until for until in eos_until(seqs, eos_ids)]
    if any(owing):
        logits = mask_eos(logits, eos_ids, torch.tensor(owing))
    argmax = logits.argmax(-1).tolist() if any(s.params.greedy for s in seqs) else None
    tokens: list[int] = []
    qs: list[Tensor | None] = []
    for b, s in enumerate(seqs):
        q = None if s.params.greedy else probs(logits[b : b + 1], s.params)[0]
        tokens.append(argmax[b] if q is None else sample(q, s.generator))
        qs.append(q)
    return tokens, qs
