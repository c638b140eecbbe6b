"""The demo model kit: the tiny profile trains end to end and its artifacts load like real
checkpoints (transformers agrees on the target), training resumes exactly, and the committed
demo kit matches its checksums and loads."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.tools.kit import main
from specdec.tools.kit import train as kit_train
from specdec.tools.kit.build import build_kit, new_llama
from specdec.tools.kit.corpus import is_heldout, read_documents, split_documents
from specdec.tools.kit.evaluate import distinct_n, second_token_ceiling
from specdec.tools.kit.export import FOLDERS, verify_checksums
from specdec.tools.kit.features import feature_batches, windows
from specdec.tools.kit.profiles import EOS_ID, PROFILES, ModelShape, Stage
from specdec.core.models.checkpoint import load_model
from specdec.core.models.config import LlamaConfig
from specdec.core.models.heads import EagleHead, MedusaHeads
from specdec.core.models.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
DEMO_KIT = REPO / "build" / "demo-kit"


@pytest.fixture(scope="module")
def tiny_kit(tmp_path_factory) -> tuple[Path, Path, dict]:
    root = tmp_path_factory.mktemp("kit")
    kit = build_kit(PROFILES["tiny"], root / "out", cache=root / "cache")
    return root / "out", root / "cache", kit


def assert_kit_loads(out: Path) -> None:
    tokenizer_bytes = {(out / name / "tokenizer.json").read_bytes() for name in FOLDERS}
    assert len(tokenizer_bytes) == 1, "every folder must carry the same tokenizer.json"
    tok = Tokenizer(out / "target")
    assert tok.eos_ids == [EOS_ID] and tok.hf.id_to_token(EOS_ID) == "<|endoftext|>"
    assert Tokenizer(out / "draft").fingerprint() == tok.fingerprint()
    text = "def f(x):\n    return x + 1  # café\n"
    assert tok.decode(tok.encode(text)) == text
    target, draft = load_model(out / "target"), load_model(out / "draft")
    medusa, eagle = MedusaHeads.load(out / "medusa"), EagleHead.load(out / "eagle")
    vocab = target.config.vocab_size
    assert vocab == tok.vocab_size == draft.config.vocab_size
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        hidden = target(ids)
        assert draft.logits(draft(ids)).shape == (1, ids.shape[1], vocab)
        assert medusa(hidden).shape == (medusa.num_heads, 1, ids.shape[1], vocab)
        pred = eagle(target.model.embed_tokens(ids[:, 1:]), hidden[:, :-1])
        assert target.logits(pred).shape == (1, ids.shape[1] - 1, vocab)
        assert torch.isfinite(pred).all()


def test_tiny_kit_trains_end_to_end_and_loads(tiny_kit):
    out, _, kit = tiny_kit
    assert_kit_loads(out)
    assert verify_checksums(out) == []
    assert set(kit["training"]) == {"target", "draft", "eagle", "medusa"}
    figures = kit["eval"]
    # Training must have learned something: uniform over 512 tokens is perplexity 512, chance agreement ~0.002.
    assert figures["target_perplexity"] < 250
    for name in ("draft", "eagle", "medusa_head_1"):
        assert figures["agreement"][name] > 0.05, name
    assert figures["agreement"]["medusa_head_1"] <= figures["medusa_head_1_reference"]["ceiling"] <= 1.0
    assert 0.0 < figures["engine"]["baseline"]["distinct_4"] <= 1.0
    for method in ("draft", "eagle", "ngram"):
        engine = figures["engine"][method]
        assert engine["identical_to_baseline"], method  # greedy speculation is lossless on the kit too
        assert 1.0 <= engine["mean_accepted_length"] <= 1 + engine["k"], method
    assert set(json.loads((out / "checksums.json").read_text())) >= {f"{n}/tokenizer.json" for n in FOLDERS}


def test_tiny_target_agrees_with_transformers(tiny_kit):
    import transformers

    out, _, _ = tiny_kit
    ref = transformers.AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()
    ours = load_model(out / "target", dtype=torch.float32)
    tokens = torch.randint(0, ours.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(tokens).logits
        got = ours.logits(ours(tokens))
    assert (expected - got).abs().max().item() <= 1e-3


def test_rerun_resumes_from_cache_and_evaluate_cli(tiny_kit):
    out, cache, kit = tiny_kit
    again = build_kit(PROFILES["tiny"], out, cache=cache)
    assert again["training"] == kit["training"]  # nothing retrained: every stage resumed at its end
    assert main(["evaluate", str(out)]) == 0
    assert json.loads((out / "kit.json").read_text())["eval"] == kit["eval"]
    assert verify_checksums(out) == []
    (out / "draft" / "config.json").write_text("{}")
    assert verify_checksums(out) == ["draft/config.json"]


def test_partial_runs_train_chosen_stages_and_need_a_cached_target(tiny_kit, tmp_path):
    out, cache, kit = tiny_kit
    before = (out / "kit.json").read_text()
    assert build_kit(PROFILES["tiny"], tmp_path / "unused", cache=cache, stages=("eagle", "medusa")) is None
    assert not (tmp_path / "unused").exists() and (out / "kit.json").read_text() == before
    with pytest.raises(SystemExit, match="target"):
        build_kit(PROFILES["tiny"], tmp_path / "out", cache=tmp_path / "fresh", stages=("eagle",))


def test_learners_read_the_targets_features_from_one_cache_file(tiny_kit):
    _, cache, kit = tiny_kit
    profile = PROFILES["tiny"]
    state = torch.load(cache / "target.pt", weights_only=False)
    assert sorted(p.name for p in cache.glob("features-*")) == [f"features-{state['step']}.npy"]
    target = new_llama(profile.target.config(kit["vocab_size"], profile.seq_len * 2), 0, "cpu")
    target.load_state_dict(state["model"])
    tokens = torch.from_numpy(np.load(cache / "train_tokens.npy").astype(np.int32))
    wins = windows(tokens, profile.seq_len)
    stored = np.load(cache / f"features-{state['step']}.npy", mmap_mode="r")
    assert stored.shape == (len(wins), profile.seq_len, target.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(np.array(stored[-3:])).float(), target(wins[-3:].long()), atol=2e-2, rtol=1e-2)
    batch = feature_batches(target, state["step"], tokens, profile.seq_len, cache, "cpu")
    x, features = batch(7, 4)
    again = batch(7, 4)
    assert torch.equal(x, again[0]) and torch.equal(features, again[1])
    for row, feats in zip(x, features):  # each window comes with its own features
        index = int((wins == row).all(dim=1).nonzero()[0])
        assert torch.equal(feats, torch.from_numpy(np.array(stored[index])).float())


def test_interrupted_stage_resumes_to_the_same_weights(tmp_path, monkeypatch):
    profile = PROFILES["tiny"]
    tokens = torch.randint(0, 64, (5000,), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    stage = Stage(steps=12, lr=3e-3, batch=4, time_share=1.0, warmup=3)
    config = ModelShape(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64).config(64, 64)

    def train(cache: Path, stop_at: int | None) -> torch.nn.Module:
        model = new_llama(config, 0, "cpu")
        ctx = kit_train.TrainContext(profile, tokens, cache, "cpu", compile=False, total_seconds=None, stages=frozenset({"t"}))

        def loss_fn(step: int) -> torch.Tensor:
            if step == stop_at:
                raise KeyboardInterrupt
            batch = ctx.batch("t", step, stage.batch)
            return torch.nn.functional.cross_entropy(model.logits(model(batch[:, :-1])).flatten(0, 1), batch[:, 1:].flatten())

        kit_train.run_stage("t", model, loss_fn, stage, ctx, key={"stage": "t"})
        return model

    monkeypatch.setattr(kit_train, "CHECKPOINT_EVERY_S", 0.0)  # checkpoint after every step
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole = train(tmp_path / "a", None)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "b", stop_at=7)
    resumed = train(tmp_path / "b", None)
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


def test_heldout_split_is_stable_and_disjoint():
    docs = read_documents()
    train, heldout = split_documents(docs, 5, None)
    assert 0.02 < len(heldout) / len(docs) < 0.09
    assert not {d.path for d in train} & {d.path for d in heldout}
    assert all(is_heldout(d.path, 5) for d in heldout)
    assert is_heldout("json/decoder.py", 5) == is_heldout("json/decoder.py", 5)


def test_second_token_ceiling_matches_one_forward_per_candidate():
    config = ModelShape(hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64).config(24, 64)
    model = new_llama(config, 3, "cpu").eval()
    for p in model.parameters():  # sharper distributions than the N(0, 0.02) init gives
        p.data.mul_(6.0)
    windows = torch.randint(0, 24, (2, 14), generator=torch.Generator().manual_seed(2))
    k, ceiling, two_step = 3, [], []
    with torch.no_grad():
        for window in windows:
            x = window[:-1]
            for t in range(x.numel() - 1):
                p, cand = model.logits(model(x[None, : t + 1]))[0, -1].softmax(-1).topk(k)
                picks = [int(model.logits(model(torch.cat([x[: t + 1], c[None]])[None]))[0, -1].argmax()) for c in cand]
                ceiling.append(max(sum(float(p[j]) for j in range(k) if picks[j] == y) for y in picks) + 1 - float(p.sum()))
                two_step.append(picks[0] == int(model.logits(model(x[None, : t + 2]))[0, -1].argmax()))
    got = second_token_ceiling(model, windows, k)
    assert got["ceiling"] == pytest.approx(sum(ceiling) / len(ceiling), abs=1e-4)
    assert got["two_step_greedy"] == pytest.approx(sum(two_step) / len(two_step), abs=1e-4)
    assert 0.0 < got["two_step_greedy"] < 1.0 and 0.0 < got["ceiling"] < 1.0


def test_distinct_4_flags_loops():
    assert distinct_n(list(range(40))) == 1.0
    assert distinct_n([1, 2, 3] * 20) < 0.1


@pytest.mark.skipif(not (DEMO_KIT / "checksums.json").exists(), reason="build/demo-kit not built yet (python -m specdec.tools.kit build --profile demo --out build/demo-kit)")
def test_committed_demo_kit_matches_checksums_and_loads():
    assert verify_checksums(DEMO_KIT) == []
    assert_kit_loads(DEMO_KIT)
    kit = json.loads((DEMO_KIT / "kit.json").read_text())
    assert kit["profile"] == "demo" and "eval" in kit
    weights = sum(p.stat().st_size for p in DEMO_KIT.rglob("*.safetensors"))
    assert weights <= 25 * 2**20


def test_a_deeper_eagle_head_grows_from_the_cached_one(tiny_kit, tmp_path):
    """Profile eagle_layers above the cached head's: the trained layer is kept, the new one starts as
    a no-op (same predictions), step and seconds carry over, and the stage resumes from it."""
    out, cache, kit = tiny_kit
    grown_cache = tmp_path / "cache"
    shutil.copytree(cache, grown_cache)
    before = torch.load(cache / "eagle.pt", weights_only=False)
    assert before["key"]["layers"] == 1
    shallow_config = LlamaConfig.from_file(out / "eagle" / "config.json")
    shallow = EagleHead(shallow_config)
    shallow.load_state_dict(before["model"])
    profile = dataclasses.replace(PROFILES["tiny"], eagle_layers=2)
    assert build_kit(profile, tmp_path / "unused", cache=grown_cache, stages=("eagle",)) is None
    after = torch.load(grown_cache / "eagle.pt", weights_only=False)
    assert after["key"] == {**before["key"], "layers": 2}
    assert (after["step"], after["seconds"]) == (before["step"], before["seconds"])
    deep = EagleHead(dataclasses.replace(shallow_config, num_hidden_layers=2))
    deep.load_state_dict(after["model"])
    assert deep.layers[1].self_attn.q_proj.weight.abs().sum() > 0  # a real layer, not a copy of nothing
    embeds, features = torch.randn(2, 9, shallow_config.hidden_size), torch.randn(2, 9, shallow_config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(deep(embeds, features), shallow(embeds, features))
