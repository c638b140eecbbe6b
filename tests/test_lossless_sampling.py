"""Statistical losslessness: speculative sampling must draw from the target's own distribution.

A tiny target over an 8-token vocabulary lets us enumerate the exact distribution of the first
three output tokens (the first from prefill, the next two through draft + verify) under each
sampling transform, and compare it with thousands of seeded speculative samples by chi-square.
The same test must reject a slightly wrong distribution, so it is known to have power.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from specdec.core.config import EngineConfig
from specdec.core.engine_config import build_engine
from specdec.core.models.checkpoint import load_model
from specdec.core.sampling import SamplingParams, probs
from test_native import DRAFTER_TYPES, ROUNDED_DTYPES, drafter_weight_types
from tiny_checkpoints import make_heads, make_small_vocab_model

V = 8
PROMPT = [1, 2, 3, 1, 2]
N = 5000


@pytest.fixture(scope="module")
def small(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("small")
    target = make_small_vocab_model(root / "target", tokenizer_dir, V, seed=11)
    draft = make_small_vocab_model(root / "draft", tokenizer_dir, V, seed=12, scale=2.0)
    make_heads(target, root / "medusa", root / "eagle", seed=13, medusa_heads=2)
    return dict(target=str(target), draft=str(draft), medusa=str(root / "medusa"), eagle=str(root / "eagle"))


def exact_joint(target_dir: str, params: SamplingParams, vocab: int = V) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) under the target with the sampling transform, by enumeration."""
    model = load_model(target_dir, torch.float64)
    with torch.no_grad():
        def dist(prefixes):
            toks = torch.tensor([PROMPT + list(p) for p in prefixes])
            return probs(model.logits(model(toks))[:, -1], params)

        p1 = dist([()])[0]
        p2 = dist([(a,) for a in range(vocab)])  # [V, V]
        p3 = dist(list(itertools.product(range(vocab), repeat=2))).view(vocab, vocab, vocab)
    return p1[:, None, None] * p2[:, :, None] * p3


def sampled_joint(small, method: str, params: SamplingParams, **kw) -> torch.Tensor:
    eng = build_engine(EngineConfig.of(method=method, dtype="float64", policy="fixed", max_batch=64, **small, **kw))
    plist = [SamplingParams(**{**params.__dict__, "seed": i}) for i in range(N)]
    results = eng.generate([PROMPT] * N, plist)
    counts = torch.zeros(V, V, V)
    for r in results:
        a, b, c = r.token_ids
        counts[a, b, c] += 1
    assert eng.metrics.draft_tokens > 0
    return counts, eng.metrics


def p_value(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    """Chi-square over cells expecting >= 5 samples, the rest pooled into one cell."""
    obs, exp = counts.flatten().double(), (expected_p.flatten() * counts.sum()).double()
    big = exp >= 5
    o = torch.cat([obs[big], obs[~big].sum()[None]])
    e = torch.cat([exp[big], exp[~big].sum()[None]])
    if e[-1] < 5:
        o, e = o[:-1], e[:-1]
        e = e * o.sum() / e.sum()
    return float(chisquare(o.numpy(), e.numpy()).pvalue)


CASES = [
    ("draft", SamplingParams(max_tokens=3, temperature=0.8, ignore_eos=True), dict(k=3)),
    ("draft", SamplingParams(max_tokens=3, temperature=1.0, top_k=5, top_p=0.9, ignore_eos=True), dict(k=2)),
    ("eagle", SamplingParams(max_tokens=3, temperature=0.7, top_p=0.95, ignore_eos=True), dict(k=2)),
    ("medusa", SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, ignore_eos=True),
     dict(medusa_tree=((0,), (1,), (0, 0), (0, 1), (1, 0), (2,)), k=6)),
    ("eagle2", SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True), dict(eagle_tree=(3, 3, 8))),
    ("ngram", SamplingParams(max_tokens=3, temperature=0.9, ignore_eos=True), dict(k=2, ngram_min=1)),
]


@pytest.mark.slow
@pytest.mark.parametrize("method, params, kw", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_speculative_samples_follow_the_target_distribution(small, method, params, kw):
    counts, metrics = sampled_joint(small, method, params, **kw)
    expected = exact_joint(small["target"], params)
    assert p_value(counts, expected) > 1e-3
    # the test has power: the same samples reject the distribution at a 15% different temperature
    wrong = exact_joint(small["target"], SamplingParams(**{**params.__dict__, "temperature": params.temperature * 1.15}))
    assert p_value(counts, wrong) < 1e-3
    # and speculation really happened, with both acceptances and rejections
    assert 0 < metrics.accepted_tokens < metrics.draft_tokens


@pytest.mark.slow
def test_typical_acceptance_is_opt_in_and_measurably_lossy(small):
    """The lossy option exists only when asked for, and the chi-square test can tell."""
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    tree = ((0,), (1,), (0, 0), (0, 1), (1, 0), (2,))
    counts, metrics = sampled_joint(small, "medusa", params, medusa_tree=tree, k=6, acceptance="typical",
                                    typical_threshold=0.3, typical_alpha=0.9)
    assert metrics.accepted_tokens > 0
    assert p_value(counts, exact_joint(small["target"], params)) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ROUNDED_DTYPES)
@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_rounded_drafters_sample_from_the_target_distribution(tmp_path_factory, tokenizer_dir, method, dtype):
    """Sampled drafts from bfloat16 or int8 drafters (`draft_dtype`; int8 the default) are drawn
    from, and judged with, the same rounded distribution, so the output still follows the
    target's: float32 models the native kernels take (a 16-token vocabulary, head_dim 16), the
    second and third tokens' joint over the first (256 cells) against the exact one, with the
    same power check."""
    vocab, n = 16, 10000
    root = tmp_path_factory.mktemp(dtype)
    target = make_small_vocab_model(root / "target", tokenizer_dir, vocab, seed=11, hidden=64)
    draft = make_small_vocab_model(root / "draft", tokenizer_dir, vocab, seed=12, hidden=64, scale=2.0)
    make_heads(target, root / "medusa", root / "eagle", seed=13, medusa_heads=2)
    params = SamplingParams(max_tokens=3, temperature=0.8, top_p=0.95, ignore_eos=True)
    eng = build_engine(EngineConfig.of(method=method, dtype="float32", policy="fixed", max_batch=64, k=2, draft_dtype=dtype,
                                       target=str(target), draft=str(draft), eagle=str(root / "eagle")))
    assert drafter_weight_types(eng.proposer) == DRAFTER_TYPES[dtype][method]
    results = eng.generate([PROMPT] * n, [SamplingParams(**{**params.__dict__, "seed": i}) for i in range(n)])
    counts = torch.zeros(vocab, vocab)
    for r in results:
        counts[r.token_ids[1], r.token_ids[2]] += 1

    def later(p: SamplingParams) -> torch.Tensor:
        return exact_joint(str(target), p, vocab).sum(0)

    assert p_value(counts, later(params)) > 1e-3
    assert p_value(counts, later(SamplingParams(**{**params.__dict__, "temperature": params.temperature * 1.15}))) < 1e-3
    assert 0 < eng.metrics.accepted_tokens < eng.metrics.draft_tokens
