"""A smaller checkpoint of the same tokenizer drafts a chain autoregressively, with its own KV cache.

The draft cache is kept in sync lazily: `fed[slot]` counts the sequence tokens it holds. Each
proposal first feeds what every running sequence has not seen (the bonus token, any accepted
tail, and what a sequence the policy paused committed meanwhile, at most its last
`CATCH_UP_WINDOW`: the cache then restarts there, `shift[slot]` positions in), then drafts.
After verification only the accepted draft tokens stay valid, so `fed` rolls back to them.
A greedy batch's whole proposal (catch-up and chains) is one native call (`native.NativeChain`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdec.core.config import EngineConfig
from specdec.core.errors import ConfigurationError
from specdec.core.models.checkpoint import load_model
from specdec.core.models.llama import LlamaForCausalLM
from specdec.core.models.tokenizer import Tokenizer
from specdec.core.proposers.registry import Target, register, require
from specdec.core.models.native import NativeChain
from specdec.core.proposers.base import (catch_up_length, catch_up_rows, eos_until, next_draft_tokens, restart_at_window,
                                        window_positions)
from specdec.core.sequence import Sequence
from specdec.core.verify import Draft


def pad_batch(rows: list[list[int]], device) -> Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device)


class DraftModelProposer:
    commits_undrafted = False  # a round without draft tokens leaves `fed` as it was

    def __init__(self, model: LlamaForCausalLM, k: int = 4, eos_ids: list[int] = (), drafts_in: str = "float32") -> None:
        self.model, self.max_k, self.eos_ids, self.drafts_in = model, k, list(eos_ids), drafts_in
        self.fed: dict[int, int] = {}
        self.drafted: dict[int, int] = {}  # draft tokens fed to the cache by the last proposal
        self.shift: dict[int, int] = {}  # positions before the cache's first entry (a windowed catch-up)
        self.chain = NativeChain.build(model.native, model.model.embed_tokens.weight, model.head)

    def depth_for(self, k: int) -> int:
        return min(k, self.max_k)  # a chain

    def allocate(self, num_slots: int, capacity: int) -> None:
        self.cache = self.model.new_cache(num_slots, capacity)

    def prefill(self, seqs: list[Sequence], features: list[Tensor]) -> None:
        for s in seqs:
            self.fed[s.slot], self.drafted[s.slot], self.shift[s.slot] = 0, 0, 0

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = [Draft.empty() for _ in seqs]
        active = [b for b, k in enumerate(ks) if k > 0]
        if not active:
            return drafts
        fed, at = catch_up_rows(seqs, ks, self.backlog)
        for s in fed:
            restart_at_window(self.fed, self.shift, s.slot, len(s.tokens))
        pending = [s.tokens[self.fed[s.slot] :] for s in fed]
        starts = window_positions(self.shift, fed, [self.fed[s.slot] for s in fed])
        chains, chain_ks = [seqs[b] for b in active], [ks[b] for b in active]
        if self.chain is not None and self.chain.takes(chains, pending):
            tokens = self.chain(pending, starts, None, at, chain_ks, self.model.rope, self.cache, [s.slot for s in fed],
                                eos_until(fed, self.eos_ids), self.eos_ids)
            found = [Draft.chain(t, None) for t in tokens]
        else:
            found = self.chains(chains, self.catch_up(fed, at, pending, starts), chain_ks)
        for s in fed:
            self.fed[s.slot], self.drafted[s.slot] = len(s.tokens), 0
        for b, d in zip(active, found):
            self.drafted[seqs[b].slot] = ks[b] - 1
            drafts[b] = d
        return drafts

    def catch_up(self, fed: list[Sequence], at: list[int], pending: list[list[int]], starts: list[int]) -> Tensor:
        """Feed the rows' pending tokens at window positions `starts` on; the logits after the
        last one of each drafting row (`at`: their rows among `fed`)."""
        device = self.model.lm_head.weight.device
        tokens = pad_batch(pending, device)
        positions = torch.tensor(starts, device=device)[:, None] + torch.arange(tokens.shape[1], device=device)
        hidden = self.model(tokens, positions, self.cache, [s.slot for s in fed], starts,
                            lengths=[len(p) for p in pending])
        last = torch.tensor([len(pending[i]) - 1 for i in at], device=device)
        return self.model.logits(hidden[torch.tensor(at, device=device), last])  # row i: at[i]

    def chains(self, seqs: list[Sequence], logits: Tensor, ks: list[int]) -> list[Draft]:
        """Chains from the catch-up's logits, one drafter forward per depth (sampled rows draw
        from their q, which verification needs)."""
        device = logits.device
        out: list[list[int]] = [[] for _ in seqs]
        qs: list[list[Tensor]] = [[] for _ in seqs]
        rows = list(range(len(seqs)))
        for depth in range(1, max(ks) + 1):
            tokens, row_qs = next_draft_tokens([seqs[r] for r in rows], logits, depth, self.eos_ids)
            for r, tok, q in zip(rows, tokens, row_qs):
                out[r].append(tok)
                if q is not None:
                    qs[r].append(q)
            rows = [r for r in rows if ks[r] > depth]
            if not rows:
                break
            rows_seqs = [seqs[r] for r in rows]
            pos = window_positions(self.shift, rows_seqs, [len(s.tokens) + depth - 1 for s in rows_seqs])
            step = torch.tensor([[out[r][-1]] for r in rows], device=device)
            hidden = self.model(step, torch.tensor(pos, device=device)[:, None], self.cache,
                                [s.slot for s in rows_seqs], pos)
            logits = self.model.logits(hidden[:, 0])
        return [Draft.chain(o, torch.stack(q) if q else None) for o, q in zip(out, qs)]

    def backlog(self, seq: Sequence) -> int:
        return catch_up_length(len(seq.tokens), self.fed[seq.slot])

    def commit(self, seq: Sequence, path: list[int], hidden: Tensor, row: int) -> None:
        # after a proposal `fed` counts the tokens before the root's successor; of the draft tokens
        # it also fed, the accepted ones stay valid (none in a round without a proposal)
        self.fed[seq.slot] += min(len(path), self.drafted[seq.slot])
        self.drafted[seq.slot] = 0

    def release(self, slot: int) -> None:
        self.fed.pop(slot, None)
        self.drafted.pop(slot, None)
        self.shift.pop(slot, None)



@register("draft")
def build(cfg: EngineConfig, target: Target) -> DraftModelProposer:
    folder = require(cfg.checkpoints.draft, "draft", cfg.proposer.method)
    if Tokenizer(folder).fingerprint() != target.tokenizer.fingerprint():
        raise ConfigurationError(f"draft {folder!r} uses a different tokenizer than target {target.folder!r}")
    model = load_model(folder, target.dtype, target.device)
    if model.config.vocab_size != target.model.config.vocab_size:
        raise ConfigurationError(
            f"draft vocabulary ({model.config.vocab_size}) differs from the target's ({target.model.config.vocab_size})")
    return DraftModelProposer(model, cfg.proposer.k, target.eos_ids, model.draft_in(cfg.proposer.draft_dtype))
