"""Serving overhead benchmark (not a test): streamed tokens/s at concurrency 1 through tritonserver
(gRPC stream) versus the same engine in-process, same model config, same prompts.

    python -m specdec.tools.serve_bench --model spec_eagle                 # a model of model_repository/
    python -m specdec.tools.serve_bench --target DIR --method baseline     # any checkpoint (temp repository)

Both sides run greedy with ignore_eos, so every request produces exactly --max-tokens tokens, and
the texts must match. Rates are client-side: tokens / (last token - submit), TTFT included. The
in-process side streams through the engine's background thread and callback, as the backend does,
in a worker process of its own (as the backend's stub is).
Requests alternate between the two sides one at a time; `ratio` is the median of per-pair ratios.
`cpu_per_token` splits the CPU seconds per token: the in-process engine vs the backend stub
(engine + response IPC), tritonserver and the client; `cpu_ratio` = in-process / all three, the
tokens/s ratio to expect when the machine has no spare core for the serving path.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from specdec.paths import MODEL_REPOSITORY

from specdec.serving.client import request_inputs, stream
from specdec.core.engine_config import build_engine
from specdec.core.sampling import SamplingParams
from specdec.core.config import add_arguments
from specdec.serving.config import PARAMETERS, backend_options, engine_config_for, read_parameters
from specdec.serving.repository import MODELS, write_repository
from specdec.serving.server import TritonServer

DEFAULT_PROMPTS = [
    "def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
    "    for i in range(len(items)):\n", "def read_config(path):\n    with open(path) as f:\n",
    "try:\n    import json\nexcept ImportError:\n", "if __name__ == '__main__':\n", "    return sorted(",
]


class InProcess:
    """The engine in this process, streaming through its background thread and callback."""

    def __init__(self, model_dir: Path) -> None:
        self.engine = build_engine(engine_config_for(model_dir))
        self.engine.start()

    def run(self, prompt: str, max_tokens: int) -> tuple[float, str]:
        done, parts, count, last = threading.Event(), [], [0], [0.0]

        def on_output(out):
            parts.append(out.text)
            if out.token_ids:
                count[0] += len(out.token_ids)
                last[0] = time.perf_counter()
            if out.finished:
                done.set()
        t0 = time.perf_counter()
        self.engine.submit(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), on_output)
        done.wait()
        return count[0] / (last[0] - t0), "".join(parts)

    def close(self) -> None:
        self.engine.stop()


def through_triton(url: str, model: str, prompt: str, max_tokens: int, protocol: str) -> tuple[float, str]:
    inputs = request_inputs(prompt, max_tokens=max_tokens, ignore_eos=True, stream=True, exclude_input_in_output=True)
    t0 = time.perf_counter()
    count, last, parts = 0, t0, []
    for chunk in stream(url, model, inputs, protocol):
        if chunk.token_ids:
            count += len(chunk.token_ids)
            last = chunk.time
        parts.append(chunk.text)
    return count / (last - t0), "".join(parts)


def _worker(model_dir: str, conn) -> None:
    """The in-process side in a process of its own (like the backend's stub: no gRPC client in it)."""
    local = InProcess(Path(model_dir))
    try:
        while (job := conn.recv()) is not None:
            c0 = _cpu_self()
            rate, text = local.run(*job)
            conn.send((rate, text, _cpu_self() - c0))
    finally:
        local.close()


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_pids(pids: list[int]) -> float:
    """utime + stime of these processes (all their threads), seconds."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return total


def _server_pids(root: int) -> dict[str, list[int]]:
    """tritonserver and its backend stub processes (children)."""
    stubs = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == root:
                stubs.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            pass
    return {"server": [root], "stub": stubs}


def compare(repo: Path, model: str, prompts: list[str], max_tokens: int, repeats: int, protocol: str) -> dict:
    """Alternate in-process and Triton requests prompt by prompt (one at a time: concurrency 1), so
    load from anything else on the machine hits both sides alike; the first round warms up. Also
    accounts CPU seconds per token on each side: wall time on a shared machine swings with
    whatever else runs, CPU time much less."""
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    worker = ctx.Process(target=_worker, args=(str(repo / model), child_conn), daemon=True)
    worker.start()
    server = TritonServer(repo, [model])
    cpu = {"in_process": 0.0, "stub": 0.0, "server": 0.0, "client": 0.0}
    tokens = 0
    try:
        with server:
            url = server.grpc_url if protocol == "grpc" else server.http_url
            pids = _server_pids(server.proc.pid)
            pairs, match = [], True
            for r in range(repeats + 1):
                for prompt in prompts:
                    conn.send((prompt, max_tokens))
                    a, text_a, cpu_a = conn.recv()
                    before = (_cpu_pids(pids["stub"]), _cpu_pids(pids["server"]), _cpu_self())
                    b, text_b = through_triton(url, model, prompt, max_tokens, protocol)
                    after = (_cpu_pids(pids["stub"]), _cpu_pids(pids["server"]), _cpu_self())
                    if r:
                        pairs.append((a, b))
                        match &= text_a == text_b
                        tokens += max_tokens
                        cpu["in_process"] += cpu_a
                        for key, x, y in zip(("stub", "server", "client"), before, after):
                            cpu[key] += y - x
    finally:
        conn.send(None)
        worker.join(30)
    a = statistics.median(p[0] for p in pairs)
    b = statistics.median(p[1] for p in pairs)
    per_token = {f"{k}_ms": round(v / tokens * 1000, 3) for k, v in cpu.items()}
    triton_cpu = per_token["stub_ms"] + per_token["server_ms"] + per_token["client_ms"]
    return {"in_process_tokens_per_s": round(a, 1), "triton_tokens_per_s": round(b, 1),
            "ratio": round(statistics.median(p[1] / p[0] for p in pairs), 3), "requests": len(pairs),
            "texts_match": match, "cpu_per_token": per_token,
            "cpu_ratio": round(per_token["in_process_ms"] / triton_cpu, 3) if triton_cpu else None,
            "pairs": [[round(x, 1), round(y, 1)] for x, y in pairs]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specdec.tools.serve_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-repository", default=str(MODEL_REPOSITORY))
    ap.add_argument("--model", default="baseline")
    ap.add_argument("--target", help="benchmark this checkpoint instead (written into a temp repository)")
    ap.add_argument("--draft")
    ap.add_argument("--medusa")
    ap.add_argument("--eagle")
    add_arguments(ap.add_argument_group("with --target: the model's settings"), ["dtype", "stream_interval"], PARAMETERS)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    try:  # a session (scheduler autogroup) of our own, shared by both sides, apart from other work
        os.setsid()
    except OSError:
        pass
    prompts = DEFAULT_PROMPTS[: args.prompts]
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(args.model_repository)
        if args.target:
            repo = Path(tmp)
            write_repository(repo, args.target, args.draft, args.medusa, args.eagle, models=[args.model],
                             dtype=args.dtype, absolute=True, stream_interval=args.stream_interval)
        if not (repo / args.model / "config.pbtxt").exists():
            print(f"error: no model {args.model!r} in {repo} (models: {', '.join(MODELS)})", file=sys.stderr)
            return 2
        options = backend_options(read_parameters(repo / args.model / "config.pbtxt"))
        result = {"model": args.model, "protocol": args.protocol, "max_tokens": args.max_tokens, **asdict(options),
                  **compare(repo, args.model, prompts, args.max_tokens, args.repeats, args.protocol)}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
