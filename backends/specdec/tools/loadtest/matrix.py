"""`specdec loadtest`: the load matrix. For every workload, load level and served model (models
innermost, so each load level is measured side by side), run Locust headless against Triton,
collect every request's sample and the server's metrics, then write report.json, report.md and
plots, and end in a keep / keep-below-N / roll-back verdict per method from the guardrails file.

Each cell is one `locust --headless` process (the users run on gevent; a separate process keeps
that away from this one, which samples server memory and scrapes metrics meanwhile). Everything
but the model and the number of users is held fixed and recorded: prompts (one file per
workload), max tokens, sampling, seeds, duration.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specdec.paths import GUARDRAILS, PACKAGE_ROOT, REPORTS
from specdec.tools.loadtest import stats
from specdec.tools.loadtest.workload import OUTPUT_BANDS, PROMPT_BANDS, SAMPLING, Workload, prompts_for, workloads, write_prompts

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


@dataclass
class MatrixConfig:
    models: list[str]
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])
    workloads: list[Workload] = field(default_factory=lambda: [Workload()])
    duration_s: float = 30.0
    warmup_s: float = 5.0
    requests: int | None = None  # request count per cell instead of duration (after warmup_requests)
    warmup_requests: int = 2
    protocol: str = "grpc"
    grpc_url: str = "localhost:8001"
    http_url: str = "localhost:8000"
    metrics_url: str = "http://localhost:8002/metrics"
    baseline: str = "baseline"
    prompts: int = 32
    seed: int = 0
    stop_timeout_s: float = 120.0
    workers: int = 0  # > 0: Locust distributed mode, one master and this many worker processes per cell
    drain_s: float = 10.0  # distributed mode: time for requests in flight after the last one was sent
    out: str = "reports/loadtest"

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "workloads"}
        d["workloads"] = [w.to_dict() for w in self.workloads]
        return d


# ---- server-side observations -----------------------------------------------------------------------
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


def _cmdline(pid: str) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def _ppid(pid: str) -> str | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("PPid:"):
                return line.split()[1]
    except OSError:
        pass
    return None


def model_processes(model: str, grpc_url: str) -> list[int]:
    """PIDs of the Python backend stubs serving `model` for the tritonserver on this machine that
    listens on grpc_url's port (one per instance); empty when that server is not local."""
    port = grpc_url.rsplit(":", 1)[-1].encode()
    procs = [p.name for p in Path("/proc").iterdir() if p.name.isdigit()]
    servers = set()
    for pid in procs:
        args = _cmdline(pid)
        if args and args[0].endswith(b"tritonserver") and (
                b"--grpc-port=" + port in args or (port == b"8001" and not any(a.startswith(b"--grpc-port") for a in args))):
            servers.add(pid)
    pids = []
    for pid in procs:
        args = _cmdline(pid)
        if len(args) < 2 or not args[0].endswith(b"triton_python_backend_stub"):
            continue
        if Path(args[1].decode(errors="replace")).parent.parent.name == model and _ppid(pid) in servers:
            pids.append(int(pid))
    return pids


def rss_mb(pids: list[int]) -> float | None:
    total, seen = 0, False
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
                    seen = True
        except OSError:
            continue
    return total / 1024 if seen else None


class MemorySampler:
    """Peak resident memory of a model's processes while a cell runs (local servers only)."""

    def __init__(self, pids: list[int], interval_s: float = 0.5) -> None:
        self.pids, self.interval_s, self.peak = pids, interval_s, None
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            value = rss_mb(self.pids)
            if value is not None:
                self.peak = value if self.peak is None else max(self.peak, value)
            if self.stop_event.wait(self.interval_s):
                return

    def __enter__(self) -> "MemorySampler":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        self.thread.join()


def served_models(http_url: str) -> list[str]:
    base = http_url if http_url.startswith("http") else f"http://{http_url}"
    req = urllib.request.Request(f"{base}/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        index = json.loads(r.read())
    return sorted(m["name"] for m in index if m.get("state") == "READY")


# ---- one cell ---------------------------------------------------------------------------------------
def locust_command(cfg: MatrixConfig, model: str, users: int, workload: Workload, prompts_file: Path,
                   samples: Path, csv_prefix: Path | None = None) -> list[str]:
    user_class = "GrpcStreamUser" if cfg.protocol == "grpc" else "HttpSseUser"
    http = cfg.http_url if cfg.http_url.startswith("http") else f"http://{cfg.http_url}"
    if cfg.requests:
        run_time = max(60.0, cfg.requests * 30.0)  # a cap; the users stop at the request count
    else:
        run_time = cfg.warmup_s + cfg.duration_s
    extra = []
    if cfg.workers > 0 and not cfg.requests:
        # a headless master quits at --run-time without waiting for the workers' requests in flight:
        # stop sending at the end of the measurement and give those requests time to finish
        extra = ["--send-for", f"{run_time:.3f}"]
        run_time += cfg.drain_s
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), user_class, "--headless",
           "-u", str(users), "-r", str(users), "--run-time", f"{math.ceil(run_time)}s", *extra,
           "--stop-timeout", f"{cfg.stop_timeout_s:.0f}", "--host", http, "--grpc-url", cfg.grpc_url,
           "--model", model, "--prompts-file", str(prompts_file), "--max-tokens", str(workload.tokens),
           "--temperature", str(workload.temperature), "--top-p", str(workload.top_p), "--seed", str(cfg.seed),
           "--samples-out", str(samples), "--only-summary", "--loglevel", "WARNING"]
    if cfg.requests:
        cmd += ["--max-requests", str(cfg.requests + cfg.warmup_requests)]
    if csv_prefix is not None:
        cmd += ["--csv", str(csv_prefix)]
    return cmd


def worker_command(cfg: MatrixConfig, port: int) -> list[str]:
    user_class = "GrpcStreamUser" if cfg.protocol == "grpc" else "HttpSseUser"
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), user_class, "--worker", "--master-host",
            "127.0.0.1", "--master-port", str(port), "--loglevel", "WARNING"]


def run_cell(cfg: MatrixConfig, model: str, users: int, workload: Workload, prompts_file: Path,
             cell_dir: Path) -> dict:
    cell_dir.mkdir(parents=True, exist_ok=True)
    samples_path = cell_dir / "samples.jsonl"
    samples_path.unlink(missing_ok=True)
    cmd = locust_command(cfg, model, users, workload, prompts_file, samples_path, cell_dir / "locust")
    before = scrape(cfg.metrics_url)
    pids = model_processes(model, cfg.grpc_url)
    t0 = time.time()
    workers = []
    if cfg.workers > 0:  # distributed: the workers run the users and send their samples to the master
        from specdec.serving.server import free_port

        port = free_port()
        cmd += ["--master", "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port),
                "--expect-workers", str(cfg.workers)]
        for i in range(cfg.workers):
            log = open(cell_dir / f"locust-worker{i}.log", "w")
            workers.append(subprocess.Popen(worker_command(cfg, port), stdout=log, stderr=subprocess.STDOUT,
                                            env=_locust_env()))
            log.close()
    with MemorySampler(pids) as memory:
        with open(cell_dir / "locust.log", "w") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_locust_env())
    for w in workers:  # they quit when the master does
        try:
            w.wait(timeout=30)
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()
    time.sleep(0.6)  # the backend flushes its metrics every 0.2 s
    after = scrape(cfg.metrics_url)
    samples = stats.load_samples(samples_path)
    if cfg.requests:
        ordered = sorted(samples, key=lambda s: s["start"])
        measured = ordered[cfg.warmup_requests:]
        w0 = measured[0]["start"] if measured else t0
        w1 = max((s["start"] + (s["e2e"] or 0.0) for s in measured), default=w0)
        w1 = max(w1, w0 + 1e-9)
    else:
        w0, w1 = stats.window(samples, cfg.warmup_s, cfg.duration_s)
    fig = stats.figures(samples, w0, w1)
    server = stats.server_figures(before, after, model) if before and after else {}
    client_tokens = sum(s["tokens"] for s in samples)
    fig.update(server)
    fig.update({
        "rss_mb": memory.peak,
        "client_output_tokens_all": client_tokens,  # every request of the cell, warm-up included
        "tokens_match_server": (server.get("server_output_tokens") == client_tokens) if server else None,
        "cell_requests_all": len(samples),
        "locust_exit_code": proc.returncode,
        "wall_s": round(time.time() - t0, 2),
    })
    served = {s.get("served_model") for s in samples if s.get("served_model")}
    if served - {model}:  # a canary router: the same live traffic, split by the model that served it
        fig["by_served_model"] = {m: stats.figures([s for s in samples if s.get("served_model") == m], w0, w1)
                                  for m in sorted(served)}
    if not samples:
        fig["error"] = f"no samples (locust exit code {proc.returncode}; see {cell_dir / 'locust.log'})"
    elif before and not after:
        fig["error"] = f"the server's metrics endpoint stopped answering during the cell (did tritonserver exit?)"
    elif samples and all(s.get("error") for s in samples):
        fig["error"] = f"every request failed, e.g. {samples[-1]['error']}"
    return fig


def _locust_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


# ---- the matrix ---------------------------------------------------------------------------------------
def run_matrix(cfg: MatrixConfig, progress=None) -> dict:
    """Run every cell; returns the report dict (figures, ratios, setup). `progress(done, total, text)`."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    # the baseline first at every load level; a canary router alone needs none (it serves both)
    models = ([cfg.baseline] if cfg.baseline in cfg.models else []) + [m for m in cfg.models if m != cfg.baseline]
    total = len(cfg.workloads) * len(cfg.concurrency) * len(models)
    cells, done = [], 0
    for wi, workload in enumerate(cfg.workloads):
        prompts_file = write_prompts(out / "prompts" / f"workload{wi}.jsonl",
                                     prompts_for(workload, cfg.prompts, cfg.seed))
        for users in cfg.concurrency:
            for model in models:
                if progress:
                    progress(done, total, f"{workload.name}  concurrency {users}  {model}")
                cell_dir = out / "cells" / f"w{wi}-c{users}-{model}"
                fig = run_cell(cfg, model, users, workload, prompts_file, cell_dir)
                cells.append({"workload": workload.name, "workload_index": wi, "concurrency": users,
                              "model": model, "figures": fig,
                              "samples": str(cell_dir.relative_to(out) / "samples.jsonl")})
                done += 1
    if progress:
        progress(done, total, "done")
    add_ratios(cells, cfg.baseline)
    report = {"setup": {**cfg.to_dict(), "models": models,
                        "prompt_files": [str(Path("prompts") / f"workload{i}.jsonl") for i in range(len(cfg.workloads))]},
              "cells": cells}
    canary = canary_cells(cells)
    if canary:
        add_ratios(canary, cfg.baseline)
        report["canary_cells"] = canary
    return report


def canary_cells(cells: list[dict]) -> list[dict]:
    """The cells of a canary router split by the model that served each request. Only per-request
    figures compare across the split (rates depend on the share), so the rates are left out."""
    out = []
    for c in cells:
        for model, f in (c["figures"].get("by_served_model") or {}).items():
            f = {**f, "output_tokens_per_s": None, "completed_rps": None}
            out.append({"workload": c["workload"], "workload_index": c["workload_index"],
                        "concurrency": c["concurrency"], "model": model, "router": c["model"], "figures": f})
    return out


def add_ratios(cells: list[dict], baseline: str) -> None:
    """Each figure as a ratio to the baseline's in the same workload and load level (same run)."""
    base = {(c["workload"], c["concurrency"]): c["figures"] for c in cells if c["model"] == baseline}
    for c in cells:
        b = base.get((c["workload"], c["concurrency"]))
        c["ratios"] = {k: stats.ratio(c["figures"].get(k), b.get(k)) if b else None for k in stats.RATIO_FIGURES}


# ---- command line -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="specdec loadtest", description=__doc__.split("\n\n")[0],
                                 epilog="`specdec loadtest canary --help`: add a canary router model to a repository.")
    src = ap.add_argument_group("server (default: a running one at localhost)")
    src.add_argument("--grpc-url", default="localhost:8001")
    src.add_argument("--http-url", default="localhost:8000")
    src.add_argument("--metrics-url", default="http://localhost:8002/metrics", type=metrics_endpoint)
    src.add_argument("--model-repository", help="start tritonserver on free ports with this repository")
    src.add_argument("--kit", help="build a repository from this kit folder (target/ draft/ medusa/ eagle/) and serve it")
    m = ap.add_argument_group("matrix")
    m.add_argument("--models", help="comma-separated (default: every model the server has ready)")
    m.add_argument("--baseline", default="baseline", help="the model every ratio is taken against")
    m.add_argument("--concurrency", default="1,4,16", help="concurrent users per load level (default 1,4,16)")
    m.add_argument("--prompt-bands", default="short", help=f"comma-separated of {', '.join(PROMPT_BANDS)} (default short)")
    m.add_argument("--output-bands", default="short",
                   help="comma-separated of " + ", ".join(f"{k} ({v} tokens)" for k, v in OUTPUT_BANDS.items()) + " (default short)")
    m.add_argument("--sampling", default="greedy", help=f"comma-separated of {', '.join(SAMPLING)} (default greedy)")
    m.add_argument("--max-tokens", type=int, help="override the output bands' token count")
    m.add_argument("--prompts-file", help="your own JSONL of prompts ({\"prompt\": ...} per line)")
    m.add_argument("--prompts", type=int, default=32, help="held-out prompts per workload (default 32)")
    m.add_argument("--duration", type=float, default=30.0, help="measured seconds per cell (default 30)")
    m.add_argument("--warmup", type=float, default=5.0, help="seconds per cell before measuring (default 5)")
    m.add_argument("--requests", type=int, help="measure this many requests per cell instead of --duration")
    m.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    m.add_argument("--workers", type=int, default=0, help="Locust distributed mode: worker processes per cell")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--guardrails", default=str(GUARDRAILS), help="YAML or TOML rollback thresholds (default loadtest/guardrails.yaml)")
    m.add_argument("--out", default=None, help="report folder (default reports/loadtest-<time>)")
    return ap.parse_args(argv)


def config_from_args(a: argparse.Namespace, models: list[str]) -> MatrixConfig:
    return MatrixConfig(
        models=models, concurrency=[int(x) for x in a.concurrency.split(",")],
        workloads=workloads(a.prompt_bands.split(","), a.output_bands.split(","), a.sampling.split(","),
                            a.max_tokens, a.prompts_file),
        duration_s=a.duration, warmup_s=a.warmup, requests=a.requests, protocol=a.protocol, grpc_url=a.grpc_url,
        http_url=a.http_url, metrics_url=a.metrics_url, baseline=a.baseline, prompts=a.prompts, seed=a.seed,
        workers=a.workers, out=a.out)


def main(argv: list[str] | None = None) -> int:
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
    server = None
    try:
        if a.kit or a.model_repository:
            server = start_server(a)
        models = a.models.split(",") if a.models else served_models(a.http_url)
        cfg = config_from_args(a, models)
        print(f"load matrix: {len(cfg.workloads)} workload(s) x concurrency {cfg.concurrency} x "
              f"{', '.join(models)}; {'%d requests' % cfg.requests if cfg.requests else '%.0f s' % cfg.duration_s} "
              f"per cell after {cfg.warmup_s:.0f} s warm-up -> {a.out}", flush=True)
        report = run_matrix(cfg, progress=lambda d, t, s: print(f"  [{d + 1 if d < t else t}/{t}] {s}", flush=True))
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    paths = write_report(report, rules, a.out)
    print(paths["verdict_table"])
    print(f"wrote {paths['json']}, {paths['md']} and {len(paths['plots'])} plots")
    failed = [c for c in report["cells"] if c["figures"].get("error")]
    for c in failed:
        print(f"error: {c['model']} at concurrency {c['concurrency']}: {c['figures']['error']}", file=sys.stderr)
    return 1 if failed else 0


def start_server(a: argparse.Namespace):
    """Serve --model-repository (or a repository built from --kit) on free ports; updates a's URLs."""
    from specdec.serving.repository import write_repository
    from specdec.serving.server import TritonServer, free_port

    repo = a.model_repository
    if a.kit:
        kit = Path(a.kit)
        repo = str(Path(a.out or ".") / "model_repository")
        write_repository(repo, kit / "target", **{k: kit / k for k in ("draft", "medusa", "eagle") if (kit / k).is_dir()},
                         models=a.models.split(",") if a.models else None, absolute=True)
    server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          log_file=Path(a.out) / "tritonserver.log" if a.out else None)
    print(f"starting tritonserver ({', '.join(server.models)}) ...", flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    server.start(timeout_s=600)
    a.model_repository = str(server.model_repository)
    a.grpc_url, a.http_url, a.metrics_url = server.grpc_url, server.http_url, server.metrics_url
    return server
