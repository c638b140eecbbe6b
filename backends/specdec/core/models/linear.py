"""Inference matmuls with weights laid out once for the CPU's GEMM kernels.

A plain `F.linear` on CPU hands the weight to a GEMM that repacks it into its own blocked layout on
every call. At the sizes speculative decoding verifies (2-40 rows against a few-MB weight) that
repacking is most of the call: on the demo kit's shapes a 5-row matmul cost 2.6-3.1x a 1-row one,
so verifying a 4-token draft cost almost three plain steps. oneDNN's prepacked linear (the layout
`torch.ops.mkldnn._reorder_linear_weight` produces, as inductor's CPU freezing pass uses it)
packs once at load: the same 5-row matmul costs 1.2-1.5x a 1-row one. oneDNN has a fixed cost of
about 12-17 us a call, though, so a single row (plain decode of one sequence, a drafter's chain
step) stays on `F.linear`'s matrix-vector kernel, which is cheaper there. `docs/engine.md` has
the end-to-end figures and the command.

Weights oneDNN cannot take (CUDA, float16 without avx512_fp16, a build without mkldnn) and small
ones (`PACK_MIN_BYTES`) keep `F.linear` for every call: both paths give the same results up to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


# Below this size a weight's repacking costs less than oneDNN's fixed cost per call: measured on the
# kit's shapes at 2-5 rows, a 256x256 fp32 weight (256 KiB) was 20-80% slower packed, 512x256
# (512 KiB) about even at 2 rows and 1.2x faster at 5, 1536x256 and larger 1.8-2x faster.
PACK_MIN_BYTES = 512 * 1024


def packable(weight: Tensor) -> bool:
    """Whether `weight` goes to oneDNN's prepacked GEMM (the one place this is decided)."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and weight.numel() * weight.element_size() >= PACK_MIN_BYTES and torch.backends.mkldnn.is_available())


class InferenceLinear:
    """`x @ weight.T + bias`: more than one row goes to a copy of the weight packed once for
    oneDNN's GEMM (when the CPU can take it: that copy is the only extra memory), a single row to
    `F.linear`'s matrix-vector kernel on `weight` itself."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        self.weight, self.bias = weight.detach(), None if bias is None else bias.detach()
        self.in_features = weight.shape[1]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None) if packable(weight) else None

    def __call__(self, x: Tensor) -> Tensor:
        if self.packed is None or x.numel() == self.in_features:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
