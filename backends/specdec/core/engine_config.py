"""Build an Engine from checkpoint folders and a method name (what the CLI, the benchmark and the
Triton model configs all describe)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.core.engine import Engine
from specdec.core.errors import ConfigurationError
from specdec.core.models.checkpoint import load_model
from specdec.core.models.tokenizer import Tokenizer
from specdec.core.proposers import PROPOSERS, Target, build_proposer, require
from specdec.core.verify import TypicalAcceptance

METHODS = ("baseline", *PROPOSERS)
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
    proposer = None if cfg.method == "baseline" else build_proposer(
        cfg, Target(target, tokenizer, target_dir, eos, dtype, cfg.device))
    typical = TypicalAcceptance(cfg.typical_threshold, cfg.typical_alpha) if cfg.acceptance == "typical" else None
    return Engine(target, tokenizer, proposer, cfg.max_batch, cfg.max_context, cfg.adaptive,
                  cfg.queue_timeout_s, typical)
