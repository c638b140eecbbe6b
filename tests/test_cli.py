"""The `specdec` command line: generate and bench run end to end on tiny checkpoints."""

from __future__ import annotations

import json
import re

import pytest

from specdec.cli import main
from specdec.core.engine import EngineMetrics
from specdec.tools import bench
from specdec.tools.bench import drafting_totals, forward_rate
from test_engine import kit  # noqa: F401  (module-scoped fixture: tiny target, draft, Medusa, EAGLE)


def kit_args(kit):  # noqa: F811
    return ["--kit", "", "--target", kit["target"], "--draft", kit["draft"], "--medusa", kit["medusa"],
            "--eagle", kit["eagle"], "--dtype", "float64"]


def test_generate_prints_text_and_stats(kit, capsys):  # noqa: F811
    # fixed k: the test kit's draft model is a copy of the target, as dear as it, and the adaptive
    # policy (timing both before serving) would rightly not draft with it
    assert main(["generate", *kit_args(kit), "--method", "draft", "--policy", "fixed", "--max-tokens", "12",
                 "def add(a, b):"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def add(a, b):")
    assert "[draft] 12 tokens" in out and "acceptance rate" in out


def test_bench_prints_every_method_and_writes_consistent_json(kit, tmp_path, capsys):  # noqa: F811
    path = tmp_path / "bench.json"
    # --ngram-min 1: 12 tokens of the test kit's random model repeat no 3-gram, and every method must draft here
    args = ["bench", *kit_args(kit), "--prompts", "2", "--max-tokens", "12", "--repeats", "1",
            "--batch-sizes", "1,2", "--json", str(path), "--profile", "--policy", "fixed", "--ngram-min", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    figures = json.loads(path.read_text())["figures"]
    methods = {f["method"] for f in figures}
    assert methods == {"baseline", "ngram", "draft", "medusa", "eagle", "eagle2"}
    for f in figures:
        assert f"| {f['batch']} | {f['method']} |" in out
        assert f["identical_share"] == 1.0  # float64: batch shapes cannot flip a greedy choice
        assert f["tokens_per_s"] > 0
        if f["method"] == "baseline":
            assert f["speedup"] == pytest.approx(1.0) and f["mean_accepted_length"] == pytest.approx(1.0)
            assert f["analytic_bound"] == pytest.approx(1.0)
        else:
            assert 0 < f["mean_draft_tokens"] <= 4  # k = 4 caps every method, trees included
        steps = f["step_ms"]
        assert steps["forward"] > 0 and steps["step"] >= steps["forward"] + steps["draft"]
        assert f"| {f['batch']} | {f['method']} | {steps['step']:.2f} |" in out  # the profile table
        assert f["speedup_interval"] is None  # one repeat: no spread to read an interval from


def run_bench(kit, tmp_path, capsys, *args: str) -> tuple[list[dict], str]:  # noqa: F811
    """`specdec bench` on the test kit, 2 prompts of 10 tokens: its JSON figures and its output."""
    path = tmp_path / "bench.json"
    assert main(["bench", *kit_args(kit), "--prompts", "2", "--max-tokens", "10", "--json", str(path), *args]) == 0
    return json.loads(path.read_text())["figures"], capsys.readouterr().out


def test_bench_compares_policies_side_by_side_in_one_run(kit, tmp_path, capsys):  # noqa: F811
    figures, out = run_bench(kit, tmp_path, capsys, "--methods", "ngram,draft", "--repeats", "2", "--batch-sizes", "2",
                             "--policies", "fixed,adaptive")
    assert [(f["label"], f["method"], f["policy"]) for f in figures] == [
        ("baseline", "baseline", "fixed"), ("ngram/fixed", "ngram", "fixed"), ("ngram/adaptive", "ngram", "adaptive"),
        ("draft/fixed", "draft", "fixed"), ("draft/adaptive", "draft", "adaptive")]
    for f in figures:
        assert f"| 2 | {f['label']} |" in out and f["identical_share"] == 1.0
    # the test kit's draft model is rarely accepted: fixed k drafts 4 tokens a round, the adaptive
    # policy pauses it and drafts in its probes only (2 deep)
    fixed, adaptive = (next(f for f in figures if f["label"] == f"draft/{p}") for p in ("fixed", "adaptive"))
    assert fixed["mean_draft_tokens"] == 4.0 and adaptive["mean_draft_tokens"] < 4.0
    # two repeats: each ratio's 90% interval holds both per-repeat ratios (so their median), and
    # the baseline's own is exactly 1
    for f in figures:
        low, high = f["speedup_interval"]
        lowest, highest = f["speedup_range"]
        assert low <= lowest <= f["speedup"] <= highest <= high
        assert f"| {f['speedup_range'][0]:.2f}-{f['speedup_range'][1]:.2f} | [{low:.2f}, {high:.2f}] |" in out
    assert figures[0]["speedup_interval"] == pytest.approx([1.0, 1.0])


def test_bench_runs_an_aa_pair_and_takes_turns_batch_by_batch(kit, tmp_path, capsys, monkeypatch):  # noqa: F811
    """--aa runs a second baseline engine as a method (its greedy tokens the baseline's, its ratio
    an A/A reading of the run's noise); every engine runs each batch of prompts before any runs
    the next (whole runs in turn let seconds of machine drift into the ratios), and no engine
    follows the same neighbour every time."""
    calls = []
    run_once = bench.run_once
    monkeypatch.setattr(bench, "run_once", lambda engine, prompts, *a: calls.append((id(engine), len(prompts)))
                        or run_once(engine, prompts, *a))
    figures, out = run_bench(kit, tmp_path, capsys, "--methods", "ngram", "--repeats", "4", "--batch-sizes", "1",
                             "--policy", "fixed", "--aa")
    assert [(f["label"], f["method"]) for f in figures] == [
        ("baseline", "baseline"), ("baseline_aa", "baseline"), ("ngram", "ngram")]
    aa = figures[1]
    assert aa["identical_share"] == 1.0 and aa["mean_accepted_length"] == pytest.approx(1.0)
    low, high = aa["speedup_interval"]
    assert low <= aa["speedup"] <= high and f"| 1 | baseline_aa | {aa['tokens_per_s']:.1f} |" in out
    timed = calls[-4 * 2 * 3:]  # after the warm-up: 4 repeats x 2 prompts x 3 engines
    assert {n for _, n in timed} == {1}  # one prompt (the batch size) at a time
    orders = [[engine for engine, _ in timed[i : i + 3]] for i in range(0, len(timed), 3)]
    assert all(len(set(o)) == 3 for o in orders) and len({frozenset(o) for o in orders}) == 1
    # the engine run right before each one (when it is not first): rotating one order gave each a
    # single such neighbour every time
    before = {e: {o[o.index(e) - 1] for o in orders if o.index(e)} for e in orders[0]}
    assert any(len(neighbours) > 1 for neighbours in before.values()), orders


def test_bench_in_flight_keeps_requests_arriving_after_the_batch_sizes(kit, tmp_path, capsys):  # noqa: F811
    """--in-flight N: at most N requests run, each finished one submitting the next (48 requests
    from 2 prompts), after the batch sizes asked for and beside the same baseline's runs."""
    figures, out = run_bench(kit, tmp_path, capsys, "--methods", "ngram", "--repeats", "1", "--batch-sizes", "2",
                             "--in-flight", "2", "--policy", "adaptive", "--profile")
    assert [(f["label"], f["batch"], f["in_flight"]) for f in figures] == [
        ("baseline", 2, 0), ("ngram", 2, 0), ("baseline", 2, 2), ("ngram", 2, 2)]
    for f in figures[2:]:
        assert f["identical_share"] == 1.0 and f["tokens_per_s"] > 0
        assert f"| 2 in flight | {f['label']} | {f['tokens_per_s']:.1f} |" in out
        assert f"| 2 in flight | {f['label']} | {f['step_ms']['step']:.2f} |" in out  # the profile table
    assert "  2 in flight repeat 1/1 ngram" in out
    figures, _ = run_bench(kit, tmp_path, capsys, "--methods", "ngram", "--repeats", "1", "--in-flight", "2")
    assert {f["in_flight"] for f in figures} == {2}  # no batch sizes by default with --in-flight


@pytest.mark.parametrize("flag, value, message", [
    ("--policies", "fixed,greedy", "--policies: policy must be one of adaptive, fixed, got 'greedy'"),
    ("--batch-sizes", "1,x", "--batch-sizes must be whole numbers separated by commas, got '1,x'"),
    ("--batch-sizes", "0", "--batch-sizes must be at least 1, got '0'"),
    ("--in-flight", "4,0", "--in-flight must be at least 1, got '4,0'"),
    ("--batch-sizes", "", "nothing to run: give --batch-sizes, --in-flight or both"),
])
def test_bench_refuses_bad_lists_by_name(kit, flag, value, message):  # noqa: F811
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(["bench", *kit_args(kit), flag, value])


def test_the_bound_is_tokens_committed_per_second_of_proposals_and_forwards():
    # rows that finish early leave later steps with fewer rows: the bound counts what the run
    # committed, not tokens per row times a full batch (prefill gave each of the 8 its first token)
    baseline = EngineMetrics(steps=10, output_tokens=8 + 80, verify_seconds=1.0)
    drained = EngineMetrics(steps=10, output_tokens=8 + 120, propose_seconds=0.5, verify_seconds=1.0)
    assert forward_rate(drained, 8) / forward_rate(baseline, 8) == pytest.approx((120 / 1.5) / (80 / 1.0))


def test_the_acceptance_reported_adds_up_every_repeat():
    # an adaptive method drafts differently from repeat to repeat: its acceptance per position is
    # every repeat's, not the last one's (which here never drafted a third token)
    first = EngineMetrics(drafts=4, draft_tokens=12, accepted_tokens=9, accepted_per_position=[4, 3, 2])
    last = EngineMetrics(drafts=2, draft_tokens=4, accepted_tokens=3, accepted_per_position=[2, 1])
    total = drafting_totals([first, last])
    assert (total.drafts, total.draft_tokens, total.accepted_tokens) == (6, 16, 12)
    assert total.accepted_per_position == [6, 4, 2]
    assert first.accepted_per_position == [4, 3, 2]  # the repeats' own counters are left as they were


def test_bench_peer_hf_runs_transformers_on_the_same_checkpoints_and_prompts(kit, tmp_path, capsys):  # noqa: F811
    figures, out = run_bench(kit, tmp_path, capsys, "--methods", "baseline,draft,ngram", "--repeats", "1",
                             "--batch-sizes", "1,2", "--peer", "hf")
    peers = {(f["batch"], f["method"]): f for f in figures if f["method"].startswith("hf-")}
    assert set(peers) == {(1, "hf-plain"), (1, "hf-draft"), (1, "hf-ngram"), (2, "hf-plain")}
    for (batch, method), f in peers.items():
        assert f["identical_share"] == 1.0  # float64: transformers' greedy tokens are specdec's
        assert f["tokens_per_s"] > 0 and f["specdec_over_peer"][0] > 0
        assert f"| {batch} | {method} |" in out
