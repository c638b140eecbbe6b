"""Greedy identity on trained weights (the tiny kit). Its target soon loops, and its two-minute
draft and EAGLE head rarely agree with it there; prompt lookup and the Medusa tree do, so long
accepted paths and tree compaction are exercised on trained weights too."""

from __future__ import annotations

import pytest

from specdec.core.config import EngineConfig
from specdec.core.engine_config import build_engine
from specdec.tools.prompts import heldout_prompts
from specdec.core.sampling import SamplingParams

METHODS = ["draft", "ngram", "medusa", "eagle", "eagle2"]


@pytest.fixture(scope="module")
def setup(trained_tiny_kit):
    paths = {n: str(trained_tiny_kit / n) for n in ("target", "draft", "medusa", "eagle")}
    prompts = heldout_prompts(30, "short", seed=3)
    base = build_engine(EngineConfig.of(method="baseline", dtype="float64", policy="fixed", max_batch=4, **paths))
    ref = [r.token_ids for r in base.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))]
    return paths, prompts, ref


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("batch", [1, 4])
def test_trained_greedy_identity(setup, method, batch):
    paths, prompts, ref = setup
    eng = build_engine(EngineConfig.of(method=method, dtype="float64", policy="fixed", max_batch=batch, k=4, **paths))
    results = eng.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    assert [r.token_ids for r in results] == ref
    m = eng.metrics
    assert m.draft_tokens > 0
    if method in ("ngram", "medusa"):
        assert len(m.accepted_per_position) >= 2, f"{method}: no path longer than one token was accepted"


@pytest.mark.slow
def test_adaptive_policy_keeps_greedy_identity(setup):
    paths, prompts, ref = setup
    eng = build_engine(EngineConfig.of(method="eagle", dtype="float64", policy="adaptive", max_batch=4, k=6, **paths))
    results = eng.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    assert [r.token_ids for r in results] == ref


@pytest.mark.slow
def test_adaptive_policy_reproduces_seeded_sampling_in_any_batch(setup):
    """Seeded sampled requests keep a fixed draft length under the adaptive policy (here the 4
    they ask; none where they ask none): the same output alone and among other requests (whose
    presence changes what the policy picks)."""
    paths, prompts, _ = setup
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=11, ignore_eos=True, num_draft_tokens=4)
    alone = build_engine(EngineConfig.of(method="draft", dtype="float64", policy="adaptive", max_batch=4, k=4, **paths))
    [ref] = alone.generate(prompts[:1], params)
    busy = build_engine(EngineConfig.of(method="draft", dtype="float64", policy="adaptive", max_batch=4, k=4, **paths))
    others = SamplingParams(max_tokens=24, ignore_eos=True)
    results = busy.generate(prompts[:4], [params, others, others, others])
    assert results[0].token_ids == ref.token_ids
