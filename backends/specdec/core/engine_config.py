"""Build an Engine from an EngineConfig (`specdec.core.config`: what the CLI, the benchmark and the
Triton model configs all describe). The one place each proposer is constructed."""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.core.config import ACCEPTANCES, DTYPES, METHODS, EngineConfig
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


def require(path: str | None, what: str, method: str) -> str:
    if not path:
        raise ConfigurationError(f"method {method!r} needs a {what} checkpoint folder")
    if not Path(path).is_dir():
        raise ConfigurationError(f"{what} checkpoint folder {path!r} does not exist")
    return path


def build_engine(cfg: EngineConfig) -> Engine:
    paths, p, sched, rt = cfg.checkpoints, cfg.proposer, cfg.scheduler, cfg.runtime
    if p.method not in METHODS:
        raise ConfigurationError(f"unknown method {p.method!r}; choose one of {', '.join(METHODS)}")
    if p.k < 0:
        raise ConfigurationError(f"k must be >= 0, got {p.k}")
    if p.acceptance not in ACCEPTANCES:
        raise ConfigurationError(f"acceptance must be 'exact' or 'typical' (lossy), got {p.acceptance!r}")
    if rt.dtype not in DTYPES:
        raise ConfigurationError(f"dtype must be one of {', '.join(DTYPES)}, got {rt.dtype!r}")
    if rt.device.startswith("cpu"):
        torch.set_num_threads(rt.threads)
    dtype = getattr(torch, rt.dtype)
    target_dir = require(paths.target, "target", p.method)
    target = load_model(target_dir, dtype, rt.device)
    tokenizer = Tokenizer(target_dir)
    eos = list(target.config.eos_token_id or tokenizer.eos_ids)
    proposer, depth_for = None, None
    if p.method == "draft":
        draft_dir = require(paths.draft, "draft", p.method)
        draft_tok = Tokenizer(draft_dir)
        if draft_tok.fingerprint() != tokenizer.fingerprint():
            raise ConfigurationError(f"draft {draft_dir!r} uses a different tokenizer than target {target_dir!r}")
        draft = load_model(draft_dir, dtype, rt.device)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ConfigurationError(
                f"draft vocabulary ({draft.config.vocab_size}) differs from the target's ({target.config.vocab_size})")
        proposer = DraftModelProposer(draft, p.k, eos)
    elif p.method == "medusa":
        heads = MedusaHeads.load(require(paths.medusa, "medusa", p.method), dtype, rt.device)
        if heads.vocab != target.config.vocab_size or heads.hidden != target.config.hidden_size:
            raise ConfigurationError("medusa heads do not fit the target (hidden size or vocabulary differ)")
        tree = [list(path) for path in p.medusa_tree] if p.medusa_tree is not None else None
        proposer = MedusaProposer(heads, tree, p.k)
        depths = [len(path) for path in proposer.tree]
        depth_for = lambda k: max(depths[:k], default=0)  # noqa: E731
    elif p.method in ("eagle", "eagle2"):
        head = EagleHead.load(require(paths.eagle, "eagle", p.method), dtype, rt.device)
        if head.config.hidden_size != target.config.hidden_size:
            raise ConfigurationError("EAGLE head hidden size differs from the target's")
        tree = None
        if p.method == "eagle2":
            tree = EagleTree(*p.eagle_tree)
            depth_for = lambda k: min(tree.depth, k)  # noqa: E731
        proposer = EagleProposer(head, target, p.k, tree, eos)
    elif p.method == "ngram":
        proposer = NgramProposer(p.k, p.ngram_min, p.ngram_max)
    typical = TypicalAcceptance(p.typical_threshold, p.typical_alpha) if p.acceptance == "typical" else None
    return Engine(target, tokenizer, proposer, sched.max_batch, sched.max_context, sched.policy == "adaptive",
                  sched.queue_timeout_s, depth_for, typical)
