"""Medusa and EAGLE checkpoints in their public layouts (key names written by hand here, as the
public repositories write them), loaded and checked against an independent computation."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from specdec.core.models.checkpoint import CheckpointError, load_model
from specdec.core.models.heads import EagleHead, MedusaHeads

H, V = 64, 300


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_medusa_public_format(tmp_path, fmt):
    torch.manual_seed(0)
    heads, layers = 3, 2
    state = {}
    for i in range(heads):
        for l in range(layers):
            state[f"{i}.{l}.linear.weight"] = torch.randn(H, H) / 8
            state[f"{i}.{l}.linear.bias"] = torch.randn(H) / 8
        state[f"{i}.{layers}.weight"] = torch.randn(V, H) / 8
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": heads, "medusa_num_layers": layers,
                                                      "base_model_name_or_path": "x"}))
    if fmt == "pt":
        torch.save(state, tmp_path / "medusa_lm_head.pt")
    else:
        save_file(state, str(tmp_path / "medusa_lm_head.safetensors"))
    loaded = MedusaHeads.load(tmp_path)
    x = torch.randn(5, H)
    with torch.no_grad():
        got = loaded(x)
    for i in range(heads):
        h = x
        for l in range(layers):
            h = h + F.silu(h @ state[f"{i}.{l}.linear.weight"].T + state[f"{i}.{l}.linear.bias"])
        assert torch.allclose(got[i], h @ state[f"{i}.{layers}.weight"].T, atol=1e-5)
    with torch.no_grad():
        assert torch.equal(loaded(x, num_heads=2), got[:2])  # a shallow draft runs the first heads only


def test_medusa_missing_weights_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    with pytest.raises(CheckpointError, match="medusa_lm_head"):
        MedusaHeads.load(tmp_path)


@pytest.mark.parametrize("fmt,layers", [("safetensors", 1), ("bin", 1), ("safetensors", 2)])
def test_eagle_public_format(tmp_path, tiny_target, fmt, layers):
    """EAGLE keys: fc.*, layers.{i}.* where layer 0 has no input_layernorm; an embed_tokens copy is tolerated."""
    import transformers

    target = load_model(tiny_target)
    cfg = json.loads((tiny_target / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    cfg["bias"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(1)
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    inter = cfg["intermediate_size"]
    state = {"fc.weight": torch.randn(H, 2 * H) / 10, "fc.bias": torch.randn(H) / 10,
             "embed_tokens.weight": target.model.embed_tokens.weight.detach().clone()}
    for i in range(layers):
        state |= {
            f"layers.{i}.self_attn.q_proj.weight": torch.randn(nh * hd, H) / 8,
            f"layers.{i}.self_attn.k_proj.weight": torch.randn(nkv * hd, H) / 8,
            f"layers.{i}.self_attn.v_proj.weight": torch.randn(nkv * hd, H) / 8,
            f"layers.{i}.self_attn.o_proj.weight": torch.randn(H, nh * hd) / 8,
            f"layers.{i}.mlp.gate_proj.weight": torch.randn(inter, H) / 8,
            f"layers.{i}.mlp.up_proj.weight": torch.randn(inter, H) / 8,
            f"layers.{i}.mlp.down_proj.weight": torch.randn(H, inter) / 8,
            f"layers.{i}.post_attention_layernorm.weight": 1 + torch.randn(H) / 10,
        } | ({f"layers.{i}.input_layernorm.weight": 1 + torch.randn(H) / 10} if i else {})
    if fmt == "bin":
        torch.save(state, tmp_path / "pytorch_model.bin")
    else:
        save_file(state, str(tmp_path / "model.safetensors"))
    head = EagleHead.load(tmp_path)
    assert len(head.layers) == layers
    assert isinstance(head.layers[0].input_layernorm, torch.nn.Identity)
    # reference: Hugging Face Llama decoder layers, the first with an identity input norm
    tokens = torch.randint(0, V, (1, 6))
    feats = torch.randn(1, 6, H)
    ref_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("bias",)})
    rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(ref_cfg)
    pos = torch.arange(6)[None]
    mask = torch.full((6, 6), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        got = head(target.model.embed_tokens(tokens), feats)
        ref = torch.cat([target.model.embed_tokens(tokens), feats], -1) @ state["fc.weight"].T + state["fc.bias"]
        for i in range(layers):
            layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(ref_cfg, i).eval()
            prefix = f"layers.{i}."
            own = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
            layer.load_state_dict({"input_layernorm.weight": torch.ones(H)} | own)
            if i == 0:
                layer.input_layernorm = torch.nn.Identity()
            ref = layer(ref, attention_mask=mask, position_ids=pos, position_embeddings=rope(ref, pos))
            ref = ref[0] if isinstance(ref, tuple) else ref
    assert torch.allclose(got, ref, atol=1e-4)
