"""Method name -> the factory that builds its proposer. Each proposer module registers itself, so
adding a method touches its own module only; importing `specdec.core.proposers` registers them all.

A factory gets the engine configuration (it reads its own options: checkpoint folder, k, tree)
and the already loaded target, and checks that what it loads fits that target.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specdec.core.config import EngineConfig
from specdec.core.errors import ConfigurationError
from specdec.core.models.llama import LlamaForCausalLM
from specdec.core.models.tokenizer import Tokenizer
from specdec.core.proposers.base import Proposer


@dataclass
class Target:
    """What a proposer may need of the target it drafts for."""

    model: LlamaForCausalLM
    tokenizer: Tokenizer
    folder: str
    eos_ids: list[int]
    dtype: torch.dtype
    device: str


Factory = Callable[[EngineConfig, Target], Proposer]  # (engine configuration, target) -> proposer
PROPOSERS: dict[str, Factory] = {}


def register(*methods: str) -> Callable[[Factory], Factory]:
    def add(factory: Factory) -> Factory:
        for m in methods:
            PROPOSERS[m] = factory
        return factory

    return add


def require(path: str | None, what: str, method: str) -> str:
    """A checkpoint folder that must exist, or a ConfigurationError naming it."""
    if not path:
        raise ConfigurationError(f"method {method!r} needs a {what} checkpoint folder")
    if not Path(path).is_dir():
        raise ConfigurationError(f"{what} checkpoint folder {path!r} does not exist")
    return path


def build_proposer(cfg: EngineConfig, target: Target) -> Proposer:
    """cfg.proposer.method must be registered (build_engine checks it against PROPOSERS)."""
    return PROPOSERS[cfg.proposer.method](cfg, target)
