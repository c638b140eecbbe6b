"""Decoder layers as one native call (`decoder.c`) for decode and verification steps on CPU.

An eager forward of the demo kit's target makes ~125 PyTorch operator calls per token, and at
these model sizes their fixed cost is most of a step. `NativeDecoder` runs a model's layers for
a few rows of new tokens in one C call instead. The C source is compiled once per machine with
the system's C compiler (`cc -O3 -march=native`) into `native_cache_dir()`; where there is no
compiler, or `SPECDEC_NATIVE=0`, every forward stays eager. Prefills and catch-ups run natively
too where `runs_natively` says so.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:  # (they import this module)
    from specdec.core.models.kv_cache import KVCache
    from specdec.core.models.linear import InferenceLinear
    from specdec.core.models.llama import RopeTable

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decoder.c")
# -Wno-psabi: without AVX-512 GCC warns that its 16-float vectors change the ABI (of static functions only)
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-pthread", "-lm", "-Wno-psabi"]


def native_cache_dir() -> Path:
    """Where the compiled library is kept: $SPECDEC_CACHE, else ~/.cache/specdec."""
    return Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec") / "native"


def _cpu_signature() -> str:
    """-march=native code runs only on CPUs like the one it was built on: part of the cache key."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return platform.machine() + flags


def _max_rows() -> int:
    """NATIVE_MAX_ROWS on this CPU: decoder.c's matmul keeps 6 rows x 64 outputs in registers with
    AVX-512, 6 rows x 16 outputs without (its weights then stream once per 16 outputs, not 64;
    one row takes 64 outputs and two rows 32 there, for their FMAs' latency)."""
    return 1024 if "avx512f" in _cpu_signature().split() else 64


# More rows than this in one forward (prompts' prefill at a large batch) go to the eager layers.
# With AVX-512, at one thread the native matmul runs 65-1024 rows as fast as oneDNN's packed GEMM
# (0.95-1.08x) and the native forward is 1.2-2.2x the eager one there (the kit's target, 1 x 72 to
# 8 x 128 rows: the eager layers' other operations, not the GEMM, cost it); at 2 threads 1.1-2.3x,
# but 0.92x for one 512-token row. A cap of 64, kept before, sent every prompt's prefill and every
# long catch-up to the eager layers (reports/engine-log.md, "The native decoder, change by
# change"). Without AVX-512 (an AVX2 EPYC, the 8-float kernels) the target's native forward
# against the eager one: 0.78 / 0.79 ms for 1 row, 1.61 /
# 4.15 for 2, 2.64 / 4.93 for 5, 4.12 / 6.45 for 8 x 1, 6.83 / 8.18 for 8 x 2, 6.71 / 6.96 for
# 1 x 16, but 8.20 / 8.09 for 4 x 5, 12.8 / 8.91 for 1 x 32 and 15.0 / 11.0 for 8 x 5. Once
# attention, norms and SiLU ran on 8-float vectors there too (decoder.c's `vf`), at a context of 100
# (interleaved, ms): 3.78 / 5.29 for 4 x 5, 7.28 / 9.06 for 8 x 5, 5.91 / 7.24 for 1 x 32, 11.5 /
# 12.5 for 1 x 64, 23.2 / 23.3 for 1 x 128: the cap there is 64 rows, where it was 16.
NATIVE_MAX_ROWS = _max_rows()
# Without AVX-512, a forward of more rows (a prefill, a long catch-up) still runs natively at one
# thread while no row has more than WIDE_ROW_TOKENS tokens, up to WIDE_MAX_ROWS rows: a row's
# attention costs the native loop per query and key (~11 cycles a key and head), so past a few
# hundred tokens a row the eager layers' batched attention wins, and at two threads the eager
# layers gained more from the second thread than the native forward did. Prefill of the kit's target at one thread on an
# AVX2 EPYC (interleaved, ms, eager / native): 11.2 / 7.1 for 1 x 80, 15.5 / 12.3 for 1 x 128,
# 20.4 / 16.4 for 1 x 165, 35.8 / 28.0 for 4 x 80, 35.4 / 34.0 for 1 x 256, 102 / 95 for 8 x 128,
# but 70 / 81 for 1 x 512 and 173 / 254 for 1 x 1000; at two threads (separate processes) 1 x 165
# 12-13 / 17-29, 4 x 80 19-21 / 23-37. The load test's prompts are 24-165 tokens, and prefill was
# 45-52% of a served baseline's engine time at 4 and 16 users.
WIDE_ROW_TOKENS = 256
WIDE_MAX_ROWS = 1024
_threads = 1  # the pool's, as `set_threads` last set it


def runs_natively(rows: int, longest: int) -> bool:
    """Whether a forward of `rows` real tokens, `longest` of them in one row, runs natively:
    the one place that decides it for a model's forward, a target's greedy step and a chain
    drafter's proposal (above: NATIVE_MAX_ROWS, WIDE_ROW_TOKENS)."""
    return rows <= NATIVE_MAX_ROWS or (_threads == 1 and rows <= WIDE_MAX_ROWS and longest <= WIDE_ROW_TOKENS)


@cache
def library() -> ctypes.CDLL | None:
    """The compiled decoder, built on first use; None where native decoding is off or cannot build."""
    if os.environ.get("SPECDEC_NATIVE", "1") == "0":
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
    target = native_cache_dir() / f"decoder-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            try:  # bytes: the compiler's messages (UTF-8 quotes) must not fail to decode in a Triton
                # stub's ASCII locale, which made the models fail to load instead of running eager
                subprocess.run([os.environ.get("CC", "cc"), str(SOURCE), "-o", str(built), *FLAGS],
                               check=True, capture_output=True, timeout=120)
            except (OSError, subprocess.SubprocessError) as e:
                stderr = getattr(e, "stderr", b"") or b""
                detail = stderr.decode(errors="replace").strip()[-2000:] or e
                log.warning("native decoder not built (%s); decoder layers run eager", detail)
                return None
            os.replace(built, target)  # atomic: concurrent builders each install a whole file
    lib = ctypes.CDLL(str(target))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.specdec_decoder_forward.restype = ctypes.c_int
    lib.specdec_decoder_forward.argtypes = [p, p, i64, i64, p, p, p, p, p, i64, i64, p, p, p, p, i64]
    lib.specdec_matmul.restype = ctypes.c_int
    lib.specdec_matmul.argtypes = [ctypes.c_int32, p, i64, i64, p, p, i64, p]
    for has in KERNELS.values():
        getattr(lib, has).restype = ctypes.c_int
    lib.specdec_greedy_draft.restype = ctypes.c_int
    lib.specdec_greedy_draft.argtypes = [p, p, i64, i64, p, p, p, p, p, p, p, p, p, i64, i64, p, p, p, i64, p]
    lib.specdec_target_step.restype = ctypes.c_int
    lib.specdec_target_step.argtypes = [p, p, i64, i64, p, p, p, p, p, p, i64, i64, p, p, p, p, i64, p, p, p]
    lib.specdec_set_threads.restype = ctypes.c_int
    lib.specdec_set_threads.argtypes = [ctypes.c_int]
    return lib


def set_threads(threads: int) -> None:
    """Threads each native matmul and attention splits its work over (the runtime's `threads`,
    as torch's): results are the one-thread ones bit for bit. No-op where native decoding is off."""
    global _threads
    lib = library()
    if lib is not None:
        _threads = lib.specdec_set_threads(threads)


@contextmanager
def threads_for(threads: int):
    """The native pool at `threads` for a section (a prompt's prefill: the runtime's
    `prefill_threads`), then as it was."""
    before = _threads
    set_threads(threads)
    try:
        yield
    finally:
        set_threads(before)


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("in_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "down")]


class _Decoder(ctypes.Structure):
    _fields_ = [("n_layers", ctypes.c_int32), ("hidden", ctypes.c_int32), ("n_heads", ctypes.c_int32),
                ("n_kv", ctypes.c_int32), ("head_dim", ctypes.c_int32), ("inter", ctypes.c_int32),
                ("wtype", ctypes.c_int32), ("eps", ctypes.c_float), ("layers", ctypes.POINTER(_Layer)), ("final_norm", ctypes.c_void_p)]


# The rounded kernels a drafter's weights can take, and the library function saying the CPU has it.
KERNELS = {"bfloat16": "specdec_has_bf16", "int8": "specdec_has_int8"}


def kernel_available(dtype: str) -> bool:
    """Whether the native matmul takes `dtype` weights here: float32 wherever it builds, bfloat16
    on a CPU with AVX512-BF16, int8 with AVX512-VNNI."""
    lib = library()
    return lib is not None and (dtype == "float32" or getattr(lib, KERNELS[dtype])() == 1)


def blocked(weight: Tensor, dtype: str = "float32") -> Tensor | None:
    """A linear's weight [out, in] in the layout `decoder.c`'s matmul reads: transposed, its
    columns in contiguous [in, 64] blocks (then [in, 16] for a remainder), each streamed in order.
    float32: stored as float16 where every value is one (a checkpoint saved in half precision, as
    the demo kit's): the kernel widens them exactly, so results are the float32 ones bit for bit,
    and a one-row step, which streams every weight from memory, reads half the bytes
    (`docs/engine.md`). A drafter's (`draft_dtype`) may be rounded: bfloat16 (to nearest even),
    each block's rows in pairs, [in / 2, 64, 2], as vdpbf16ps takes them; int8, each column
    scaled by its largest magnitude over 127 and rounded, stored as `decoder.c`'s WT_I8 says
    (the column scales, 128 x each column's sum, then each block's rows in fours, [in / 4, 64, 4],
    as vpdpbusd takes them). None where the native matmul cannot take it: no library, not
    float32 on CPU, out % 16, no kernel for `dtype` here (`kernel_available`), or an input width
    it cannot split (odd for bfloat16; not a multiple of 16 for int8)."""
    if library() is None or weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.shape[0] % 16:
        return None
    if not kernel_available(dtype) or weight.shape[1] % {"float32": 1, "bfloat16": 2, "int8": 16}[dtype]:
        return None
    wt = weight.detach().t()
    scales = None
    if dtype == "int8":
        scales = wt.abs().amax(0) / 127
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        wt = torch.round(wt / scales).clamp(-127, 127).to(torch.int8)
    whole = wt.shape[1] // 64 * 64
    blocks = [wt[:, o : o + 64] for o in range(0, whole, 64)] + [wt[:, o : o + 16] for o in range(whole, wt.shape[1], 16)]
    if dtype == "float32":
        flat = torch.cat([b.contiguous().flatten() for b in blocks])
        half = flat.to(torch.float16)
        return half if torch.equal(half.to(torch.float32), flat) else flat
    group = {"bfloat16": 2, "int8": 4}[dtype]  # rows side by side in a lane, as vdpbf16ps / vpdpbusd take them
    grouped = [b.reshape(-1, group, b.shape[1]).transpose(1, 2).flatten() for b in blocks]
    if dtype == "bfloat16":
        return torch.cat(grouped).to(torch.bfloat16)
    compensation = 128 * wt.sum(0, dtype=torch.int32)
    return torch.cat([scales.contiguous().view(torch.int8), compensation.view(torch.int8)] + grouped)


# decoder.c's WT_F32, WT_F16, WT_BF16, WT_I8
WEIGHT_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}


def weight_type(blocked_weight: Tensor) -> int:
    """The `decoder.c` type of a `blocked` weight: its kernel."""
    return WEIGHT_TYPES[blocked_weight.dtype]


def matmul(x: Tensor, blocked_weight: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """x [..., in] @ weight.T + bias through the native kernel; x float32 on CPU, few rows."""
    x = x.contiguous()
    out = x.new_empty(*x.shape[:-1], out_features)
    rc = library().specdec_matmul(weight_type(blocked_weight), x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1],
                                  blocked_weight.data_ptr(), None if bias is None else bias.data_ptr(), out_features,
                                  out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"native matmul failed with code {rc}")
    return out


def layer_linears(layers: nn.ModuleList) -> list["InferenceLinear"]:
    """Every decoder layer's inference projections (after `llama.prepare_inference`)."""
    return [x for layer in layers for x in (layer.self_attn.qkv, layer.self_attn.out, layer.mlp.gate_up, layer.mlp.down)]


class NativeDecoder:
    """A model's decoder layers (after `llama.prepare_inference`) and its final norm, if any, as
    one native call. Reads each projection's `InferenceLinear.blocked` weight (the C kernel's
    layout) and holds a contiguous copy of norms and biases."""

    def __init__(self, layers: nn.ModuleList, norm: nn.Module | None, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.keep: list[Tensor] = []  # every tensor the C struct points to

        def t(linear) -> int:
            return linear.blocked.data_ptr()

        def own(w: Tensor | None) -> int | None:
            if w is None:
                return None
            self.keep.append(w.detach().contiguous())
            return self.keep[-1].data_ptr()

        structs = []
        for layer in layers:
            a, m, first = layer.self_attn, layer.mlp, layer.input_layernorm
            structs.append(_Layer(
                in_norm=own(getattr(first, "weight", None)),  # EAGLE's first layer has none (nn.Identity)
                qkv=t(a.qkv), qkv_bias=own(a.qkv.bias), o=t(a.out), o_bias=own(a.out.bias),
                post_norm=own(layer.post_attention_layernorm.weight), gate_up=t(m.gate_up), down=t(m.down)))
        self.layer_array = (_Layer * len(structs))(*structs)
        a = layers[0].self_attn
        self.decoder = _Decoder(len(structs), a.qkv.in_features, a.n_heads, a.n_kv, a.head_dim,
                                layers[0].mlp.down.in_features, weight_type(a.qkv.blocked),
                                layers[0].post_attention_layernorm.eps,
                                self.layer_array, own(None if norm is None else norm.weight))
        self.decoder_ptr = ctypes.addressof(self.decoder)

    @staticmethod
    def for_layers(layers: nn.ModuleList, norm: nn.Module | None = None) -> "NativeDecoder | None":
        """The native decoder for these layers (then `norm`, an RMSNorm with the layers' eps), or
        None where they must stay eager (no library, not float32 on CPU, a shape the kernel does
        not take)."""
        a, m = layers[0].self_attn, layers[0].mlp
        linears = layer_linears(layers)
        dims = (a.qkv.in_features, a.head_dim, m.down.in_features, a.n_heads * a.head_dim)
        if any(x.blocked is None for x in linears) or any(n % 16 for n in dims) or a.head_dim > 512:
            return None
        if len({x.blocked.dtype for x in linears}) > 1:  # one kernel per call: all float32 then
            for x in linears:
                x.blocked = blocked(x.weight).to(torch.float32)
        return NativeDecoder(layers, norm, library())

    def __call__(self, x: Tensor, positions: Tensor, rope: "RopeTable", cache: "KVCache", slots: list[int],
                 starts: list[int], tree_mask: Tensor | None, lengths: list[int] | None) -> Tensor:
        """The layers over x [B, T, H] (a new tensor is returned); arguments as `llama.run_decoder`'s
        (the rotary tables and the cache handed over as every native call takes them:
        `RopeTable.addresses`, `KVCache.native_args`). Padding (row b's tokens from lengths[b] on)
        is neither computed nor written to the cache: its output is zero."""
        B, T, _ = x.shape
        x = x.clone(memory_format=torch.contiguous_format)  # the call writes its result in place
        positions = positions.to(torch.int64).contiguous()
        i64 = ctypes.c_int64 * B
        W = T if tree_mask is None else tree_mask.shape[-1]
        mask = None if tree_mask is None else tree_mask.to(torch.bool).contiguous()
        rc = self.lib.specdec_decoder_forward(
            self.decoder_ptr, x.data_ptr(), B, T, positions.data_ptr(), *rope.addresses(max(starts) + W),
            *cache.native_args, i64(*slots), i64(*starts),
            None if lengths is None else i64(*lengths), None if mask is None else mask.data_ptr(), W)
        if rc != 0:
            raise RuntimeError(f"native decoder failed with code {rc}")
        return x

    @staticmethod
    def accepts(x: Tensor, cache: "KVCache", lengths: list[int] | None = None) -> bool:
        """Whether this forward runs natively: float32 on CPU (the cache too: `native_args`), few
        enough real rows (`lengths`: each row's real tokens; None: all; padding is not computed)."""
        rows = x.shape[0] * x.shape[1] if lengths is None else sum(lengths)
        longest = x.shape[1] if lengths is None else max(lengths)
        return (x.dtype == torch.float32 and x.device.type == "cpu" and cache.native_args is not None
                and runs_natively(rows, longest))


class _Chain(ctypes.Structure):
    _fields_ = [("embed", ctypes.c_void_p), ("head", ctypes.c_void_p), ("head_wtype", ctypes.c_int32),
                ("vocab", ctypes.c_int64), ("fc", ctypes.c_void_p), ("fc_bias", ctypes.c_void_p),
                ("fc_wtype", ctypes.c_int32)]


class NativeChain:
    """A model's embeddings, layers and output head in one native call: a greedy chain drafter's
    proposal (`__call__`, `decoder.c`'s `specdec_greedy_draft`: its catch-up forward, then each
    depth's forward, output head and argmax, without returning to Python; a draft model's
    one-token step was ~0.1 ms of Python around a ~0.02 ms native forward), or a target's step
    for greedy rows (`greedy_step`). `decoder`: the model's layers (with its final norm, but
    EAGLE's head); `embed`: the token embeddings [V, H]; `head`: the output head over a forward's
    output; `fc`: EAGLE's input projection of (embedding, feature), whose output is the next
    feature."""

    def __init__(self, decoder: NativeDecoder, embed: Tensor, head: "InferenceLinear",
                 fc: "InferenceLinear | None" = None) -> None:
        self.decoder = decoder
        self.keep = [embed, head.blocked] + ([] if fc is None else [fc.blocked] + ([] if fc.bias is None else [fc.bias]))
        self.chain = _Chain(embed.data_ptr(), head.blocked.data_ptr(), weight_type(head.blocked),
                            head.out_features, None if fc is None else fc.blocked.data_ptr(),
                            None if fc is None or fc.bias is None else fc.bias.data_ptr(),
                            0 if fc is None else weight_type(fc.blocked))
        self.chain_ptr = ctypes.addressof(self.chain)

    @staticmethod
    def build(decoder: NativeDecoder | None, embed: Tensor, head: "InferenceLinear",
              fc: "InferenceLinear | None" = None) -> "NativeChain | None":
        """The chain for these parts (`head`, `fc`: `linear.InferenceLinear`s), or None where a part
        is not native (then the drafter's Python runs every proposal)."""
        parts = [head] + ([] if fc is None else [fc])
        if (decoder is None or any(x.blocked is None for x in parts) or embed.device.type != "cpu"
                or embed.dtype != torch.float32 or not embed.is_contiguous() or head.out_features % 16):
            return None
        return NativeChain(decoder, embed.detach(), head, fc)

    @staticmethod
    def takes(drafting: list, pending: list[list[int]]) -> bool:
        """Whether a proposal runs here: every drafting sequence greedy (a sampled one draws from
        its q, which rejection sampling needs) and a catch-up of no more entries than a native
        forward takes (a longer one goes to the eager layers, as the drafter's Python sends it).
        Its entries, not its padded rows: the native forward skips padding, and gated on rows x the
        longest row, a batch of 8 sent every catch-up of a newcomer's prompt past 128 tokens to
        the eager layers (9 of 145 proposals of the draft model at 16 users' prompts, fixed k = 4)."""
        return all(s.params.greedy for s in drafting) and runs_natively(sum(map(len, pending)), max(map(len, pending), default=0))

    def greedy_step(self, tokens: list[int], positions: list[int], B: int, T: int, rope: "RopeTable",
                    cache: "KVCache", slots: list[int], starts: list[int], tree_mask: Tensor | None,
                    lengths: list[int] | None) -> tuple[Tensor, list[int]] | None:
        """A target's forward over tokens [B, T] (flattened, right-padded: row b's first lengths[b]
        are real; None: all) at `positions` (flattened) as `LlamaForCausalLM.forward` takes them,
        and the argmax of each real token's logits, in row order, as the engine's greedy
        verification reads them: (hidden states [B, T, H], padding zero; argmax ids). None where
        the forward is not native (`runs_natively`, a cache not float32)."""
        real = B * T if lengths is None else sum(lengths)
        out = (ctypes.c_int64 * real)()
        x = self.step(real, None, out, tokens, positions, B, T, rope, cache, slots, starts, tree_mask, lengths)
        return None if x is None else (x, list(out))

    def logits_step(self, tokens: list[int], positions: list[int], B: int, T: int, rope: "RopeTable",
                    cache: "KVCache", slots: list[int], starts: list[int], tree_mask: Tensor | None,
                    lengths: list[int] | None) -> tuple[Tensor, Tensor] | None:
        """`greedy_step`'s forward, returning each real token's logits instead of their argmax, as
        `LlamaForCausalLM.forward` then `logits` give them (bit for bit): (hidden states [B, T, H];
        logits [B, T, V], or [real tokens, V] where rows are padded), for a step whose rows sample.
        None where the forward is not native."""
        real = B * T if lengths is None else sum(lengths)
        logits = torch.empty(real, self.chain.vocab)
        x = self.step(real, logits, None, tokens, positions, B, T, rope, cache, slots, starts, tree_mask, lengths)
        return None if x is None else (x, logits if lengths is not None else logits.view(B, T, -1))

    def step(self, real: int, logits: Tensor | None, out, tokens: list[int], positions: list[int], B: int, T: int,
             rope: "RopeTable", cache: "KVCache", slots: list[int], starts: list[int], tree_mask: Tensor | None,
             lengths: list[int] | None) -> Tensor | None:
        """Run a target's step (`specdec_target_step`) over its `real` tokens, writing their logits
        to `logits` and/or their argmax to `out` (a ctypes array; None: not asked); its hidden
        states [B, T, H], or None where the forward is not native."""
        if not runs_natively(real, T if lengths is None else max(lengths)) or cache.native_args is None:
            return None
        d = self.decoder
        W = T if tree_mask is None else tree_mask.shape[-1]
        x = torch.empty(B, T, d.decoder.hidden)
        mask = None if tree_mask is None else tree_mask.to(torch.bool).contiguous()
        i64 = ctypes.c_int64 * B
        rc = d.lib.specdec_target_step(
            d.decoder_ptr, self.chain_ptr, B, T, (ctypes.c_int64 * (B * T))(*tokens),
            (ctypes.c_int64 * (B * T))(*positions), *rope.addresses(max(starts) + W), *cache.native_args,
            i64(*slots), i64(*starts), None if lengths is None else i64(*lengths),
            None if mask is None else mask.data_ptr(), W, x.data_ptr(), None if logits is None else logits.data_ptr(), out)
        if rc != 0:
            raise RuntimeError(f"native target step failed with code {rc}")
        return x

    def __call__(self, pending: list[list[int]], starts: list[int], pairs: list[int] | None, drafting: list[int],
                 draft_ks: list[int], rope: "RopeTable", cache: "KVCache", slots: list[int],
                 eos_until: list[int], eos_ids: list[int]) -> list[list[int]]:
        """Row b feeds its pending tokens (EAGLE: each paired with a true feature: `pairs`, the
        address of each pending token's H float32s, every row's in order, kept alive by the
        caller: `feature_addresses`) at window positions starts[b] .. of slots[b]; rows
        drafting[i] then draft draft_ks[i] tokens each (the others only catch up), returned in
        that order. EOS is skipped at depths <= eos_until[b]. `rope`: the drafter's `RopeTable`."""
        B, T = len(pending), max(map(len, pending))
        ks = [0] * B
        for b, k in zip(drafting, draft_ks):
            ks[b] = k
        width = max(max(ks), 1)
        out = (ctypes.c_int64 * (B * width))()
        i64 = ctypes.c_int64 * B
        tokens = (ctypes.c_int64 * (B * T))(*[t for p in pending for t in p + [0] * (T - len(p))])
        eos = (ctypes.c_int64 * max(len(eos_ids), 1))(*eos_ids)
        rc = self.decoder.lib.specdec_greedy_draft(
            self.decoder.decoder_ptr, self.chain_ptr, B, T, tokens, i64(*map(len, pending)), i64(*starts),
            None if pairs is None else (ctypes.c_void_p * len(pairs))(*pairs), i64(*ks),
            *rope.addresses(max(s + len(p) + k for s, p, k in zip(starts, pending, ks))), *cache.native_args,
            i64(*slots), i64(*eos_until), eos, len(eos_ids), out)
        if rc != 0:
            raise RuntimeError(f"native chain failed with code {rc}")
        flat = list(out)
        return [flat[b * width : b * width + k] for b, k in zip(drafting, draft_ks)]
