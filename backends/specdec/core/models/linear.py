"""Inference matmuls with weights laid out once for the CPU's GEMM kernels.

A plain `F.linear` on CPU hands the weight to a GEMM that repacks it into its own blocked layout on
every call. At the sizes speculative decoding verifies (2-40 rows against a few-MB weight) that
repacking is most of the call: on the demo kit's shapes a 5-row matmul cost 2.6-3.1x a 1-row one,
so verifying a 4-token draft cost almost three plain steps. oneDNN's prepacked linear (the layout
`torch.ops.mkldnn._reorder_linear_weight` produces, as inductor's CPU freezing pass uses it)
packs once at load: the same 5-row matmul costs 1.2-1.5x a 1-row one. oneDNN has a fixed cost of
about 12-17 us a call, though, so a single row (plain decode of one sequence, a drafter's chain
step) of a small model stays on `F.linear`'s matrix-vector kernel, which is cheaper while the
model's weights stay in the CPU's caches. A model too big for that (`ONE_ROW_PACKED_MIN_BYTES`)
reads its weights from the shared cache or memory on every step, and there the packed layout is
faster for one row too. `docs/engine.md` has the end-to-end figures and the commands.

Weights oneDNN cannot take (CUDA, float16 without avx512_fp16, a build without mkldnn) and small
ones (`PACK_MIN_BYTES`) keep `F.linear` for every call: both paths give the same results up to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.core.config import DRAFT_DTYPES
from specdec.core.models import native


# Below this size a weight's repacking costs less than oneDNN's fixed cost per call: measured on the
# kit's shapes at 2-5 rows, a 256x256 fp32 weight (256 KiB) was 20-80% slower packed, 512x256
# (512 KiB) about even at 2 rows and 1.2x faster at 5, 1536x256 and larger 1.8-2x faster.
PACK_MIN_BYTES = 512 * 1024
# A model with at least this many bytes of weights sends single rows to its packed weights too.
# Measured on the kit, whole engines at batch 1 against single rows on F.linear (forward_ab, 12
# rounds each, identical outputs): the 14.7 MB target 1.06x / 1.12x as the baseline, the EAGLE
# head (6.3 MB, with the target's output head) 1.11x, Medusa's heads (7 MB) 1.07x, EAGLE-2 1.07x;
# the 1.8 MB draft model 0.96x / 0.97x (its weights stay in cache, where F.linear's matrix-vector
# kernel is cheaper). Routing by each weight's size instead (>= 1.5 MB) gave the baseline 1.03x.
ONE_ROW_PACKED_MIN_BYTES = 4 * 1024 * 1024


def narrow(linears: list["InferenceLinear"], draft_dtype: str) -> str:
    """A drafter's projections' native rows to the narrowest kernel, `draft_dtype` or wider (int8,
    then bfloat16: `DRAFT_DTYPES`, widest first), that all of them take here (`native.blocked`),
    all or none (a native call runs one kernel for all its matmuls): their rounded products
    change only what the drafter proposes. Rows past `native.NATIVE_MAX_ROWS` keep the float32
    weights. Returns the type their matmuls now take: a rounded one (`native.KERNELS`), else the
    weights' own (where nothing narrower fits, or any of them has no native matmul)."""
    if all(x.blocked is not None for x in linears):
        for dtype in DRAFT_DTYPES[DRAFT_DTYPES.index(draft_dtype):0:-1]:
            converted = [native.blocked(x.weight, dtype) for x in linears]
            if all(b is not None for b in converted):
                for x, b in zip(linears, converted):
                    x.blocked = b
                return dtype
    return str(linears[0].weight.dtype).removeprefix("torch.")


def packable(weight: Tensor) -> bool:
    """Whether `weight` goes to oneDNN's prepacked GEMM (the one place this is decided)."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and weight.numel() * weight.element_size() >= PACK_MIN_BYTES and torch.backends.mkldnn.is_available())


def one_row_packed(model: nn.Module) -> bool:
    """Whether a model's single rows go to its packed weights too (the one place this is decided)."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) >= ONE_ROW_PACKED_MIN_BYTES


class InferenceLinear:
    """`x @ weight.T + bias`. Up to `native.NATIVE_MAX_ROWS` rows go to the native matmul on a
    blocked copy of the weight, where it builds (`native.blocked`); more rows go to a copy packed
    once for oneDNN's GEMM (when the CPU can take it); without the native kernel a single row goes
    there too if `pack_one_row` (a large model: `one_row_packed()`), else to `F.linear`'s
    matrix-vector kernel on `weight` itself."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None, pack_one_row: bool = False) -> None:
        self.weight, self.bias = weight.detach(), None if bias is None else bias.detach().contiguous()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None) if packable(weight) else None
        self.blocked = native.blocked(self.weight)
        self.one_row_plain = not pack_one_row  # single rows take F.linear

    def __call__(self, x: Tensor) -> Tensor:
        if self.blocked is not None and x.dtype == torch.float32 and x.numel() <= native.NATIVE_MAX_ROWS * self.in_features:
            return native.matmul(x, self.blocked, self.bias, self.out_features)
        if self.packed is None or (self.one_row_plain and x.numel() == self.in_features):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

