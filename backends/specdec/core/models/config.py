"""Llama-family model configuration, read from and written to Hugging Face `config.json`.

One dataclass covers LlamaForCausalLM, Qwen2ForCausalLM and MistralForCausalLM: they differ only
in which projections carry biases and in defaults, which `from_hf` resolves.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


class ConfigError(ValueError):
    """A checkpoint's config.json describes something this runtime cannot run."""


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "LlamaConfig":
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        heads = d["num_attention_heads"]
        attention_bias = bool(d.get("attention_bias", False))
        eos = d.get("eos_token_id")
        # transformers v5 writes `rope_parameters` (theta included); v4 wrote rope_theta + rope_scaling.
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "linear", "llama3"):
                raise ConfigError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=d.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and no o_proj bias; Llama's attention_bias covers all four.
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            model_type=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "LlamaConfig":
        return cls.from_hf(json.loads(Path(path).read_text()))

    def to_hf(self) -> dict[str, Any]:
        """The config.json a Hugging Face loader understands for this model."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
        d = asdict(self)
        for key in ("qkv_bias", "o_bias"):
            d.pop(key)
        if self.model_type == "llama":
            d["attention_bias"] = self.qkv_bias
        d["architectures"] = [arch[self.model_type]]
        d["hidden_act"] = "silu"
        d["torch_dtype"] = "float32"
        eos = self.eos_token_id
        d["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
        return d
