"""`specdec serve` as a user runs it, on the real tritonserver: a killed backend stub is reloaded
while the other models keep serving; a killed tritonserver is restarted; SIGINT/SIGTERM drain the
streams in flight and stop cleanly with the ports free at once; SIGHUP, a closed stdout and a killed
`specdec serve` leave no tritonserver. (`make serve` on the committed repository: test_readme.py.)

Every server here is a `specdec serve` subprocess on tiny checkpoints.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from specdec.paths import REPO_ROOT
from specdec.serving.client import grpc_tensors, request_inputs
from specdec.serving.repository import write_repository
from specdec.serving.server import free_ports
from specdec.serving.supervisor import stub_pids
from specdec.tools.loadtest.matrix import scrape
from tiny_checkpoints import make_tiny_kit

pytestmark = pytest.mark.slow

LONG = 480  # tokens: a stream that is still running when the test acts on the server
CRASH = re.compile(r"Signal \((6|11)\)|malloc\(\)|tcache|Exit timeout expired|lock_exception|Aborted")


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tokenizer_dir) -> Path:
    root = tmp_path_factory.mktemp("resilience")
    kit = make_tiny_kit(root / "kit", tokenizer_dir)
    repo = root / "model_repository"
    write_repository(repo, kit["target"], models=["baseline", "spec_ngram"], policy="fixed", max_batch=4,
                     max_context=512)
    return repo


# ---- helpers -------------------------------------------------------------------------------------
class Serve:
    """`specdec serve` in a subprocess (its own session, as from a terminal), its stdout collected."""

    def __init__(self, tmp: Path, repo: Path, *args: str, ports: list[int] | None = None) -> None:
        self.ports = ports or free_ports(3)
        self.log = tmp / f"tritonserver-{self.ports[0]}.log"
        port_args = ["--http-port", str(self.ports[0]), "--grpc-port", str(self.ports[1]),
                     "--metrics-port", str(self.ports[2]), "--log-file", str(self.log), *args]
        cmd = [sys.executable, "-m", "specdec.serving.server", "--model-repository", str(repo), *port_args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, cwd=REPO_ROOT)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout_s: float = 240) -> "Serve":
        deadline = time.monotonic() + timeout_s
        while not any(line.startswith("Ctrl-C") for line in self.lines):
            assert self.proc.poll() is None, f"specdec serve exited:\n{self.text}"
            assert time.monotonic() < deadline, f"not ready after {timeout_s} s:\n{self.text}"
            time.sleep(0.1)
        return self

    @property
    def http(self) -> str:
        return f"localhost:{self.ports[0]}"

    @property
    def grpc(self) -> str:
        return f"localhost:{self.ports[1]}"

    def server_pid(self) -> int | None:
        pids = tritonservers(self.ports[0])
        return pids[0] if pids else None

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            self.reader.join(5)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in tritonservers(self.ports[0]):  # never leave one behind, whatever failed
            os.killpg(pid, signal.SIGKILL)


def processes(program: str, arg: str) -> list[int]:
    """Processes running `program` (the end of its path) with `arg` among their arguments."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv[0].endswith(program) and arg in argv:
            found.append(int(entry.name))
    return found


def tritonservers(http_port: int) -> list[int]:
    return processes("/tritonserver", f"--http-port={http_port}")


def stubs_of(server_pid: int) -> list[int]:
    """Stubs started by that tritonserver, also once they are orphans (their argv names the parent)."""
    return processes("triton_python_backend_stub", str(server_pid))


@dataclass
class Stream:
    """One gRPC stream of `max_tokens` tokens, read on its own thread."""

    url: str
    model: str
    max_tokens: int = LONG
    tokens: int = 0
    outcome: str | None = None  # "final" | "error: ..."
    ended_at: float | None = None
    first: threading.Event = field(default_factory=threading.Event)

    def start(self) -> "Stream":
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        responses: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.url)
        client.start_stream(callback=lambda result=None, error=None: responses.put((result, error)))
        try:
            client.async_stream_infer(self.model, grpc_tensors(request_inputs(
                "def add(a, b):", max_tokens=self.max_tokens, ignore_eos=True, stream=True)),
                enable_empty_final_response=True)
        except InferenceServerException as exc:  # the stream broke before the request went out (a server
            responses.put((None, exc))  # going down): its error is this stream's outcome, not a dead thread
        while self.outcome is None:
            result, error = responses.get()
            self.first.set()
            if error is not None:
                self.outcome = f"error: {error.message()}"
            else:
                ids = result.as_numpy("output_ids")
                self.tokens += 0 if ids is None else len(ids)
                if result.get_response().parameters["triton_final_response"].bool_param:
                    self.outcome = "final"
        self.ended_at = time.monotonic()
        client.close()


def open_streams(url: str, model: str, n: int, running: int = 4) -> list[Stream] | None:
    """n streams, once `running` of them (the model's KV slots) have their first response; None
    where one ended in an error instead (the server or the model's stub went down under them)."""
    streams = [Stream(url, model).start() for _ in range(n)]
    assert wait_for(lambda: sum(s.first.is_set() for s in streams) >= min(n, running), 60), "no first response"
    return None if any((s.outcome or "").startswith("error") for s in streams) else streams


def generate(http: str, model: str, **body) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{http}/v2/models/{model}/generate", method="POST",
                                     data=json.dumps({"text_input": "def", "max_tokens": 4, **body}).encode())
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except (urllib.error.URLError, OSError) as exc:
        return 0, {"error": str(exc)}


def metric(http_metrics_port: int, name: str, model: str) -> float | None:
    return scrape(f"http://localhost:{http_metrics_port}/metrics").get((name, (("model", model),)))


def arrived(http_metrics_port: int, model: str) -> float:
    """Requests the model's engine has seen: running + waiting + finished (any reason), as last
    flushed (every 0.2 s), so it lags an arrival by up to that much."""
    names = {"specdec:num_requests_running", "specdec:num_requests_waiting", "specdec:request_success"}
    return sum(value for (name, labels), value in scrape(f"http://localhost:{http_metrics_port}/metrics").items()
               if name in names and ("model", model) in labels)


def wait_for(predicate, timeout_s: float, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    return predicate()


# ---- a dead stub, a dead tritonserver --------------------------------------------------------------
@pytest.fixture(scope="module")
def stub_killed(repo, tmp_path_factory):
    """Kill -9 spec_ngram's stub while 24 streams are in flight on it (4 running, 20 waiting for a
    KV slot: 6 x LONG steps a slot, a second or more) and baseline is asked every 0.2 s. Three
    streams were too few: they ran their LONG tokens out in 0.3 s here, and in a CI run (at 8b513cb)
    every try found them all ended by the time of the kill, so none was killed."""
    serve = Serve(tmp_path_factory.mktemp("stub"), repo, "--drain-timeout", "2").wait_ready()
    baseline: list[tuple[float, int]] = []
    done = threading.Event()

    def poll_baseline() -> None:
        while not done.is_set():
            baseline.append((time.monotonic(), generate(serve.http, "baseline")[0]))
            time.sleep(0.2)
    poller = threading.Thread(target=poll_baseline, daemon=True)
    poller.start()
    # tritonserver itself sometimes crashes (a libc backtrace in its log) when a stub is killed
    # under streams, and now and then just after it is ready (`boost::interprocess::lock_exception`;
    # the streams opened on it then broke): then a model reload is not what is being tested, so the
    # kill is repeated on the restarted server (up to three tries); `server_crashes` (the watchdog's
    # restarts of tritonserver) tells the later tests how often it happened
    streams, t_kill, served_again, kills = [], None, None, 0
    for _ in range(3):
        assert wait_for(lambda: generate(serve.http, "spec_ngram")[0] == 200, 120), f"spec_ngram does not serve:\n{serve.text}"
        server = serve.server_pid()
        opened = open_streams(serve.grpc, "spec_ngram", 24)
        stubs = stub_pids(server)
        # the kill is about the streams still running: one that already ended (once, the test of
        # the dead stub's streams passed strictly-xfailed: they had all ended within seconds) is not
        running = [s for s in opened or [] if s.outcome is None]
        if opened is None or not running:
            continue
        streams = running
        t_kill = time.monotonic()
        os.kill(stubs["spec_ngram"].pop(), signal.SIGKILL)
        kills += 1
        served_again = wait_for(lambda: generate(serve.http, "spec_ngram")[0] == 200 and time.monotonic(), 30)
        time.sleep(1.0)
        if serve.server_pid() == server:
            break
        for s in streams:
            wait_for(lambda: s.outcome is not None, 10)
    server_crashes = serve.text.count("watchdog: tritonserver exited with code")
    try:
        yield dict(serve=serve, streams=streams, t_kill=t_kill, served_again=served_again, baseline=baseline,
                   server_crashes=server_crashes, kills=kills)
    finally:
        done.set()
        poller.join(5)
        serve.close()


def test_dead_stub_is_reloaded_and_the_other_models_keep_serving(stub_killed):
    serve, t_kill = stub_killed["serve"], stub_killed["t_kill"]
    assert stub_killed["served_again"], f"spec_ngram does not serve 30 s after its stub died:\n{serve.text}"
    assert stub_killed["served_again"] - t_kill < 30
    assert re.search(r"watchdog: model spec_ngram: backend stub \(pid \d+\) died with \d+ requests in flight",
                     serve.text) and "spec_ngram serves again" in serve.text
    assert stub_killed["server_crashes"] < 3, f"tritonserver crashed at every stub kill:\n{serve.text}"
    watchdog = "\n".join(line for line in serve.text.splitlines() if line.startswith("watchdog"))
    # a kill the server crashed at is repeated on the restarted one (the fixture); whether that kill
    # was also a model reload depends on who the watchdog saw die first (once, CI: tritonserver, so
    # 2 kills, 1 reload): the counter must match the reloads the watchdog reported, at least one
    reloads = len(re.findall(r"watchdog: model spec_ngram: backend stub \(pid [\d, ]+\) died", serve.text))
    assert 1 <= reloads <= stub_killed["kills"], watchdog
    assert metric(serve.ports[2], "specdec:model_restarts", "spec_ngram") == reloads, watchdog
    assert metric(serve.ports[2], "specdec:model_restarts", "baseline") == 0, watchdog
    around = [status for t, status in stub_killed["baseline"] if t > t_kill - 1]
    assert len(around) >= 5 and set(around) == {200}, around  # baseline never stopped serving


@pytest.mark.xfail(strict=True, reason=(
    "Triton 2.51's Python backend never completes the response factories of a dead decoupled stub "
    "(python_be.cc r24.10: 'TODO: Implement restart on decoupled'); its clients end when tritonserver "
    "exits (next test), not within seconds"))
def test_streams_of_a_dead_stub_end_within_seconds(stub_killed):
    for s in stub_killed["streams"]:
        assert s.outcome is not None and s.ended_at - stub_killed["t_kill"] < 5


def test_dead_tritonserver_is_restarted(stub_killed):
    serve = stub_killed["serve"]
    pid = serve.server_pid()
    # the streams the dead stub left hanging end with the server; one whose last tokens were on
    # their way as the stub died ended in full (once in CI: 'final', 480 of 480 tokens), not hanging
    hanging = [s for s in stub_killed["streams"] if s.outcome is None]
    assert hanging, stub_killed["streams"]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    for s in hanging:
        assert wait_for(lambda: s.outcome is not None, 10), "a stream outlived its tritonserver"
        assert s.outcome.startswith("error")
    assert wait_for(lambda: generate(serve.http, "spec_ngram")[0] == 200, 120), serve.text
    assert "tritonserver exited with code -9; restarting it" in serve.text
    assert serve.server_pid() not in (None, pid)
    assert metric(serve.ports[2], "specdec:server_restarts", "spec_ngram") == 1 + stub_killed["server_crashes"]
    assert time.monotonic() - t0 < 120


def test_a_tritonserver_killed_while_a_model_reloads_is_restarted_at_once(repo, tmp_path):
    """A stub dies, the watchdog reloads its model, and tritonserver is killed during that load.
    The load request stayed open (the stub it had started inherited the connection and lived on),
    and the watchdog waited out its 600 s timeout with nothing serving; now it restarts tritonserver
    as soon as the process is gone."""
    serve = Serve(tmp_path, repo, "--models", "spec_ngram").wait_ready()
    try:
        assert wait_for(lambda: generate(serve.http, "spec_ngram")[0] == 200, 60), serve.text
        server = serve.server_pid()
        os.kill(stub_pids(server)["spec_ngram"].pop(), signal.SIGKILL)
        assert wait_for(lambda: "reloading it" in serve.text, 10), serve.text
        time.sleep(0.5)  # into the reload: unloading and loading spec_ngram take seconds
        os.kill(server, signal.SIGKILL)
        assert wait_for(lambda: "reload failed" in serve.text and "tritonserver exited with code -9" in serve.text, 15), serve.text
        assert wait_for(lambda: generate(serve.http, "spec_ngram")[0] == 200, 120), serve.text
        assert metric(serve.ports[2], "specdec:server_restarts", "spec_ngram") == 1
    finally:
        serve.close()


SERVER_CRASH = "tritonserver exited"  # the watchdog's line when tritonserver itself died


def test_restarts_count_each_reload_of_a_model_once(repo, tmp_path):
    """Its stub killed twice on one tritonserver, spec_ngram counts 2 restarts. A dead stub never
    deletes its metrics, so its reload's stub gets them back with their values: one that added the
    watchdog's whole count on top read 1 + 2 = 3 here (and 5 in a CI run whose tritonserver had
    crashed at two of three kills). Triton 2.51 itself sometimes aborts while reloading a model
    whose stub was killed (an uncaught C++ exception in libtriton_python.so; CI at 058f5c9): then
    the premise, one tritonserver, is gone, and the scenario runs again on a fresh server, at most
    3 times."""
    for attempt in range(3):
        (tmp_path / str(attempt)).mkdir()
        serve = Serve(tmp_path / str(attempt), repo, "--models", "spec_ngram").wait_ready()
        try:
            for kill in (1, 2):
                assert wait_for(lambda: generate(serve.http, "spec_ngram")[0] == 200, 60), serve.text
                os.kill(stub_pids(serve.server_pid())["spec_ngram"].pop(), signal.SIGKILL)
                assert wait_for(lambda: SERVER_CRASH in serve.text
                                or serve.text.count("spec_ngram serves again") == kill, 60), serve.text
                if SERVER_CRASH in serve.text:
                    # at once: a second kill on the restarted server found the crash line already
                    # there, went on without waiting for its reload, and the check after it failed
                    # (CI at 8283c3e: tritonserver aborted at the first kill's reload)
                    break
            if SERVER_CRASH in serve.text:
                continue
            assert wait_for(lambda: generate(serve.http, "spec_ngram")[0] == 200, 60), serve.text
            assert metric(serve.ports[2], "specdec:model_restarts", "spec_ngram") == 2
            assert metric(serve.ports[2], "specdec:server_restarts", "spec_ngram") == 0
            return
        finally:
            serve.close()
    pytest.fail(f"tritonserver crashed at a stub's reload in all 3 attempts; the last:\n{serve.text}")


# ---- shutdown ---------------------------------------------------------------------------------------
# Each of these servers starts on the ports the previous one just left: a restart right after a stop
# must not be refused.
PORTS = free_ports(3)


@pytest.mark.parametrize("signum,drain_s", [(signal.SIGINT, 60.0), (signal.SIGTERM, 0.5)])
def test_signal_drains_streams_in_flight_and_stops_cleanly(repo, tmp_path, signum, drain_s):
    serve = Serve(tmp_path, repo, "--models", "spec_ngram", "--drain-timeout", str(drain_s), ports=PORTS).wait_ready()
    try:
        # 4 running, 44 waiting for a KV slot: 12 x LONG steps, so a short drain leaves some unfinished
        # (8 streams finished within 0.5 s once detokenizing got O(1) a step), while the drain still
        # runs when the refused request below arrives (a 0.1 s drain had unloaded the model by then)
        streams = open_streams(serve.grpc, "spec_ngram", 48)
        # every request reached the engine before the signal: one still in a stream thread's send
        # when SIGTERM lands is rightly refused by the drain, which is not what this test asks
        assert wait_for(lambda: arrived(serve.ports[2], "spec_ngram") >= 48, 30), "not all 48 requests arrived"
        t0 = time.monotonic()
        serve.proc.send_signal(signum)
        assert wait_for(lambda: "draining" in serve.text, 5)
        assert wait_for(lambda: "spec_ngram draining" in serve.log.read_text(errors="replace"), 5)  # the backend knows
        status, body = generate(serve.http, "spec_ngram")
        assert status >= 400 and "draining" in body["error"], body  # new requests are refused
        assert serve.wait_exit(drain_s + 30) == 0, serve.text
        for s in streams:
            assert wait_for(lambda: s.outcome is not None, 5), "a stream got no final response"
            assert s.ended_at - t0 < drain_s + 10
            assert (s.outcome, s.tokens) == ("final", LONG) or "drain deadline passed" in s.outcome, s.outcome
        outcomes = [s.outcome for s in streams]
        if drain_s >= 30:
            assert outcomes == ["final"] * len(streams)  # time enough: every output complete
        else:
            assert any(o != "final" for o in outcomes)  # 12 x LONG tokens per slot take longer than that
        log = serve.log.read_text(errors="replace")
        assert not CRASH.search(log), CRASH.search(log).group(0)
        assert not tritonservers(serve.ports[0])
    finally:
        serve.close()


def test_sighup_closed_stdout_and_a_killed_serve_leave_no_tritonserver(repo, tmp_path):
    # a closed terminal: SIGHUP
    serve = Serve(tmp_path, repo, "--models", "spec_ngram", ports=PORTS).wait_ready()
    try:
        assert generate(serve.http, "spec_ngram")[0] == 200
        serve.proc.send_signal(signal.SIGHUP)
        assert serve.wait_exit(60) == 0, serve.text
        assert not tritonservers(PORTS[0])
    finally:
        serve.close()
    # `specdec serve | head -1`: the reader goes away after the first line
    log = tmp_path / "piped.log"
    shell = subprocess.Popen(
        f"{sys.executable} -m specdec.serving.server --model-repository {repo} --models spec_ngram "
        f"--http-port {PORTS[0]} --grpc-port {PORTS[1]} --metrics-port {PORTS[2]} --log-file {log} | head -1",
        shell=True, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        first, _ = shell.communicate(timeout=240)
        assert first.startswith("starting tritonserver")
        assert "Started GRPCInferenceService" in log.read_text()  # it did serve, and stopped
        assert wait_for(lambda: not tritonservers(PORTS[0]), 30)
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
        for pid in tritonservers(PORTS[0]):
            os.killpg(pid, signal.SIGKILL)
    # kill -9 of `specdec serve` itself: tritonserver dies with it (PR_SET_PDEATHSIG), its stubs follow
    serve = Serve(tmp_path, repo, "--models", "spec_ngram", ports=PORTS).wait_ready()
    try:
        pid = serve.server_pid()
        serve.proc.kill()
        assert wait_for(lambda: not tritonservers(PORTS[0]), 5)
        assert wait_for(lambda: not stubs_of(pid), 15), [Path(f"/proc/{p}/status").read_text()[:300] for p in stubs_of(pid)]
    finally:
        serve.close()
