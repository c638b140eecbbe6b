"""Build an Engine from checkpoint folders and a method name (what the CLI, the benchmark and the
Triton model configs all describe)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.core.engine import Engine
from specdec.core.errors import ConfigurationError
from specdec.core.models.checkpoint import load_model
from specdec.core.models.heads import EagleHead, MedusaHeads
from specdec.core.models.tokenizer import Tokenizer
from specdec.core.proposers.draft_model import DraftModelProposer
from specdec.core.proposers.eagle import EagleProposer, EagleTree
from specdec.core.proposers.medusa import MedusaProposer
from specdec.core.proposers.ngram import NgramProposer
from specdec.core.verify import TypicalAcceptance

METHODS = ("baseline", "draft", "medusa", "eagle", "eagle2", "ngram")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class EngineConfig:
    target: str
    method: str = "baseline"
    draft: str | None = None
    medusa: str | None = None
    eagle: str | None = None
    k: int = 4
    medusa_tree: str | None = None  # JSON list of top-k index paths; default mc_sim_7b_63
    eagle_tree: str = "4,5,24"  # EAGLE-2: top_k,depth,total_tokens
    ngram_min: int = 1
    ngram_max: int = 4
    adaptive: bool = True
    acceptance: str = "exact"  # "typical": Medusa-2 typical acceptance, LOSSY for sampled requests
    typical_threshold: float = 0.09
    typical_alpha: float = 0.3
    max_batch: int = 8
    max_context: int = 1024
    queue_timeout_s: float = 60.0
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 1


def require(path: str | None, what: str, method: str) -> str:
    if not path:
        raise ConfigurationError(f"method {method!r} needs a {what} checkpoint folder")
    if not Path(path).is_dir():
        raise ConfigurationError(f"{what} checkpoint folder {path!r} does not exist")
    return path


def build_engine(cfg: EngineConfig) -> Engine:
    if cfg.method not in METHODS:
        raise ConfigurationError(f"unknown method {cfg.method!r}; choose one of {', '.join(METHODS)}")
    if cfg.k < 0:
        raise ConfigurationError(f"k must be >= 0, got {cfg.k}")
    if cfg.acceptance not in ("exact", "typical"):
        raise ConfigurationError(f"acceptance must be 'exact' or 'typical' (lossy), got {cfg.acceptance!r}")
    if cfg.dtype not in DTYPES:
        raise ConfigurationError(f"dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    if cfg.device.startswith("cpu"):
        torch.set_num_threads(cfg.threads)
    dtype = DTYPES[cfg.dtype]
    target_dir = require(cfg.target, "target", cfg.method)
    target = load_model(target_dir, dtype, cfg.device)
    tokenizer = Tokenizer(target_dir)
    eos = list(target.config.eos_token_id or tokenizer.eos_ids)
    proposer = None
    if cfg.method == "draft":
        draft_dir = require(cfg.draft, "draft", cfg.method)
        draft_tok = Tokenizer(draft_dir)
        if draft_tok.fingerprint() != tokenizer.fingerprint():
            raise ConfigurationError(f"draft {draft_dir!r} uses a different tokenizer than target {target_dir!r}")
        draft = load_model(draft_dir, dtype, cfg.device)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ConfigurationError(
                f"draft vocabulary ({draft.config.vocab_size}) differs from the target's ({target.config.vocab_size})")
        proposer = DraftModelProposer(draft, cfg.k, eos)
    elif cfg.method == "medusa":
        heads = MedusaHeads.load(require(cfg.medusa, "medusa", cfg.method), dtype, cfg.device)
        if heads.vocab != target.config.vocab_size or heads.hidden != target.config.hidden_size:
            raise ConfigurationError("medusa heads do not fit the target (hidden size or vocabulary differ)")
        tree = json.loads(cfg.medusa_tree) if cfg.medusa_tree else None
        proposer = MedusaProposer(heads, tree, cfg.k)
    elif cfg.method in ("eagle", "eagle2"):
        head = EagleHead.load(require(cfg.eagle, "eagle", cfg.method), dtype, cfg.device)
        if head.config.hidden_size != target.config.hidden_size:
            raise ConfigurationError("EAGLE head hidden size differs from the target's")
        tree = None
        if cfg.method == "eagle2":
            top_k, depth, total = (int(x) for x in cfg.eagle_tree.split(","))
            tree = EagleTree(top_k, depth, total)
        proposer = EagleProposer(head, target, cfg.k, tree, eos)
    elif cfg.method == "ngram":
        proposer = NgramProposer(cfg.k, cfg.ngram_min, cfg.ngram_max)
    typical = TypicalAcceptance(cfg.typical_threshold, cfg.typical_alpha) if cfg.acceptance == "typical" else None
    return Engine(target, tokenizer, proposer, cfg.max_batch, cfg.max_context, cfg.adaptive,
                  cfg.queue_timeout_s, typical)
