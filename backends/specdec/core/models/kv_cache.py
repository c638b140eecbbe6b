"""Preallocated KV cache with rollback by length and tree-path compaction.

Each running sequence owns one slot (its length is the sequence's `cache_len`). A forward writes
its new tokens' keys and values at `start .. start+T-1` of its slot; what stays valid is decided
afterwards by the caller: rollback is just not advancing the length, and after a tree verification
`compact` moves the accepted path's entries (at arbitrary offsets) down to consecutive positions.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        # one position past the capacity: where rows padded to a batch's widest row write their
        # padding (BatchContext); it is never read
        shape = (num_layers, num_slots, capacity + 1, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.scratch = capacity
        # what a native forward is handed each call, as plain ints (fixed for the cache's life):
        # read off the tensors per call, with the interpreter's caches cold after a forward, they
        # were a few us of a ~0.2 ms step; None where the cache is not float32 on the CPU
        self.native_args = ((self.k.data_ptr(), self.v.data_ptr(), self.k.stride(0), self.k.stride(1))
                            if dtype == torch.float32 and self.k.device.type == "cpu" else None)

    def compact(self, slot: int, start: int, offsets: list[int]) -> None:
        """Move the entries at `start + offsets[j]` to `start + j` (offsets ascending, offsets[0] == 0)."""
        if offsets == list(range(len(offsets))):
            return
        src = torch.tensor([start + o for o in offsets], device=self.k.device)
        dst = slice(start, start + len(offsets))
        self.k[:, slot, dst] = self.k[:, slot, src]
        self.v[:, slot, dst] = self.v[:, slot, src]
