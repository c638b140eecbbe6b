"""Drafts (chains and trees) and their lossless verification against the target's logits.

A draft hangs below the sequence's last committed token (the root, not yet in the KV cache).
The target runs root + draft nodes in one forward; logits row 0 belongs to the root and row
i + 1 to node i, so row r is the target's distribution for the token that follows r.

Greedy: walk down while a child equals the target's argmax. Sampling: recursive rejection
(SpecInfer): at each node try the children in order, accepting child c with probability
min(1, p(c) / q_c(c)); a rejection replaces p by norm(max(0, p - q_c)). A node whose children
are all rejected ends the walk with a token sampled from the remaining p. Children picked
deterministically (top-k heads, prompt lookup) have one-hot q, which makes this exact for them too.

Typical acceptance (Medusa-2) is the one lossy option, off unless configured: a child is kept when
the target gives it probability above min(threshold, alpha * exp(-entropy of p)). Output then no
longer follows the target's distribution exactly; greedy requests are unaffected.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.core.sampling import SamplingParams, mask_eos, probs, sample


@dataclass(eq=False)
class TreeShape:
    """A draft's structure, worked out once: static trees (Medusa's, chains of each length) build it
    at construction and every step reuses it, instead of rebuilding depths, children and the
    attention mask in Python per sequence per step."""

    parents: list[int]  # parent node index, -1 for the root; parents come before children
    depths: list[int]  # 1 = a child of the root
    children: dict[int, list[int]]  # node (-1: root) -> its children, in order
    mask: Tensor  # [n + 1, n + 1] bool, row/col 0 the root, i + 1 node i: True where the row sees the column
    is_chain: bool

    @classmethod
    def build(cls, parents: list[int]) -> "TreeShape":
        n = len(parents)
        depths: list[int] = []
        children: dict[int, list[int]] = {}
        mask = torch.eye(n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, p in enumerate(parents):
            if not -1 <= p < i:
                raise ValueError(f"draft node {i} has parent {p}: parents must come before their children")
            depths.append(1 if p < 0 else depths[p] + 1)
            children.setdefault(p, []).append(i)
            if p >= 0:
                mask[i + 1] |= mask[p + 1]
        return cls(list(parents), depths, children, mask, parents == list(range(-1, n - 1)))


@functools.lru_cache(maxsize=None)
def chain_shape(n: int) -> TreeShape:
    return TreeShape.build(list(range(-1, n - 1)))


@dataclass
class Draft:
    tokens: list[int]
    parents: list[int]  # parent node index, -1 for the root; parents come before children
    q: Tensor | None = None  # [n, V] distribution each node was sampled from; None: chosen deterministically
    shape: TreeShape | None = None  # the parents' structure; built on first use when not given

    @classmethod
    def chain(cls, tokens: list[int], q: Tensor | None = None) -> "Draft":
        shape = chain_shape(len(tokens))
        return cls(tokens, shape.parents, q, shape)

    @classmethod
    def empty(cls) -> "Draft":
        return cls.chain([])

    def __len__(self) -> int:
        return len(self.tokens)

    def tree(self) -> TreeShape:
        if self.shape is None:
            self.shape = TreeShape.build(self.parents)
        return self.shape

    def is_chain(self) -> bool:
        return self.tree().is_chain

    def depths(self) -> list[int]:
        return self.tree().depths

    def children(self) -> dict[int, list[int]]:
        return self.tree().children


def tree_mask(draft: Draft, size: int) -> Tensor:
    """[size, size] bool: row/col 0 is the root, i + 1 is node i; True where the row sees the column.

    Rows past the draft (batch padding) see only themselves, so attention stays well defined.
    """
    mask = torch.eye(size, dtype=torch.bool)
    n = len(draft) + 1
    mask[:n, :n] = draft.tree().mask
    return mask


@dataclass
class TypicalAcceptance:
    threshold: float = 0.09
    alpha: float = 0.3


@dataclass
class Verdict:
    path: list[int]  # accepted node indices, root to leaf
    bonus: int  # the target's own next token after the accepted path


def greedy_walk(draft: Draft, targets: list[int], kids: dict[int, list[int]] | None = None) -> Verdict:
    """Greedy: follow the child equal to the target's argmax; targets[r] is row r's argmax."""
    kids = draft.children() if kids is None else kids
    path: list[int] = []
    node = -1
    while True:
        want = targets[node + 1]
        nxt = next((c for c in kids.get(node, []) if draft.tokens[c] == want), None)
        if nxt is None:
            return Verdict(path, want)
        path.append(nxt)
        node = nxt


def verify(
    draft: Draft, logits: Tensor, params: SamplingParams, generator: torch.Generator | None,
    eos_ids: list[int] = (), eos_blocked_until_depth: int = 0, typical: TypicalAcceptance | None = None,
) -> Verdict:
    """Accept a prefix path of the draft tree; logits: [>= len(draft) + 1, V] target rows.

    eos_blocked_until_depth: rows at depth < this may not produce EOS (min_tokens).
    """
    kids = draft.children()
    depth = [0] + draft.depths()
    rows = logits[: len(draft) + 1].detach().to("cpu", torch.float64)  # small; exact compare and sampling
    if eos_blocked_until_depth > 0:
        rows = mask_eos(rows, list(eos_ids), torch.tensor([d < eos_blocked_until_depth for d in depth]))
    if params.greedy:
        return greedy_walk(draft, rows.argmax(-1).tolist(), kids)
    path: list[int] = []
    node = -1
    p_all = probs(rows, params)
    if typical is not None:
        return verify_typical(draft, kids, p_all, typical, generator)
    while True:
        p = p_all[node + 1]
        for c in kids.get(node, []):
            x = draft.tokens[c]
            qx = 1.0 if draft.q is None else float(draft.q[c, x])
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if qx > 0 and u * qx < float(p[x]):
                path.append(c)
                node = c
                break
            residual = p.clone()
            if draft.q is None:
                residual[x] = 0.0
            else:
                residual = (residual - draft.q[c].double()).clamp_min(0.0)
            total = residual.sum()
            if total > 0:  # total == 0 only when p == q_c, where acceptance was certain
                p = residual / total
        else:
            return Verdict(path, sample(p, generator))


def verify_typical(
    draft: Draft, kids: dict[int, list[int]], p_all: Tensor, typical: TypicalAcceptance,
    generator: torch.Generator | None,
) -> Verdict:
    """Lossy: follow the first child the target finds typical enough; then sample from p."""
    path: list[int] = []
    node = -1
    while True:
        p = p_all[node + 1]
        entropy = -(p * torch.log(p.clamp_min(1e-30))).sum()
        floor = min(typical.threshold, typical.alpha * float(torch.exp(-entropy)))
        nxt = next((c for c in kids.get(node, []) if float(p[draft.tokens[c]]) > floor), None)
        if nxt is None:
            return Verdict(path, sample(p, generator))
        path.append(nxt)
        node = nxt
