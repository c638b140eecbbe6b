"""`specdec loadtest`: the load matrix. For every workload and load level, the served models take
turns in short trials (every model once a round, in orders that balance each model's position and
predecessor: `balanced_orders`), so a slow period of the machine lands on every model of a round
alike; each figure is then compared with the baseline's of the same round, and the verdict rests on
the interval of those paired ratios (`intervals`, `guardrails`), not on one window's point
estimate. Writes report.json, report.md and plots.

Each (workload, load level) is one `locust --headless` process running a trial plan
(`users.run_plan`): it drains the requests in flight between trials and records, per trial, the
measurement window and the machine's CPU use (`noise`). This process scrapes the server's
metrics around it. Everything but the model and the number of users is held fixed and recorded:
prompts (one file per workload), max tokens, sampling, seeds, trial length.

`--aa` adds a copy of the baseline under a second name (`<baseline>_aa`, the same config) to the
served repository: an A/A pair that must show no difference, or the run is flagged untrustworthy.
`--rev REV` serves every model a second time from another git revision of specdec, in the same
rounds, and reports each against its twin (`revision`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specdec.paths import GUARDRAILS, PACKAGE_ROOT, REPORTS
from specdec.serving.interface import DEFAULT_GRPC_URL, DEFAULT_HTTP_URL, DEFAULT_METRICS_URL
from specdec.tools.loadtest import revision, stats
from specdec.tools.loadtest.intervals import mean_interval, round_lives, round_ratios
from specdec.tools.loadtest.noise import server_pid
from specdec.tools.loadtest.workload import (OUTPUT_BANDS, OUTPUT_SPREAD, PROMPT_BANDS, SAMPLING, Workload, prompts_for,
                                             workloads, write_prompts)

LOCUSTFILE = Path(__file__).with_name("users.py")  # Locust loads the users module by path


@dataclass
class MatrixConfig:
    models: list[str]
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])
    workloads: list[Workload] = field(default_factory=lambda: [Workload()])
    rounds: int = 5  # trials per model and load level, interleaved
    duration_s: float = 5.0  # measured seconds per trial
    warmup_s: float = 1.0  # seconds per trial before measuring
    # unmeasured rounds of every model that open each load level: a model's first trial at a level
    # meets it cold (at b399930 the two baselines' first trials after the server started ran 1216
    # and 1153 tokens/s against 1624-1868 in their later rounds, and at the next level every model
    # but the baseline, which opened it, ran 10-25% slow in its first two rounds)
    warmup_rounds: int = 1
    protocol: str = "grpc"
    grpc_url: str = DEFAULT_GRPC_URL
    http_url: str = DEFAULT_HTTP_URL
    metrics_url: str = DEFAULT_METRICS_URL
    baseline: str = "baseline"
    aa_model: str | None = None  # the baseline's A/A copy, when served
    revision: str | None = None  # the commit whose twins of the models are served (`revision`), when any
    prompts: int = 32
    seed: int = 0
    stop_timeout_s: float = 120.0
    drain_s: float = 30.0  # at most this long for a trial's requests in flight to end; the rest are abandoned
    workers: int = 0  # > 0: Locust distributed mode, one master and this many worker processes per level
    # server lives the rounds are split over (a fresh tritonserver each, warm-up rounds again in
    # each): a difference two stubs keep for a server's life is in every round of it, which only
    # more lives average out; over lives, the intervals are too (`intervals`, docs/verdicts.md)
    servers: int = 1
    out: str = "reports/loadtest"

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.duration_s <= 0 or self.warmup_s < 0 or self.warmup_rounds < 0:
            raise ValueError(f"rounds must be >= 1, warm-up rounds >= 0 and the trial length > 0 (rounds "
                             f"{self.rounds}, warm-up rounds {self.warmup_rounds}, duration {self.duration_s}, "
                             f"warmup {self.warmup_s})")
        if not 1 <= self.servers <= self.rounds:
            raise ValueError(f"--servers {self.servers}: the server lives must be between 1 and the rounds "
                             f"({self.rounds}); each life runs a share of them")

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "workloads"}
        d["workloads"] = [w.to_dict() for w in self.workloads]
        return d


# ---- server side ----------------------------------------------------------------------------------------
def metrics_endpoint(url: str) -> str:
    """`host:port` -> `http://host:port/metrics` (else the server-side token check stays silently empty)."""
    url = url if "://" in url else f"http://{url}"
    return url if urllib.parse.urlsplit(url).path.strip("/") else url.rstrip("/") + "/metrics"


def scrape(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return stats.parse_metrics(r.read().decode())
    except OSError:
        return {}


def served_models(http_url: str) -> list[str]:
    base = http_url if http_url.startswith("http") else f"http://{http_url}"
    req = urllib.request.Request(f"{base}/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        index = json.loads(r.read())
    return sorted(m["name"] for m in index if m.get("state") == "READY")


def aa_name(baseline: str) -> str:
    return f"{baseline}_aa"


def write_aa_model(repo: str | Path, baseline: str) -> str:
    """A second folder for the baseline with the same config under another name (a sibling, so
    relative checkpoint paths stay valid); returns its name."""
    name = aa_name(baseline)
    src, dst = Path(repo) / baseline, Path(repo) / name
    if not (src / "config.pbtxt").exists():
        raise ValueError(f"--aa: {src} has no config.pbtxt (the baseline must be in the repository)")
    text = (src / "config.pbtxt").read_text()
    if f'name: "{baseline}"' not in text:
        raise ValueError(f"--aa: {src / 'config.pbtxt'} does not name the model {baseline!r}")
    (dst / "1").mkdir(parents=True, exist_ok=True)
    (dst / "config.pbtxt").write_text(text.replace(f'name: "{baseline}"', f'name: "{name}"', 1))
    return name


def write_repository_for(kit: str | Path, repo: str | Path, models: list[str] | None = None) -> list[str]:
    """A fresh repository with one model per method the kit's folders allow (or `models`)."""
    from specdec.serving.repository import write_repository

    kit, repo = Path(kit), Path(repo)
    if repo.exists():
        shutil.rmtree(repo)
    return write_repository(repo, kit / "target", **{k: kit / k for k in ("draft", "medusa", "eagle") if (kit / k).is_dir()},
                            models=models, absolute=True)


def start_server(repo: str | Path, out: Path, aa_of: str | None = None, timeout_s: float = 600.0,
                 backend_dir: Path | None = None):
    """Serve `repo` on free ports (with the A/A copy of the model `aa_of` added, when given; from
    `backend_dir`, when given: the default backends plus a revision's, `revision.add_backend`);
    returns the started TritonServer. `specdec loadtest` and `specdec demo` start servers here."""
    from specdec.serving.server import TritonServer, start_retrying

    repo = Path(repo)
    if aa_of is not None:
        write_aa_model(repo, aa_of)
    out.mkdir(parents=True, exist_ok=True)
    server = TritonServer(repo, exit_timeout_s=3, log_file=out / "tritonserver.log",
                          backend_dir=backend_dir)
    start_retrying(server, timeout_s, lambda text: print(text, file=sys.stderr, flush=True))
    return server


# ---- one load level: every model, interleaved trials -------------------------------------------------
def balanced_orders(n: int) -> list[list[int]]:
    """A Williams design: orders of range(n) in which every index takes every position, and follows
    every other index, equally often (n orders for even n, 2n for odd). Rotating one order (round 1:
    A B C, round 2: B C A, ...) balanced the positions but put every model after the same
    neighbour in all but one round of n, so whatever a trial leaves behind (its drain, the caches
    it filled, its server's background work) would fall on one model's figures every time."""
    first = [0]
    for i in range(1, n):  # 0, 1, n-1, 2, n-2, ...: the steps between neighbours are all distinct mod n
        first.append((i + 1) // 2 if i % 2 else n - i // 2)
    orders = [[(j + shift) % n for j in first] for shift in range(n)]
    return orders if n % 2 == 0 else orders + [o[::-1] for o in orders]


def trial_plan(models: list[str], rounds: range, warmup_rounds: int = 0) -> list[dict]:
    """Round r sends to the models in the order `balanced_orders` gives it (r modulo the design's
    length): every model takes every position, and follows every other model, equally often when
    rounds is a multiple of the number of models (of twice that for an odd number). Warm-up rounds
    come first, numbered -warmup_rounds .. -1 (`measured` drops them); `rounds` are the measured
    ones (a server life's share, `life_rounds`)."""
    orders = balanced_orders(len(models))
    return [{"model": models[i], "round": r} for r in [*range(-warmup_rounds, 0), *rounds]
            for i in orders[r % len(orders)]]


def life_rounds(rounds: int, servers: int) -> list[range]:
    """The measured rounds of each server life: consecutive shares, as equal as they divide."""
    cuts = [rounds * i // servers for i in range(servers + 1)]
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def measured(trials: list[dict]) -> list[dict]:
    """The trials that count: not the warm-up rounds (their requests still count in the checks of
    every request against the server's counters)."""
    return [t for t in trials if t["round"] >= 0]


def locust_command(cfg: MatrixConfig, users: int, workload: Workload, prompts_file: Path, plan_file: Path,
                   samples: Path, planned_s: float, csv_prefix: Path | None = None) -> list[str]:
    user_class = "GrpcStreamUser" if cfg.protocol == "grpc" else "HttpSseUser"
    http = cfg.http_url if cfg.http_url.startswith("http") else f"http://{cfg.http_url}"
    # a cap only: the plan ends the run when its last trial has drained
    run_time = math.ceil(2 * planned_s + planned_s / (cfg.warmup_s + cfg.duration_s) * cfg.drain_s
                         + cfg.stop_timeout_s + 60)
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), user_class, "--headless",
           "-u", str(users), "-r", str(users), "--run-time", f"{run_time}s",
           "--stop-timeout", f"{cfg.stop_timeout_s:.0f}", "--host", http, "--grpc-url", cfg.grpc_url,
           "--trial-plan", str(plan_file), "--prompts-file", str(prompts_file), "--max-tokens", str(workload.tokens),
           "--max-tokens-spread", str(workload.max_tokens_spread),
           "--temperature", str(workload.temperature), "--top-p", str(workload.top_p), "--seed", str(cfg.seed),
           "--samples-out", str(samples), "--only-summary", "--loglevel", "INFO"]
    if csv_prefix is not None:
        cmd += ["--csv", str(csv_prefix)]
    return cmd


def worker_command(cfg: MatrixConfig, port: int) -> list[str]:
    user_class = "GrpcStreamUser" if cfg.protocol == "grpc" else "HttpSseUser"
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), user_class, "--worker", "--master-host",
            "127.0.0.1", "--master-port", str(port), "--loglevel", "INFO"]


@dataclass
class LevelRun:
    """One server life's run of a load level: what Locust recorded and the server's counters around it."""

    samples: list[dict]
    trials: list[dict]  # every trial, warm-ups included (`measured` drops them)
    before: dict  # the server's metrics scraped before and after
    after: dict
    exit_code: int  # Locust's
    worker_exit_codes: list[int | None]  # -9: killed, it did not quit
    unreported: list[str]  # Locust workers that did not report a trial drained
    wall_s: float
    samples_path: Path
    trials_path: Path


def run_level(cfg: MatrixConfig, models: list[str], users: int, workload: Workload, prompts_file: Path,
              level_dir: Path, rounds: range) -> LevelRun:
    """Run the interleaved trials of every model at one load level, `rounds` of them, on the server
    the config names."""
    level_dir.mkdir(parents=True, exist_ok=True)
    samples_path, trials_path, plan_path = (level_dir / n for n in ("samples.jsonl", "trials.jsonl", "plan.json"))
    for p in (samples_path, trials_path):
        p.unlink(missing_ok=True)
    plan = trial_plan(models, rounds, cfg.warmup_rounds)
    plan_path.write_text(json.dumps({"warmup_s": cfg.warmup_s, "duration_s": cfg.duration_s, "drain_s": cfg.drain_s,
                                     "trials": plan,
                                     "server_pid": server_pid(cfg.grpc_url), "out": str(trials_path)}))
    planned_s = len(plan) * (cfg.warmup_s + cfg.duration_s)  # without drains
    cmd = locust_command(cfg, users, workload, prompts_file, plan_path, samples_path, planned_s, level_dir / "locust")
    before = scrape(cfg.metrics_url)
    t0 = time.time()
    workers = []
    if cfg.workers > 0:  # distributed: the workers run the users and send their samples to the master
        from specdec.serving.server import free_port

        port = free_port()
        cmd += ["--master", "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port),
                "--expect-workers", str(cfg.workers)]
        for i in range(cfg.workers):
            with open(level_dir / f"locust-worker{i}.log", "w") as log:
                workers.append(subprocess.Popen(worker_command(cfg, port), stdout=log, stderr=subprocess.STDOUT,
                                                env=_locust_env()))
    with open(level_dir / "locust.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_locust_env())
    for w in workers:  # they quit when the master does
        try:
            w.wait(timeout=30)
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()
    time.sleep(0.6)  # the backend flushes its metrics every 0.2 s
    after = scrape(cfg.metrics_url)
    all_trials = stats.load_samples(trials_path)
    # warm-up trials too: a sample lost there is missing from the level's checks against the server
    unreported = sorted({w for t in all_trials for w in t.get("unreported_workers", [])})
    return LevelRun(stats.load_samples(samples_path), all_trials, before, after, proc.returncode,
                    [w.returncode for w in workers], unreported, round(time.time() - t0, 2), samples_path, trials_path)


def level_cells(cfg: MatrixConfig, models: list[str], runs: list[LevelRun]) -> list[dict]:
    """One cell per model from a load level's runs, one per server life: each trial keeps its
    life's figures (a trial's samples are found by its index within its life), and the cell's
    pooled figures count every life's requests and the sum of the lives' server counters."""
    lives = len(runs)
    before, after = summed_counters(runs)
    exit_code = next((r.exit_code for r in runs if r.exit_code), 0)
    logs = ", ".join(str(r.samples_path.with_name("locust.log")) for r in runs)
    cells = []
    for model in models:
        records, mine, cell_samples = [], [], []
        for life, run in enumerate(runs):
            own = [t for t in measured(run.trials) if t["model"] == model]
            for t in own:
                records.append({**trial_record(t, run.samples), **({"life": life} if lives > 1 else {})})
            mine += own
            cell_samples += [s for s in run.samples if s.get("model") == model]
        fig = cell_figures(cell_samples, mine, before, after, model)
        fig.update({"locust_exit_code": exit_code,
                    "locust_worker_exit_codes": [c for r in runs for c in r.worker_exit_codes],
                    "level_wall_s": round(sum(r.wall_s for r in runs), 2)})
        unreported = sorted({w for r in runs for w in r.unreported})
        if not cell_samples:
            fig["error"] = f"no samples (locust exit code {exit_code}; see {logs})"
        elif len(mine) < cfg.rounds:
            fig["error"] = f"{len(mine)} of {cfg.rounds} trials ran (see {logs})"
        elif unreported:
            fig["error"] = (f"Locust worker(s) {', '.join(unreported)} did not report a trial drained: its samples "
                            f"may be lost (see {logs})")
        elif any(r.before and not r.after for r in runs):
            fig["error"] = "the server's metrics endpoint stopped answering (did tritonserver exit?)"
        elif all(s.get("error") for s in cell_samples):
            fig["error"] = f"every request failed, e.g. {cell_samples[-1]['error']}"
        cells.append({"model": model, "figures": fig, "trials": records,
                      "samples": [str(r.samples_path) for r in runs], "trials_file": [str(r.trials_path) for r in runs]})
    return cells


def summed_counters(runs: list[LevelRun]) -> tuple[dict, dict]:
    """(before, after) scrapes whose difference is the sum of every life's (each server's counters
    start at zero); empty where a life has no scrape (no metrics endpoint)."""
    if not all(r.before and r.after for r in runs):
        return {}, {}
    if len(runs) == 1:
        return runs[0].before, runs[0].after
    after: dict = {}
    for r in runs:
        for key, value in r.after.items():
            after[key] = after.get(key, 0.0) + value - r.before.get(key, 0.0)
    return dict.fromkeys(after, 0.0), after


def trial_record(trial: dict, samples: list[dict]) -> dict:
    """One trial's figures (its requests, its window) with its CPU figures."""
    mine = [s for s in samples if s.get("trial") == trial["trial"]]
    fig = stats.figures(mine, [(trial["w0"], trial["w1"])])
    cpu = trial["cpu"]
    tokens = fig["output_tokens_in_window"]
    fig.update({"cpu_ms_per_token": 1000 * cpu["model_cpu_s"] / tokens if cpu.get("model_cpu_s") and tokens else None,
                "foreign_cores": cpu["foreign_cores"], "rss_mb": trial.get("rss_mb")})
    record = {"round": trial["round"], "trial": trial["trial"], "figures": fig, "cpu": cpu}
    served = {s.get("served_model") for s in mine if s.get("served_model")}
    if served - {trial["model"]}:  # a canary router: the same live traffic, split by the model that served it
        record["by_served_model"] = {m: stats.figures([s for s in mine if s.get("served_model") == m],
                                                      [(trial["w0"], trial["w1"])]) for m in sorted(served)}
    return record


def cell_figures(samples: list[dict], trials: list[dict], before: dict, after: dict, model: str) -> dict:
    """The pooled figures of one model at one level: its requests over all its trials' windows,
    the server's counters and the noise summary."""
    windows = [(t["w0"], t["w1"]) for t in trials]
    fig = stats.figures(samples, windows)
    server = stats.server_figures(before, after, model) if before and after else {}
    fig.update(server)
    client_tokens = sum(s["tokens"] for s in samples)
    model_cpu = [t["cpu"].get("model_cpu_s") for t in trials]
    rss = [t.get("rss_mb") for t in trials if t.get("rss_mb") is not None]
    fig.update({
        "rss_mb": max(rss) if rss else None,
        "cpu_ms_per_token": (1000 * sum(model_cpu) / fig["output_tokens_in_window"]
                             if model_cpu and None not in model_cpu and fig["output_tokens_in_window"] else None),
        "foreign_cores": sum(t["cpu"]["foreign_cores"] for t in trials) / len(trials) if trials else None,
        "foreign_load_trials": sum(1 for t in trials if t["cpu"]["foreign_load"]),
        "trials": len(trials),
        "abandoned_requests": sum(t.get("abandoned", 0) for t in trials),  # no response by the end of a drain
        "client_output_tokens_all": client_tokens,  # every request of the level, warm-ups and drains included
        "tokens_match_server": (server.get("server_output_tokens") == client_tokens) if server else None,
        "cell_requests_all": len(samples),
    })
    served = {s.get("served_model") for s in samples if s.get("served_model")}
    if served - {model}:
        fig["by_served_model"] = {m: stats.figures([s for s in samples if s.get("served_model") == m], windows)
                                  for m in sorted(served)}
    return fig


def _locust_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


# ---- the matrix ---------------------------------------------------------------------------------------
def run_matrix(cfg: MatrixConfig, progress=None, restart=None) -> dict:
    """Run every level; returns the report dict (figures, intervals, setup). `progress(done, total,
    text)`. Over `cfg.servers` lives, `restart(life)` stops the server and starts a fresh one
    (returning it: its URLs go into `cfg`) before each life after the first; every life runs every
    level."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.servers > 1 and restart is None:
        raise ValueError(f"--servers {cfg.servers} needs --kit or --model-repository (the command restarts the "
                         "server it starts, never a running one)")
    # the baseline (and its A/A copy) first; a canary router alone needs no baseline (it serves both)
    first = [m for m in (cfg.baseline, cfg.aa_model) if m and m in cfg.models]
    models = first + [m for m in cfg.models if m not in first]
    shares = life_rounds(cfg.rounds, cfg.servers)
    levels = [(wi, workload, users) for wi, workload in enumerate(cfg.workloads) for users in cfg.concurrency]
    prompts = {wi: write_prompts(out / "prompts" / f"workload{wi}.jsonl", prompts_for(workload, cfg.prompts, cfg.seed))
               for wi, workload in enumerate(cfg.workloads)}
    runs: dict[tuple[int, int], list[LevelRun]] = {(wi, users): [] for wi, _, users in levels}
    total, done = len(levels) * cfg.servers, 0
    for life, rounds in enumerate(shares):
        if life:
            server = restart(life)
            cfg.grpc_url, cfg.http_url, cfg.metrics_url = server.grpc_url, server.http_url, server.metrics_url
        for wi, workload, users in levels:
            if progress:
                where = f" (server life {life + 1}/{cfg.servers})" if cfg.servers > 1 else ""
                progress(done, total, f"{workload.name}  concurrency {users}: {len(rounds)} rounds of "
                                      f"{', '.join(models)}{where}")
            level_dir = out / "levels" / f"w{wi}-c{users}" / (f"life{life}" if cfg.servers > 1 else "")
            runs[wi, users].append(run_level(cfg, models, users, workload, prompts[wi], level_dir, rounds))
            done += 1
    if progress:
        progress(done, total, "done")
    cells = []
    for wi, workload, users in levels:
        for c in level_cells(cfg, models, runs[wi, users]):
            c.update({"workload": workload.name, "workload_index": wi, "concurrency": users})
            c["samples"] = [str(Path(p).relative_to(out)) for p in c["samples"]]
            c["trials_file"] = [str(Path(p).relative_to(out)) for p in c["trials_file"]]
            cells.append(c)
    add_intervals(cells, cfg.baseline)
    report = {"setup": {**cfg.to_dict(), "models": models,
                        "prompt_files": [str(Path("prompts") / f"workload{i}.jsonl") for i in range(len(cfg.workloads))]},
              "cells": cells}
    canary = canary_cells(cells)
    if canary:
        add_intervals(canary, cfg.baseline)
        report["canary_cells"] = canary
    return report


def canary_cells(cells: list[dict]) -> list[dict]:
    """The cells of a canary router split by the model that served each request, trial by trial.
    Only per-request figures compare across the split (rates depend on the share), so the rates
    are left out."""
    rates = {"output_tokens_per_s": None, "completed_rps": None}
    out = []
    for c in cells:
        for model, f in (c["figures"].get("by_served_model") or {}).items():
            trials = [{"round": t["round"], "trial": t["trial"], "figures": {**t["by_served_model"][model], **rates}}
                      for t in c["trials"] if model in t.get("by_served_model", {})]
            out.append({"workload": c["workload"], "workload_index": c["workload_index"],
                        "concurrency": c["concurrency"], "model": model, "router": c["model"],
                        "figures": {**f, **rates}, "trials": trials})
    return out


def add_intervals(cells: list[dict], baseline: str) -> None:
    """Per cell and figure: `ratios` (the interval of the per-round paired ratios to the baseline at
    the same workload and load level) and `means` (the interval of the figure's per-trial values)."""
    base = {(c["workload"], c["concurrency"]): c for c in cells if c["model"] == baseline}
    for c in cells:
        b = base.get((c["workload"], c["concurrency"]))
        rounds = sorted({t["round"] for t in c["trials"]} | ({t["round"] for t in b["trials"]} if b else set()))
        mine = {t["round"]: t["figures"] for t in c["trials"]}
        life = round_lives(c["trials"] + (b["trials"] if b else []))
        c["ratios"] = (round_ratios(c["trials"], b["trials"], stats.TRIAL_FIGURES) if b
                       else dict.fromkeys(stats.TRIAL_FIGURES))
        c["means"] = {}
        for k in stats.TRIAL_FIGURES:
            m = mean_interval([mine.get(r, {}).get(k) for r in rounds], lives=[life.get(r, 0) for r in rounds])
            c["means"][k] = m.to_dict() if m else None


# ---- command line -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="specdec loadtest", description=__doc__.split("\n\n")[0],
                                 epilog="`specdec loadtest canary --help`: add a canary router model to a repository.")
    src = ap.add_argument_group("server (default: a running one at localhost)")
    src.add_argument("--grpc-url", default=DEFAULT_GRPC_URL)
    src.add_argument("--http-url", default=DEFAULT_HTTP_URL)
    src.add_argument("--metrics-url", default=DEFAULT_METRICS_URL, type=metrics_endpoint)
    src.add_argument("--model-repository", help="start tritonserver on free ports with this repository")
    src.add_argument("--kit", help="build a repository from this kit folder (target/ draft/ medusa/ eagle/) and serve it")
    src.add_argument("--aa", action="store_true",
                     help="also serve the baseline under a second name (<baseline>_aa, a folder next to it with "
                          "the same config): an A/A pair that must show no difference (with --kit or "
                          "--model-repository; a running server must already serve <baseline>_aa)")
    src.add_argument("--rev", help="also serve every model from this git revision of specdec (a Triton backend of its "
                                   "own) as <model>_<sha7>, in the same rounds, and report each model against it "
                                   "(with --kit or --model-repository)")
    src.add_argument("--servers", type=int, default=MatrixConfig.servers,
                     help="server lives to split the rounds over: a fresh tritonserver for each share, whose "
                          "instances' luck the intervals then hold (with --kit or --model-repository; "
                          f"default {MatrixConfig.servers})")
    m = ap.add_argument_group("matrix")
    m.add_argument("--models", help="comma-separated (default: every model the server has ready)")
    m.add_argument("--baseline", default="baseline", help="the model every ratio is taken against")
    m.add_argument("--concurrency", default="1,4,16", help="concurrent users per load level (default 1,4,16)")
    m.add_argument("--prompt-bands", default="short", help=f"comma-separated of {', '.join(PROMPT_BANDS)} (default short)")
    m.add_argument("--output-bands", default="short",
                   help="comma-separated of " + ", ".join(f"{k} ({v} tokens)" for k, v in OUTPUT_BANDS.items()) + " (default short)")
    m.add_argument("--sampling", default="greedy", help=f"comma-separated of {', '.join(SAMPLING)} (default greedy)")
    m.add_argument("--max-tokens", type=int, help="override the output bands' token count")
    m.add_argument("--max-tokens-spread", type=float, default=OUTPUT_SPREAD,
                   help="request i asks for the tokens x uniform(1 - spread, 1 + spread), the same for every model; "
                        f"0 keeps closed-loop users in lockstep (default {OUTPUT_SPREAD})")
    m.add_argument("--prompts-file", help="your own JSONL of prompts ({\"prompt\": ...} per line)")
    m.add_argument("--prompts", type=int, default=32, help="held-out prompts per workload (default 32)")
    m.add_argument("--rounds", type=int, default=MatrixConfig.rounds,
                   help=f"interleaved trials per model and load level (default {MatrixConfig.rounds})")
    m.add_argument("--duration", type=float, default=MatrixConfig.duration_s,
                   help=f"measured seconds per trial (default {MatrixConfig.duration_s:g})")
    m.add_argument("--warmup", type=float, default=MatrixConfig.warmup_s,
                   help=f"seconds per trial before measuring (default {MatrixConfig.warmup_s:g})")
    m.add_argument("--warmup-rounds", type=int, default=MatrixConfig.warmup_rounds,
                   help=f"unmeasured rounds of every model opening each load level (default {MatrixConfig.warmup_rounds})")
    m.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    m.add_argument("--workers", type=int, default=0, help="Locust distributed mode: worker processes per load level")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--guardrails", default=str(GUARDRAILS), help="YAML or TOML rollback thresholds (default loadtest/guardrails.yaml)")
    m.add_argument("--out", default=None, help="report folder (default reports/loadtest-<time>)")
    return ap.parse_args(argv)


def config_from_args(a: argparse.Namespace, models: list[str]) -> MatrixConfig:
    return MatrixConfig(
        models=models, concurrency=[int(x) for x in a.concurrency.split(",")],
        workloads=workloads(a.prompt_bands.split(","), a.output_bands.split(","), a.sampling.split(","),
                            a.max_tokens, a.prompts_file, a.max_tokens_spread),
        rounds=a.rounds, duration_s=a.duration, warmup_s=a.warmup, warmup_rounds=a.warmup_rounds,
        protocol=a.protocol, grpc_url=a.grpc_url, http_url=a.http_url, metrics_url=a.metrics_url, baseline=a.baseline,
        aa_model=aa_name(a.baseline) if a.aa else None, revision=a.revision, prompts=a.prompts, seed=a.seed,
        workers=a.workers, servers=a.servers, out=a.out)


def main(argv: list[str] | None = None) -> int:
    from specdec.serving.server import assemble_backends, repository_models
    from specdec.tools.loadtest.guardrails import load_guardrails
    from specdec.tools.loadtest.report import write_report

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "canary":
        from specdec.tools.loadtest.canary import main as canary_main

        return canary_main(argv[1:])
    a = parse_args(argv)
    a.out = a.out or str(REPORTS / time.strftime("loadtest-%Y%m%d-%H%M%S"))
    try:
        rules = load_guardrails(a.guardrails)
    except (OSError, ValueError) as exc:
        print(f"error: guardrails {a.guardrails}: {exc}", file=sys.stderr)
        return 2
    server, added, twins = None, [], []
    try:
        if a.rev and not (a.kit or a.model_repository):
            raise ValueError("--rev needs --kit or --model-repository (the command serves the revision's twins itself)")
        a.revision = revision.resolve(a.rev) if a.rev else None
        if a.kit or a.model_repository:
            out = Path(a.out)
            repo = out / "model_repository" if a.kit else Path(a.model_repository)
            models = a.models.split(",") if a.models else None
            print(f"starting tritonserver ({repo}) ...", flush=True)
            if a.aa and not a.kit:
                added.append(repo / aa_name(a.baseline))  # added to the user's repository: removed afterwards
            if a.kit:
                write_repository_for(a.kit, repo, models)
            backend_dir = None
            if a.revision:
                backend_dir = assemble_backends(out / "backends")
                backend = revision.add_backend(backend_dir, a.revision,
                                               revision.export(a.revision, out / f"revision-{revision.short(a.revision)}"))
                compared = models or repository_models(repo)
                twins = [f.name for f in revision.write_twins(repo, compared, a.revision, backend)]
                added += [repo / t for t in twins] if not a.kit else []
            server = start_server(repo, out, aa_of=a.baseline if a.aa else None, backend_dir=backend_dir)
            a.grpc_url, a.http_url, a.metrics_url = server.grpc_url, server.http_url, server.metrics_url
        models = a.models.split(",") if a.models else [m for m in served_models(a.http_url) if m not in twins]
        if a.aa and aa_name(a.baseline) not in models:
            models.append(aa_name(a.baseline))
        models += twins
        if a.aa and not server and aa_name(a.baseline) not in served_models(a.http_url):
            raise ValueError(f"--aa: the running server has no {aa_name(a.baseline)} (the A/A copy); give --kit or "
                             "--model-repository to have one added")
        cfg = config_from_args(a, models)
        print(f"load matrix: {len(cfg.workloads)} workload(s) x concurrency {cfg.concurrency}; {cfg.rounds} "
              f"interleaved rounds of {', '.join(models)} after {cfg.warmup_rounds} unmeasured; {cfg.warmup_s:g} s "
              f"warm-up + {cfg.duration_s:g} s measured per trial -> {a.out}", flush=True)

        def restart(life: int):
            nonlocal server
            server.stop()
            server = None
            server = start_server(repo, out / f"life{life}", aa_of=a.baseline if a.aa else None, backend_dir=backend_dir)
            return server

        report = run_matrix(cfg, progress=lambda d, t, s: print(f"  [{d + 1 if d < t else t}/{t}] {s}", flush=True),
                            restart=restart if server else None)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
        for folder in added:
            shutil.rmtree(folder, ignore_errors=True)
    paths = write_report(report, rules, a.out)
    print(paths["verdict_table"])
    print(f"wrote {paths['json']}, {paths['md']} and {len(paths['plots'])} plots")
    failed = [c for c in report["cells"] if c["figures"].get("error")]
    for c in failed:
        print(f"error: {c['model']} at concurrency {c['concurrency']}: {c['figures']['error']}", file=sys.stderr)
    return 1 if failed else 0
