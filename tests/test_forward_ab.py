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
