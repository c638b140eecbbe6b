"""Requests arriving as others finish (`tools.arrivals`): what `bench --in-flight` and
`forward_ab --in-flight` run."""

from __future__ import annotations

from specdec.core.config import EngineConfig
from specdec.core.engine_config import build_engine
from specdec.core.sampling import SamplingParams
from specdec.paths import DEMO_KIT
from specdec.tools.arrivals import arrivals, repeated, staggered
from specdec.tools.bench import kit_paths
from specdec.tools.prompts import heldout_prompts


def test_arrivals_keep_that_many_in_flight_and_return_each_prompts_tokens():
    """Each finished request submits the next, so the batch never holds more than `in_flight`
    and changes as they finish; every prompt gets what `generate` gives it at its own length."""
    engine = build_engine(EngineConfig.of(method="ngram", max_batch=8, policy="fixed", **kit_paths(DEMO_KIT)))
    prompts, params = heldout_prompts(5), SamplingParams(max_tokens=12, ignore_eos=True)
    batches, step = [], engine.step
    engine.step = lambda: batches.append(len(engine.running) + len(engine.queue)) or step()
    results = arrivals(engine, params, prompts, 2)
    assert max(batches) == 2 and len(batches) > 12  # more steps than one generation: they queued
    assert [len(r.token_ids) for r in results] == [6, 12, 12, 12, 12]  # the first two staggered
    assert all(r.finish_reason == "length" and r.stats is not None for r in results)
    expected = engine.generate(prompts, staggered(params, 2, len(prompts)))
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]


def test_the_first_requests_are_staggered_so_that_they_finish_one_at_a_time():
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    assert [p.max_tokens for p in staggered(params, 4, 6)] == [16, 32, 48, 64, 64, 64]
    assert [p.max_tokens for p in staggered(SamplingParams(max_tokens=2), 4, 4)] == [1, 1, 1, 2]  # at least one
    assert staggered(params, 1, 2) == [params, params]


def test_prompts_are_repeated_to_at_least_the_requests_asked_for():
    assert repeated(["a", "b", "c"], 7) == ["a", "b", "c"] * 3
    assert len(repeated(["a"] * 48)) == 48
