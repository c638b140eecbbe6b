"""A Llama-family decoder in plain torch, with Hugging Face weight names.

`LlamaForCausalLM.forward` runs T new tokens for each of B sequences against their KV-cache
slots. The new tokens may form a tree (speculative verification): `tree_mask[b, i, j]` says new
token i may attend to new token j, and `positions` carries each token's depth-based position.
Without a tree mask the new tokens are causal, which with right padding is also what a batched
prefill of prompts with different lengths needs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.core.models.config import LlamaConfig
from specdec.core.models.kv_cache import KVCache
from specdec.core.models.linear import InferenceLinear, narrow, one_row_packed
from specdec.core.models.native import KERNELS, NativeChain, NativeDecoder, layer_linears


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # one fused kernel instead of six; half-precision inputs are normalised in float32, as in
        # Llama's reference
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inv_freq(config: LlamaConfig) -> Tensor:
    """Rotary inverse frequencies, including linear and Llama-3 frequency scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RopeTable:
    """cos and signed sin rows per position [n, 1, head_dim] for `apply_rope`, computed once (grown
    by doubling when a longer sequence arrives) instead of ~12 small operations every forward.

    The sin rows carry rotate_half's sign (-sin on the first half), so the rotation is one roll
    instead of chunk, negate and concatenate: bitwise the same products as Llama's reference."""

    def __init__(self, config: LlamaConfig) -> None:
        self.config = config  # (models are built on the meta device: nothing is computed here)
        self.cos = self.sin = None
        self.native: tuple[Tensor, Tensor] | None = None  # float32 CPU tables a native forward reads
        self.native_addresses, self.native_rows = (0, 0), 0

    def __call__(self, positions: Tensor, bound: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """Rows for positions [B, T] (all < bound) as [B, T, 1, head_dim], in like's dtype and device."""
        cos, sin = self.table(bound, like)
        return cos[positions], sin[positions]

    def table(self, bound: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """The whole tables [n, 1, head_dim], n >= bound, in like's dtype and device."""
        if self.cos is None or bound > len(self.cos) or self.cos.dtype != like.dtype or self.cos.device != like.device:
            n = max(bound, 2 * (0 if self.cos is None else len(self.cos)), 256)
            inv_freq = rope_inv_freq(self.config).float().to(like.device)
            freqs = torch.arange(n, device=like.device, dtype=torch.float32)[:, None] * inv_freq
            cos, sin = freqs.cos(), freqs.sin()
            self.cos = torch.cat((cos, cos), -1)[:, None].to(like.dtype)
            self.sin = torch.cat((-sin, sin), -1)[:, None].to(like.dtype)
        return self.cos, self.sin

    def addresses(self, bound: int) -> tuple[int, int]:
        """The float32 CPU tables' addresses, n >= bound rows, as a native forward takes them: plain
        ints while the tables stand (kept alive here), so a step reads no tensor for them."""
        if bound > self.native_rows:
            self.native = self.table(bound, torch.empty(0))
            self.native_addresses, self.native_rows = (self.native[0].data_ptr(), self.native[1].data_ptr()), len(self.native[0])
        return self.native_addresses


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotary embedding of x [B, T, heads, head_dim] (queries and keys together, in one pass)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * self.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=c.o_bias)
        self.qkv: InferenceLinear | None = None  # set by prepare_inference
        self.out: InferenceLinear | None = None

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], cache: KVCache | None, ctx: "BatchContext | None") -> Tensor:
        B, T, _ = x.shape
        nq, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        if self.qkv is None:  # training
            qk, v = torch.cat((self.q_proj(x), self.k_proj(x)), -1), self.v_proj(x)
        else:
            qk, v = self.qkv(x).split([(nq + nkv) * hd, nkv * hd], -1)
        q, k = apply_rope(qk.view(B, T, nq + nkv, hd), *rope).split([nq, nkv], 2)
        v = v.view(B, T, nkv, hd)
        if cache is not None:  # serving: attend over the slot's cache; else training: causal over x
            kc, vc = cache.k[self.layer_idx], cache.v[self.layer_idx]
            ctx.write(kc, k)
            ctx.write(vc, v)
            k, v = ctx.read(kc), ctx.read(vc)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=None if ctx is None else ctx.mask, is_causal=ctx is None,
            enable_gqa=self.n_kv != self.n_heads,
        )
        return (self.out or self.o_proj)(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, i, b = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)
        self.gate_up: InferenceLinear | None = None  # set by prepare_inference
        self.down: InferenceLinear | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up is None:  # training
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int, input_norm: bool = True) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        # EAGLE's single decoder layer has no input layernorm; its checkpoint simply lacks the key.
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps) if input_norm else nn.Identity()
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], cache: KVCache | None, ctx: "BatchContext | None") -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class BatchContext:
    """Where B sequences' T new tokens go in the cache, and what each may attend to.

    Built once per forward and shared by all layers. Key j of sequence b is visible to its new
    token i when j lies in the sequence's committed prefix (j < start_b), or when j is new token
    j - start_b and the tree mask allows it.

    A tree mask may also cover tree nodes an earlier forward wrote (EAGLE-2 grows its tree one
    depth per forward and runs only the new depth): with `tree_mask` [B, T, W], keys
    start_b .. start_b + W - T - 1 are those nodes and the new tokens are written after them.

    Rows padded to the batch's widest row (`lengths[b]` < T real tokens) write their padding to
    the cache's scratch position, never past the row's own entries: a long-running sequence
    batched with a newly admitted long prompt would otherwise write start_b + T past the end of
    its slot. Padding is never attended to by a real token, so where it goes does not matter.
    """

    def __init__(self, slots: list[int], starts: list[int], T: int, tree_mask: Tensor | None, device,
                 lengths: list[int] | None = None, scratch: int | None = None) -> None:
        B = len(slots)
        self.B, self.slot0 = B, slots[0]
        self.contiguous = B == 1 or slots == list(range(slots[0], slots[0] + B))
        # the keys after the prefix: tree nodes (if any) and the new tokens, last
        self.width = W = T if tree_mask is None else tree_mask.shape[-1]
        self.length = max(starts) + W
        padded = lengths is not None and min(lengths) < T
        same_start = min(starts) == max(starts)
        # Tensors are made only where a shape needs them (each is a few microseconds, and a
        # drafter's one-token step is all fixed costs): the common decode shapes write a plain
        # block of the cache and read a plain range of slots.
        self.window = (slice(self.slot0, self.slot0 + B), slice(starts[0] + W - T, starts[0] + W)) \
            if self.contiguous and same_start and not padded else None
        self.slots = None if self.contiguous else torch.tensor(slots, device=device)
        start_t = None if self.window is not None and W == 1 else torch.tensor(starts, device=device)
        if self.window is None:
            self.slot_index = torch.tensor(slots, device=device)[:, None]
            self.write_pos = start_t[:, None] + torch.arange(W - T, W, device=device)
            if padded:
                valid = torch.arange(T, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
                self.write_pos = torch.where(valid, self.write_pos, scratch)
                self.length = max(s + W - T + n for s, n in zip(starts, lengths))  # after earlier tree nodes
        if W == 1 and same_start:
            self.mask = None  # one new token per sequence, same length: it sees every key
        else:
            j = torch.arange(self.length, device=device)
            rel = j[None, :] - start_t[:, None]  # [B, L]: key j's index among the tree's (or new) tokens
            if tree_mask is None:  # (a padded query sees keys up to its own index: outputs unused)
                i = torch.arange(T, device=device)
                new_visible = (rel[:, None, :] >= 0) & (rel[:, None, :] <= i[None, :, None])
            else:
                in_new = (rel >= 0) & (rel < W)
                gathered = torch.gather(tree_mask, 2, rel.clamp(0, W - 1)[:, None, :].expand(B, T, self.length))
                new_visible = gathered & in_new[:, None, :]
            self.mask = ((rel < 0)[:, None, :] | new_visible)[:, None]  # [B, 1, T, L]

    def write(self, cache_layer: Tensor, values: Tensor) -> None:
        """Store the new tokens' keys or values [B, T, heads, head_dim] in their slots."""
        if self.window is not None:
            cache_layer[self.window] = values
        else:
            cache_layer[self.slot_index, self.write_pos] = values

    def read(self, cache_layer: Tensor) -> Tensor:
        if self.contiguous:
            return cache_layer[self.slot0 : self.slot0 + self.B, : self.length]
        # a copy either way; index_select copies 4x faster than advanced indexing here
        return cache_layer[:, : self.length].index_select(0, self.slots)


def linear_of(modules: list[nn.Linear], pack_one_row: bool = False) -> InferenceLinear:
    """One inference matmul for several projections of the same input (q/k/v; gate/up): small
    models on CPU are bound by per-call cost, so one call instead of three or two. The modules'
    own parameters become views of the fused weight, so it is not a second copy (a single
    module's weight is used as it is)."""
    if len(modules) == 1:
        return InferenceLinear(modules[0].weight, modules[0].bias, pack_one_row)
    weight = torch.cat([m.weight.detach() for m in modules])
    bias = None if modules[0].bias is None else torch.cat([m.bias.detach() for m in modules])
    start = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[start : start + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start : start + n], requires_grad=False)
        start += n
    return InferenceLinear(weight, bias, pack_one_row)


def prepare_inference(layers: nn.ModuleList, pack_one_row: bool = False) -> None:
    """Inference: fused and packed projections (`linear.InferenceLinear`) for every layer."""
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        a.qkv = linear_of([a.q_proj, a.k_proj, a.v_proj], pack_one_row)
        a.out = linear_of([a.o_proj], pack_one_row)
        m.gate_up, m.down = linear_of([m.gate_proj, m.up_proj], pack_one_row), linear_of([m.down_proj], pack_one_row)


def run_decoder(
    layers: nn.ModuleList, rope: RopeTable, x: Tensor, positions: Tensor | None, cache: KVCache | None,
    slots: list[int] | None, starts: list[int] | None, tree_mask: Tensor | None = None,
    lengths: list[int] | None = None, norm: nn.Module | None = None, native: NativeDecoder | None = None,
) -> Tensor:
    """Decoder layers over embedded inputs x [B, T, H], then `norm` if given; shared by the Llama
    model and the EAGLE head. With `native` (the same layers and norm as a `NativeDecoder`), the
    forwards it accepts run as one native call.
    lengths[b]: how many of row b's T tokens are real (the rest is padding); None: all of them.
    Every position is below max(starts) + W, W the tree mask's width or else T (a tree node's depth
    and a padded row's index both are)."""
    T = x.shape[1]
    if native is not None and cache is not None and native.accepts(x, cache, lengths):
        return native(x, positions, rope, cache, slots, starts, tree_mask, lengths)
    if cache is None:
        ctx = None
        positions, bound = torch.arange(T, device=x.device).expand(x.shape[0], -1), T
    else:
        ctx = BatchContext(slots, starts, T, tree_mask, x.device, lengths, cache.scratch)
        bound = max(starts) + ctx.width
    cos_sin = rope(positions, bound, x)
    for layer in layers:
        x = layer(x, cos_sin, cache, ctx)
    return x if norm is None else norm(x)


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, initialize: bool = True) -> None:
        super().__init__()
        # initialize=False: an allocated weight, not drawn (`LlamaForCausalLM`)
        weight = None if initialize else torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Parameter names equal Hugging Face's, so checkpoints load with `load_state_dict` as they are.
    `initialize=False` leaves the embedding as allocated, for a checkpoint's weights to replace
    (`checkpoint.load_model`, on the meta device): its default init there, `normal_` on a meta
    tensor, imported torch._dynamo, which nothing else of an engine needs: a draft-model engine
    built in a fresh process (a Triton model's stub, the bench, a test run) took 2.8-3.6 s with
    it and 2.1-2.8 s without."""

    def __init__(self, config: LlamaConfig, initialize: bool = True) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, initialize)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.head: InferenceLinear | None = None  # set by prepare_inference
        self.native: NativeDecoder | None = None  # set by prepare_inference where it can run
        self.native_step: NativeChain | None = None  # ... and with it, embeddings and head (`greedy_step`)
        self.rope = RopeTable(config)

    def new_cache(self, num_slots: int, capacity: int) -> KVCache:
        c, p = self.config, self.lm_head.weight
        return KVCache(c.num_hidden_layers, num_slots, capacity, c.num_key_value_heads, c.head_dim, p.dtype, p.device)

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
        slots: list[int] | None = None,
        starts: list[int] | None = None,
        tree_mask: Tensor | None = None,
        lengths: list[int] | None = None,
    ) -> Tensor:
        """Hidden states after the final norm, [B, T, hidden]; `logits(hidden)` maps them to the vocabulary.

        tokens, positions: [B, T]; starts[b] is how many cached tokens of slot slots[b] stay visible;
        lengths[b] how many of row b's tokens are real (right padding is never written into the slot).
        Without a cache (training) the tokens are whole sequences attended causally.
        """
        return self.run_layers(self.model.embed_tokens(tokens), positions, cache, slots, starts, tree_mask, lengths)

    def run_layers(
        self, x: Tensor, positions: Tensor | None, cache: KVCache | None, slots: list[int] | None,
        starts: list[int] | None, tree_mask: Tensor | None = None, lengths: list[int] | None = None,
    ) -> Tensor:
        return run_decoder(self.model.layers, self.rope, x, positions, cache, slots, starts, tree_mask, lengths,
                           self.model.norm, self.native)

    def logits(self, hidden: Tensor) -> Tensor:
        return (self.head or self.lm_head)(hidden)

    def greedy_step(
        self, tokens: list[int], positions: list[int], B: int, T: int, cache: KVCache, slots: list[int],
        starts: list[int], tree_mask: Tensor | None = None, lengths: list[int] | None = None,
    ) -> tuple[Tensor, list[int]] | None:
        """`forward` over tokens [B, T] and positions [B, T], given flattened as lists, and the
        argmax of each real token's logits in row order, in one native call: (hidden states,
        argmax ids), the same as `forward` then `logits(...).argmax(-1)` gives. None where the
        step cannot run natively (then the caller takes those two)."""
        if self.native_step is None:
            return None
        return self.native_step.greedy_step(tokens, positions, B, T, self.rope, cache, slots, starts, tree_mask, lengths)

    def logits_step(
        self, tokens: list[int], positions: list[int], B: int, T: int, cache: KVCache, slots: list[int],
        starts: list[int], tree_mask: Tensor | None = None, lengths: list[int] | None = None,
    ) -> tuple[Tensor, Tensor] | None:
        """`greedy_step` for a step whose rows sample: (hidden states, the real tokens' logits:
        [B, T, V], or [real tokens, V] where rows are padded), the same as `forward` then
        `logits(...)` gives. None where the step cannot run natively."""
        if self.native_step is None:
            return None
        return self.native_step.logits_step(tokens, positions, B, T, self.rope, cache, slots, starts, tree_mask, lengths)

    def prepare_inference(self) -> None:
        """Fused, packed projections and output head (`linear.InferenceLinear`); training keeps the
        modules' own `nn.Linear`s."""
        pack_one_row = one_row_packed(self)
        prepare_inference(self.model.layers, pack_one_row)
        self.head = InferenceLinear(self.lm_head.weight, pack_one_row=pack_one_row)
        self.build_native()

    def build_native(self) -> None:
        """The native calls over its layers, and with them its embeddings and head, as its
        projections' blocked weights now are."""
        self.native = NativeDecoder.for_layers(self.model.layers, self.model.norm)
        self.native_step = NativeChain.build(self.native, self.model.embed_tokens.weight, self.head)

    def draft_in(self, draft_dtype: str) -> str:
        """This model as a drafter (after `prepare_inference`): its layers' and output head's
        native matmuls in `draft_dtype` or the narrowest wider type this CPU takes
        (`linear.narrow`); returns that type."""
        dtype = narrow(layer_linears(self.model.layers) + [self.head], draft_dtype)
        if dtype in KERNELS:
            self.build_native()
        return dtype
