"""`python -m specdec.tools.acceptance_fit`: the policy's acceptance estimates replayed against
recorded rounds."""

from __future__ import annotations

import re

import pytest

from specdec.core.policy import DECAY
from specdec.core.sampling import SamplingParams
from specdec.core.sequence import Sequence
from specdec.tools.acceptance_fit import main, replay


def sequence(slot: int) -> Sequence:
    return Sequence(f"r{slot}", [1, 2], SamplingParams(max_tokens=256), lambda o: None, slot=slot)


def test_a_shorter_memory_follows_a_sequence_whose_acceptance_changes():
    """One sequence rejects every draft for 40 rounds, then accepts all 4 tokens for 40: the
    replay predicts each round from the estimates before it, so the shorter memory errs less and
    the longer one lags (predicts too few accepted tokens once they come)."""
    s = sequence(0)
    steps = [[(s, 0, 4, 0)] for _ in range(40)] + [[(s, 0, 4, 4)] for _ in range(40)]
    long, short = replay(steps, 4, 0.95), replay(steps, 4, 0.6)
    assert long.rounds == short.rounds == 80
    assert long.accepted == short.accepted == 2.0
    assert short.rmse < long.rmse
    assert abs(short.bias) < abs(long.bias)


def test_rounds_that_did_not_draft_are_not_predicted():
    a, b = sequence(0), sequence(1)
    steps = [[(a, 0, 4, 4)] for _ in range(30)] + [[(a, 0, 0, 0), (b, 1, 4, 4)]]
    assert replay(steps, 4, DECAY).rounds == 31


@pytest.mark.parametrize("argv, message", [
    (["--decays", "0.7,1.5"], r"--decays must lie in \(0, 1\], got '0.7,1.5'"),
    (["--decays", "abc"], r"--decays must be numbers separated by commas, got 'abc'"),
    (["--batch", "0"], r"--batch must be at least 1, got 0"),
    (["--max-tokens", "0"], r"--max-tokens must be at least 1, got 0"),
    (["--method", "nope", "--prompts", "1"], r"acceptance_fit: unknown method 'nope'"),
])
def test_bad_arguments_are_refused_by_name(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_the_command_records_a_fixed_k_run_and_prints_a_row_per_decay(capsys):
    main(["--method", "ngram", "--batch", "2", "--prompts", "2", "--max-tokens", "16", "--decays", f"0.9,{DECAY}"])
    out = capsys.readouterr().out
    rows = re.findall(r"^\| ([\d.]+)( \(the policy's\))? \| (\d+) \| ([\d.]+) \| ([\d.]+) \(([+-][\d.]+)%\) \| ([\d.]+) \|", out, re.M)
    assert [r[0] for r in rows] == ["0.9", f"{DECAY:g}"]
    assert [bool(r[1]) for r in rows] == [False, True]
    assert all(int(r[2]) > 0 for r in rows)  # prompt lookup drafted on these prompts
    assert rows[0][3] == rows[1][3]  # the same recorded rounds, whatever the decay
