"""EAGLE: a small head extrapolates the target's features; EAGLE-1 drafts a chain, EAGLE-2 a tree.

Pair t is (feature_t, token_{t+1}) at position t; the head turns it into a predicted
feature_{t+1}, and the target's lm_head turns that into a distribution over token_{t+2}.
Committed pairs always use the target's true features (given back by the engine after each
verification, `pending`); draft pairs use the head's own predictions and are overwritten later.
A greedy EAGLE-1 batch's whole proposal (catch-up and chains) is one native call (`native.NativeChain`).

EAGLE-2's dynamic tree: expand the `top_k` most likely nodes of each depth by their top_k
children, scoring nodes by cumulative draft log-probability, and keep the best min(k, total_tokens)
nodes (a child never scores above its parent, so the kept set is a tree): `k` caps the tree as
it caps every method's draft tokens per step. Tree nodes are chosen
deterministically, so their q is one-hot and verification stays exact under sampling.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor

from specdec.core.config import EngineConfig
from specdec.core.errors import ConfigurationError
from specdec.core.models.heads import EagleHead
from specdec.core.models.linear import InferenceLinear, narrow
from specdec.core.models.llama import LlamaForCausalLM
from specdec.core.models.native import KERNELS, NativeChain
from specdec.core.proposers.base import (CATCH_UP_WINDOW, catch_up_length, catch_up_rows, eos_until, feature_addresses,
                                        next_draft_tokens, path_features, restart_at_window, window_positions)
from specdec.core.sequence import Sequence
from specdec.core.verify import Draft
from specdec.core.proposers.draft_model import pad_batch
from specdec.core.proposers.registry import Target, register, require


@dataclass
class EagleTree:
    """EAGLE-2's tree shape (the default is the `eagle_tree` setting in `specdec.core.config`)."""

    top_k: int
    depth: int
    total_tokens: int


class EagleProposer:
    commits_undrafted = True  # every round's features, pending until a proposal feeds them

    def __init__(
        self, head: EagleHead, target: LlamaForCausalLM, k: int = 4, tree: EagleTree | None = None,
        eos_ids: list[int] = (), vocab: InferenceLinear | None = None, drafts_in: str = "float32",
    ) -> None:
        self.head, self.target, self.tree, self.eos_ids = head, target, tree, list(eos_ids)
        self.drafts_in = drafts_in  # its layers' and output head's type; its fc's is bfloat16 at most
        # the output head a draft's logits come from: the target's, or a copy in `draft_dtype`
        self.vocab = vocab or target.head or target.lm_head
        self.max_k = min(k, tree.total_tokens) if tree else k  # k caps a tree's nodes too
        self.fed: dict[int, int] = {}  # pairs fed; those from here to the root's are pending
        # per slot, the true-feature blocks not fed yet as (pairs, hidden, row, path), each made
        # (`path_features`) only when the catch-up joins them (a paused sequence's steps sliced a
        # block every step, 2% of a plain step at batch 1, for a catch-up that may never come)
        self.pending: dict[int, list[tuple[int, Tensor, int, tuple[int, ...] | range]]] = {}
        self.shift: dict[int, int] = {}  # positions before the cache's first entry (a windowed catch-up)
        self.chain = None if tree else NativeChain.build(head.native, target.model.embed_tokens.weight, self.vocab,
                                                         head.fc_inference)

    def depth_for(self, k: int) -> int:
        k = min(k, self.max_k)
        return min(self.tree.depth, k) if self.tree else k  # a tree of k nodes is at most k deep

    def allocate(self, num_slots: int, capacity: int) -> None:
        # EAGLE-2 writes the pair of every node it expands past the root: top_k per level, which
        # can be more than the k nodes it keeps
        expanded = self.tree.top_k * (self.depth_for(self.max_k) - 1) if self.tree else 0
        self.cache = self.head.new_cache(num_slots, capacity + expanded)

    def prefill(self, seqs: list[Sequence], features: list[Tensor]) -> None:
        for s, f in zip(seqs, features):
            self.fed[s.slot], self.shift[s.slot] = 0, 0
            self.pending[s.slot] = [(len(f), f[None], 0, range(len(f) - 1))]  # the prompt: one chain

    def commit(self, seq: Sequence, path: list[int], hidden: Tensor, row: int) -> None:
        # rounds without a proposal leave their pairs pending too: append, never replace (a list:
        # joining a growing tensor every round of a long pause cost O(pause) per round). A
        # paused row keeps this for every step of its window: one tuple, and its path as a tuple
        # of ints (which the cyclic collector stops tracking; an empty one is shared)
        blocks, slot = self.pending[seq.slot], seq.slot
        blocks.append((1 + len(path), hidden, row, tuple(path)))
        # a block wholly before the window a catch-up feeds is never made: dropped now, as the
        # window's restart (`restart_at_window`) would drop it, so that a paused sequence does not
        # hold every step's hidden states until it drafts or ends (each block keeps its step's
        # whole [B, T, H]: on a 4096-wide model at batch 8, 128 KB a plain step)
        while len(seq.tokens) - 1 - self.fed[slot] - blocks[0][0] >= CATCH_UP_WINDOW:
            self.fed[slot] = self.shift[slot] = self.fed[slot] + blocks.pop(0)[0]

    def release(self, slot: int) -> None:
        self.fed.pop(slot, None)
        self.pending.pop(slot, None)
        self.shift.pop(slot, None)

    def embed(self, tokens: Tensor) -> Tensor:
        return self.target.model.embed_tokens(tokens)

    def backlog(self, seq: Sequence) -> int:
        """Pairs not fed yet: pair t is (feature_t, token_t+1), so they run up to the root's."""
        return catch_up_length(len(seq.tokens) - 1, self.fed[seq.slot])

    def pending_blocks(self, seq: Sequence) -> list[tuple[int, Tensor, int, tuple[int, ...] | range, int]]:
        """The sequence's pending true features as blocks (pairs, hidden, row, path, first): each
        block's are `path_features(hidden, row, path)[first:]`, `pairs` of them. At most
        CATCH_UP_WINDOW pairs: past that the cache restarts at the window's first pair (`shift`),
        and the blocks before it are dropped."""
        drop = restart_at_window(self.fed, self.shift, seq.slot, len(seq.tokens) - 1)
        kept = []
        for n, hidden, row, path in self.pending[seq.slot]:
            if drop < n:
                kept.append((n - drop, hidden, row, path, drop))
            drop = max(drop - n, 0)
        return kept

    def catch_up_inputs(self, seqs: list[Sequence]) -> tuple[list[list[int]], list[list[tuple]], list[int]]:
        """Every sequence's pending pairs, now counted as fed: their tokens, their true features'
        blocks (`pending_blocks`) and the window position of the first."""
        blocks = [self.pending_blocks(s) for s in seqs]
        starts = [self.fed[s.slot] for s in seqs]
        counts = [sum(n for n, *_ in b) for b in blocks]
        tokens = [s.tokens[st + 1 : st + 1 + n] for s, st, n in zip(seqs, starts, counts)]
        at = window_positions(self.shift, seqs, starts)
        for s, st, n in zip(seqs, starts, counts):
            self.fed[s.slot] = st + n
            self.pending[s.slot] = []
        return tokens, blocks, at

    def catch_up(self, seqs: list[Sequence], tokens: list[list[int]], blocks: list[list[tuple]], at: list[int]) -> Tensor:
        """Feed every sequence's pending pairs (`catch_up_inputs`); return the predicted feature of its root."""
        feats = [torch.cat([path_features(hidden, row, path)[first:] for _, hidden, row, path, first in b]) for b in blocks]
        device = self.head.fc.weight.device
        padded = pad_batch(tokens, device)
        width = padded.shape[1]
        features = torch.stack([torch.cat([f, f.new_zeros(width - len(f), f.shape[-1])]) for f in feats])
        positions = torch.tensor(at, device=device)[:, None] + torch.arange(width, device=device)
        out = self.head(self.embed(padded), features, positions, self.cache, [s.slot for s in seqs], at,
                        lengths=[len(f) for f in feats])
        return out[torch.arange(len(seqs)), torch.tensor([len(f) - 1 for f in feats])]

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = [Draft.empty() for _ in seqs]
        active = [b for b, k in enumerate(ks) if k > 0]
        if not active:
            return drafts
        batch, batch_ks = [seqs[b] for b in active], [ks[b] for b in active]
        fed, rows = catch_up_rows(seqs, ks, self.backlog)
        tokens, blocks, at = self.catch_up_inputs(fed)  # `blocks` keeps the features alive through the call
        if self.chain is not None and self.chain.takes(batch, tokens):
            pairs = [a for b in blocks for _, hidden, row, path, first in b for a in feature_addresses(hidden, row, path)[first:]]
            chains = self.chain(tokens, at, pairs, rows, batch_ks, self.head.rope, self.cache, [s.slot for s in fed],
                                eos_until(fed, self.eos_ids), self.eos_ids)
            found = [Draft.chain(t, None) for t in chains]
        else:
            root_features = self.catch_up(fed, tokens, blocks, at)[torch.tensor(rows, device=self.head.fc.weight.device)]
            found = (self.tree_drafts(batch, root_features, batch_ks) if self.tree
                     else self.chain_drafts(batch, root_features, batch_ks))
        for b, d in zip(active, found):
            drafts[b] = d
        return drafts

    def chain_drafts(self, seqs: list[Sequence], feature: Tensor, ks: list[int]) -> list[Draft]:
        device = feature.device
        out: list[list[int]] = [[] for _ in seqs]
        qs: list[list[Tensor]] = [[] for _ in seqs]
        rows = list(range(len(seqs)))
        for depth in range(1, max(ks) + 1):
            tokens, row_qs = next_draft_tokens([seqs[r] for r in rows], self.vocab(feature), depth, self.eos_ids)
            for r, tok, q in zip(rows, tokens, row_qs):
                out[r].append(tok)
                if q is not None:
                    qs[r].append(q)
            keep = [i for i, r in enumerate(rows) if ks[r] > depth]
            if not keep:
                break
            rows = [rows[i] for i in keep]
            pos = window_positions(self.shift, [seqs[r] for r in rows], [len(seqs[r].tokens) + depth - 2 for r in rows])
            tokens = torch.tensor([[out[r][-1]] for r in rows], device=device)
            feature = self.head(self.embed(tokens), feature[keep][:, None], torch.tensor(pos, device=device)[:, None],
                                self.cache, [seqs[r].slot for r in rows], pos)[:, 0]
        return [Draft.chain(o, torch.stack(q) if q else None) for o, q in zip(out, qs)]

    def tree_drafts(self, seqs: list[Sequence], root_feature: Tensor, ks: list[int]) -> list[Draft]:
        """EAGLE-2: grow every sequence's tree depth by depth, one head forward per depth for the
        whole batch over that depth's frontier only (the nodes expanded before it are already in
        the head's cache, and the tree mask reaches back to them); each depth's inputs are built
        from Python lists in one tensor each, and its new candidates scored with one output-head
        call and one topk. A frontier node that can no longer be kept is not expanded
        (`worth_expanding`): the tree is the same, and the head runs fewer rows."""
        tree, device = self.tree, root_feature.device
        B = len(seqs)
        keep_n = [min(k, self.max_k) for k in ks]
        logp = torch.log_softmax(self.vocab(root_feature).float(), -1)
        values, indices = (t.tolist() for t in torch.topk(logp, tree.top_k, dim=-1))
        # candidate nodes per sequence: (token, parent candidate index, cumulative score), and
        # each candidate's ancestors (root side first), built once when the candidate is made
        cands = [[(t, -1, v) for v, t in zip(values[b], indices[b])] for b in range(B)]
        ancestors: list[list[list[int]]] = [[[] for _ in range(tree.top_k)] for _ in range(B)]
        frontier = [list(range(tree.top_k)) for _ in range(B)]  # at most top_k nodes each, at every depth
        where: list[dict[int, int]] = [{} for _ in range(B)]  # expanded candidate -> its key after the root
        starts = window_positions(self.shift, seqs, [len(s.tokens) - 1 for s in seqs])
        parent_feature: list[dict[int, Tensor]] = [{-1: root_feature[b]} for b in range(B)]
        # keys after each root so far: every depth adds T, its longest frontier's; a shorter
        # frontier's padding and a sequence not grown leave keys that no mask opens
        written = 0
        for depth in range(1, min(tree.depth, max(ks))):  # a tree of k nodes is at most k deep
            frontier = [worth_expanding(cands[b], frontier[b], keep_n[b], depth) for b in range(B)]
            grow = [b for b in range(B) if frontier[b]]
            if not grow:
                break
            T = max(len(frontier[b]) for b in grow)
            tokens, features, positions, mask = [], [], [], []
            for b in grow:
                pad = T - len(frontier[b])
                for i, c in enumerate(frontier[b]):
                    where[b][c] = written + i
                tokens.append([cands[b][c][0] for c in frontier[b]] + [0] * pad)
                row_features = [parent_feature[b][cands[b][c][1]] for c in frontier[b]]
                features.append(torch.stack(row_features + row_features[:1] * pad))
                positions.append([starts[b] + len(ancestors[b][c]) for c in frontier[b]] + [starts[b]] * pad)
                rows = [[False] * (written + T) for _ in range(T)]
                for i, c in enumerate(frontier[b]):
                    for a in ancestors[b][c] + [c]:
                        rows[i][where[b][a]] = True
                mask.append(rows)
            lengths = [len(frontier[b]) for b in grow]
            padded = min(lengths) < T
            grown = self.head(self.embed(torch.tensor(tokens, device=device)), torch.stack(features),
                              torch.tensor(positions, device=device), self.cache, [seqs[b].slot for b in grow],
                              [starts[b] for b in grow], torch.tensor(mask, device=device), lengths if padded else None)
            grown = torch.cat([grown[i, :n] for i, n in enumerate(lengths)]) if padded else grown.flatten(0, 1)
            written += T
            node_logp = torch.log_softmax(self.vocab(grown).float(), -1)
            values, indices = (t.tolist() for t in torch.topk(node_logp, tree.top_k, dim=-1))
            row = 0
            for b in grow:
                first = len(cands[b])
                for c in frontier[b]:
                    parent_feature[b][c] = grown[row]
                    base = cands[b][c][2]
                    for v, t in zip(values[row], indices[row]):
                        cands[b].append((t, c, base + v))
                        ancestors[b].append(ancestors[b][c] + [c])
                    row += 1
                order = sorted(range(first, len(cands[b])), key=lambda c: -cands[b][c][2])
                frontier[b] = order[: tree.top_k]
        return [self.select(cands[b], keep_n[b]) for b in range(B)]

    @staticmethod
    def select(cands: list[tuple[int, int, float]], n: int) -> Draft:
        """The n best-scoring candidates (with their ancestors), as a Draft with parents first."""
        keep: set[int] = set()
        for c in sorted(range(len(cands)), key=lambda c: -cands[c][2]):
            chain = []
            a = c
            while a >= 0 and a not in keep:
                chain.append(a)
                a = cands[a][1]
            if len(keep) + len(chain) > n:
                continue
            keep.update(chain)
            if len(keep) == n:
                break
        ordered = sorted(keep)  # candidates were appended parents-first, so index order is topological
        where = {c: i for i, c in enumerate(ordered)}
        return Draft(tokens=[cands[c][0] for c in ordered],
                     parents=[where[cands[c][1]] if cands[c][1] >= 0 else -1 for c in ordered])


def worth_expanding(cands: list[tuple[int, int, float]], frontier: list[int], n: int, depth: int) -> list[int]:
    """The frontier nodes (at `depth`, the root's children at 1) whose subtrees can still hold one
    of the n best candidates `select` keeps: none where n nodes cannot reach depth + 1, and none
    scoring strictly below the n-th best score so far (its descendants score no higher, and more
    candidates only raise the n-th best), so expanding them changes nothing kept.
    On the demo kit at k = 4 (the (4, 5, 24) tree: 4 nodes expanded at each of 3 depths) the head
    ran 6.6 rows a step instead of 12, growing the same trees."""
    if depth >= n:
        return []
    if len(cands) < n:
        return frontier
    bar = sorted((c[2] for c in cands), reverse=True)[n - 1]
    return [c for c in frontier if cands[c][2] >= bar]


@register("eagle", "eagle2")
def build(cfg: EngineConfig, target: Target) -> EagleProposer:
    p = cfg.proposer
    head = EagleHead.load(require(cfg.checkpoints.eagle, "eagle", p.method), target.dtype, target.device)
    if head.config.hidden_size != target.model.config.hidden_size:
        raise ConfigurationError("EAGLE head hidden size differs from the target's")
    tree = EagleTree(*p.eagle_tree) if p.method == "eagle2" else None
    vocab = None
    drafts_in = head.draft_in(p.draft_dtype)
    if drafts_in in KERNELS:
        vocab = copy.copy(target.model.head)  # shares the target's float32 weight and packed copy
        if narrow([vocab], p.draft_dtype) not in KERNELS:
            vocab = None
    return EagleProposer(head, target.model, p.k, tree, target.eos_ids, vocab, drafts_in)
