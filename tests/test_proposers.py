"""Each proposer's first draft token is what its model predicts for the committed context,
recomputed from scratch (no caches): catches misaligned features, positions or stale caches."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.core.config import EngineConfig
from specdec.core.engine_config import build_engine
from specdec.core.errors import ConfigurationError
from specdec.core.proposers.medusa import MC_SIM_7B_63
from specdec.core.proposers import base
from specdec.core.proposers import eagle as eagle_module
from specdec.core.proposers.ngram import NgramIndex, lookup
from specdec.core.sampling import SamplingParams
from specdec.core.verify import TreeShape
from test_engine import kit, prompts  # noqa: F401


def recorded_first_drafts(eng, skip_every: int = 0, long_pause: int = 0, shifts: list[int] | None = None):
    """(tokens, draft) of every proposal; with skip_every, some rounds propose nothing (k = 0); with
    long_pause, no row drafts for that many rounds (from the fourth), then only the odd slots do for
    as many again while the even slots' backlog, longer than `proposers.base.RIDE_ALONG_TOKENS`,
    waits (it catches up only when its row drafts), then all rows draft. `shifts` gets each
    recorded draft's positions before its drafter's cache (a windowed catch-up)."""
    seen = []
    propose = eng.proposer.propose
    rounds = iter(range(10**9))
    if skip_every:
        eng.policy.choose = lambda seqs: [0 if next(rounds) % skip_every else eng.proposer.max_k for _ in seqs]
    if long_pause:
        def choose(seqs):
            r = next(rounds) - 3
            return [0 if 0 <= r < long_pause or (r < 2 * long_pause and s.slot % 2 == 0) else eng.proposer.max_k
                    for s in seqs]
        eng.policy.choose = choose

    def spy(seqs, ks):
        drafts = propose(seqs, ks)
        seen.extend((list(s.tokens), d) for s, d in zip(seqs, drafts) if len(d))
        if shifts is not None:
            shifts.extend(eng.proposer.shift[s.slot] for s, d in zip(seqs, drafts) if len(d))
        return drafts

    eng.proposer.propose = spy
    eng.generate(prompts(3, seed=9), SamplingParams(max_tokens=60 if long_pause else 12, ignore_eos=True))
    assert len(seen) > 10
    return seen


@pytest.mark.parametrize("k, heads_run", [(1, 1), (4, 2), (6, 3)])
def test_medusa_runs_only_the_heads_its_tree_reaches(kit, k, heads_run):  # noqa: F811
    # mc_sim_7b_63's first nodes: [0] [0,0] [1] [0,1] [2] [0,0,0]: depth 1, 2 and 3 at k = 1, 4, 6
    eng = build_engine(EngineConfig.of(method="medusa", dtype="float64", policy="fixed", max_batch=2, k=k, **kit))
    heads, ran = eng.proposer.heads, []
    forward = heads.forward
    heads.forward = lambda hidden, num_heads=None: ran.append(num_heads) or forward(hidden, num_heads)
    drafts = [d for _, d in recorded_first_drafts(eng)]
    assert set(ran) == {heads_run} and max(map(len, drafts)) == k


@pytest.mark.parametrize("skip_every,long_pause", [(0, 0), (3, 0), (0, 12)])
@pytest.mark.parametrize("method", ["eagle", "eagle2"])
def test_eagle_first_draft_matches_teacher_forced_head(kit, method, skip_every, long_pause):  # noqa: F811
    eng = build_engine(EngineConfig.of(method=method, dtype="float64", policy="fixed", max_batch=2, k=3, **kit))
    target, head = eng.target, eng.proposer.head
    for tokens, draft in recorded_first_drafts(eng, skip_every, long_pause):
        ids = torch.tensor([tokens])
        with torch.no_grad():
            feats = target(ids[:, :-1])  # features of every committed token before the root
            pred = head(target.model.embed_tokens(ids[:, 1:]), feats)  # pairs (f_t, x_t+1)
            want = int(target.logits(pred[0, -1]).argmax())
        first_children = [t for t, p in zip(draft.tokens, draft.parents) if p == -1]
        assert first_children[0] == want


def test_medusa_first_draft_matches_heads_on_last_hidden(kit):  # noqa: F811
    eng = build_engine(EngineConfig.of(method="medusa", dtype="float64", policy="fixed", max_batch=2, **kit))
    target, heads = eng.target, eng.proposer.heads
    for tokens, draft in recorded_first_drafts(eng):
        with torch.no_grad():
            last_hidden = target(torch.tensor([tokens[:-1]]))[0, -1]
            top = heads(last_hidden).argmax(-1).tolist()  # best token per head
        assert draft.tokens[0] == top[0]  # path [0]: head 0's best
        if [0, 0] in eng.proposer.tree[: len(draft)]:
            assert draft.tokens[eng.proposer.tree.index([0, 0])] == top[1]


@pytest.mark.parametrize("skip_every,long_pause", [(0, 0), (3, 0), (0, 12)])
def test_draft_model_first_draft_matches_its_own_forward(kit, skip_every, long_pause):  # noqa: F811
    eng = build_engine(EngineConfig.of(method="draft", dtype="float64", policy="fixed", max_batch=2, k=3, **kit))
    model = eng.proposer.model
    for tokens, draft in recorded_first_drafts(eng, skip_every, long_pause):
        with torch.no_grad():
            logits = model.logits(model(torch.tensor([tokens + draft.tokens[:-1]])))[0]
        assert draft.tokens == logits[len(tokens) - 1 :].argmax(-1).tolist()


@pytest.mark.parametrize("method", ["draft", "eagle", "eagle2"])
def test_a_catch_up_feeds_only_a_window_and_drafts_as_the_drafter_over_it(kit, method, monkeypatch):  # noqa: F811
    """A catch-up further back than CATCH_UP_WINDOW tokens (a prompt, a long pause) restarts the
    drafter's cache at the window: every first draft token is the drafter's over the window's
    tokens alone, as if they began the sequence (the target's features are of the whole one)."""
    monkeypatch.setattr(base, "CATCH_UP_WINDOW", 6)
    eng = build_engine(EngineConfig.of(method=method, dtype="float64", policy="fixed", max_batch=2, k=3, **kit))
    target, shifts = eng.target, []
    recorded = recorded_first_drafts(eng, long_pause=12, shifts=shifts)
    assert min(shifts) > 0 and len(set(shifts)) > 2  # the prompt's window, and the pauses'
    for (tokens, draft), shift in zip(recorded, shifts):
        ids = torch.tensor([tokens])
        with torch.no_grad():
            if method == "draft":
                model = eng.proposer.model
                window = torch.tensor([tokens[shift:]])
                want = int(model.logits(model(window))[0, -1].argmax())
            else:
                head = eng.proposer.head
                feats = target(ids[:, :-1])
                pred = head(target.model.embed_tokens(ids[:, shift + 1 :]), feats[:, shift:])
                want = int(target.logits(pred[0, -1]).argmax())
        assert [t for t, p in zip(draft.tokens, draft.parents) if p == -1][0] == want


@pytest.mark.parametrize("window", [6, base.CATCH_UP_WINDOW])
@pytest.mark.parametrize("method", ["draft", "eagle", "eagle2", "medusa", "ngram"])
def test_backlog_is_what_the_next_catch_up_feeds(kit, method, window, monkeypatch):  # noqa: F811
    """The policy charges a resume with `backlog`: for every drafting row it must be exactly the
    entries the drafter's catch-up forward then runs for it (a newcomer's prompt, a pause, at most
    the window), the tokens prompt lookup's index then records (no window), and 0 for Medusa."""
    monkeypatch.setattr(base, "CATCH_UP_WINDOW", window)
    eng = build_engine(EngineConfig.of(method=method, dtype="float64", policy="fixed", max_batch=2, k=3, **kit))
    proposer, fed, expected = eng.proposer, [], []
    model = getattr(proposer, "head", None) if method.startswith("eagle") else getattr(proposer, "model", None)
    if model is not None:
        forward, slots_arg = model.forward, 4 if method.startswith("eagle") else 3  # (tokens or embeds, [features,] positions, cache, slots, ...)

        def spy(*args, **kwargs):
            if not fed[-1]:  # the proposal's first forward is its catch-up
                fed[-1] = dict(zip(args[slots_arg], kwargs["lengths"]))
            return forward(*args, **kwargs)

        monkeypatch.setattr(model, "forward", spy)
    propose = proposer.propose

    def recording(seqs, ks):
        expected.append({s.slot: proposer.backlog(s) for s, k in zip(seqs, ks) if k})
        if method == "ngram":
            before = {s.slot: proposer.index(s).indexed for s, k in zip(seqs, ks) if k}
        fed.append({})
        drafts = propose(seqs, ks)
        if method == "ngram":
            fed[-1] = {s.slot: proposer.index(s).indexed - before[s.slot] for s, k in zip(seqs, ks) if k}
        return drafts

    proposer.propose = recording
    rounds = iter(range(10**9))
    eng.policy.choose = lambda seqs: [0 if 2 <= next(rounds) % 20 < 12 else 3 for _ in seqs]  # pauses of 10 rounds
    eng.generate(prompts(3, seed=9), SamplingParams(max_tokens=50, ignore_eos=True))
    backlogs = [b for e in expected for b in e.values()]
    if method == "medusa":
        assert set(backlogs) == {0}
        return
    if method == "ngram":
        assert max(backlogs) > 10  # prompts and pauses, whole (with the 6-entry window too)
    else:
        assert max(backlogs) == window if window < 10 else 10 < max(backlogs) <= window  # prompts and pauses
    for e, f in zip(expected, fed):
        assert {slot: f[slot] for slot in e} == e


def searched(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup's rule by exhaustive search: the longest suffix n-gram with an earlier match;
    its latest match with k tokens after it, else its earliest."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        matches = [i for i in range(L - n) if tokens[i : i + n] == tokens[L - n :]]
        if matches:
            full = [i for i in matches if i + n + k <= L]
            i = full[-1] if full else matches[0]
            return tokens[i + n : i + n + k]
    return []


def test_the_ngram_index_kept_as_a_sequence_grows_finds_what_a_full_search_finds():
    rng = random.Random(0)
    for trial in range(30):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 8))]
        index = NgramIndex(1, 4)
        for _ in range(60):
            k = rng.randrange(1, 6)
            assert index.lookup(tokens, k) == searched(tokens, k, 1, 4), (trial, tokens, k)
            tokens = tokens + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


def test_ngram_prefers_a_match_with_a_full_continuation():
    assert lookup([5] * 8, 3, 1, 3) == [5, 5, 5]
    assert lookup([5] * 5, 3, 1, 3) == [5, 5]
    assert lookup([1, 2, 3, 9, 1, 2], 2, 1, 3) == [3, 9]
    assert lookup([1, 2, 3, 4], 2, 1, 3) == []


def test_a_shorter_ngram_max_than_the_default_ngram_min_is_refused_naming_both(kit):  # noqa: F811
    """ngram_min defaults to 3: a user who sets only ngram_max below it is told which settings clash."""
    with pytest.raises(ConfigurationError, match="ngram_min=3, ngram_max=2 .ngram_min defaults to 3"):
        build_engine(EngineConfig.of(method="ngram", ngram_max=2, target=kit["target"]))


@pytest.mark.parametrize("method, k", [("medusa", 4), ("medusa", 1), ("eagle2", 4), ("eagle2", 2)])
def test_k_caps_the_tree_nodes_of_every_step(kit, method, k):  # noqa: F811
    eng = build_engine(EngineConfig.of(method=method, dtype="float64", policy="fixed", max_batch=2, k=k, **kit))
    assert eng.proposer.max_k == k
    sizes = [len(d) for _, d in recorded_first_drafts(eng)]
    assert max(sizes) == k


@pytest.mark.parametrize("dtype, k, tree, mixed", [("float64", 4, (4, 5, 24), False), ("float32", 4, (4, 5, 24), False),
                                                   ("float32", 6, (3, 4, 12), True), ("float64", 2, (3, 3, 8), False)])
def test_eagle2_expands_only_nodes_that_can_be_kept_and_grows_the_same_tree(kit, monkeypatch, dtype, k, tree, mixed):  # noqa: F811
    """Every recorded tree equals the one grown expanding every frontier node (eager at float64,
    the native decoder at float32), from fewer head rows: a frontier node scoring below the k-th
    best candidate so far is not expanded. The head's scores are sharpened (logits x 8: the same
    argmax, so the same greedy output) so that the kept nodes spread over several subtrees (the
    tiny kit's random heads are flat: their best nodes are the root's children); expanding only
    each depth's best node then grows other trees, which is what this test must catch. `mixed`:
    the rows of a batch ask for 1..k nodes, each tree no deeper than its own k."""
    def run(expand):
        if expand is not None:
            monkeypatch.setattr(eagle_module, "worth_expanding", expand)
        eng = build_engine(EngineConfig.of(method="eagle2", dtype=dtype, policy="fixed", max_batch=3, k=k,
                                           eagle_tree=tree, **kit))
        head, rows = eng.proposer.head, []
        forward, vocab = head.forward, eng.proposer.vocab
        eng.proposer.vocab = lambda hidden: vocab(hidden) * 8
        if mixed:  # the same k for a row in both runs: the tokens so far are the same
            eng.policy.choose = lambda seqs: [1 + (len(s.tokens) + s.slot) % k for s in seqs]

        def counted(embeds, features, positions=None, cache=None, slots=None, starts=None, tree_mask=None, lengths=None):
            if tree_mask is not None:  # a tree depth's forward, not the catch-up
                rows.append(sum(lengths) if lengths else embeds.shape[0] * embeds.shape[1])
            return forward(embeds, features, positions, cache, slots, starts, tree_mask, lengths)
        head.forward = counted
        recorded = [(tokens, d.tokens, d.parents) for tokens, d in recorded_first_drafts(eng)]
        monkeypatch.undo()
        return recorded, sum(rows)

    pruned, pruned_rows = run(None)
    full, full_rows = run(lambda cands, frontier, n, depth: frontier)
    assert pruned == full and pruned_rows < full_rows, (pruned_rows, full_rows)
    if k > 2:  # two nodes are the root's best child and its best child, or two root children
        best_only, _ = run(lambda cands, frontier, n, depth: frontier[:1])
        assert best_only != full


def test_worth_expanding_keeps_the_frontier_nodes_at_or_above_the_nth_best_score():
    scores = [-0.1, -1.0, -2.0, -3.0, -3.0, -2.5]
    cands = [(t, -1, v) for t, v in enumerate(scores)]
    assert eagle_module.worth_expanding(cands, [0, 2, 3, 5], 3, 1) == [0, 2]  # the 3rd best: -2.0
    assert eagle_module.worth_expanding(cands, [3, 4, 5], 5, 2) == [3, 4, 5]  # a tie at the 5th best is kept
    assert eagle_module.worth_expanding(cands, [4, 1], 7, 3) == [4, 1]  # fewer candidates than kept nodes
    assert eagle_module.worth_expanding(cands, [0, 1], 3, 3) == []  # 3 nodes reach depth 3 at most


def test_medusa_tree_is_pruned_to_its_best_first_prefix_with_buffers_built_once(kit):  # noqa: F811
    eng = build_engine(EngineConfig.of(method="medusa", dtype="float64", policy="fixed", k=5, **kit))
    proposer = eng.proposer
    assert proposer.tree == MC_SIM_7B_63[:5]  # [0] [0,0] [1] [0,1] [2]
    assert [proposer.depth_for(k) for k in range(7)] == [0, 1, 2, 2, 2, 2, 2]
    drafts = [d for _, d in recorded_first_drafts(eng)]
    assert all(d.shape is proposer.shapes[len(d)] for d in drafts)  # shared, not rebuilt per step
    with pytest.raises(ConfigurationError, match="k >= 1"):
        build_engine(EngineConfig.of(method="medusa", dtype="float64", k=0, **kit))


def test_tree_shape_mask_sees_exactly_the_ancestors():
    parents = [-1, 0, -1, 1, 0, 2]
    shape = TreeShape.build(parents)
    assert shape.depths == [1, 2, 1, 3, 2, 2] and shape.children == {-1: [0, 2], 0: [1, 4], 1: [3], 2: [5]}
    for i in range(len(parents)):
        ancestors, a = {i}, parents[i]
        while a >= 0:
            ancestors.add(a)
            a = parents[a]
        assert shape.mask[i + 1, 0]
        assert {j for j in range(len(parents)) if shape.mask[i + 1, j + 1]} == ancestors
    assert not shape.is_chain and TreeShape.build([-1, 0, 1]).is_chain
    with pytest.raises(ValueError, match="parents must come before"):
        TreeShape.build([-1, 2, 0])


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_a_native_chain_drafts_what_the_python_loop_drafts(method, monkeypatch):
    """Greedy chains past their first token run as one native call (`native.NativeChain`): on
    the demo kit in float32 (the native path), with rows drafting different lengths, a window
    restart and EOS forbidden while min_tokens is owed, every draft and every cache entry it
    writes are the Python loop's bit for bit."""
    from specdec.paths import DEMO_KIT
    from specdec.tools.bench import kit_paths

    monkeypatch.setattr(base, "CATCH_UP_WINDOW", 24)
    runs = []
    for native in (True, False):
        eng = build_engine(EngineConfig.of(method=method, max_batch=3, policy="fixed", k=5, **kit_paths(DEMO_KIT)))
        assert eng.proposer.chain is not None
        if not native:
            eng.proposer.chain = None
        eng.proposer.eos_ids = [t for t in range(eng.target.config.vocab_size) if t % 3]  # masked often while owed
        rounds = iter(range(10**9))
        eng.policy.choose = lambda seqs: [(next(rounds) // 3 + s.slot) % 6 for s in seqs]  # 0-5, pauses
        drafts, propose = [], eng.proposer.propose
        eng.proposer.propose = lambda seqs, ks: drafts.append(propose(seqs, ks)) or drafts[-1]
        out = eng.generate(prompts(3, seed=9), SamplingParams(max_tokens=60, min_tokens=30))
        runs.append(([[d.tokens for d in step] for step in drafts], [r.token_ids for r in out], eng.proposer.cache.k))
    assert any(max(map(len, step)) == 5 for step in runs[0][0])
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1]
    assert torch.equal(runs[0][2], runs[1][2])


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_a_catch_up_of_one_long_row_among_short_ones_runs_natively(method, monkeypatch):
    """The native chain takes a catch-up by its entries, not by rows x its longest row: it skips
    padding. A newcomer's prompt beside rows in sync (here 3 rows, NATIVE_MAX_ROWS lowered to 48)
    runs there, drafting what the Python loop drafts bit for bit; gated on padded rows, such
    catch-ups of a batch of 8 past 128 tokens went to the eager layers. (The caches differ past
    each row's end only: the eager catch-up also writes its padding there, which no step reads.)
    Float32 drafters: the Python loop's long catch-up runs on the eager layers' float32 weights,
    where the chain's rounds them (`draft_dtype`)."""
    from specdec.core.models import native
    from specdec.paths import DEMO_KIT
    from specdec.tools.bench import kit_paths

    monkeypatch.setattr(native, "NATIVE_MAX_ROWS", 48)
    runs, gated = [], []
    for use_chain in (True, False):
        eng = build_engine(EngineConfig.of(method=method, max_batch=3, policy="fixed", k=4, draft_dtype="float32",
                                           **kit_paths(DEMO_KIT)))
        if use_chain:
            takes = eng.proposer.chain.takes
            eng.proposer.chain.takes = lambda d, p: gated.append((len(p) * max(map(len, p)), sum(map(len, p)), takes(d, p))) or gated[-1][2]
        else:
            eng.proposer.chain = None
        rounds = iter(range(10**9))
        eng.policy.choose = lambda seqs: [4 if s.slot or next(rounds) > 12 else 0 for s in seqs]  # slot 0 waits 12 steps
        drafts, propose = [], eng.proposer.propose
        eng.proposer.propose = lambda seqs, ks: drafts.append(propose(seqs, ks)) or drafts[-1]
        out = eng.generate(prompts(3, seed=9), SamplingParams(max_tokens=40))
        runs.append(([[d.tokens for d in step] for step in drafts], [r.token_ids for r in out]))
    assert any(padded > 48 and entries <= 48 and native_ran for padded, entries, native_ran in gated), gated
    assert runs[0] == runs[1]


def test_a_paused_eagle_keeps_only_the_feature_blocks_its_window_can_feed(monkeypatch):
    """A paused EAGLE sequence appends a block of true features every step; blocks wholly before
    the catch-up's window (CATCH_UP_WINDOW, lowered to 24 here) are dropped at once, as the
    window's restart drops them, so a long pause holds at most a window of them (it held every
    step's). The drafts after the pause, the outputs and the head's cache are the same as when
    every block is kept until the catch-up."""
    from specdec.paths import DEMO_KIT
    from specdec.tools.bench import kit_paths

    monkeypatch.setattr(base, "CATCH_UP_WINDOW", 24)
    monkeypatch.setattr(eagle_module, "CATCH_UP_WINDOW", 24)
    runs, held = [], []
    for trim in (True, False):
        eng = build_engine(EngineConfig.of(method="eagle", max_batch=2, policy="fixed", k=4, **kit_paths(DEMO_KIT)))
        p = eng.proposer
        if not trim:
            p.commit = lambda seq, path, hidden, row: p.pending[seq.slot].append((1 + len(path), hidden, row, tuple(path)))
        rounds = iter(range(10**9))
        eng.policy.choose = lambda seqs: [0 if 2 <= next(rounds) // 2 % 60 < 50 else 4 for _ in seqs]  # pauses of ~100 steps
        spy, drafts = p.propose, []
        p.propose = lambda seqs, ks: drafts.append(spy(seqs, ks)) or drafts[-1]
        commit = p.commit
        p.commit = lambda seq, path, *f: commit(seq, path, *f) or held.append((trim, sum(b[0] for b in p.pending[seq.slot])))
        out = eng.generate(prompts(2, seed=3), SamplingParams(max_tokens=150, ignore_eos=True))
        runs.append(([[d.tokens for d in step] for step in drafts], [r.token_ids for r in out], p.cache.k.clone()))
    assert max(n for t, n in held if t) < 24 + 5 < max(n for t, n in held if not t)
    assert runs[0][:2] == runs[1][:2] and any(map(any, runs[0][0]))
    assert torch.equal(runs[0][2], runs[1][2])
