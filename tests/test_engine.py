"""Engine behaviour: greedy identity for every proposer, KV-cache consistency after any accept/reject
pattern, stop conditions, streaming text, per-request k, cancellation and argument errors."""

from __future__ import annotations

import random
import time

import pytest
import torch

from specdec.core.engine import PHASES, Result
from specdec.core.config import EngineConfig
from specdec.core.engine_config import build_engine
from specdec.core.errors import ConfigurationError, InvalidRequest
from specdec.core.sampling import SamplingParams
from tiny_checkpoints import CORPUS, make_heads, make_perturbed_copy

METHODS = ["draft", "ngram", "medusa", "eagle", "eagle2"]


@pytest.fixture(scope="module")
def kit(tmp_path_factory, tiny_target):
    root = tmp_path_factory.mktemp("kit")
    make_heads(tiny_target, root / "medusa", root / "eagle", seed=5, eagle_layers=2)  # the trained tiny kit has one
    draft = make_perturbed_copy(tiny_target, root / "draft", noise=0.3, seed=7)
    return dict(target=str(tiny_target), draft=str(draft), medusa=str(root / "medusa"), eagle=str(root / "eagle"))


def engine(kit, method="baseline", **kw):
    kw.setdefault("dtype", "float64")
    kw.setdefault("policy", "fixed")
    return build_engine(EngineConfig.of(method=method, **kit, **kw))


def prompts(n: int, seed: int = 0) -> list[str]:
    """Code-like prompts, some repeating themselves so prompt lookup has something to find."""
    rng = random.Random(seed)
    text = "".join(CORPUS)
    out = []
    for _ in range(n):
        a = rng.randrange(0, len(text) - 40)
        piece = text[a : a + rng.randrange(8, 40)]
        out.append(piece * rng.choice([1, 1, 2]) or "x")
    return out


@pytest.fixture(scope="module")
def baseline_outputs(kit):
    base = engine(kit, max_batch=4)
    ps = prompts(32)
    return ps, [r.token_ids for r in base.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True))]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_output_identical_to_baseline(kit, baseline_outputs, method, batch):
    ps, ref = baseline_outputs
    eng = engine(kit, method, max_batch=batch, k=4)
    results = eng.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [r.token_ids for r in results] == ref
    assert eng.metrics.draft_tokens > 0
    if method in ("draft", "ngram"):  # these propose the target's tokens often even with random weights
        assert eng.metrics.accepted_tokens > 0


@pytest.mark.parametrize("method", ["draft", "medusa", "eagle2"])
def test_kv_cache_equals_fresh_prefill_after_every_step(kit, method):
    eng = engine(kit, method, max_batch=3, k=5)
    target = eng.target
    for p in prompts(3, seed=4):
        eng.submit(p, SamplingParams(max_tokens=20, ignore_eos=True), lambda out: None)
    checked = 0
    while eng.has_work():
        eng.step()
        for seq in eng.running:
            n = seq.cache_len
            fresh = target.new_cache(1, n + 1)
            with torch.no_grad():
                target(torch.tensor([seq.tokens[:n]]), torch.arange(n)[None], fresh, [0], [0])
            assert torch.allclose(eng.cache.k[:, seq.slot, :n], fresh.k[:, 0, :n], atol=1e-10)
            assert torch.allclose(eng.cache.v[:, seq.slot, :n], fresh.v[:, 0, :n], atol=1e-10)
            checked += 1
    assert checked > 10
    assert 0 < eng.metrics.accepted_tokens < eng.metrics.draft_tokens  # both accepts and rejects happened


def test_each_output_carries_the_counters_as_they_stood_when_it_went_out(kit):
    """Every streamed Output's stats is its own copy (`RequestStats.snapshot`): later steps must
    not move an Output already handed out, nor share its per-position list."""
    eng = engine(kit, "draft")
    outs = []
    eng.submit("def add(a, b):", SamplingParams(max_tokens=30, ignore_eos=True), outs.append)
    while eng.has_work():
        eng.step()
    counts = [o.stats.output_tokens for o in outs]
    assert counts == sorted(counts) and counts[0] == len(outs[0].token_ids) and counts[-1] == 30
    assert sum(len(o.token_ids) for o in outs) == 30
    drafted = [o.stats.draft_tokens for o in outs]
    assert drafted == sorted(drafted) and drafted[0] < drafted[-1]
    assert len({id(o.stats.accepted_per_position) for o in outs}) == len(outs)


def test_streamed_chunks_concatenate_to_the_whole_text(kit):
    eng = engine(kit, "ngram")
    text = "Grüße, naïve café — 日本語のテキスト 🙂 emoji\n"
    ids = eng.tokenizer.encode(text)
    # feed the multi-byte text itself as the output: teacher-force by prompting it repeatedly
    results = eng.generate([text * 2, "def add(a, b):"], SamplingParams(max_tokens=40, ignore_eos=True))
    for r in results:
        assert "".join(r.chunks) == r.text == eng.tokenizer.decode(r.token_ids)
    from specdec.core.models.tokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(eng.tokenizer)
    pieces = [detok.push([t]) for t in ids] + [detok.push([], final=True)]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_incremental_text_is_the_whole_decode_and_each_push_decodes_a_short_window(kit):
    """Pushed in chunks of 1-5 ids, random ids (byte tokens that split characters included) hand
    out exactly the decode of all of them, nothing unfinished before the end, and no push decodes
    more than its window (the ids of the last complete push and its own), however long the text."""
    from specdec.core.models.tokenizer import IncrementalDetokenizer

    tokenizer = engine(kit).tokenizer
    rng = random.Random(0)
    text = "Grüße, naïve café — 日本語のテキスト 🙂 emoji\n"
    for trial in range(20):
        ids = tokenizer.encode(text * 3) if trial % 2 else [rng.randrange(tokenizer.hf.get_vocab_size()) for _ in range(400)]
        decoded: list[int] = []
        decode = tokenizer.decode
        tokenizer.decode = lambda window: decoded.append(len(window)) or decode(window)
        detok, pieces, i = IncrementalDetokenizer(tokenizer), [], 0
        while i < len(ids):
            n = rng.randint(1, 5)
            pieces.append(detok.push(ids[i : i + n]))
            i += n
        pieces.append(detok.push([], final=True))
        tokenizer.decode = decode
        assert "".join(pieces) == decode(ids)
        if trial % 2:
            assert all("\ufffd" not in p for p in pieces)
            assert max(decoded) <= 40  # the longest run of ids that leave a character unfinished, and two pushes
        else:
            assert max(decoded) < 100  # 400 ids


def test_stop_strings_max_tokens_min_tokens(kit):
    eng = engine(kit)
    [free] = eng.generate(["for i in range(10):"], SamplingParams(max_tokens=30, ignore_eos=True))
    assert len(free.token_ids) == 30 and free.finish_reason == "length"
    stop = free.text[10:13]
    [stopped] = eng.generate(["for i in range(10):"], SamplingParams(max_tokens=30, stop=[stop], ignore_eos=True))
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(stop)]
    assert "".join(stopped.chunks) == stopped.text
    # min_tokens forbids EOS until reached (EOS is token 0 in the tiny checkpoints)
    [r] = eng.generate(["x"], SamplingParams(max_tokens=12, min_tokens=12, temperature=1.0, seed=1))
    assert len(r.token_ids) == 12 and 0 not in r.token_ids


def test_per_request_k_override(kit):
    eng = engine(kit, "draft", k=4)
    [r] = eng.generate(["def add(a, b):"], SamplingParams(max_tokens=16, num_draft_tokens=0, ignore_eos=True))
    assert r.stats.draft_tokens == 0
    [r] = eng.generate(["def add(a, b):"], SamplingParams(max_tokens=16, num_draft_tokens=2, ignore_eos=True))
    assert 0 < r.stats.draft_tokens <= 2 * r.stats.drafts


def test_cancel_frees_the_slot_within_one_step(kit):
    eng = engine(kit, "draft", max_batch=1)
    outs = []
    seq = eng.submit("def add(a, b):", SamplingParams(max_tokens=200, ignore_eos=True), outs.append)
    eng.step()
    eng.step()
    eng.cancel(seq)
    eng.step()
    assert outs[-1].finished and outs[-1].finish_reason == "cancelled"
    assert eng.free_slots == [0] and not eng.running


def test_a_batch_takes_the_lowest_slots_in_order_whatever_order_the_last_one_finished(kit):
    """Slots come back in the order sequences finish; the next batch still runs in slots 0..B-1, in
    order, so attention reads the KV cache as a slice (scattered slots gathered a copy of the whole
    batch's cache in every layer)."""
    eng = engine(kit, max_batch=4)
    eng.generate(prompts(4), [SamplingParams(max_tokens=n, ignore_eos=True) for n in (5, 2, 7, 3)])
    for p in prompts(3, seed=1):
        eng.submit(p, SamplingParams(max_tokens=4, ignore_eos=True), lambda out: None)
    eng.step()
    assert [s.slot for s in eng.running] == [0, 1, 2]
    eng.submit("def f(x):", SamplingParams(max_tokens=4, ignore_eos=True), lambda out: None)
    eng.step()
    assert [s.slot for s in eng.running] == [0, 1, 2, 3]


def test_full_slots_queue_then_time_out(kit):
    eng = engine(kit, max_batch=1, queue_timeout_s=0.0)
    first, second = [], []
    eng.submit("a", SamplingParams(max_tokens=5, ignore_eos=True), first.append)
    eng.submit("b", SamplingParams(max_tokens=5, ignore_eos=True), second.append)
    while eng.has_work():
        eng.step()
    assert first[-1].finish_reason == "length"
    assert second[-1].finish_reason == "error" and "no KV slot" in second[-1].error


@pytest.mark.parametrize("params, message", [
    (SamplingParams(max_tokens=0), "max_tokens"),
    (SamplingParams(max_tokens=10**6), "max_tokens"),
    (SamplingParams(temperature=-1.0), "temperature"),
    (SamplingParams(temperature=float("nan")), "temperature"),
    (SamplingParams(top_p=0.0), "top_p"),
    (SamplingParams(top_p=1.5), "top_p"),
    (SamplingParams(top_k=-1), "top_k"),
    (SamplingParams(num_draft_tokens=-1), "num_draft_tokens"),
])
def test_bad_arguments_raise_invalid_request(kit, params, message):
    eng = engine(kit)
    with pytest.raises(InvalidRequest, match=message):
        eng.submit("hello", params, lambda out: None)


def test_bad_prompts_raise_invalid_request(kit):
    eng = engine(kit, max_context=64)
    with pytest.raises(InvalidRequest, match="empty"):
        eng.submit("", SamplingParams(), lambda out: None)
    with pytest.raises(InvalidRequest, match="context"):
        eng.submit("def add(a, b): " * 40, SamplingParams(max_tokens=8), lambda out: None)


def test_bad_configuration_is_a_clear_error(kit, tmp_path):
    with pytest.raises(ConfigurationError, match="unknown method"):
        engine(kit, "lookahead")
    with pytest.raises(ConfigurationError, match="k must be"):
        engine(kit, "draft", k=-1)
    other = dict(kit, draft=str(tmp_path / "nope"))
    with pytest.raises(ConfigurationError, match="does not exist"):
        engine(other, "draft")


def test_draft_with_another_tokenizer_is_refused(kit, tmp_path):
    import shutil

    from tiny_checkpoints import make_tokenizer

    other = tmp_path / "other_draft"
    shutil.copytree(kit["draft"], other)
    make_tokenizer(tmp_path / "tok2", vocab_size=290)
    shutil.copy(tmp_path / "tok2" / "tokenizer.json", other / "tokenizer.json")
    with pytest.raises(ConfigurationError, match="different tokenizer"):
        engine(dict(kit, draft=str(other)), "draft")


def test_seeded_sampling_reproduces(kit):
    eng = engine(kit, "draft")
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=123, ignore_eos=True)
    a = eng.generate(["def add(a, b):"] * 3, params)
    b = eng.generate(["def add(a, b):"], params)
    assert a[0].token_ids == a[1].token_ids == a[2].token_ids == b[0].token_ids


def test_an_internal_error_fails_the_batch_with_final_responses_and_the_engine_keeps_serving(kit):
    eng = engine(kit, "draft", max_batch=2)
    outs: list = []
    eng.submit("def add(a, b):", SamplingParams(max_tokens=30, ignore_eos=True), outs.append)
    eng.step()
    propose = eng.proposer.propose
    eng.proposer.propose = lambda seqs, ks: 1 / 0  # a bug in a proposer
    late: list = []
    eng.submit("import os", SamplingParams(max_tokens=5, ignore_eos=True), late.append)
    with pytest.raises(ZeroDivisionError):
        eng.step()
    assert outs[-1].finished and outs[-1].finish_reason == "error" and "ZeroDivisionError" in outs[-1].error
    assert late[-1].finished and late[-1].finish_reason == "error"
    assert sorted(eng.free_slots) == [0, 1] and not eng.running
    eng.proposer.propose = propose
    [ok] = eng.generate(["import os"], SamplingParams(max_tokens=5, ignore_eos=True))
    assert ok.finish_reason == "length" and len(ok.token_ids) == 5


def test_duplicate_request_id_is_refused(kit):
    eng = engine(kit)
    eng.submit("a", SamplingParams(max_tokens=3), lambda out: None, request_id="same")
    with pytest.raises(InvalidRequest, match="already in use"):
        eng.submit("b", SamplingParams(max_tokens=3), lambda out: None, request_id="same")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("batch", [2, 4])
def test_long_sequences_never_overflow_the_caches(kit, method, batch):
    """A long-running sequence, then long prompts admitted next to it up to the context limit: the
    proposers catch up on each row's pending tokens in one padded forward, and that padding once
    ran past the end of the long sequence's slot (IndexError). Each output equals its run alone."""
    max_context, k = 96, 4
    eng = engine(kit, method, max_batch=batch, max_context=max_context, k=k)
    ids = [t for p in prompts(40, seed=9) for t in eng.tokenizer.encode(p)]
    long_running = (ids[:6], SamplingParams(max_tokens=max_context - 6, ignore_eos=True))
    newcomers = [(ids[10 * i : 10 * i + n], SamplingParams(max_tokens=max_context - n, ignore_eos=True))
                 for i, n in enumerate([88, 70, 60][: batch - 1])]
    results = [Result()]
    eng.submit(*long_running, results[0].add)
    for _ in range(12):  # the long-running sequence gets well past its prompt first
        eng.step()
    for prompt, params in newcomers:
        results.append(Result())
        eng.submit(prompt, params, results[-1].add)
    while eng.has_work():
        eng.step()
    alone = engine(kit, max_batch=1, max_context=max_context)
    for result, (prompt, params) in zip(results, [long_running] + newcomers):
        assert result.error is None
        assert result.token_ids == alone.generate([prompt], params)[0].token_ids


@pytest.mark.parametrize("method", ["medusa", "eagle2"])
def test_adaptive_calibration_fits_any_tree_in_the_cache(kit, method):
    """The start-up cost probe covers max_batch * (max_k + 1) tokens: it must stay inside the cache
    whatever the tree size (the shipped spec_medusa, 8 x 62 tokens into a 512-token context, failed to load)."""
    eng = engine(kit, method, max_batch=8, max_context=64, policy="adaptive")
    assert eng.policy.cost.token_counts[-1] == 8 * (eng.policy.max_k + 1)
    [result] = eng.generate(["def f(x):"], SamplingParams(max_tokens=8, ignore_eos=True))
    assert result.error is None and len(result.token_ids) == 8


@pytest.mark.parametrize("method", ["draft", "eagle", "ngram"])
def test_adaptive_start_up_times_proposals_then_forgets_its_timing_requests(kit, method):
    """Before serving, an adaptive engine times its proposer for one row and a full batch at two
    depths (the policy's proposal fit starts from that, not from a guess), and then serves as a
    fresh engine: no counters, no acceptance learnt, every slot free."""
    from specdec.core.policy import PRIOR_ALPHA
    eng = engine(kit, method, max_batch=4, max_context=64, policy="adaptive")
    timed = eng.time_proposals(rounds=1)
    assert sorted((m, d) for m, d, _ in timed) == [(1, 2), (1, 4), (4, 2), (4, 4)] and all(t > 0 for *_, t in timed)
    fresh = engine(kit, method, max_batch=4, max_context=64, policy="adaptive")
    cost = fresh.policy.cost
    guess = 0.1 * cost.seconds[0]
    assert (cost.proposals.fixed, cost.proposals.per_level) != (guess, guess)
    assert fresh.metrics.steps == fresh.metrics.requests == 0 and fresh.policy.alpha == PRIOR_ALPHA
    assert sorted(fresh.free_slots) == [0, 1, 2, 3] and not fresh.streams and not fresh.running
    [result] = fresh.generate(["def f(x):"], SamplingParams(max_tokens=8, ignore_eos=True))
    assert result.error is None and len(result.token_ids) == 8
    assert engine(kit, method, max_batch=4, max_context=1, policy="adaptive").time_proposals() == []  # no request fits


def test_a_servers_response_cost_is_counted_and_reaches_the_adaptive_policy(kit):
    """The backend's sender thread reports the CPU its responses took (`note_responses`): the
    engine counts it (exported as specdec:response_seconds), and an adaptive policy charges it
    per row and step; a fixed policy has no cost model to charge."""
    eng = engine(kit, "draft", max_batch=2, max_context=64, policy="adaptive")
    eng.note_responses(0.003, 6)
    eng.note_responses(0.0, 0)  # a sender wake-up with nothing sent
    assert eng.metrics.response_seconds == 0.003 and eng.metrics.response_outputs == 6
    cost = eng.policy.cost
    assert cost.output_plain == cost.output_drafting == pytest.approx(0.0005 / cost.load)  # the first sets both
    fixed = engine(kit, "draft", max_batch=2, max_context=64, policy="fixed")
    fixed.note_responses(0.003, 6)
    assert fixed.policy.cost is None and fixed.metrics.response_outputs == 6


def test_an_adaptive_engines_steps_carry_the_policys_own_time(kit):
    """Each step hands the policy what its choice for the step and its observation of the step
    before took (`StepRecord.policy_seconds`), counted with the proposal's time."""
    eng = engine(kit, "ngram", max_batch=2, max_context=64, policy="adaptive")
    records, observe = [], eng.policy.observe
    eng.policy.observe = lambda step: records.append(step) or observe(step)
    eng.generate(["def f(x):", "import os"], SamplingParams(max_tokens=16, ignore_eos=True))
    assert len(records) >= 8 and all(r.policy_seconds > 0 for r in records)
    assert all(r.proposal_seconds == r.propose_seconds + r.policy_seconds for r in records)


def test_an_adaptive_engines_steps_carry_the_engines_time_between_them(kit):
    """A step's time as the policy sees it (`StepRecord.step_seconds`) includes the engine's loop
    since the step before, which every step pays, but not a prefill between them. Here the loop
    is made to take 5 ms (before the admissions, so the first decode step follows the prefill)."""
    eng = engine(kit, "ngram", max_batch=2, max_context=64, policy="adaptive")
    seconds = []
    observe, coasting, drop = eng.policy.observe, eng.policy.observe_coasting, eng._drop_cancelled
    eng.policy.observe = lambda step: seconds.append(step.step_seconds) or observe(step)
    eng.policy.observe_coasting = lambda seqs, step, proposal: seconds.append(step) or coasting(seqs, step, proposal)
    eng._drop_cancelled = lambda: time.sleep(0.005) or drop()
    eng.generate(["def f(x):", "import os"], SamplingParams(max_tokens=16, ignore_eos=True))
    assert len(seconds) >= 8
    assert seconds[0] < 0.005 <= min(seconds[1:])


def test_outputs_that_shared_a_response_are_not_charged_as_responses(kit):
    """Where the sender fell behind, a stream's Outputs left together: a step fewer would have
    saved no response. 6 Outputs in 2 responses of 3: no charge; 4 in 3 responses, 2 of them
    alone: a response's cost (1 ms) for half of the Outputs. Charged per Output regardless, the
    draft model served at 4 and 16 users drafted at a loss (`Engine.note_responses`)."""
    shared = engine(kit, "draft", max_batch=2, max_context=64, policy="adaptive")
    shared.note_responses(0.003, 6, 2, 0)
    assert shared.metrics.response_seconds == 0.003 and shared.metrics.response_outputs == 6
    assert shared.policy.cost.output_plain == 0.0
    mixed = engine(kit, "draft", max_batch=2, max_context=64, policy="adaptive")
    mixed.note_responses(0.003, 4, 3, 2)
    assert mixed.policy.cost.output_plain == pytest.approx(0.0005 / mixed.policy.cost.load)


def test_a_huge_prompt_is_refused_before_tokenizing(kit):
    eng = engine(kit, max_context=64)
    bound = 63 * eng.tokenizer.max_token_chars
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequest, match="text_input has 20000000 characters"):
        eng.submit("x" * 20_000_000, SamplingParams(max_tokens=4), lambda out: None)
    assert time.perf_counter() - t0 < 1.0  # tokenizing 20 M characters takes ~10 s
    with pytest.raises(InvalidRequest, match="exceeds the context"):  # just inside the bound: tokenized, too long
        eng.submit("x" * bound, SamplingParams(max_tokens=4), lambda out: None)


def test_profile_phases_add_up_to_the_decode_step(kit):
    eng = engine(kit, "draft", max_batch=2)
    eng.generate(prompts(3), SamplingParams(max_tokens=16, ignore_eos=True))
    m = eng.metrics
    assert set(m.phase_seconds) == set(PHASES)
    assert all(m.phase_seconds[p] > 0 for p in ("policy", "draft", "inputs", "forward", "verify", "output", "commit"))
    uncovered = m.decode_seconds - sum(m.phase_seconds.values())
    assert 0 <= uncovered < 0.05 * m.decode_seconds  # the laps cover the step: nothing is left out


def test_freeze_heap_takes_a_built_engine_out_of_the_collectors_passes(kit):  # noqa: F811
    """What a serving or benchmarking process keeps to its end is not scanned again by every
    full collection (100+ ms a pass with the bench's engines); garbage alive then is collected."""
    import gc
    import weakref

    from specdec.core.engine_config import freeze_heap

    class Node:
        pass

    engine = build_engine(EngineConfig.of(method="eagle", **kit))
    cycle = Node()
    cycle.me = cycle
    garbage = weakref.ref(cycle)
    del cycle
    freeze_heap()
    tracked = {id(o) for o in gc.get_objects()}
    assert id(engine.__dict__) not in tracked and id(engine.policy.__dict__) not in tracked
    assert garbage() is None and gc.get_freeze_count() > 0

