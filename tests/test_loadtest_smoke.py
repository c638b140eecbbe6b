"""Smoke load matrix, end to end: real tritonserver, real Locust (headless subprocesses), tiny
checkpoints. The report's figures must be consistent with what was streamed: every model's tokens
equal the server's generation counter and Locust's own accounting, trials interleave and never
overlap, the figures recompute from the raw samples per trial, every interval comes from the
per-round paired ratios, and an A/A run (the baseline under two names) reports no difference."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from specdec.paths import REPO_ROOT
from specdec.tools.loadtest import noise, stats
from specdec.tools.loadtest.intervals import paired_ratio
from specdec.tools.loadtest.matrix import (MatrixConfig, _locust_env, level_cells, main as loadtest_main, measured,
                                           run_level, scrape)
from specdec.tools.loadtest.workload import OUTPUT_SPREAD, Workload, write_prompts
from specdec.serving.repository import write_repository
from specdec.serving.server import TritonServer
from tiny_checkpoints import make_tiny_kit

pytestmark = pytest.mark.slow
MAX_TOKENS = 16


def served_requests(before: dict, after: dict, model: str) -> float:
    """Requests the server counted for `model` between two scrapes of its metrics."""
    return stats.metric_delta(before, after, "specdec:request_queue_time_seconds_count", model=model)


def locust_log_tails(folder: Path) -> dict[str, str]:
    """The ends of the Locust logs under `folder`, for an assertion's message."""
    return {p.name: p.read_text()[-3000:] for p in sorted(folder.rglob("locust*.log"))}


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("loadtest")
    kit = make_tiny_kit(root / "kit", tokenizer_dir)
    repo = root / "model_repository"
    # the draft is a copy of the target: with a fixed k every greedy draft token is accepted
    write_repository(repo, kit["target"], draft=kit["draft"], models=["baseline", "spec_draft"], policy="fixed",
                     k=3, max_batch=4, max_context=512)
    with TritonServer(repo, exit_timeout_s=2, log_file=root / "tritonserver.log") as server:
        yield server


def test_smoke_matrix_report_is_consistent(served, tmp_path):
    out = tmp_path / "report"
    rc = loadtest_main([
        "--grpc-url", served.grpc_url, "--http-url", served.http_url, "--metrics-url", served.metrics_url,
        "--models", "baseline,spec_draft", "--concurrency", "1,2", "--rounds", "2", "--duration", "1.5",
        "--warmup", "0.5", "--max-tokens", str(MAX_TOKENS), "--prompts", "8", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    md = (out / "report.md").read_text()
    assert md.startswith("# Load matrix report") and "Foreign load:" in md and "## Verdict" in md
    assert len(report["plots"]) == 5 and all((out / p).stat().st_size > 10_000 for p in report["plots"])
    assert len(report["cells"]) == 4

    by = {(c["model"], c["concurrency"]): c for c in report["cells"]}
    for level in (1, 2):
        trials = stats.load_samples(out / by[("baseline", level)]["trials_file"][0])
        # a warm-up round, then two rounds, in the balanced orders; one trial ends (requests drained)
        # before the next starts; the cells count the measured rounds only
        assert [(t["model"], t["round"]) for t in trials] == [("spec_draft", -1), ("baseline", -1),
                                                            ("baseline", 0), ("spec_draft", 0),
                                                            ("spec_draft", 1), ("baseline", 1)]
        assert [t["round"] for t in by[("baseline", level)]["trials"]] == [0, 1]
        for a, b in zip(trials, trials[1:]):
            assert a["start"] < a["w0"] < a["w1"] <= a["end"] <= b["start"]
        samples = stats.load_samples(out / by[("baseline", level)]["samples"][0])
        for s in samples:  # each request started and ended inside its own trial
            t = trials[s["trial"]]
            assert s["model"] == t["model"] and t["start"] <= s["start"] and s["start"] + s["e2e"] <= t["end"] + 0.05
    for c in report["cells"]:
        f = c["figures"]
        samples = [s for s in stats.load_samples(out / c["samples"][0]) if s["model"] == c["model"]]
        assert samples and f["locust_exit_code"] == 0
        for s in samples:  # what each user counted, response by response
            assert s["error"] is None
            assert sum(n for _, n in s["chunks"]) == s["tokens"] <= s["max_tokens"]
            if s["finish_reason"] == "length":
                assert s["tokens"] == s["max_tokens"]
        # each request asks its own length around --max-tokens (OUTPUT_SPREAD), drawn from its index
        asked = {s["max_tokens"] for s in samples}
        assert len(asked) > 1 and all(MAX_TOKENS * (1 - OUTPUT_SPREAD) - 0.5 <= t <= MAX_TOKENS * (1 + OUTPUT_SPREAD) + 0.5
                                      for t in asked)
        # the users' token count equals the server's generation counter and Locust's own statistics
        streamed = sum(s["tokens"] for s in samples)
        assert f["client_output_tokens_all"] == streamed == f["server_output_tokens"]
        assert f["tokens_match_server"] is True and f["abandoned_requests"] == 0
        assert f["cell_requests_all"] == len(samples) == f["server_requests"]
        locust = json.loads((out / (c["samples"][0] + ".locust.json")).read_text())[c["model"]]
        assert locust == {"requests": len(samples), "failures": 0, "content_length": streamed}
        # per trial: the figures recompute from that trial's samples and window; CPU figures are there
        assert len(c["trials"]) == 2
        for t in c["trials"]:
            raw = next(x for x in stats.load_samples(out / c["trials_file"][0]) if x["trial"] == t["trial"])
            again = stats.figures([s for s in samples if s["trial"] == t["trial"]], [(raw["w0"], raw["w1"])])
            for key, value in again.items():
                assert t["figures"][key] == value, key
            assert t["figures"]["requests"] > 0 and t["figures"]["output_tokens_per_s"] > 0
            assert t["cpu"]["busy_cores"] >= t["cpu"]["ours_cores"] * 0.5 and t["cpu"]["model_cpu_s"] > 0
            assert t["figures"]["cpu_ms_per_token"] > 0 and t["figures"]["rss_mb"] > 50
        # the pooled figures recompute from every trial's window
        windows = [(x["w0"], x["w1"]) for x in measured(stats.load_samples(out / c["trials_file"][0]))
                   if x["model"] == c["model"]]
        assert f["output_tokens_in_window"] == stats.figures(samples, windows)["output_tokens_in_window"]
        # intervals: the paired per-round ratios to the baseline at the same load
        base = by[("baseline", c["concurrency"])]
        for key in ("tpot_p50", "output_tokens_per_s", "ttft_p95"):
            mine = {t["round"]: t["figures"][key] for t in c["trials"]}
            theirs = {t["round"]: t["figures"][key] for t in base["trials"]}
            assert c["ratios"][key] == paired_ratio([mine[r] for r in (0, 1)], [theirs[r] for r in (0, 1)]).to_dict()
        # the engine's busy time: every phase the model ran, never more than the level's wall time
        busy = f["engine_seconds"]
        assert busy["prefill"] > 0 and busy["forward"] > 0 and 0 < sum(busy.values()) < f["level_wall_s"]
        assert 0 < f["prefill_share"] < 1 and f["decode_ms_per_token"] > 0
        assert 1 <= f["mean_batch"] <= c["concurrency"]  # sampled while any request runs
        if c["model"] == "spec_draft":
            assert busy["draft"] > 0
            assert f["acceptance_rate"] == 1.0 and f["mean_accepted_length"] > 1.5
            assert f["acceptance_per_position"] and f["acceptance_per_position"][0] == 1.0
        else:
            assert f["draft_tokens"] == 0 and f["mean_accepted_length"] is None
            assert c["ratios"]["tpot_p50"]["value"] == 1.0
    rows = {(r["model"], r["concurrency"]): r for r in report["engine_time"]}
    assert set(rows) == set(by) and all(rows[("baseline", n)]["engine_speedup"] == 1.0 for n in (1, 2))
    assert "### Where the engine's time went" in md
    [verdict] = report["verdicts"]
    assert verdict["model"] == "spec_draft" and verdict["verdict"] and verdict["reason"]
    assert [lv["concurrency"] for lv in verdict["levels"]] == [1, 2]
    assert report["noise"]["trials"] == 8


def test_aa_run_reports_no_difference(served, tmp_path):
    """`--aa` serves the baseline under a second name (its own tritonserver, started by the command):
    the two must show no difference, the copy gets no method verdict, and the folder is removed."""
    out = tmp_path / "aa"
    rc = loadtest_main(["--model-repository", str(served.model_repository), "--aa", "--models", "baseline",
                        "--concurrency", "1,2", "--rounds", "4", "--duration", "1.5", "--warmup", "0.5",
                        "--max-tokens", str(MAX_TOKENS), "--prompts", "8", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert report["setup"]["models"] == ["baseline", "baseline_aa"] and report["verdicts"] == []
    aa = report["aa_check"]
    assert aa["passed"], aa
    assert [(lv["concurrency"], lv["result"]) for lv in aa["levels"]] == [(1, "no difference"), (2, "no difference")]
    assert "A/A check passed" in (out / "report.md").read_text()
    assert not (served.model_repository / "baseline_aa").exists()


def test_a_revision_is_served_beside_this_checkout_and_reported_against_it(served, tmp_path):
    """`--rev HEAD`: every model also served by HEAD's specdec (exported, on a backend of its own)
    as <model>_<sha7>, in the same rounds; the report pairs each model with its twin, whose stubs ran
    the exported package; the twins' folders are removed from the user's repository afterwards."""
    sha = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                         check=True).stdout.strip()
    out, s = tmp_path / "rev", sha[:7]
    rc = loadtest_main(["--model-repository", str(served.model_repository), "--rev", "HEAD", "--models",
                        "baseline,spec_draft", "--concurrency", "1", "--rounds", "2", "--duration", "1",
                        "--warmup", "0.3", "--max-tokens", str(MAX_TOKENS), "--prompts", "8", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert report["setup"]["revision"] == sha
    assert report["setup"]["models"] == ["baseline", "spec_draft", f"baseline_{s}", f"spec_draft_{s}"]
    rows = {r["model"]: r for r in report["revision"]}
    assert set(rows) == {"baseline", "spec_draft"} and rows["spec_draft"]["twin"] == f"spec_draft_{s}"
    assert all(r["ratios"]["output_tokens_per_s"]["value"] > 0 for r in rows.values())
    twins = [c for c in report["cells"] if c["model"].endswith(s)]
    assert len(twins) == 2 and all(c["figures"]["tokens_match_server"] for c in twins)
    assert f"## This checkout against {s}" in (out / "report.md").read_text()
    entry = (out / "backends" / f"specdec_{s}" / "model.py").read_text()
    assert str(out / f"revision-{s}" / "backends") in entry
    assert (out / f"revision-{s}" / "backends" / "specdec" / "serving" / "model.py").exists()
    assert not any(p.name.endswith(s) for p in served.model_repository.iterdir())


def test_rounds_split_over_fresh_servers_pool_by_life(served, tmp_path):
    """`--servers 2`: the rounds run in two server lives (a fresh tritonserver each, its own
    warm-up), the trials say which, the server counters of both lives add up to what the users
    streamed, and the intervals are over the lives (n = 2), whose own ratios the report lists."""
    out = tmp_path / "report"
    rc = loadtest_main(["--model-repository", str(served.model_repository), "--servers", "2", "--models",
                        "baseline,spec_draft", "--concurrency", "1", "--rounds", "4", "--duration", "0.75",
                        "--warmup", "0.3", "--max-tokens", str(MAX_TOKENS), "--prompts", "8", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert report["setup"]["servers"] == 2
    pids = set()
    for c in report["cells"]:
        assert [(t["round"], t["life"]) for t in c["trials"]] == [(0, 0), (1, 0), (2, 1), (3, 1)]
        files = [stats.load_samples(out / f) for f in c["trials_file"]]
        assert [sorted({t["round"] for t in f}) for f in files] == [[-1, 0, 1], [-1, 2, 3]]  # a warm-up in each life
        pids |= {json.loads((out / f).with_name("plan.json").read_text())["server_pid"] for f in c["trials_file"]}
        streamed = sum(s["tokens"] for f in c["samples"] for s in stats.load_samples(out / f) if s["model"] == c["model"])
        assert c["figures"]["server_output_tokens"] == c["figures"]["client_output_tokens_all"] == streamed
    assert len(pids) == 2 and (out / "life1" / "tritonserver.log").exists()  # two servers, one after the other
    draft = next(c for c in report["cells"] if c["model"] == "spec_draft")
    assert draft["ratios"]["output_tokens_per_s"]["unit"] == "life" and draft["ratios"]["output_tokens_per_s"]["n"] == 2
    md = (out / "report.md").read_text()
    assert "split over 2 server lives" in md and "by server life" in md and "| 2 (life 1) |" in md


def test_demo_runs_its_stages_over_two_server_lives(served, tmp_path):
    """`specdec demo` (what `make demo` runs, here on the tiny kit, two models, one load level):
    every stage passes, the load stage over two fresh servers, and the report's A/A check and
    verdicts stand on intervals over the lives."""
    from specdec.tools.demo import main as demo_main

    kit = served.model_repository.parent / "kit"
    out = tmp_path / "demo"
    rc = demo_main(["--kit", str(kit), "--models", "baseline,spec_draft", "--concurrency", "1", "--rounds", "2",
                    "--servers", "2", "--duration", "0.5", "--warmup", "0.2", "--max-tokens", str(MAX_TOKENS),
                    "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert report["setup"]["servers"] == 2 and [lv["concurrency"] for lv in report["aa_check"]["levels"]] == [1]
    assert {t["life"] for c in report["cells"] for t in c["trials"]} == {0, 1}
    ratio = next(c for c in report["cells"] if c["model"] == "spec_draft")["ratios"]["output_tokens_per_s"]
    assert ratio["unit"] == "life" and ratio["n"] == 2
    assert [v["model"] for v in report["verdicts"]] == ["spec_draft"]


def test_servers_need_a_server_the_command_starts(served, capsys):
    rc = loadtest_main(["--grpc-url", served.grpc_url, "--http-url", served.http_url, "--servers", "2"])
    assert rc == 1 and "--servers 2 needs --kit or --model-repository" in capsys.readouterr().err


def test_a_revision_that_is_no_commit_is_refused_by_name(served, tmp_path, capsys):
    rc = loadtest_main(["--model-repository", str(served.model_repository), "--rev", "no-such-rev", "--out",
                        str(tmp_path / "x")])
    assert rc == 1 and "--rev 'no-such-rev': not a commit" in capsys.readouterr().err


def test_http_sse_user_counts_the_same_tokens(served, tmp_path):
    cfg = MatrixConfig(models=["spec_draft"], protocol="http", grpc_url=served.grpc_url, http_url=served.http_url,
                       metrics_url=served.metrics_url, rounds=1, duration_s=1.5, warmup_s=0.5)
    prompts = write_prompts(tmp_path / "p.jsonl", ["def add(a, b):\n", "import os\n", "class Point:\n"])
    run = run_level(cfg, ["spec_draft"], 2, Workload(max_tokens=12, sampling="t0.7"), prompts, tmp_path / "level",
                    range(1))
    [cell] = level_cells(cfg, ["spec_draft"], [run])
    f = cell["figures"]
    samples = stats.load_samples(tmp_path / "level" / "samples.jsonl")
    assert samples and all(s["protocol"] == "http" and s["error"] is None for s in samples)
    assert f["client_output_tokens_all"] == f["server_output_tokens"] == sum(s["tokens"] for s in samples)
    assert f["requests"] > 0 and f["ttft_p50"] is not None and f["itl_p95"] is not None


def test_canary_router_splits_live_traffic_in_distributed_mode(served, tmp_path):
    """A Triton canary model sends half the requests to spec_draft and half to the baseline; the
    matrix runs Locust as one master and one worker; every request is accounted for by the served
    models' counters and the report compares the two halves of the same traffic. (Forwarding
    through BLS, the router's stub deadlocked in 3 of 15 runs here, and the users hung with it.)"""
    from specdec.tools.loadtest.canary import routes_to_candidate, write_canary_model

    assert [routes_to_candidate(n, 0.25) for n in range(8)] == [False, False, False, True] * 2
    write_canary_model(served.model_repository, "baseline", "spec_draft", share=0.5, grpc_url=served.grpc_url)
    r = requests.post(f"http://{served.http_url}/v2/repository/models/canary/load", json={}, timeout=120)
    assert r.status_code == 200, r.text
    out = tmp_path / "report"
    before = scrape(served.metrics_url)
    rc = loadtest_main([
        "--grpc-url", served.grpc_url, "--http-url", served.http_url, "--metrics-url", served.metrics_url,
        "--models", "canary", "--concurrency", "2", "--rounds", "2", "--duration", "1.5", "--warmup", "0.5",
        "--max-tokens", "10", "--prompts", "4", "--workers", "1", "--out", str(out)])
    after = scrape(served.metrics_url)
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    [cell] = report["cells"]
    assert cell["figures"]["locust_worker_exit_codes"] == [0]  # it quit with the master, not killed
    samples = stats.load_samples(out / cell["samples"][0])  # written by the master, sent by the worker
    assert samples and all(s["error"] is None and s["tokens"] <= s["max_tokens"] <= 10 * (1 + OUTPUT_SPREAD) + 0.5
                       for s in samples)
    served_by = [s["served_model"] for s in samples]
    assert set(served_by) == {"baseline", "spec_draft"}
    assert abs(served_by.count("baseline") - served_by.count("spec_draft")) <= 2  # in flight at the end
    tokens = {}
    for s in samples:  # greedy: the speculative model streams exactly the baseline's tokens
        tokens.setdefault((s["prompt_index"], s["max_tokens"]), set()).add(s["tokens"])
    assert all(len(v) == 1 for v in tokens.values())
    seen = {m: served_requests(before, after, m) for m in ("baseline", "spec_draft")}
    generated = sum(stats.metric_delta(before, after, "specdec:generation_tokens", model=m)
                    for m in ("baseline", "spec_draft"))
    # every request the server counted has its sample (clean-clone runs lost the two in flight when
    # the worker stalled: test_a_stalled_worker_loses_no_request); on a mismatch the message names
    # the models, the tokens, and the tails of Locust's logs
    served_count = {m: served_by.count(m) for m in seen}
    logs = locust_log_tails(out)
    assert seen == served_count and generated == sum(s["tokens"] for s in samples), (
        seen, served_count, generated, sum(s["tokens"] for s in samples), logs)
    split = {c["model"]: c for c in report["canary_cells"]}
    assert set(split) == {"baseline", "spec_draft"} and split["baseline"]["ratios"]["tpot_p50"]["value"] == 1.0
    assert len(split["spec_draft"]["trials"]) == 2  # both halves of each trial, paired by round
    assert split["spec_draft"]["figures"]["acceptance_rate"] == 1.0
    [verdict] = report["canary_verdicts"]
    assert verdict["model"] == "spec_draft" and verdict["verdict"]
    assert "## Canary" in (out / "report.md").read_text()


def test_a_stalled_worker_loses_no_request(served, tmp_path):
    """A Locust worker stalled for 5 s (stopped with SIGSTOP, as a busy machine can starve it) is
    not a lost worker: every request the server counted has its sample. Before, Locust's master
    called the worker missing after 3 s without heartbeats, stopped the test and ended the trial
    without waiting: clean-clone runs lost the requests in flight, one per canary model."""
    cfg = MatrixConfig(models=["baseline"], grpc_url=served.grpc_url, http_url=served.http_url,
                       metrics_url=served.metrics_url, rounds=1, warmup_rounds=0, duration_s=1.5, warmup_s=0.5,
                       workers=1)  # one trial: the stall lasts past its end
    prompts = write_prompts(tmp_path / "p.jsonl", ["def add(a, b):\n", "import os\n"])
    level = tmp_path / "level"
    stalled = []

    def stall() -> None:  # once the first sample reached the master, the worker stops for 5 s
        deadline = time.monotonic() + 120
        samples = level / "samples.jsonl"
        while time.monotonic() < deadline and not (samples.exists() and samples.stat().st_size):
            time.sleep(0.02)
        procs = noise.process_table()
        stalled.extend(p for p in noise.tree([os.getpid()], procs) if b"--worker" in noise.cmdline(p))
        for p in stalled:
            os.kill(p, signal.SIGSTOP)
        time.sleep(5)
        for p in stalled:
            os.kill(p, signal.SIGCONT)

    before = scrape(served.metrics_url)
    thread = threading.Thread(target=stall, daemon=True)
    thread.start()
    [cell] = level_cells(cfg, ["baseline"], [run_level(cfg, ["baseline"], 2, Workload(max_tokens=MAX_TOKENS), prompts,
                                                       level, range(1))])
    thread.join(10)
    after = scrape(served.metrics_url)
    assert len(stalled) == 1  # the worker process
    samples = stats.load_samples(level / "samples.jsonl")
    logs = locust_log_tails(level)
    assert "error" not in cell["figures"] and all(s["error"] is None for s in samples), (cell["figures"], logs)
    served = served_requests(before, after, "baseline")
    assert served == len(samples) > 0, (served, len(samples), logs)
    assert cell["figures"]["server_output_tokens"] == sum(s["tokens"] for s in samples)


def test_requests_cut_off_by_the_run_time_keep_their_samples(served, tmp_path):
    """loadtest/README.md's headless command without --stop-timeout: the requests in flight when the
    run time ends are cut off, and each still leaves a sample that says so (before, they left none,
    and the server counted requests the samples did not have)."""
    out = tmp_path / "samples.jsonl"
    prompts = write_prompts(tmp_path / "p.jsonl", ["def add(a, b):\n", "import os\n"])
    before = scrape(served.metrics_url)
    proc = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(Path(__file__).parents[1] / "loadtest" / "locustfile.py"),
         "GrpcStreamUser", "--headless", "-u", "2", "-r", "2", "--run-time", "6s", "--host", f"http://{served.http_url}",
         "--grpc-url", served.grpc_url, "--model", "baseline", "--max-tokens", "400", "--max-tokens-spread", "0", "--prompts-file", str(prompts),
         "--samples-out", str(out)],
        capture_output=True, text=True, timeout=180, env=_locust_env())
    time.sleep(0.6)  # the backend flushes its metrics every 0.2 s
    after = scrape(served.metrics_url)
    samples = stats.load_samples(out)
    cut = [s for s in samples if s["error"] == "the user was stopped while its request was in flight"]
    assert cut and all(s["error"] is None for s in samples if s not in cut), (proc.stdout[-2000:], proc.stderr[-2000:])
    served = served_requests(before, after, "baseline")
    assert served == len(samples), (served, len(samples))


class SilencingRelay:
    """A TCP relay to tritonserver's gRPC port whose answers can be silenced: once `silence()` is
    called, what the server sends is read and dropped, so every stream through the relay stops
    answering mid-response while tritonserver and its model run on as they were. (Stopping the
    model's stub with SIGSTOP did that too, but Triton 2.51's Python backend aborts tritonserver on
    a timed-out lock that the stopped stub holds: seen in two clean-clone CI runs.)"""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.silenced = threading.Event()
        self.dropped = 0  # bytes of the server's that never reached a client
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def silence(self) -> None:
        self.silenced.set()

    def close(self) -> None:
        for s in [self.listener, *self.sockets]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self.target)
            self.sockets += [client, server]
            threading.Thread(target=self._relay, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._relay, args=(server, client, True), daemon=True).start()

    def _relay(self, source: socket.socket, sink: socket.socket, answers: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if answers and self.silenced.is_set():
                    self.dropped += len(data)
                else:
                    sink.sendall(data)


def test_a_request_that_never_answers_is_given_up_without_hanging_its_user(served, tmp_path):
    """A request whose stream stops answering mid-response (a relay between Locust and tritonserver
    drops what the server sends from 1.5 s after the server's first tokens of the run's back-to-back
    500-token requests) is given up after --request-timeout with a sample that says so, and Locust
    still ends at its run time. Before, the user dropped the stream's client, whose `__del__` closed
    it without cancelling: it waited for responses that never came, and Locust's exit waited for its
    reader (the distributed canary test's worker, killed after 30 s, in 3 of 15 runs, when the
    canary's BLS calls deadlocked: `bls.exec`). The silence waits for the server's first tokens (a
    timer from the command's start once fired while Locust, slow to start on a loaded machine, had
    sent nothing)."""
    prompts = write_prompts(tmp_path / "p.jsonl", ["def add(a, b):\n"])
    out = tmp_path / "samples.jsonl"
    relay = SilencingRelay(served.grpc_url)
    before = scrape(served.metrics_url)
    done = threading.Event()

    def silence_once_streaming() -> None:
        while not done.wait(0.1):
            if stats.metric_delta(before, scrape(served.metrics_url), "specdec:generation_tokens", model="baseline") > 0:
                if not done.wait(1.5):
                    relay.silence()
                return

    silencer = threading.Thread(target=silence_once_streaming, daemon=True)
    t0 = time.monotonic()
    silencer.start()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(Path(__file__).parents[1] / "loadtest" / "locustfile.py"),
             "GrpcStreamUser", "--headless", "-u", "1", "-r", "1", "--run-time", "8s", "--host", f"http://{served.http_url}",
             "--grpc-url", relay.url, "--model", "baseline", "--max-tokens", "500", "--max-tokens-spread", "0",
             "--prompts-file", str(prompts), "--request-timeout", "3", "--samples-out", str(out)],
            capture_output=True, text=True, timeout=60, env=_locust_env())
        took = time.monotonic() - t0
    finally:
        done.set()
        silencer.join()
        relay.close()
    errors = collections.Counter(s["error"] for s in stats.load_samples(out))
    assert relay.silenced.is_set() and relay.dropped > 0, ("the server streamed nothing", took, errors,
                                                           proc.stderr[-2000:])
    assert took < 30 and errors["no response within 3 s"], (took, errors, proc.stdout[-2000:], proc.stderr[-2000:])


def test_a_stopped_server_unloads_the_canary_loaded_after_it_started(served, tmp_path):
    """`TritonServer.stop` unloads every model before its SIGINT, also a canary router loaded
    through the repository API after the start (before, it stayed loaded: the unload wait ran to
    its 30 s timeout and tritonserver then shut down with a model still loaded)."""
    from specdec.tools.loadtest.canary import write_canary_model

    repo = served.model_repository.parent / "stop_repository"  # beside it: the same relative checkpoint paths
    shutil.copytree(served.model_repository / "baseline", repo / "baseline")
    with TritonServer(repo, exit_timeout_s=2, log_file=tmp_path / "tritonserver.log") as server:
        write_canary_model(repo, "baseline", "baseline", share=0.5, grpc_url=server.grpc_url)
        r = requests.post(f"http://{server.http_url}/v2/repository/models/canary/load", json={}, timeout=120)
        assert r.status_code == 200, r.text
        server.unload_models(timeout_s=10)
        index = json.loads(server.post("/v2/repository/index"))
        assert [m["name"] for m in index if m.get("state") in ("READY", "UNLOADING")] == [], index
