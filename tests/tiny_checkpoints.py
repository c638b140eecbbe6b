"""Writers for tiny random checkpoints in the public formats (used by the tests only)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    main()\n",
    "Grüße, naïve café — 日本語のテキスト 🙂 emoji\n",
]


def make_tokenizer(folder: Path, vocab_size: int = 300) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def make_hf_checkpoint(
    folder: Path, tokenizer_dir: Path, layers: int = 2, hidden: int = 64, seed: int = 0,
    model_type: str = "llama", tie: bool = False, kv_heads: int = 2, rope_scaling: dict | None = None,
    sharded: bool = False, bin_format: bool = False, vocab: int | None = None,
) -> Path:
    """A random checkpoint saved by transformers' own save_pretrained; `vocab`: its vocabulary, if
    wider than the tokenizer's (ids past the tokenizer's are never tokens, as in padded vocabularies)."""
    import transformers

    vocab = vocab or Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    kwargs = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=512,
        tie_word_embeddings=tie, eos_token_id=0, bos_token_id=None, rope_theta=10000.0,
    )
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[model_type]
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    if model_type == "mistral":
        kwargs["sliding_window"] = None
    torch.manual_seed(seed)
    model = cls[1](cls[0](**kwargs)).float()
    with torch.no_grad():  # random init is small; widen it so logits have real structure
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5 / p.shape[-1] ** 0.5 * 4)
    model.save_pretrained(folder, safe_serialization=not bin_format, max_shard_size="50KB" if sharded else "5GB")
    shutil.copy(tokenizer_dir / "tokenizer.json", folder / "tokenizer.json")
    return folder


def make_small_vocab_model(folder: Path, tokenizer_dir: Path, vocab: int, seed: int, layers: int = 1,
                           hidden: int = 32, scale: float = 3.0) -> Path:
    """A random model over the first `vocab` token ids (for exact distribution tests), no EOS."""
    from specdec.core.models.checkpoint import save_model
    from specdec.core.models.config import LlamaConfig
    from specdec.core.models.llama import LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=256)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, scale / p.shape[-1] ** 0.5)
    save_model(model, folder, dtype=torch.float32)
    shutil.copy(tokenizer_dir / "tokenizer.json", folder / "tokenizer.json")
    return folder


def make_perturbed_copy(src: Path, folder: Path, noise: float, seed: int) -> Path:
    """The same model with noise on every weight: a draft that agrees often, not always."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, folder, dirs_exist_ok=True)
    torch.manual_seed(seed)
    weights = load_file(str(src / "model.safetensors"))
    weights = {k: v + noise * v.std() * torch.randn_like(v) if v.dim() > 1 else v for k, v in weights.items()}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def make_heads(
    target_dir: Path, medusa_dir: Path, eagle_dir: Path, seed: int = 0, medusa_heads: int = 3, eagle_layers: int = 1,
) -> None:
    """Random Medusa heads and EAGLE head shaped for the target, in their public formats."""
    from specdec.core.models.config import LlamaConfig
    from specdec.core.models.heads import EagleHead, MedusaHeads

    cfg = LlamaConfig.from_file(target_dir / "config.json")
    torch.manual_seed(seed)
    MedusaHeads(cfg.hidden_size, cfg.vocab_size, medusa_heads, 1).save(medusa_dir, dtype=torch.float32)
    cfg.num_hidden_layers = eagle_layers
    EagleHead(cfg).save(eagle_dir, dtype=torch.float32)


def make_tiny_kit(folder: Path, tokenizer_dir: Path, medusa_heads: int = 3) -> dict[str, Path]:
    """A kit folder like build/demo-kit: target/, draft/ (a copy of the target, so greedy drafts are
    always accepted), medusa/ and eagle/ (random heads in the public formats)."""
    import json

    from specdec.core.models.config import LlamaConfig
    from specdec.core.models.heads import EagleHead, MedusaHeads

    folder = Path(folder)
    target = make_hf_checkpoint(folder / "target", tokenizer_dir, layers=2, hidden=64, seed=1)
    draft = folder / "draft"
    if draft.exists():
        shutil.rmtree(draft)
    shutil.copytree(target, draft)
    cfg = json.loads((target / "config.json").read_text())
    torch.manual_seed(3)
    MedusaHeads(cfg["hidden_size"], cfg["vocab_size"], medusa_heads, 1).save(folder / "medusa", torch.float32)
    EagleHead(LlamaConfig.from_hf({**cfg, "num_hidden_layers": 1})).save(folder / "eagle", torch.float32)
    return {"target": target, "draft": draft, "medusa": folder / "medusa", "eagle": folder / "eagle"}
