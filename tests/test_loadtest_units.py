"""Unit tests for the load-test figures and the guardrail verdicts, on synthetic inputs."""

from __future__ import annotations

import pytest

from specdec.tools.loadtest import stats
from specdec.tools.loadtest.guardrails import Guardrails, Rule, decide, load_guardrails, parse_guardrails, verdicts
from specdec.paths import GUARDRAILS
from specdec.tools.loadtest.matrix import add_ratios
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
    w0, w1 = stats.window(samples, warmup_s=1.0, duration_s=5.0)
    assert (w0, w1) == (101.0, 106.0)
    f = stats.figures(samples, w0, w1)
    assert f["requests"] == 4 and f["errors"] == 1 and f["error_rate"] == 0.25
    assert f["output_tokens"] == 4 + 2 + 2                    # requests sent in the window, no errors
    assert f["output_tokens_in_window"] == 1 + 4 + 2 + 1      # token arrivals in [101, 106)
    assert f["output_tokens_per_s"] == pytest.approx(8 / 5)
    assert f["completed_requests_in_window"] == 3             # 100+1.0, 101+0.3, 102+0.4 (105.5+1.0 is outside)
    assert f["completed_rps"] == pytest.approx(3 / 5)
    assert f["ttft_p50"] == pytest.approx(0.1)
    assert f["acceptance_rate"] == 0.5
    assert f["tokens_per_response"] == pytest.approx((3 + 1 + 1) / (2 + 1 + 1))


def test_ratios_come_from_the_same_workload_and_load():
    cells = [{"workload": "w", "concurrency": c, "model": m, "figures": {"itl_p50": v, "output_tokens_per_s": t}}
             for c, m, v, t in [(1, "baseline", 0.02, 100.0), (1, "spec", 0.01, 180.0),
                                (4, "baseline", 0.04, 300.0), (4, "spec", 0.05, 270.0)]]
    add_ratios(cells, "baseline")
    spec = {c["concurrency"]: c["ratios"] for c in cells if c["model"] == "spec"}
    assert spec[1]["itl_p50"] == pytest.approx(0.5) and spec[1]["output_tokens_per_s"] == pytest.approx(1.8)
    assert spec[4]["itl_p50"] == pytest.approx(1.25) and spec[4]["output_tokens_per_s"] == pytest.approx(0.9)
    assert stats.ratio(0.0, 0.0) == 1.0 and stats.ratio(1.0, 0.0) is None and stats.ratio(None, 1.0) is None


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


# ---- guardrails ----------------------------------------------------------------------------------------------
G = Guardrails(baseline="baseline", improve=Rule("tpot_p50", ratio_max=0.95), rollback=[
    Rule("itl_p95", ratio_max=2.0), Rule("output_tokens_per_s", ratio_min=0.95),
    Rule("completed_rps", ratio_min=0.95, at="peak"), Rule("error_rate", max=0.01), Rule("acceptance_rate", min=0.2)])


def cells_for(rows):
    """rows: (concurrency, tpot ratio, tokens/s ratio, error rate, acceptance)."""
    cells = []
    for c, tpot, tps, err, acc in rows:
        cells.append({"workload": "w", "model": "baseline", "concurrency": c, "figures": {"error_rate": 0.0},
                      "ratios": {}})
        cells.append({"workload": "w", "model": "spec", "concurrency": c,
                      "figures": {"error_rate": err, "acceptance_rate": acc, "requests": 10},
                      "ratios": {"tpot_p50": tpot, "output_tokens_per_s": tps, "completed_rps": tps, "itl_p95": 1.2}})
    return cells


def test_verdict_keep():
    [v] = verdicts(cells_for([(1, 0.5, 1.5, 0.0, 0.7), (4, 0.7, 1.2, 0.0, 0.7), (16, 0.9, 1.0, 0.0, 0.7)]), G)
    assert v["verdict"] == "keep" and all(lv["pass"] for lv in v["levels"])


def test_verdict_keep_below_n_names_the_reason():
    [v] = verdicts(cells_for([(1, 0.5, 1.5, 0.0, 0.7), (4, 0.8, 1.1, 0.0, 0.7), (16, 1.05, 0.85, 0.0, 0.7)]), G)
    assert v["verdict"] == "keep below concurrency 16" and v["keep_below"] == 16
    assert "output_tokens_per_s 0.85x baseline < 0.95x" in v["reason"]
    assert "completed_rps" in v["reason"]  # a peak-only rule, and 16 is the peak
    assert "no gain" in v["reason"]


def test_verdict_roll_back_on_errors_or_collapsed_acceptance():
    [v] = verdicts(cells_for([(1, 0.5, 1.5, 0.05, 0.7), (4, 0.5, 1.5, 0.0, 0.7)]), G)
    assert v["verdict"] == "roll back" and "error_rate 0.05 > 0.01" in v["reason"]
    [v] = verdicts(cells_for([(1, 0.9, 1.1, 0.0, 0.1), (4, 0.9, 1.0, 0.0, 0.1)]), G)
    assert v["verdict"] == "roll back" and "acceptance_rate 0.1 < 0.2" in v["reason"]


def test_peak_rule_only_at_the_highest_level():
    cells = cells_for([(1, 0.5, 1.5, 0.0, 0.7), (4, 0.5, 1.5, 0.0, 0.7)])
    cells[1]["ratios"]["completed_rps"] = 0.5  # low completed req/s at concurrency 1 only: not the peak
    [v] = verdicts(cells, G)
    assert v["verdict"] == "keep"


def test_a_failure_is_not_forgiven_by_a_later_pass():
    levels = [{"concurrency": 1, "pass": True, "reasons": []}, {"concurrency": 4, "pass": False, "reasons": ["x"]},
              {"concurrency": 16, "pass": True, "reasons": []}]
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


# ---- matrix plumbing ---------------------------------------------------------------------------------------
def test_locust_command_holds_the_workload_fixed(tmp_path):
    from specdec.tools.loadtest.matrix import MatrixConfig, locust_command

    cfg = MatrixConfig(models=["baseline"], duration_s=10, warmup_s=2, grpc_url="h:1", http_url="h:2")
    w = Workload("short", "long", "t0.7")
    cmd = locust_command(cfg, "spec_eagle", 4, w, tmp_path / "p.jsonl", tmp_path / "s.jsonl")
    args = dict(zip(cmd, cmd[1:]))
    assert "GrpcStreamUser" in cmd and "--headless" in cmd
    assert (args["-u"], args["-r"], args["--run-time"], args["--model"]) == ("4", "4", "12s", "spec_eagle")
    assert (args["--max-tokens"], args["--temperature"], args["--host"], args["--grpc-url"]) == ("128", "0.7", "http://h:2", "h:1")
    cfg.workers, cfg.drain_s = 2, 5
    cmd = locust_command(cfg, "m", 4, w, tmp_path / "p", tmp_path / "s")
    args = dict(zip(cmd, cmd[1:]))
    assert args["--send-for"] == "12.000" and args["--run-time"] == "17s"  # requests in flight finish
    cfg.workers, cfg.requests = 0, 20
    cmd = locust_command(cfg, "m", 4, w, tmp_path / "p", tmp_path / "s")
    assert dict(zip(cmd, cmd[1:]))["--max-requests"] == str(20 + cfg.warmup_requests)


def test_canary_model_config(tmp_path):
    from specdec.tools.loadtest.canary import routes_to_candidate, write_canary_model

    folder = write_canary_model(tmp_path, "baseline", "spec_medusa", 0.3)
    text = (folder / "config.pbtxt").read_text()
    assert 'backend: "python"' in text and "decoupled: true" in text
    assert 'name: "served_model"' in text and 'name: "text_input"' in text
    assert 'key: "candidate" value: { string_value: "spec_medusa" }' in text
    assert "specdec.tools.loadtest.canary" in (folder / "1" / "model.py").read_text()
    assert sum(routes_to_candidate(n, 0.3) for n in range(1000)) == 300
    with pytest.raises(ValueError):
        write_canary_model(tmp_path, share=1.5)
