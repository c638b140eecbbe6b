"""One kit build: corpus -> tokenizer -> target -> draft -> EAGLE -> Medusa -> export -> evaluate.

Everything slow is cached under the cache folder (tokenizer, token streams, each stage's
checkpoint), so rerunning the same command resumes, and rerunning with more `--minutes` trains
further and re-exports. The cache belongs to one profile: a changed profile needs a fresh folder.
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer
from torch import nn

from specdec.core.models.config import LlamaConfig
from specdec.core.models.heads import EagleHead, MedusaHeads
from specdec.core.models.llama import LlamaForCausalLM
from specdec.tools.kit.corpus import encode_documents, read_documents, split_documents, stdlib_root
from specdec.tools.kit.evaluate import evaluate_kit
from specdec.tools.kit.export import FOLDERS, export_kit, folder_bytes, write_checksums
from specdec.tools.kit.features import feature_batches
from specdec.tools.kit.profiles import EOS_ID, STAGE_ORDER, Profile
from specdec.tools.kit.tokenizer_train import train_tokenizer
from specdec.tools.kit.train import TrainContext, init_medusa, train_draft, train_eagle, train_medusa, train_target


def default_cache(profile: Profile) -> Path:
    return Path.home() / ".cache" / "specdec" / "kit" / profile.name


def training_identity(profile: Profile) -> dict[str, Any]:
    """The profile fields the cached data and checkpoints depend on (budgets and eval sizes may change)."""
    d = json.loads(json.dumps(profile.to_dict()))
    # eagle_layers: the EAGLE checkpoint's key carries it, and a deeper head grows from a shallower one
    for key in ("minutes", "eval_windows", "eval_prompts", "eval_new_tokens", "compile", "eagle_layers"):
        d.pop(key)
    for stage in d["stages"].values():
        stage.pop("time_share")
    return d


def claim_cache(cache: Path, profile: Profile) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    marker = cache / "profile.json"
    current = training_identity(profile)
    if marker.exists() and json.loads(marker.read_text()) != current:
        raise SystemExit(f"{cache} holds a build of a different profile definition; pass a fresh --cache")
    marker.write_text(json.dumps(current, indent=2) + "\n")


def prepare_data(profile: Profile, cache: Path) -> tuple[Path, np.ndarray, dict[str, Any]]:
    """Tokenizer and train token stream, each built once and then read from the cache."""
    tok_path, tokens_path, stats_path = cache / "tokenizer.json", cache / "train_tokens.npy", cache / "corpus.json"
    if tok_path.exists() and tokens_path.exists() and stats_path.exists():
        return tok_path, np.load(tokens_path), json.loads(stats_path.read_text())
    train_docs, heldout_docs = split_documents(read_documents(), profile.heldout_percent, profile.max_train_files)
    print(f"corpus: {len(train_docs)} train files, {len(heldout_docs)} held-out files", flush=True)
    tokenizer = train_tokenizer(train_docs, profile.vocab, profile.tokenizer_chars, tok_path)
    tokens = encode_documents(tokenizer, train_docs, EOS_ID)
    np.save(tokens_path, tokens)
    stats = {
        "source": "Python standard library .py files", "stdlib": str(stdlib_root()), "python": platform.python_version(),
        "train_files": len(train_docs), "heldout_files": len(heldout_docs),
        "train_chars": sum(len(d.text) for d in train_docs), "train_tokens": int(len(tokens)),
        "heldout_rule": f"sha1(relative path)[:8] as int % 100 < {profile.heldout_percent}",
    }
    stats_path.write_text(json.dumps(stats, indent=2) + "\n")
    return tok_path, tokens, stats


def init_weights(model: nn.Module, residual_layers: int) -> None:
    """GPT-2 style init: N(0, 0.02), residual output projections scaled down by depth."""
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * residual_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            nn.init.normal_(p, 0.0, std)


def new_llama(config: LlamaConfig, seed: int, device: str) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    init_weights(model, config.num_hidden_layers)
    return model.to(device)


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def build_kit(
    profile: Profile, out: Path, cache: Path | None = None, minutes: float | None = None, device: str = "cpu",
    compile: bool | None = None, stages: Collection[str] = STAGE_ORDER,
) -> dict[str, Any] | None:
    """Train (or resume) every stage within `minutes` in total, then export to `out` and evaluate.

    With `stages` a subset, only those stages train (the rest load from the cache) and nothing is
    exported (returns None): parallel processes may share one cache, one stage set each.
    """
    started = time.monotonic()
    cache = cache or default_cache(profile)
    claim_cache(cache, profile)
    total_minutes = profile.minutes if minutes is None else minutes
    tok_path, tokens, corpus_stats = prepare_data(profile, cache)
    vocab = HFTokenizer.from_file(str(tok_path)).get_vocab_size()
    ctx = TrainContext(
        profile=profile, tokens=torch.from_numpy(tokens.astype(np.int32)), cache=cache, device=device,
        compile=profile.compile if compile is None else compile,
        total_seconds=None if total_minutes is None else total_minutes * 60, stages=frozenset(stages),
    )
    max_positions = profile.seq_len * 2
    target_config = profile.target.config(vocab, max_positions)
    target = new_llama(target_config, profile.seed, device)
    results = {"target": train_target(target, ctx)}
    target_step = results["target"].steps
    features = feature_batches(target, target_step, ctx.tokens, profile.seq_len, cache, device)

    partial = set(stages) != set(STAGE_ORDER)  # train only the chosen learners, export nothing
    if not partial or "draft" in stages:
        draft = new_llama(profile.draft.config(vocab, max_positions), profile.seed + 1, device)
        results["draft"] = train_draft(draft, target, target_step, features, ctx)

    if not partial or "eagle" in stages:
        torch.manual_seed(profile.seed + 2)
        eagle_config = LlamaConfig(**{**target_config.__dict__, "num_hidden_layers": profile.eagle_layers})
        eagle = EagleHead(eagle_config).to(device)
        init_weights(eagle, profile.eagle_layers)
        results["eagle"] = train_eagle(eagle, target, target_step, features, ctx)

    if not partial or "medusa" in stages:
        torch.manual_seed(profile.seed + 3)
        medusa = MedusaHeads(target_config.hidden_size, vocab, profile.medusa_heads, num_layers=1).to(device)
        init_medusa(medusa, target)
        results["medusa"] = train_medusa(medusa, target, target_step, features, ctx)

    if partial:
        print(f"trained {', '.join(sorted(stages))}; run without --stages to export and evaluate", flush=True)
        return None
    for module in (target, draft, eagle, medusa):
        module.to("cpu")
    export_kit(out, tok_path, target, draft, medusa, eagle, max_positions)
    kit = {
        "profile": profile.name, "seed": profile.seed, "device": device, "torch": torch.__version__,
        "python": sys.version.split()[0], "minutes_budget": total_minutes,
        "corpus": corpus_stats, "seq_len": profile.seq_len, "vocab_size": vocab,
        "params": {"target": param_count(target), "draft": param_count(draft), "eagle": param_count(eagle),
                   "medusa": param_count(medusa)},
        "bytes_fp16": {name: folder_bytes(out / name) for name in FOLDERS},
        "training": {name: r.to_dict() for name, r in results.items()},
    }
    (out / "kit.json").write_text(json.dumps(kit, indent=2) + "\n")
    print("evaluating...", flush=True)
    evaluate_kit(out)
    write_checksums(out)
    kit = json.loads((out / "kit.json").read_text())
    print(f"kit written to {out} in {(time.monotonic() - started) / 60:.1f} min", flush=True)
    return kit
