"""Unit tests for the load-test figures, the intervals and the guardrail verdicts, on synthetic inputs."""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

import pytest

from specdec.paths import GUARDRAILS
from specdec.tools.loadtest import report, stats
from specdec.tools.loadtest.guardrails import (Guardrails, Rule, aa_check, decide, load_guardrails, parse_guardrails,
                                               verdicts)
from specdec.tools.loadtest.intervals import (Interval, mean_interval, paired_ratio, round_ratios, rounds_to_clear,
                                              t_quantile)
from specdec.tools.loadtest.matrix import (LevelRun, MatrixConfig, add_intervals, life_rounds, measured, summed_counters,
                                           trial_plan)
from specdec.tools.loadtest.workload import Workload, workloads


def sample(start, chunks, error=None, drafted=0, accepted=0):
    tokens = sum(n for _, n in chunks)
    first = next((t for t, n in chunks if n), None)
    return {"start": start, "chunks": [list(c) for c in chunks], "tokens": tokens, "ttft": first,
            "e2e": chunks[-1][0] if chunks else 0.5, "error": error, "draft_tokens": drafted,
            "accepted_tokens": accepted}


# ---- stats -------------------------------------------------------------------------------------------------
def test_percentile_interpolates_like_numpy():
    np = pytest.importorskip("numpy")
    xs = [5.0, 1.0, 3.0, 2.0, 10.0, 7.0]
    for q in (0, 25, 50, 95, 100):
        assert stats.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert stats.percentile([], 50) is None


def test_tokens_in_one_response_arrive_together():
    s = sample(0.0, [(0.1, 1), (0.2, 3), (0.5, 1), (0.5, 0)])
    assert stats.token_gaps(s) == pytest.approx([0.1, 0.0, 0.0, 0.3])
    assert stats.tpot(s) == pytest.approx((0.5 - 0.1) / 4)
    assert stats.token_gaps(sample(0.0, [(0.1, 2)])) == [0.0]


def test_figures_count_the_window_only():
    samples = [
        sample(100.0, [(0.5, 1), (1.0, 1)]),                 # warm-up request (starts before the window)
        sample(101.0, [(0.1, 1), (0.2, 2), (0.3, 1)], drafted=4, accepted=2),
        sample(102.0, [(0.1, 1), (0.4, 1)]),
        sample(103.0, [(0.1, 0)], error="boom"),
        sample(105.5, [(0.1, 1), (1.0, 1)]),                 # ends after the window
    ]
    f = stats.figures(samples, [(101.0, 106.0)])
    assert f["requests"] == 4 and f["errors"] == 1 and f["error_rate"] == 0.25
    assert f["output_tokens"] == 4 + 2 + 2                    # requests sent in the window, no errors
    assert f["output_tokens_in_window"] == 1 + 4 + 2 + 1      # token arrivals in [101, 106)
    assert f["output_tokens_per_s"] == pytest.approx(8 / 5)
    assert f["completed_requests_in_window"] == 3             # 100+1.0, 101+0.3, 102+0.4 (105.5+1.0 is outside)
    assert f["completed_rps"] == pytest.approx(3 / 5)
    assert f["ttft_p50"] == pytest.approx(0.1)
    assert f["acceptance_rate"] == 0.5
    assert f["tokens_per_response"] == pytest.approx((3 + 1 + 1) / (2 + 1 + 1))


def test_figures_pool_several_windows():
    samples = [sample(100.0, [(0.5, 2)]), sample(103.0, [(0.5, 2)]), sample(110.0, [(0.5, 3)])]
    f = stats.figures(samples, [(100.0, 101.0), (110.0, 112.0)])
    assert f["requests"] == 2 and f["output_tokens_in_window"] == 5 and f["window_s"] == 3.0
    assert f["output_tokens_per_s"] == pytest.approx(5 / 3)


# ---- intervals ------------------------------------------------------------------------------------------------
def test_t_quantiles_match_the_tables():
    for p, df, table in [(0.95, 1, 6.3138), (0.95, 2, 2.9200), (0.975, 4, 2.7764), (0.95, 30, 1.6973),
                         (0.995, 3, 5.8409)]:
        assert t_quantile(p, df) == pytest.approx(table, abs=1e-4)
    assert t_quantile(0.05, 2) == pytest.approx(-2.9200, abs=1e-4)


def test_paired_ratio_interval():
    iv = paired_ratio([1.1, 1.2, 1.05, 1.15, None], [1.0, 1.0, 1.0, 1.0, 1.0])
    logs = [math.log(x) for x in (1.1, 1.2, 1.05, 1.15)]
    mean = sum(logs) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    assert iv.n == 4 and iv.value == pytest.approx(math.exp(mean))
    assert iv.lo == pytest.approx(math.exp(mean - t_quantile(0.95, 3) * sd / 2))
    assert iv.hi == pytest.approx(math.exp(mean + t_quantile(0.95, 3) * sd / 2))
    assert iv.above(1.0) and not iv.above(1.1)
    one = paired_ratio([2.0], [1.0])  # one round says nothing about its spread
    assert one.value == 2.0 and (one.lo, one.hi) == (0.0, math.inf) and not one.above(1.0)
    assert paired_ratio([0.0, 0.0], [1.0, 2.0]).hi == 0.0  # e.g. ITL p50 when tokens come several at a time
    assert paired_ratio([None], [1.0]) is None
    m = mean_interval([0.0, 0.0, 0.0])
    assert (m.lo, m.hi, m.kind) == (0.0, 0.0, "mean")


def test_rounds_to_clear_is_where_the_interval_would_clear():
    iv = paired_ratio([0.90, 0.97, 0.85, 0.93], [1.0] * 4)
    assert iv.lo < 0.95 < iv.hi
    n = rounds_to_clear(iv, 0.95)
    p = 1 - (1 - iv.confidence) / 2
    gap = math.log(0.95) - math.log(iv.value)
    assert t_quantile(p, n - 1) * iv.sd / math.sqrt(n) < gap <= t_quantile(p, n - 2) * iv.sd / math.sqrt(n - 1)
    assert rounds_to_clear(paired_ratio([0.95, 0.95 * 1.01, 0.95 / 1.01], [1.0] * 3), 0.95) is None  # on the line


# ---- synthetic trials -> intervals -> verdicts ----------------------------------------------------------------
def simulate(rng: random.Random, rounds: int, gain: float, noise: float = 0.10, machine: float = 0.3) -> list[dict]:
    """Cells of one load level with `rounds` interleaved trials of baseline and spec: each round has
    its own machine speed (shared by both models: a slow period) and each trial its own noise."""
    cells = {m: {"workload": "w", "concurrency": 1, "model": m, "figures": {"requests": 10}, "trials": []}
             for m in ("baseline", "spec")}
    for r in range(rounds):
        speed = math.exp(rng.gauss(0, machine))
        for m, factor in (("baseline", 1.0), ("spec", gain)):
            tpot = 0.010 * speed * math.exp(rng.gauss(0, noise)) / factor
            cells[m]["trials"].append({"round": r, "figures": {
                "tpot_p50": tpot, "output_tokens_per_s": 8 / tpot, "error_rate": 0.0, "acceptance_rate": 0.7,
                "ttft_p95": 0.05 * speed * math.exp(rng.gauss(0, noise)),  # no gain there, independent noise
                "itl_p95": 0.02 * speed * math.exp(rng.gauss(0, noise))}})
    cells = list(cells.values())
    add_intervals(cells, "baseline")
    return cells


SHIPPED_LIKE = Guardrails(improve=Rule("tpot_p50", ratio_max=0.95), rollback=[
    Rule("output_tokens_per_s", ratio_min=0.95), Rule("error_rate", max=0.01), Rule("acceptance_rate", min=0.2)])


def test_a_true_gain_is_kept_with_enough_rounds_and_inconclusive_with_five():
    """A true 10% gain (TPOT 0.91x, threshold 0.95x) with 10% noise per trial and large slow periods."""
    [v] = verdicts(simulate(random.Random(1), 250, 1.10), SHIPPED_LIKE)
    assert v["verdict"] == "keep", v
    [v] = verdicts(simulate(random.Random(1), 5, 1.10), SHIPPED_LIKE)
    assert v["verdict"] == "inconclusive", v
    assert "rounds in all would likely decide it (5 ran)" in v["reason"]
    needed = v["levels"][0]["rounds"]
    assert 5 < needed < 200
    kept = sum(verdicts(simulate(random.Random(s), 5, 1.10), SHIPPED_LIKE)[0]["verdict"] == "keep" for s in range(200))
    assert kept < 200 * 0.25  # five rounds rarely suffice at this noise
    kept = sum(verdicts(simulate(random.Random(s), 250, 1.10), SHIPPED_LIKE)[0]["verdict"] == "keep" for s in range(100))
    assert kept > 90


def test_identical_distributions_keep_or_roll_back_at_the_stated_error_rate():
    """Thresholds at the truth (1.0x): any keep or roll back of identical models is an error, and each
    side may happen at most (1 - confidence) / 2 = 5% of the time (seeded, 2000 runs of 5 rounds)."""
    g = Guardrails(improve=Rule("tpot_p50", ratio_max=1.0))
    runs = 2000
    results = [verdicts(simulate(random.Random(s), 5, 1.0), g)[0]["verdict"] for s in range(runs)]
    for verdict in ("keep", "roll back"):
        rate = results.count(verdict) / runs
        assert rate <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / runs), (verdict, rate)  # 3 sigma over the stated rate
    assert results.count("inconclusive") / runs >= 0.88
    # three bounds at the truth, any of which fails the level: the family-wise intervals keep "roll
    # back" at the stated rate (per-bound 90% intervals would roll back ~14% of the time)
    g3 = Guardrails(improve=Rule("tpot_p50", ratio_max=1.0), rollback=[Rule("ttft_p95", ratio_max=1.0),
                                                                       Rule("itl_p95", ratio_max=1.0)])
    same = [verdicts(simulate(random.Random(s), 5, 1.0), g3)[0]["verdict"] for s in range(1000)]
    assert same.count("roll back") / 1000 <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 1000), same.count("roll back")
    # with the shipped-like thresholds (5% margins) identical models pass as a gain far more rarely
    kept = sum(verdicts(simulate(random.Random(s), 5, 1.0), SHIPPED_LIKE)[0]["verdict"] == "keep" for s in range(300))
    assert kept <= 3


def test_pairing_by_round_cancels_slow_periods():
    """Huge slow periods (machine noise 0.5) with little trial noise: paired ratios still decide."""
    [v] = verdicts(simulate(random.Random(3), 5, 1.3, noise=0.02, machine=0.5), SHIPPED_LIKE)
    assert v["verdict"] == "keep", v


def test_aa_check_on_identical_and_different_copies():
    def cells(gain, seed):
        cs = simulate(random.Random(seed), 5, gain, noise=0.03)
        for c in cs:
            c["model"] = "baseline_aa" if c["model"] == "spec" else c["model"]
        add_intervals(cs, "baseline")
        return cs
    assert sum(not aa_check(cells(1.0, s), "baseline_aa")["passed"] for s in range(200)) <= 2
    bad = aa_check(cells(1.25, 0), "baseline_aa")
    assert not bad["passed"] and bad["levels"][0]["result"] == "difference"
    assert any(d.startswith("tpot_p50") for d in bad["levels"][0]["differences"])


def test_trial_plan_balances_positions_and_neighbours():
    """Over a whole design every model takes every position, and follows every other model, the
    same number of times (a rotation, "abc" "bca" "cab", put b after a in every round but one)."""
    for models, rounds in ((list("abc"), 6), (list("abcdef"), 12), (list("ab"), 4)):
        plan = trial_plan(models, range(rounds))
        orders = [[t["model"] for t in plan[i : i + len(models)]] for i in range(0, len(plan), len(models))]
        assert [t["round"] for t in plan] == [r for r in range(rounds) for _ in models]
        assert all(sorted(o) == models for o in orders)
        positions = Counter((m, o.index(m)) for o in orders for m in o)
        after = Counter(pair for o in orders for pair in zip(o, o[1:]))
        assert set(positions.values()) == {rounds // len(models)}, positions
        assert len(after) == len(models) * (len(models) - 1) and len(set(after.values())) == 1, after
    assert [t["model"] for t in trial_plan(list("abc"), range(3))] == list("abc" "bca" "cab")


def test_warm_up_rounds_open_the_plan_and_do_not_count():
    """Every model meets a load level once before any trial counts: the warm-up rounds come first,
    in the design's order like the rest, and `measured` drops them."""
    plan = trial_plan(["a", "b", "c"], range(2), warmup_rounds=1)
    assert [t["model"] for t in plan] == list("bac" "abc" "bca")
    assert [t["round"] for t in plan] == [-1] * 3 + [0] * 3 + [1] * 3
    assert measured(plan) == trial_plan(["a", "b", "c"], range(2))
    with pytest.raises(ValueError, match="warm-up rounds"):
        MatrixConfig(models=["baseline"], warmup_rounds=-1)


def test_server_lives_share_the_rounds_and_keep_the_design():
    """Each server life runs its own warm-up and a consecutive share of the rounds, each round in
    the order the whole design gives it: the lives' measured trials are the one-life plan's."""
    assert life_rounds(7, 3) == [range(0, 2), range(2, 4), range(4, 7)]
    assert life_rounds(4, 1) == [range(4)]
    models = ["a", "b", "c"]
    lives = [trial_plan(models, r, warmup_rounds=1) for r in life_rounds(6, 2)]
    assert all([t["round"] for t in life[:3]] == [-1] * 3 for life in lives)
    assert measured(lives[0]) + measured(lives[1]) == trial_plan(models, range(6))
    for bad in (0, 7):
        with pytest.raises(ValueError, match=f"--servers {bad}"):
            MatrixConfig(models=["baseline"], rounds=6, servers=bad)


def test_intervals_over_server_lives():
    """Rounds of one server life share its instances' luck: over several lives the interval is
    Student's t over the lives' mean log ratios (n = lives), not over the rounds, so an instance
    difference that every round of a life carries widens it instead of passing for a result."""
    # two lives: every round of the first reads 1.10x, of the second 0.95x (tight within each)
    ratios = [1.10, 1.11, 1.09, 1.10, 0.95, 0.96, 0.94, 0.95]
    base = [100.0] * 8
    values = [100 * r for r in ratios]
    rounds_only = paired_ratio(values, base)
    by_lives = paired_ratio(values, base, lives=[0] * 4 + [1] * 4)
    assert rounds_only.unit == "round" and rounds_only.n == 8 and by_lives.unit == "life" and by_lives.n == 2
    assert rounds_only.lo > 0.96 and rounds_only.hi < 1.08  # eight rounds look sure of a small gain
    assert by_lives.lo < 0.8 and by_lives.hi > 1.3  # two lives that disagree say little
    assert math.isclose(by_lives.value, math.sqrt(1.10 * 0.95), rel_tol=1e-3)
    # one life is the rounds' interval as before; means group the same way
    assert paired_ratio(values, base, lives=[3] * 8) == rounds_only
    m = mean_interval([0.1, 0.1, 0.3, 0.3], lives=[0, 0, 1, 1])
    assert m.unit == "life" and m.n == 2 and math.isclose(m.value, 0.2) and math.isclose(m.sd, math.sqrt(0.02))
    # the rounds' lives come from the trials (one-life trials record none); needed lives are counted
    trials = [{"round": r, "life": r // 4, "figures": {"x": v}} for r, v in enumerate(values)]
    ratios_by_round = round_ratios(trials, [{"round": r, "figures": {"x": 100.0}} for r in range(8)], ["x"])
    assert Interval(**ratios_by_round["x"]) == by_lives
    assert rounds_to_clear(Interval(**ratios_by_round["x"]).at(0.9), 0.9) > 2


def test_lives_that_agree_take_the_rounds_spread_within_them():
    """Two lives whose means agree at least as well as their rounds' noise predicts show no
    difference of their own: the interval then takes the rounds' spread within their lives, with
    its degrees of freedom (over two lives' means alone it would have one, t = 6.3 at 90%)."""
    rng = random.Random(3)
    logs = [rng.gauss(0, 0.1) for _ in range(16)]
    logs = [x - sum(logs[:8]) / 8 for x in logs[:8]] + [x - sum(logs[8:]) / 8 for x in logs[8:]]  # equal means
    values = [100 * math.exp(x) for x in logs]
    over_lives = paired_ratio(values, [100.0] * 16, lives=[0] * 8 + [1] * 8)
    rounds_only = paired_ratio(values, [100.0] * 16)
    assert over_lives.unit == "life" and over_lives.n == 2 and over_lives.df == 14
    assert over_lives.at(0.95).hi < 1.12 and math.isclose(math.log(over_lives.hi), math.log(rounds_only.hi), rel_tol=0.1)
    assert Interval(**over_lives.to_dict()).at(0.9) == over_lives  # the degrees of freedom travel with it


@pytest.mark.parametrize("instance_sd", [0.0, 0.1])
def test_intervals_over_lives_keep_their_coverage(instance_sd):
    """Seeded: rounds' log ratios with sd 0.1 and each of 3 lives offset by N(0, instance_sd);
    the 90% interval over the lives covers the true ratio (1) about 90% of the time or more,
    whether or not the lives carry differences of their own (simulated: 94% and 91%)."""
    rng = random.Random(11)
    covered, runs = 0, 600
    for _ in range(runs):
        lives, values = [], []
        for life in range(3):
            offset = rng.gauss(0, instance_sd)
            for _ in range(6):
                lives.append(life)
                values.append(math.exp(offset + rng.gauss(0, 0.1)))
        iv = paired_ratio(values, [1.0] * len(values), lives=lives)
        covered += iv.lo <= 1.0 <= iv.hi
    assert covered / runs >= 0.87, covered / runs


def test_summed_counters_add_each_server_lifes_deltas():
    """Each fresh server's counters start at zero: a cell's server figures over several lives are
    the sum of every life's (after - before), the check of the users' tokens against the server's included."""
    key, other = ("specdec:generation_tokens", (("model", "m"),)), ("x", ())
    runs = [LevelRun([], [], {key: 5.0}, {key: 105.0, other: 1.0}, 0, [], [], 1.0, Path("a"), Path("b")),
            LevelRun([], [], {key: 0.0}, {key: 40.0}, 0, [], [], 1.0, Path("a"), Path("b"))]
    before, after = summed_counters(runs)
    assert stats.metric_delta(before, after, "specdec:generation_tokens", model="m") == 140.0
    assert stats.metric_delta(before, after, "x") == 1.0
    assert summed_counters(runs[:1]) == (runs[0].before, runs[0].after)
    runs[1].after = {}  # a life whose metrics endpoint stopped answering: no server figures at all
    assert summed_counters(runs) == ({}, {})


PROM = """# HELP x
specdec:spec_decode_num_drafts{model="spec"} 10
specdec:spec_decode_num_accepted_tokens{model="spec"} 15
specdec:spec_decode_num_accepted_tokens_per_pos{model="spec",position="0"} 8
specdec:spec_decode_num_accepted_tokens_per_pos{model="spec",position="1"} 5
specdec:spec_decode_num_accepted_tokens_per_pos{model="spec",position="2"} 2
specdec:generation_tokens{model="spec"} 100
specdec:request_queue_time_seconds_count{model="spec"} 4
specdec:request_queue_time_seconds_sum{model="spec"} 0.2
specdec:request_queue_time_seconds_bucket{model="spec",le="0.01"} 1
specdec:request_queue_time_seconds_bucket{model="spec",le="0.1"} 3
specdec:request_queue_time_seconds_bucket{model="spec",le="+Inf"} 4
specdec:generation_tokens{model="other"} 7
specdec:engine_seconds{model="spec",phase="prefill"} 1.0
specdec:engine_seconds{model="spec",phase="draft"} 1.0
specdec:engine_seconds{model="spec",phase="forward"} 2.0
specdec:engine_seconds{model="other",phase="prefill"} 9.0
specdec:batch_size_sum{model="spec"} 30
specdec:batch_size_count{model="spec"} 10
"""


def test_server_figures_are_deltas_between_scrapes():
    after = stats.parse_metrics(PROM)
    before = {key: 0.0 for key in after}
    before[("specdec:generation_tokens", (("model", "spec"),))] = 40.0
    f = stats.server_figures(before, after, "spec")
    assert f["server_output_tokens"] == 60
    assert f["acceptance_per_position"] == pytest.approx([0.8, 0.5, 0.2])
    assert f["mean_accepted_length"] == pytest.approx(2.5)
    assert f["queue_wait_mean"] == pytest.approx(0.05)
    assert 0.1 <= f["queue_wait_p95"] <= 0.1 + 1e-9  # the p95 observation lies in the +Inf bucket
    assert stats.histogram_quantile({}, after, "specdec:request_queue_time_seconds", 0.5, model="spec") == \
        pytest.approx(0.01 + 0.09 * (2 - 1) / 2)


def test_engine_figures_split_the_engine_time_of_one_model():
    after = stats.parse_metrics(PROM)
    before = {key: 0.0 for key in after}
    before[("specdec:generation_tokens", (("model", "spec"),))] = 40.0
    before[("specdec:engine_seconds", (("model", "spec"), ("phase", "forward")))] = 0.5
    f = stats.server_figures(before, after, "spec")
    assert f["engine_seconds"] == {"draft": 1.0, "forward": 1.5, "prefill": 1.0}  # deltas; not "other"'s 9 s
    assert f["prefill_share"] == pytest.approx(1.0 / 3.5)
    assert f["engine_ms_per_token"] == pytest.approx(3500 / 60)
    assert f["decode_ms_per_token"] == pytest.approx(2500 / (60 - 4))  # 4 requests: their first tokens are prefill's
    assert f["mean_batch"] == 3.0 and stats.server_figures(after, after, "spec")["mean_batch"] is None
    assert "engine_seconds" not in stats.server_figures(after, after, "spec")  # no engine time: no figures


def test_engine_time_rows_compare_with_the_baseline_at_the_same_level():
    def cell(model, conc, engine_ms, decode_ms, served=None):
        return {"workload": "w", "model": model, "concurrency": conc,
                "ratios": {"output_tokens_per_s": {"value": served, "lo": served, "hi": served} if served else None},
                "figures": {"engine_seconds": {"prefill": 1.0, "draft": 1.0, "forward": 2.0}, "mean_batch": 2.5,
                            "engine_ms_per_token": engine_ms, "decode_ms_per_token": decode_ms}}
    cells = [cell("base", 1, 2.0, 1.0), cell("spec", 1, 1.6, 0.5, 1.1), cell("base", 4, 1.0, 0.6),
             cell("spec", 4, 1.25, 0.4, 0.9), {"workload": "w", "model": "trt", "concurrency": 1, "figures": {}}]
    rows = {(r["model"], r["concurrency"]): r for r in report.engine_time(cells, "base")}
    assert set(rows) == {("base", 1), ("spec", 1), ("base", 4), ("spec", 4)}  # no engine time, no row
    assert rows[("spec", 1)]["decode_speedup"] == pytest.approx(2.0)
    assert rows[("spec", 1)]["engine_speedup"] == pytest.approx(1.25)
    assert rows[("spec", 4)]["engine_speedup"] == pytest.approx(0.8) and rows[("spec", 4)]["served_speedup"] == 0.9
    assert rows[("base", 4)]["engine_speedup"] == 1.0
    assert rows[("spec", 1)]["shares"] == {"prefill": 0.25, "draft": 0.25, "forward": 0.5}
    md = "\n".join(report.engine_time_lines(list(rows.values())))
    assert "| spec | 4 | 25 | 25 | 50 | 0 | 0 | 2.50 | 1.25 | 0.40 | 1.50x | 0.80x | 0.90x |" in md


# ---- guardrails ----------------------------------------------------------------------------------------------
G = Guardrails(baseline="baseline", improve=Rule("tpot_p50", ratio_max=0.95), rollback=[
    Rule("itl_p95", ratio_max=2.0), Rule("output_tokens_per_s", ratio_min=0.95),
    Rule("completed_rps", ratio_min=0.95, at="peak"), Rule("error_rate", max=0.01), Rule("acceptance_rate", min=0.2)])


def cells_for(rows, spread=0.002):
    """rows: (concurrency, tpot ratio, tokens/s ratio, error rate, acceptance): three rounds each,
    the ratios varying by `spread` around the given value."""
    cells = []
    for c, tpot, tps, err, acc in rows:
        base = {"workload": "w", "model": "baseline", "concurrency": c, "figures": {"requests": 10}, "trials": []}
        spec = {"workload": "w", "model": "spec", "concurrency": c, "figures": {"requests": 10}, "trials": []}
        for r, wobble in enumerate((1 - spread, 1.0, 1 + spread)):
            base["trials"].append({"round": r, "figures": {"tpot_p50": 0.01, "output_tokens_per_s": 100.0,
                                                           "completed_rps": 2.0, "itl_p95": 0.02, "error_rate": 0.0}})
            spec["trials"].append({"round": r, "figures": {
                "tpot_p50": 0.01 * tpot * wobble, "output_tokens_per_s": 100.0 * tps * wobble,
                "completed_rps": 2.0 * tps * wobble, "itl_p95": 0.024, "error_rate": err, "acceptance_rate": acc}})
        cells += [base, spec]
    add_intervals(cells, "baseline")
    return cells


def test_verdict_keep():
    [v] = verdicts(cells_for([(1, 0.5, 1.5, 0.0, 0.7), (4, 0.7, 1.2, 0.0, 0.7), (16, 0.9, 1.0, 0.0, 0.7)]), G)
    assert v["verdict"] == "keep" and all(lv["status"] == "pass" for lv in v["levels"])


def test_verdict_keep_below_n_names_the_reason():
    [v] = verdicts(cells_for([(1, 0.5, 1.5, 0.0, 0.7), (4, 0.8, 1.1, 0.0, 0.7), (16, 1.05, 0.85, 0.0, 0.7)]), G)
    assert v["verdict"] == "keep below concurrency 16" and v["keep_below"] == 16
    assert "output_tokens_per_s 0.85x baseline [" in v["reason"] and "< 0.95x" in v["reason"]
    assert "completed_rps" in v["reason"]  # a peak-only rule, and 16 is the peak
    assert "gain: tpot_p50" in v["reason"]


def test_verdict_roll_back_on_errors_or_collapsed_acceptance():
    [v] = verdicts(cells_for([(1, 0.5, 1.5, 0.05, 0.7), (4, 0.5, 1.5, 0.0, 0.7)]), G)
    assert v["verdict"] == "roll back" and "error_rate 0.05 > 0.01" in v["reason"]
    [v] = verdicts(cells_for([(1, 0.9, 1.1, 0.0, 0.1), (4, 0.9, 1.0, 0.0, 0.1)]), G)
    assert v["verdict"] == "roll back" and "acceptance_rate 0.1 < 0.2" in v["reason"]


def test_a_threshold_inside_the_interval_is_inconclusive_not_a_failure():
    # tokens/s 0.93x, but spread so wide that 0.95x lies inside the interval: no roll back
    [v] = verdicts(cells_for([(1, 0.7, 0.93, 0.0, 0.7)], spread=0.1), G)
    assert v["verdict"] == "inconclusive" and v["levels"][0]["status"] == "inconclusive"
    assert "output_tokens_per_s 0.9" in v["reason"] and "rounds in all would likely decide it" in v["reason"]
    # passes at 1, undecided at 4: not "keep below 4", which would claim a failure at 4
    cells = cells_for([(1, 0.5, 1.5, 0.0, 0.7)]) + cells_for([(4, 0.7, 0.93, 0.0, 0.7)], spread=0.1)
    [v] = verdicts(cells, G)
    assert v["verdict"] == "inconclusive" and v["reason"].startswith("passes below concurrency 4")


def test_peak_rule_only_at_the_highest_level():
    cells = cells_for([(1, 0.5, 1.5, 0.0, 0.7), (4, 0.5, 1.5, 0.0, 0.7)])
    cells[1]["ratios"]["completed_rps"] = {**cells[1]["ratios"]["completed_rps"], "value": 0.5, "lo": 0.45, "hi": 0.55}
    [v] = verdicts(cells, G)  # low completed req/s at concurrency 1 only: not the peak
    assert v["verdict"] == "keep"


def test_a_failure_is_not_forgiven_by_a_later_pass():
    levels = [{"concurrency": c, "status": s, "reasons": r, "rounds": None, "rounds_run": 3}
              for c, s, r in [(1, "pass", []), (4, "fail", ["x"]), (16, "pass", [])]]
    d = decide(levels)
    assert d["verdict"] == "keep below concurrency 4" and "passes again at 16" in d["reason"]


def test_guardrail_files(tmp_path):
    g = load_guardrails(GUARDRAILS)  # the shipped, documented defaults
    assert g.baseline == "baseline" and g.improve.figure == "tpot_p50"
    assert {r.figure for r in g.rollback} >= {"itl_p95", "output_tokens_per_s", "completed_rps", "error_rate",
                                              "acceptance_rate"}
    toml = tmp_path / "g.toml"
    toml.write_text('baseline = "base"\n[[rollback]]\nfigure = "error_rate"\nmax = 0.1\n')
    t = load_guardrails(toml)
    assert t.baseline == "base" and t.rollback[0].max == 0.1 and t.improve is None
    for bad, message in [({"rollback": [{"max": 1}]}, "figure"), ({"rollback": [{"figure": "x"}]}, "at least one"),
                         ({"rollback": [{"figure": "x", "max": 1, "at": "sometimes"}]}, "'at'"),
                         ({"rules": []}, "unknown keys")]:
        with pytest.raises(ValueError, match=message):
            parse_guardrails(bad)


def test_workload_grid():
    grid = workloads(["short", "long"], ["short", "long"], ["greedy", "t0.7", "t1.0"])
    assert len(grid) == 12 and len({w.name for w in grid}) == 12
    w = Workload("long", "long", "t0.7")
    assert (w.tokens, w.temperature) == (128, 0.7)
    with pytest.raises(ValueError):
        Workload(sampling="hot")
    assert workloads(["short", "long"], ["short"], ["greedy"], prompts_file="mine.jsonl")[0].name.startswith("mine/")
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="spread"):
            Workload(max_tokens_spread=bad)


def test_each_request_asks_its_own_length_drawn_from_its_index():
    """Closed-loop users asking one length run in lockstep (`OUTPUT_SPREAD`): each request asks
    max_tokens x uniform(1 - spread, 1 + spread), the same for request i whichever model serves it."""
    from specdec.tools.loadtest.workload import OUTPUT_SPREAD, request_tokens

    lengths = [request_tokens(64, OUTPUT_SPREAD, i) for i in range(2000)]
    assert lengths == [request_tokens(64, OUTPUT_SPREAD, i) for i in range(2000)]
    assert min(lengths) == 48 and max(lengths) == 80 and len(set(lengths)) == 33
    assert abs(sum(lengths) / len(lengths) - 64) < 1.0  # 64.5 for these 2000
    assert [request_tokens(64, 0.0, i) for i in range(5)] == [64] * 5
    assert min(request_tokens(1, 0.9, i) for i in range(100)) == 1  # never fewer than one token


# ---- matrix plumbing ---------------------------------------------------------------------------------------
def test_locust_command_holds_the_workload_fixed(tmp_path):
    from specdec.tools.loadtest.matrix import MatrixConfig, locust_command

    cfg = MatrixConfig(models=["baseline"], duration_s=10, warmup_s=2, grpc_url="h:1", http_url="h:2")
    w = Workload("short", "long", "t0.7")
    cmd = locust_command(cfg, 4, w, tmp_path / "p.jsonl", tmp_path / "plan.json", tmp_path / "s.jsonl", 100.0)
    args = dict(zip(cmd, cmd[1:]))
    assert "GrpcStreamUser" in cmd and "--headless" in cmd and "--model" not in cmd
    assert (args["-u"], args["-r"], args["--trial-plan"]) == ("4", "4", str(tmp_path / "plan.json"))
    assert int(args["--run-time"].rstrip("s")) >= 200  # a cap: the plan ends the run
    assert (args["--max-tokens"], args["--temperature"], args["--host"], args["--grpc-url"]) == ("128", "0.7", "http://h:2", "h:1")
    assert float(args["--max-tokens-spread"]) == w.max_tokens_spread > 0
    with pytest.raises(ValueError, match="rounds"):
        MatrixConfig(models=["baseline"], rounds=0)


def test_canary_model_config(tmp_path):
    from specdec.tools.loadtest.canary import routes_to_candidate, write_canary_model

    folder = write_canary_model(tmp_path, "baseline", "spec_medusa", 0.3)
    text = (folder / "config.pbtxt").read_text()
    assert 'backend: "python"' in text and "decoupled: true" in text
    assert 'name: "served_model"' in text and 'name: "text_input"' in text
    assert 'key: "candidate" value: { string_value: "spec_medusa" }' in text
    assert 'key: "grpc_url" value: { string_value: "localhost:8001" }' in text  # Triton's default address
    assert "specdec.tools.loadtest.canary" in (folder / "1" / "model.py").read_text()
    assert sum(routes_to_candidate(n, 0.3) for n in range(1000)) == 300
    with pytest.raises(ValueError):
        write_canary_model(tmp_path, share=1.5)


# ---- noise ---------------------------------------------------------------------------------------------------
def test_noise_counts_our_processes_apart_from_foreign_ones():
    """A busy child process is foreign load unless it is one of ours (a root of the own process trees);
    both readings come from the same two /proc snapshots, so they differ by exactly its CPU time."""
    import subprocess
    import sys
    import time

    from specdec.tools.loadtest import noise

    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 5: pass"])
    try:
        time.sleep(0.3)
        before = noise.snapshot()
        time.sleep(1.0)
        after = noise.snapshot()
    finally:
        child.kill()
        child.wait()
    spent = noise.cpu_seconds({child.pid}, before, after)
    assert spent > 0.05  # it ran (on a busy 2-core machine, at least a little)
    wall = after.wall - before.wall
    theirs = noise.trial_cpu(before, after, own_roots=[], model_pids=[child.pid])
    ours = noise.trial_cpu(before, after, own_roots=[child.pid], model_pids=[child.pid])
    assert theirs["model_cpu_s"] == pytest.approx(spent, abs=1e-3)
    assert ours["ours_cores"] == pytest.approx(spent / wall, abs=2e-3)
    if theirs["busy_cores"] - spent / wall > 0:  # nothing clamped: foreign load drops by exactly the child's use
        assert theirs["foreign_cores"] - ours["foreign_cores"] == pytest.approx(spent / wall, abs=2e-3)
    assert theirs["foreign_cores"] >= spent / wall - 0.05 and theirs["foreign_load"] == (theirs["foreign_cores"] > 0.25)
    assert noise.tree([child.pid], after.procs) == {child.pid}


def test_a_level_without_the_baseline_is_not_judged():
    """`--models spec_draft --aa` once ran no baseline and read "keep" (and the A/A check "passed")
    at every level, having compared nothing: such a level is inconclusive and says why."""
    cells = cells_for([(1, 0.5, 1.5, 0.0, 0.7), (4, 0.5, 1.5, 0.0, 0.7)])
    cells = [c for c in cells if not (c["model"] == "baseline" and c["concurrency"] == 4)]
    add_intervals(cells, "baseline")
    [v] = verdicts(cells, G)
    assert [lv["status"] for lv in v["levels"]] == ["pass", "inconclusive"]
    assert v["verdict"] == "inconclusive" and "no trials of the baseline `baseline`" in v["reason"]
    for c in cells:
        c["model"] = "baseline_aa" if c["model"] == "spec" else c["model"]
    aa = aa_check(cells, "baseline_aa")
    assert not aa["passed"] and aa["levels"][1]["result"] == "no baseline"
    lines = report.trust_lines({"aa_check": {**aa, "levels": aa["levels"][1:]}})
    assert lines[0].startswith("**A/A check not made** at c=4")
