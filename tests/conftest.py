"""Shared fixtures: tiny random checkpoints written by `transformers` itself, so the loaders are
tested against the real Hugging Face layout, and a tiny byte-level BPE tokenizer."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)

from tiny_checkpoints import make_tokenizer, make_hf_checkpoint  # noqa: E402


@pytest.fixture(autouse=True)
def collected_heap():
    """A test that runs the bench or forward_ab in this process freezes the heap
    (`engine_config.freeze_heap`, for a process that keeps its engines): the suite drops its
    engines, so the next tests get the collector back over everything."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=300)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, tokenizer_dir) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("target"), tokenizer_dir, layers=2, hidden=64, seed=1)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory, tokenizer_dir) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("draft"), tokenizer_dir, layers=1, hidden=32, seed=2)


@pytest.fixture(scope="session")
def trained_tiny_kit(tmp_path_factory) -> Path:
    """The `tiny` demo-kit profile trained end to end (about two minutes on 2 cores), built once
    per test session: target, distilled draft, EAGLE and Medusa heads with real acceptance."""
    from specdec.tools.kit.build import build_kit
    from specdec.tools.kit.profiles import PROFILES

    root = tmp_path_factory.mktemp("trained-kit")
    build_kit(PROFILES["tiny"], root / "out", cache=root / "cache")
    return root / "out"
