"""Read and write Hugging Face checkpoint folders: config.json plus weights in any public layout.

Weights come as model.safetensors, sharded safetensors (model.safetensors.index.json),
pytorch_model.bin, or sharded .bin files; all end up as one name -> tensor dict.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from specdec.core.models.config import LlamaConfig
from specdec.core.models.llama import LlamaForCausalLM


class CheckpointError(ValueError):
    """A checkpoint folder is missing files or holds weights that do not fit its config."""


def load_weight_file(path: Path) -> dict[str, Tensor]:
    if path.suffix == ".safetensors":
        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def load_weights(folder: str | Path) -> dict[str, Tensor]:
    folder = Path(folder)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.exists():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            weights: dict[str, Tensor] = {}
            for shard in shards:
                weights.update(load_weight_file(folder / shard))
            return weights
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (folder / name).exists():
            return load_weight_file(folder / name)
    raise CheckpointError(f"{folder}: no model.safetensors, pytorch_model.bin or shard index found")


def load_model(
    folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LlamaForCausalLM:
    """Build the model a checkpoint folder describes and load its weights (strictly: no key left over)."""
    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise CheckpointError(f"{folder}: config.json not found")
    config = LlamaConfig.from_file(folder / "config.json")
    weights = load_weights(folder)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, initialize=False)
    model = model.to_empty(device=device)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    unexpected = [k for k in unexpected if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise CheckpointError(f"{folder}: weights do not match config (missing {missing[:5]}, unexpected {unexpected[:5]})")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(dtype).eval()
    model.prepare_inference()
    return model


def save_model(model: LlamaForCausalLM, folder: str | Path, dtype: torch.dtype = torch.float16) -> None:
    """Write config.json and model.safetensors (tied embeddings stored once, as HF does)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config.to_hf()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().to(dtype).clone() for k, v in model.state_dict().items()}  # clone: no shared views
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
