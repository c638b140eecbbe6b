"""The CPU `tensorrt_llm`-contract model (serving/trtllm_contract.py) against hand-computed
expectations: the reference is the same checkpoint run over whole sequences without any cache
(training-mode causal attention), one argmax or one seeded draw at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.core.errors import InvalidRequest
from specdec.core.models.checkpoint import load_model
from specdec.core.sampling import SamplingParams, probs
from specdec.serving.trtllm_contract import ContractModel, parse_inputs

PROMPT = [5, 17, 42, 8, 99, 23, 61, 7, 150, 3]  # 10 tokens


@pytest.fixture(scope="module")
def model(tiny_target):
    return load_model(tiny_target, torch.float64)


def reference_greedy(model, ids, n):
    out = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(model.logits(model(torch.tensor([out])))[0, -1].argmax()))
    return out[len(ids):]


def run(core, **inputs):
    """Admit one request per keyword set and step until every one has its final reply."""
    reqs = [parse_inputs(tensors(**inputs))] if inputs else []
    return drive(core, reqs)[0]


def drive(core, reqs):
    acts = [core.admit(r) for r in reqs]
    replies = {id(a): [] for a in acts}
    while core.active:
        for a, reply in core.step():
            replies[id(a)].append(reply)
    return [replies[id(a)] for a in acts]


def tensors(input_ids, request_output_len, **extra):
    t = {"input_ids": np.array([input_ids], np.int32), "input_lengths": np.array([[len(input_ids)]], np.int32),
         "request_output_len": np.array([[request_output_len]], np.int32)}
    for key, value in extra.items():
        dtype = {"draft_input_ids": np.int32, "temperature": np.float32, "runtime_top_p": np.float32,
                 "random_seed": np.uint64, "exclude_input_in_output": bool, "streaming": bool}.get(key, np.int32)
        t[key] = np.array([value] if key == "draft_input_ids" else [[value]], dtype)
    return t


def ids_of(reply):
    return reply.output_ids[0, 0, : int(reply.sequence_length[0, 0])].tolist()


def test_exclude_input_in_output_false_and_true(model):
    ref = reference_greedy(model, PROMPT, 5)
    core = ContractModel(model, max_batch=4, tokens_per_block=4)
    (full,) = run(core, input_ids=PROMPT, request_output_len=5)
    assert ids_of(full) == PROMPT + ref and full.final
    (only,) = run(core, input_ids=PROMPT, request_output_len=5, exclude_input_in_output=True)
    assert ids_of(only) == ref and only.output_ids.shape == (1, 1, 5)


def test_streaming_sends_each_steps_new_tokens(model):
    ref = reference_greedy(model, PROMPT, 4)
    replies = run(ContractModel(model), input_ids=PROMPT, request_output_len=4, streaming=True)
    assert [ids_of(r) for r in replies] == [[t] for t in ref] and [r.final for r in replies] == [0, 0, 0, 1]


def test_draft_returns_the_accepted_tokens_plus_one_of_the_targets(model):
    ref = reference_greedy(model, PROMPT, 4)
    core = ContractModel(model, max_draft_len=4)
    wrong = (ref[2] + 1) % model.config.vocab_size
    (partial,) = run(core, input_ids=PROMPT, request_output_len=4, draft_input_ids=ref[:2] + [wrong],
                     exclude_input_in_output=True)
    assert ids_of(partial) == ref[:3]  # 2 accepted + the target's own third token
    (whole,) = run(core, input_ids=PROMPT, request_output_len=4, draft_input_ids=ref[:3])
    assert ids_of(whole) == PROMPT + ref[:4]  # all 3 accepted + bonus
    (none,) = run(core, input_ids=PROMPT, request_output_len=3, draft_input_ids=[wrong, ref[1]],
                  exclude_input_in_output=True)
    assert ids_of(none) == ref[:1]


def test_sampled_tokens_are_the_targets_own_draws_whatever_the_draft(model):
    """Token matching: with the same seed the target draws the same tokens with or without a draft."""
    core = ContractModel(model, max_draft_len=4)
    sampling = dict(temperature=1.0, runtime_top_p=1.0, runtime_top_k=0, random_seed=1234, exclude_input_in_output=True)
    (plain,) = run(core, input_ids=PROMPT, request_output_len=3, **sampling)
    own = ids_of(plain)
    (matched,) = run(core, input_ids=PROMPT, request_output_len=3, draft_input_ids=own[:2], **sampling)
    assert ids_of(matched) == own
    wrong = (own[1] + 1) % model.config.vocab_size
    (cut,) = run(core, input_ids=PROMPT, request_output_len=3, draft_input_ids=[own[0], wrong], **sampling)
    assert ids_of(cut) == own[:2]
    p = probs(model.logits(model(torch.tensor([PROMPT])))[0, -1:].detach(), SamplingParams(temperature=1.0))[0]
    assert float(p.max()) < 0.9  # a real draw, not a near-certain token


def test_end_id_ends_the_output_and_min_length_holds_it_back(model):
    ref = reference_greedy(model, PROMPT, 3)
    core = ContractModel(model)
    (ended,) = run(core, input_ids=PROMPT, request_output_len=3, end_id=ref[1], exclude_input_in_output=True)
    assert ids_of(ended) == ref[:1]
    (held,) = run(core, input_ids=PROMPT, request_output_len=3, end_id=ref[1], min_length=2,
                  exclude_input_in_output=True)
    assert ids_of(held)[0] == ref[0] and ids_of(held)[1] != ref[1] and len(ids_of(held)) >= 2


def test_a_resent_prefix_is_reused_in_whole_blocks_and_gives_the_same_tokens(model):
    ref = reference_greedy(model, PROMPT, 8)
    core = ContractModel(model, max_batch=2, tokens_per_block=4)
    (first,) = run(core, input_ids=PROMPT, request_output_len=5, exclude_input_in_output=True)
    assert first.reused_blocks == 0 and first.total_blocks == 4  # ceil(15 / 4)
    computed = core.stats.forward_tokens
    # the slot holds the KV of PROMPT + ref[:4] (14 tokens; the last output token was never fed)
    (second,) = run(core, input_ids=PROMPT + ref[:5], request_output_len=3, exclude_input_in_output=True)
    assert second.reused_blocks == 3  # 12 of the 14 cached tokens: whole blocks only
    assert ids_of(second) == ref[5:8]
    assert core.stats.forward_tokens - computed == (15 - 12) + 2  # suffix prefill, then two decode steps
    assert core.stats.reused_tokens == 12 and core.stats.reused_blocks == 3
    (other,) = run(core, input_ids=[9] + PROMPT, request_output_len=1)
    assert other.reused_blocks == 0


def test_requests_batched_together_match_their_runs_alone(model):
    prompts = [PROMPT, PROMPT[:4], [200, 201, 202, 9, 9, 9, 9]]
    alone = [ids_of(run(ContractModel(model), input_ids=p, request_output_len=6)[0]) for p in prompts]
    core = ContractModel(model, max_batch=3)
    together = drive(core, [parse_inputs(tensors(p, 6)) for p in prompts])
    assert [ids_of(r[0]) for r in together] == alone
    assert core.stats.forwards == 6  # one prefill and five decode forwards for all three


@pytest.mark.parametrize("inputs, message", [
    (dict(input_ids=PROMPT, request_output_len=2, draft_input_ids=[1] * 9), "draft_input_ids has 9 tokens"),
    (dict(input_ids=PROMPT, request_output_len=0), "request_output_len must be >= 1"),
    (dict(input_ids=[1, 100000], request_output_len=2), "outside the vocabulary"),
    (dict(input_ids=PROMPT, request_output_len=2000), "exceeds max_context"),
])
def test_bad_requests_get_errors_naming_the_input(model, inputs, message):
    core = ContractModel(model, max_draft_len=8)
    with pytest.raises(InvalidRequest, match=message):
        core.check(parse_inputs(tensors(**inputs)))


def test_parse_rejects_a_batch_and_unknown_inputs():
    t = tensors(PROMPT, 2)
    with pytest.raises(InvalidRequest, match="batch size 2"):
        parse_inputs({**t, "input_ids": np.array([PROMPT, PROMPT], np.int32)})
    with pytest.raises(InvalidRequest, match="unknown input 'beam_width'"):
        parse_inputs({**t, "beam_width": np.array([[1]], np.int32)})
    with pytest.raises(InvalidRequest, match="request_output_len is missing"):
        parse_inputs({k: v for k, v in t.items() if k != "request_output_len"})


# ---- draft_logits: rejection sampling against the draft's distribution (core.verify) -------------
V = 8  # a vocabulary small enough to know the target's first-token distribution exactly
DRAFT_LEN, SAMPLES = 2, 3000
PROMPT_V = [1, 2, 3, 1, 2]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory, tokenizer_dir):
    from tiny_checkpoints import make_small_vocab_model

    return load_model(make_small_vocab_model(tmp_path_factory.mktemp("small"), tokenizer_dir, V, seed=21), torch.float64)


def with_draft_logits(prompt, draft, logits, **extra):
    t = tensors(prompt, len(draft) + 1, draft_input_ids=draft, exclude_input_in_output=True, **extra)
    return {**t, "draft_logits": np.asarray(logits, np.float32)[None]}  # [1 (batch), n, V]


def first_tokens_with_draft_logits(model, params: SamplingParams, draft_logits: torch.Tensor) -> torch.Tensor:
    """Counts of the first output token over SAMPLES seeded verification requests whose draft tokens
    are drawn from the draft's own distribution q (what rejection sampling assumes)."""
    q = probs(draft_logits.double(), params)
    g = torch.Generator().manual_seed(7)
    reqs = []
    for seed in range(SAMPLES):
        draft = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(DRAFT_LEN)]
        reqs.append(parse_inputs(with_draft_logits(PROMPT_V, draft, draft_logits.numpy(), temperature=params.temperature,
                                                   runtime_top_p=params.top_p, random_seed=seed)))
    core, counts = ContractModel(model, max_batch=64, max_draft_len=DRAFT_LEN), torch.zeros(V)
    for start in range(0, SAMPLES, 64):
        for replies in drive(core, reqs[start: start + 64]):
            counts[ids_of(replies[-1])[0]] += 1
    return counts



def test_draft_logits_sampling_follows_the_targets_exact_first_token_distribution(small_model):
    params = SamplingParams(temperature=0.9, top_p=1.0)
    exact = probs(small_model.logits(small_model(torch.tensor([PROMPT_V])))[0, -1:].detach(), params)[0]
    draft_logits = torch.randn(DRAFT_LEN, V, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2
    q0 = probs(draft_logits.double(), params)[0]
    assert float((exact - q0).abs().sum()) > 0.5  # the draft disagrees a lot: acceptance alone would show
    counts = first_tokens_with_draft_logits(small_model, params, draft_logits)

    def p_value(p):
        return float(chisquare(counts.numpy(), (p * SAMPLES).numpy()).pvalue)

    assert p_value(exact) > 1e-3
    assert p_value(q0) < 1e-3  # the test has power: the same samples reject the draft's distribution


def test_greedy_with_draft_logits_returns_what_token_matching_returns(model):
    ref = reference_greedy(model, PROMPT, 4)
    vocab = model.config.vocab_size
    wrong = (ref[1] + 1) % vocab
    logits = np.random.default_rng(5).normal(size=(3, vocab)).astype(np.float32)
    core = ContractModel(model, max_draft_len=4)
    for draft in (ref[:3], ref[:1] + [wrong, ref[2]], [wrong, ref[1], ref[2]]):
        (matching,) = drive(core, [parse_inputs(tensors(PROMPT, 4, draft_input_ids=draft, exclude_input_in_output=True,
                                                        temperature=0.0))])
        (rejection,) = drive(core, [parse_inputs(with_draft_logits(PROMPT, draft, logits, temperature=0.0))])
        assert ids_of(rejection[-1]) == ids_of(matching[-1])
    assert ids_of(matching[-1]) == ref[:1]  # the last draft was rejected at once: the target's own token
