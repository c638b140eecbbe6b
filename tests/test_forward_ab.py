"""`python -m specdec.tools.forward_ab` (the interleaved forward A/B against an earlier commit) and
`python -m specdec.tools.contended_start` (the adaptive policy at a busy start)."""

from __future__ import annotations

import re

from specdec.tools.forward_ab import main


def test_forward_ab_against_head_times_both_and_agrees(capsys):
    main(["--rev", "HEAD", "--model", "draft", "--shapes", "1x1,2x3", "--calls", "5"])
    out = capsys.readouterr().out
    rows = re.findall(r"B=(\d) T=(\d): HEAD ([\d.]+) ms, this checkout ([\d.]+) ms; speedup median ([\d.]+)x", out)
    assert [(b, t) for b, t, *_ in rows] == [("1", "1"), ("2", "3")]
    assert all(float(old) > 0 and float(new) > 0 and float(ratio) > 0 for *_, old, new, ratio in rows)


def test_engine_ab_against_head_checks_outputs_and_times_both(capsys):
    main(["--rev", "HEAD", "--method", "ngram", "--batch", "8", "--rounds", "1", "--policy", "adaptive", "--engines", "2"])
    out = capsys.readouterr().out
    assert re.search(r"ngram, batch 8, adaptive policy, 1 thread\(s\), 2 engine\(s\) a side, 1 alternating rounds .*: HEAD [\d.]+ s, "
                     r"this checkout [\d.]+ s; "
                     r"speedup median [\d.]+x .*identical outputs", out)


def test_engine_ab_with_arrivals_sends_the_prompts_asked_for_at_least_48_requests(capsys):
    main(["--rev", "HEAD", "--method", "baseline", "--batch", "4", "--rounds", "1", "--prompts", "5", "--in-flight", "4",
          "--max-tokens", "4"])
    assert re.search(r"1 alternating rounds of 50 x 4 greedy tokens, 4 in flight \(short prompts\): .*identical outputs", capsys.readouterr().out)


def test_engine_ab_takes_turns_batch_by_batch_and_gives_an_interval(capsys, monkeypatch):
    """Each round runs both sides on one batch of prompts at a time (at batch 1, prompt by prompt),
    as `specdec bench` does, and the ratio comes with its 90% interval."""
    from specdec.core.engine import Engine

    sizes, generate = [], Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, prompts, *a: sizes.append(len(prompts)) or generate(self, prompts, *a))
    main(["--rev", "HEAD", "--method", "baseline", "--rounds", "3", "--prompts", "2", "--max-tokens", "2"])
    assert sizes[-3 * 2:] == [1] * 6  # this checkout's timed runs: 3 rounds x 2 prompts, one at a time
    assert re.search(r"speedup median [\d.]+x \(range [\d.]+-[\d.]+, 90% interval \[[\d.]+, [\d.]+\]\); identical outputs",
                     capsys.readouterr().out)



def test_engine_ab_with_sampled_traffic_first_times_each_phase_apart(capsys, monkeypatch):
    """`--sampled-first T`: each turn's prompts run sampled at T, then greedy, one call each; the
    two phases are reported apart, the greedy one checked for identical outputs."""
    from specdec.core.engine import Engine

    temperatures, generate = [], Engine.generate
    monkeypatch.setattr(Engine, "generate",
                        lambda self, prompts, params: temperatures.append(params.temperature) or generate(self, prompts, params))
    main(["--rev", "HEAD", "--method", "baseline", "--rounds", "2", "--prompts", "2", "--max-tokens", "2",
          "--sampled-first", "0.8"])
    assert temperatures[-4:] == [0.8, 0.0, 0.8, 0.0]  # this checkout's last round: 2 prompts, each sampled then greedy
    out = capsys.readouterr().out
    assert re.search(r"2 alternating rounds of 2 x 2 sampled tokens at temperature 0.8 \(short prompts\): HEAD [\d.]+ s, "
                     r"this checkout [\d.]+ s; speedup median [\d.]+x \(range [^)]*\)\n", out)
    assert re.search(r"2 alternating rounds of 2 x 2 greedy tokens \(short prompts\), each turn after its prompts sampled "
                     r"at temperature 0.8: .*identical outputs", out)

def test_engine_ab_takes_the_prompts_of_a_band(capsys):
    main(["--rev", "HEAD", "--method", "baseline", "--rounds", "1", "--prompts", "2", "--max-tokens", "2", "--band", "long"])
    assert re.search(r"1 alternating rounds of 2 x 2 greedy tokens \(long prompts\): .*identical outputs", capsys.readouterr().out)


def test_engine_ab_against_eager_layers(capsys):
    """`--eager`: the A side is this checkout with its decoder layers eager, the B side native."""
    import pytest

    from specdec.core.config import EngineConfig
    from specdec.core.engine_config import build_engine
    from specdec.core.models import native
    from specdec.paths import DEMO_KIT
    from specdec.tools.bench import kit_paths
    from specdec.tools.forward_ab import eager_layers

    config = EngineConfig.of(method="draft", max_batch=2, policy="fixed", **kit_paths(DEMO_KIT))
    with eager_layers():
        eager = build_engine(config)
    assert eager.target.native is None and eager.proposer.chain is None
    assert native.library() is not None and build_engine(config).target.native is not None
    main(["--eager", "--method", "draft", "--batch", "2", "--rounds", "1", "--max-tokens", "16"])
    assert re.search(r"draft, batch 2, fixed policy, .*: eager [\d.]+ s, this checkout [\d.]+ s; speedup median "
                     r"[\d.]+x .*identical outputs", capsys.readouterr().out)
    with pytest.raises(SystemExit):
        main(["--eager", "--rev", "HEAD", "--method", "draft"])


def test_contended_start_reports_each_engines_drafted_steps_and_fit(capsys):
    """`python -m specdec.tools.contended_start`: engines of one served model started at once,
    each serving requests one at a time, report their drafted steps and proposal-cost fit (one-row
    fixed and per-level cost, the rows' share, the catch-up per entry)."""
    from specdec.tools.contended_start import main as contended

    assert contended(["--model", "spec_ngram", "--engines", "2", "--requests", "2", "--max-tokens", "8"]) == 0
    rows = re.findall(r"^\| (\d) \| (\d+) / (\d+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$",
                      capsys.readouterr().out, re.M)
    assert [r[0] for r in rows] == ["0", "1"]
    # 2 requests of 8 tokens: the first of each comes from its prefill, the other 7 from 1-7 decode steps
    assert all(0 <= int(drafts) <= int(steps) and 2 <= int(steps) <= 14 for _, drafts, steps, *_ in rows)
