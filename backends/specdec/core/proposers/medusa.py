"""Medusa: extra heads on the target's last hidden state propose a static tree of top-k tokens.

A tree is a list of paths of top-k indices: [0, 1] is head 0's best token followed by head 1's
second best. Paths come in priority order with parents first, so the first n paths always form a
tree: `k` prunes the configured tree to its first k paths, and the policy's per-step k shrinks it
further the same way. The order is best-first by static acceptance: mc_sim_7b_63 was grown one node
at a time, each time adding the node that most raised the expected accepted length in Medusa's
calibration (per-head top-k accuracies), so its first k nodes are the best k-node tree under that
estimate. (A product of per-rank head accuracies would need this kit's calibration figures, which a
checkpoint does not carry; the published order needs none.) The tree's structure, the prefix
shapes and the gather indices are built once at construction, as Medusa's generate_medusa_buffers does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdec.core.config import EngineConfig
from specdec.core.errors import ConfigurationError
from specdec.core.models.heads import MedusaHeads
from specdec.core.proposers.registry import Target, register, require
from specdec.core.sequence import Sequence
from specdec.core.verify import Draft, TreeShape

# The tree Medusa ships for Vicuna-7B (63 nodes, depth 4): public data from FasterDecoding/Medusa.
MC_SIM_7B_63 = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0]]  # noqa: E501


def check_tree(paths: list[list[int]], num_heads: int, vocab: int) -> list[list[int]]:
    """Keep paths the heads can fill (depth <= heads, index < vocab); parents must come first."""
    paths = [list(p) for p in paths if len(p) <= num_heads and max(p, default=0) < vocab]
    seen: set[tuple[int, ...]] = set()
    for p in paths:
        if not p or min(p) < 0:
            raise ConfigurationError(f"medusa tree path {p} is empty or negative")
        if len(p) > 1 and tuple(p[:-1]) not in seen:
            raise ConfigurationError(f"medusa tree path {p} comes before its parent {p[:-1]}")
        if tuple(p) in seen:
            raise ConfigurationError(f"medusa tree path {p} appears twice")
        seen.add(tuple(p))
    if not paths:
        raise ConfigurationError("medusa tree is empty")
    return paths


class MedusaProposer:
    commits_undrafted = True  # the last round's features, what the heads draft from

    def __init__(self, heads: MedusaHeads, tree: list[list[int]] | None = None, k: int | None = None,
                 drafts_in: str = "float32") -> None:
        self.heads, self.drafts_in = heads, drafts_in
        paths = check_tree(tree if tree is not None else MC_SIM_7B_63, heads.num_heads, heads.vocab)
        if k is not None and k < 1:
            raise ConfigurationError(f"medusa needs k >= 1 (tree nodes per step), got {k}")
        self.tree = paths[:k]  # best-first: the first k paths are the best k-node tree
        self.max_k = len(self.tree)
        index = {tuple(p): i for i, p in enumerate(self.tree)}
        parents = [index[tuple(p[:-1])] if len(p) > 1 else -1 for p in self.tree]
        self.shapes = [TreeShape.build(parents[:n]) for n in range(self.max_k + 1)]  # the tree's prefixes
        self.head_of = torch.tensor([len(p) - 1 for p in self.tree], device=heads_device(heads))
        self.rank_of = torch.tensor([p[-1] for p in self.tree], device=heads_device(heads))
        # per tree prefix of n nodes: the top-k its deepest ranks need (heads run: depth_for)
        self.topk = [max((max(p) for p in self.tree[:n]), default=0) + 1 for n in range(self.max_k + 1)]
        # per slot, where the heads' input lies: the last accepted node's hidden state of its last
        # step, as (that step's hidden states, row, node), read only when a proposal reads it: a
        # paused Medusa's commit sliced them every step (about 2% of a plain step at batch 1) for
        # proposals that never came
        self.last_features: dict[int, tuple[Tensor, int, int]] = {}

    def depth_for(self, k: int) -> int:
        return max(self.shapes[min(k, self.max_k)].depths, default=0)

    def allocate(self, num_slots: int, capacity: int) -> None:
        self.last_features.clear()

    def prefill(self, seqs: list[Sequence], features: list[Tensor]) -> None:
        for s, f in zip(seqs, features):
            self.last_features[s.slot] = (f[None], 0, len(f) - 1)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = [Draft.empty() for _ in seqs]
        active = [b for b, k in enumerate(ks) if k > 0]
        if not active:
            return drafts
        n = min(max(ks), self.max_k)  # the batch's largest tree prefix: every row's nodes are among its first n
        hidden = torch.stack([states[row, node] for states, row, node in (self.last_features[seqs[b].slot] for b in active)])
        logits = self.heads(hidden, num_heads=self.depth_for(n))  # only the heads its nodes come from
        top = torch.topk(logits, self.topk[n], dim=-1).indices  # [heads, B, topk]
        nodes = top[self.head_of[:n], :, self.rank_of[:n]].T.tolist()  # [B, nodes]: one host transfer
        for row, b in enumerate(active):
            shape = self.shapes[min(ks[b], self.max_k)]
            drafts[b] = Draft(nodes[row][: len(shape.parents)], shape.parents, shape=shape)
        return drafts

    def backlog(self, seq: Sequence) -> int:
        return 0  # no model state to keep in sync

    def commit(self, seq: Sequence, path: list[int], hidden: Tensor, row: int) -> None:
        self.last_features[seq.slot] = (hidden, row, path[-1] + 1 if path else 0)  # path_offsets(path)[-1], no list

    def release(self, slot: int) -> None:
        self.last_features.pop(slot, None)


def heads_device(heads: MedusaHeads) -> torch.device:
    return next(heads.parameters()).device


@register("medusa")
def build(cfg: EngineConfig, target: Target) -> MedusaProposer:
    p = cfg.proposer
    heads = MedusaHeads.load(require(cfg.checkpoints.medusa, "medusa", p.method), target.dtype, target.device)
    if heads.vocab != target.model.config.vocab_size or heads.hidden != target.model.config.hidden_size:
        raise ConfigurationError("medusa heads do not fit the target (hidden size or vocabulary differ)")
    drafts_in = heads.draft_in(p.draft_dtype)
    return MedusaProposer(heads, [list(path) for path in p.medusa_tree] if p.medusa_tree else None, p.k, drafts_in)
