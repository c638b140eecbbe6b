"""`python -m specdec.tools.forward_ab`: the interleaved forward A/B against an earlier commit."""

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
    main(["--rev", "HEAD", "--method", "ngram", "--batch", "8", "--rounds", "1", "--policy", "adaptive"])
    out = capsys.readouterr().out
    assert re.search(r"ngram, batch 8, adaptive policy, 1 thread\(s\), 1 alternating rounds .*: HEAD [\d.]+ s, this checkout [\d.]+ s; "
                     r"speedup median [\d.]+x .*identical outputs", out)
