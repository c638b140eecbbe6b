"""Medusa heads and the EAGLE head, in their public checkpoint formats.

Both read the target's last hidden state (after the final norm: what the public implementations
call `hidden_states = base_model.model(...)[0]`).

Medusa (FasterDecoding/Medusa): folder with config.json (`medusa_num_heads`, `medusa_num_layers`)
and `medusa_lm_head.safetensors` (or .pt); head i is `num_layers` residual blocks
x + SiLU(W x + b) (keys `{i}.{l}.linear.weight|bias`) then a bias-free vocabulary projection
(key `{i}.{num_layers}.weight`). Head i predicts the token i+2 positions after the hidden state.

EAGLE-1/2 (SafeAILab/EAGLE): folder with a Llama config.json and model.safetensors or
pytorch_model.bin; `fc` maps concat(embed(token_{t+1}), feature_t) from 2H to H, then
`num_hidden_layers` decoder layers (`layers.{i}.*`; one in the released heads) predict feature_{t+1};
the first has no input layernorm, the others are plain Llama layers (EAGLE's cnets.py). The target's
lm_head turns the prediction into a distribution over token_{t+2}. Embeddings and lm_head are the target's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from specdec.core.config import DRAFT_DTYPES
from specdec.core.models.checkpoint import CheckpointError, load_weights
from specdec.core.models.config import LlamaConfig
from specdec.core.models.kv_cache import KVCache
from specdec.core.models.linear import InferenceLinear, narrow, one_row_packed
from specdec.core.models.llama import DecoderLayer, RopeTable, prepare_inference, run_decoder
from specdec.core.models.native import KERNELS, NativeDecoder, layer_linears

MEDUSA_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.inference: InferenceLinear | None = None  # set by MedusaHeads.prepare_inference

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu((self.inference or self.linear)(x))


class MedusaHeads(nn.Module):
    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int = 1) -> None:
        super().__init__()
        self.num_heads, self.num_layers, self.hidden, self.vocab = num_heads, num_layers, hidden, vocab
        # nn.Sequential names children 0..n, which is exactly the public key layout
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)], nn.Linear(hidden, vocab, bias=False))
            for _ in range(num_heads)
        )
        # per head, its residual blocks and its packed vocabulary projection; set by prepare_inference
        self.inference: list[tuple[list[ResBlock], InferenceLinear]] | None = None

    def prepare_inference(self) -> None:
        """Packed matmuls (`linear.InferenceLinear`), as the target's: a batch's rows no longer
        make `F.linear` repack each head's vocabulary projection (2 MB on the kit) on every call."""
        self.inference, pack_one_row = [], one_row_packed(self)
        for head in self.heads:
            *blocks, vocab = head
            for block in blocks:
                block.inference = InferenceLinear(block.linear.weight, block.linear.bias, pack_one_row)
            self.inference.append((blocks, InferenceLinear(vocab.weight, pack_one_row=pack_one_row)))

    def draft_in(self, draft_dtype: str) -> str:
        """Every head's native matmuls in `draft_dtype` or the narrowest wider type this CPU takes
        (`linear.narrow`); returns that type."""
        return narrow([x for blocks, vocab in self.inference for x in [b.inference for b in blocks] + [vocab]], draft_dtype)

    def forward(self, hidden: Tensor, num_heads: int | None = None) -> Tensor:
        """[..., H] -> [num_heads, ..., V] logits of the first `num_heads` heads (all by default).

        A draft that reaches depth d needs heads 0..d-1 only. Each head ends in a vocabulary
        projection (on the kit a sixth of the target's weights), and a 4-node tree (depth 2) that
        ran all three heads spent a third of its drafting on tokens it never used."""
        n = self.num_heads if num_heads is None else num_heads
        if self.inference is None:  # training
            return torch.stack([self.heads[i](hidden) for i in range(n)])
        logits = []
        for blocks, vocab in self.inference[:n]:
            x = hidden
            for block in blocks:
                x = block(x)
            logits.append(vocab(x))
        return torch.stack(logits)

    def save(self, folder: str | Path, dtype: torch.dtype = torch.float16, base_model: str = "") -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = {
            "medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
            "hidden_size": self.hidden, "vocab_size": self.vocab, "base_model_name_or_path": base_model,
        }
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        state = {k: v.detach().to(dtype).contiguous() for k, v in self.heads.state_dict().items()}
        save_file(state, str(folder / MEDUSA_WEIGHTS[0]))

    @classmethod
    def load(cls, folder: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> "MedusaHeads":
        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        for name in MEDUSA_WEIGHTS:
            if (folder / name).exists():
                path = folder / name
                break
        else:
            raise CheckpointError(f"{folder}: no {' or '.join(MEDUSA_WEIGHTS)} found")
        state = load_file(str(path)) if path.suffix == ".safetensors" else torch.load(path, map_location="cpu", weights_only=True)
        num_heads, num_layers = config["medusa_num_heads"], config.get("medusa_num_layers", 1)
        vocab, hidden = state[f"0.{num_layers}.weight"].shape
        heads = cls(hidden, vocab, num_heads, num_layers)
        heads.heads.load_state_dict(state, strict=True)
        heads = heads.to(device=device, dtype=dtype).eval()
        heads.prepare_inference()
        return heads


class EagleHead(nn.Module):
    def __init__(self, config: LlamaConfig, fc_bias: bool = True) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(config, i, input_norm=i > 0) for i in range(config.num_hidden_layers))
        self.rope = RopeTable(config)
        self.fc_inference: InferenceLinear | None = None  # set by prepare_inference
        self.native: NativeDecoder | None = None  # set by prepare_inference where it can run

    def prepare_inference(self) -> None:
        """Fused, packed projections (`linear.InferenceLinear`), as the target's."""
        pack_one_row = one_row_packed(self)
        prepare_inference(self.layers, pack_one_row)
        self.fc_inference = InferenceLinear(self.fc.weight, self.fc.bias, pack_one_row)
        self.native = NativeDecoder.for_layers(self.layers)

    def draft_in(self, draft_dtype: str) -> str:
        """Its layers' native matmuls in `draft_dtype` or the narrowest wider type this CPU takes
        (`linear.narrow`), which it returns, and its fc's in bfloat16 at most: the fc's input
        joins a token's embedding and a target feature of larger magnitude, and int8's one scale
        per row rounded the embedding's half away (on the demo kit EAGLE's drafts then kept 3.18
        tokens a draft against 3.58)."""
        dtype = narrow(layer_linears(self.layers), draft_dtype)
        narrow([self.fc_inference], min(draft_dtype, "bfloat16", key=DRAFT_DTYPES.index))
        if dtype in KERNELS:
            self.native = NativeDecoder.for_layers(self.layers)
        return dtype

    def new_cache(self, num_slots: int, capacity: int) -> KVCache:
        c, p = self.config, self.fc.weight
        return KVCache(c.num_hidden_layers, num_slots, capacity, c.num_key_value_heads, c.head_dim, p.dtype, p.device)

    def forward(
        self, token_embeds: Tensor, features: Tensor, positions: Tensor | None = None,
        cache: KVCache | None = None, slots: list[int] | None = None, starts: list[int] | None = None,
        tree_mask: Tensor | None = None, lengths: list[int] | None = None,
    ) -> Tensor:
        """Predicted next features [B, T, H] from (embed(token_{t+1}), feature_t) pairs."""
        x = (self.fc_inference or self.fc)(torch.cat((token_embeds, features), dim=-1))
        return run_decoder(self.layers, self.rope, x, positions, cache, slots, starts, tree_mask, lengths, native=self.native)

    def save(self, folder: str | Path, dtype: torch.dtype = torch.float16) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = self.config.to_hf()
        config["bias"] = self.fc.bias is not None
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        state = {k: v.detach().to(dtype).clone() for k, v in self.state_dict().items()}
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def load(cls, folder: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> "EagleHead":
        folder = Path(folder)
        raw = json.loads((folder / "config.json").read_text())
        config = LlamaConfig.from_hf({**raw, "model_type": raw.get("model_type", "llama")})
        state = load_weights(folder)
        state = {k: v for k, v in state.items() if not k.startswith("embed_tokens.") and "rotary_emb" not in k}
        head = cls(config, fc_bias="fc.bias" in state)
        missing, unexpected = head.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise CheckpointError(f"{folder}: EAGLE weights do not fit (missing {missing[:5]}, unexpected {unexpected[:5]})")
        head = head.to(device=device, dtype=dtype).eval()
        head.prepare_inference()
        return head
