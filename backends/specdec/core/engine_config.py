"""Build an Engine from an EngineConfig (`specdec.core.config`: what the CLI, the benchmark and the
Triton model configs all describe). Each proposer is built by the factory its module registers."""

from __future__ import annotations

import gc

import torch

from specdec.core.config import ACCEPTANCES, DTYPES, EngineConfig
from specdec.core.engine import Engine
from specdec.core.errors import ConfigurationError
from specdec.core.models import native
from specdec.core.models.checkpoint import load_model
from specdec.core.models.tokenizer import Tokenizer
from specdec.core.proposers import PROPOSERS, Target, build_proposer, require
from specdec.core.verify import TypicalAcceptance

METHODS = ("baseline", *PROPOSERS)


def freeze_heap() -> None:
    """Take what is alive now (the loaded models, the tokenizer, the imported modules: objects a
    serving or benchmarking process keeps to its end) out of the cyclic collector's passes; call
    it once the process has built its engines. A full pass scanned all of them: 114-166 ms with the
    bench's engines on this machine (289 k objects for one engine), enough to halve a 150 ms bench
    repeat, and a stall of as much in a served stream. The garbage alive at that moment is
    collected first."""
    gc.collect()
    gc.freeze()


def build_engine(cfg: EngineConfig) -> Engine:
    p, sched, rt = cfg.proposer, cfg.scheduler, cfg.runtime
    if p.method not in METHODS:
        raise ConfigurationError(f"unknown method {p.method!r}; choose one of {', '.join(METHODS)}")
    if p.k < 0:
        raise ConfigurationError(f"k must be >= 0, got {p.k}")
    if p.acceptance not in ACCEPTANCES:
        raise ConfigurationError(f"acceptance must be 'exact' or 'typical' (lossy), got {p.acceptance!r}")
    if rt.dtype not in DTYPES:
        raise ConfigurationError(f"dtype must be one of {', '.join(DTYPES)}, got {rt.dtype!r}")
    if rt.threads < 1 or rt.prefill_threads < 0:
        raise ConfigurationError(f"threads must be >= 1 and prefill_threads >= 0 (0: threads), got {rt.threads} "
                                 f"and {rt.prefill_threads}")
    if rt.device.startswith("cpu"):
        torch.set_num_threads(rt.threads)
        native.set_threads(rt.threads)
    dtype = getattr(torch, rt.dtype)
    target_dir = require(cfg.checkpoints.target, "target", p.method)
    target = load_model(target_dir, dtype, rt.device)
    tokenizer = Tokenizer(target_dir)
    eos = list(target.config.eos_token_id or tokenizer.eos_ids)
    proposer = None if p.method == "baseline" else build_proposer(
        cfg, Target(target, tokenizer, target_dir, eos, dtype, rt.device))
    typical = TypicalAcceptance(p.typical_threshold, p.typical_alpha) if p.acceptance == "typical" else None
    return Engine(target, tokenizer, proposer, sched.max_batch, sched.max_context, sched.policy == "adaptive",
                  sched.queue_timeout_s, typical, rt.prefill_threads or rt.threads)
