"""Start the real `tritonserver` from the nvidia-pytriton wheel with the specdec backend.

`assemble_backends()` builds a backend directory: `python/` (pytriton's libtriton_python.so, its
utils and the stub for this Python version) and `specdec/model.py` (an entry point importing
`specdec.serving.model`), so model configs say `backend: "specdec"`. `TritonServer` runs the binary
with the environment it needs (docs/design.md, "Triton traps"): the venv's bin first on PATH, the wheel's
`nvidia_pytriton.libs` on LD_LIBRARY_PATH, a unique shared-memory prefix, and waits until every
model is ready; it dies with the process that started it (PR_SET_PDEATHSIG). `main()` is
`specdec serve`: tritonserver under `supervisor.Supervisor` (stub and server restarts, drain on
SIGINT, SIGTERM and SIGHUP), and it ends too when its stdout goes away (`specdec serve | head -1`).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from specdec import OPENMP_ENV
from specdec.paths import CACHE, MODEL_REPOSITORY, PACKAGE_ROOT
from specdec.serving.control import CONTROL_DIR_ENV
from specdec.serving.interface import GRPC_PORT, HTTP_PORT, METRICS_PORT

ENTRY_POINT = "from specdec.serving.model import TritonPythonModel  # noqa: F401\n"
UNLOAD_TIMEOUT_S = 30.0  # how long stop() waits for the models to unload (idle ones take about 1 s)


class ServerError(RuntimeError):
    pass


class ServerExited(ServerError):
    """tritonserver exited on its own before it was ready."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


def pytriton_root() -> Path:
    try:
        import pytriton
    except ImportError as exc:  # pragma: no cover - the serve extra is missing
        raise ServerError("nvidia-pytriton is not installed: pip install -e '.[serve]'") from exc
    root = Path(pytriton.__file__).resolve().parent
    if not (root / "tritonserver" / "bin" / "tritonserver").exists():
        raise ServerError(f"{root}: the wheel has no tritonserver binary")
    return root


def tritonserver_binary() -> Path:
    return pytriton_root() / "tritonserver" / "bin" / "tritonserver"


def assemble_backends(folder: str | Path | None = None) -> Path:
    """The backend directory (cached per pytriton install and Python version); returns its path."""
    triton = pytriton_root() / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = triton / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise ServerError(f"pytriton ships no Python backend stub for Python {version} ({stub})")
    if folder is None:
        key = hashlib.sha1(f"{triton}|{version}|{ENTRY_POINT}".encode()).hexdigest()[:12]
        folder = CACHE / "triton-backends" / key
    folder = Path(folder)
    python, ours = folder / "python", folder / "specdec"
    python.mkdir(parents=True, exist_ok=True)
    ours.mkdir(parents=True, exist_ok=True)
    for src in (triton / "backends" / "python").iterdir():
        if src.is_file():
            _copy(src, python / src.name)  # a copy: tritonserver rejects a library that symlinks out
    _copy(stub, python / stub.name)  # the backend looks for the stub next to libtriton_python.so
    _copy(stub, ours / stub.name)
    entry = ours / "model.py"
    if not entry.exists() or entry.read_text() != ENTRY_POINT:
        tmp = entry.with_name(f".model.py.{os.getpid()}")
        tmp.write_text(ENTRY_POINT)
        os.replace(tmp, entry)
    return folder


def _copy(src: Path, dst: Path) -> None:
    if dst.exists() and dst.stat().st_size == src.stat().st_size:
        return
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}")  # atomic, also with several servers starting at once
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def server_env(threads: int | None = None) -> dict[str, str]:
    """tritonserver's environment: venv bin first on PATH, the wheel's libraries, our package."""
    env = dict(os.environ)
    # the environment that holds pytriton (and torch): its bin/ first, as `activate` does
    venv_bin = pytriton_root().parents[3] / "bin"
    if not (venv_bin / "python").exists():
        venv_bin = Path(sys.executable).parent
    env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("VIRTUAL_ENV", str(venv_bin.parent))
    root = pytriton_root()
    libs = [str(root.parent / "nvidia_pytriton.libs"), str(root / "tritonserver" / "external_libs")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [p for p in libs if Path(p).is_dir()] + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else []))
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    for name, value in OPENMP_ENV.items():
        env.setdefault(name, value)
    return env


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int) -> Callable[[], None]:
    """A preexec_fn: the child gets SIGKILL when the thread that started it dies, even by kill -9,
    so tritonserver is never left serving with parent pid 1 (its stubs then follow their parent)."""
    libc = ctypes.CDLL(None, use_errno=True)  # resolved before the fork

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl
            os._exit(1)
    return preexec


def repository_models(repo: Path) -> list[str]:
    """The models of a repository: its folders with a config.pbtxt, sorted."""
    return sorted(p.name for p in Path(repo).iterdir() if (p / "config.pbtxt").exists())


def free_ports(n: int) -> list[int]:
    """n distinct free ports: held open together while the kernel picks them (picked one at a time,
    a port freed by the first could come back for the second: a load test's second server life
    was refused, "cannot listen to HTTP requests and GRPC requests at the same address and port")."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


START_ATTEMPTS = 3  # starts of tritonserver when a signal kills it while it loads the models


def start_retrying(server: "TritonServer", timeout_s: float, say: Callable[[str], None]) -> None:
    """Start tritonserver, again when a signal killed it while loading: its Python backend aborts
    (`boost::interprocess::lock_exception`) when a stub holds a shared lock too long, as on a
    starved machine. An exit of its own (a bad configuration) fails at once. `specdec serve`'s
    supervisor and the load test's servers (one per server life) start this way."""
    for attempt in range(2, START_ATTEMPTS + 2):
        try:
            server.start(timeout_s)
            return
        except ServerExited as exc:
            if exc.returncode >= 0 or attempt > START_ATTEMPTS:
                raise
            say(f"tritonserver was killed by signal {-exc.returncode} while loading the models "
                f"(its log ends: {server.log_tail(3)}); starting it again ({attempt}/{START_ATTEMPTS})")


class TritonServer:
    """A tritonserver process; a context manager that always kills what it started. A port left
    as None is a free one (tests, benchmarks and load tests run beside other servers)."""

    def __init__(
        self, model_repository: str | Path, models: list[str] | None = None, http_port: int | None = None,
        grpc_port: int | None = None, metrics_port: int | None = None, exit_timeout_s: int = 3, log_file: str | Path | None = None,
        verbose: bool = False, backend_dir: str | Path | None = None, extra_args: list[str] | None = None,
        control_dir: str | Path | None = None,
    ) -> None:
        self.model_repository = Path(model_repository).resolve()
        if not self.model_repository.is_dir():
            raise ServerError(f"model repository {self.model_repository} does not exist")
        self.models = models or repository_models(self.model_repository)
        if not self.models:
            raise ServerError(f"no models (folders with config.pbtxt) in {self.model_repository}")
        picked = iter(free_ports(3))
        self.http_port, self.grpc_port, self.metrics_port = (p or next(picked) for p in (http_port, grpc_port, metrics_port))
        self.exit_timeout_s, self.verbose, self.extra_args = exit_timeout_s, verbose, extra_args or []
        self.backend_dir = Path(backend_dir) if backend_dir else None
        self.log_path = Path(log_file) if log_file else Path(tempfile.mkstemp(prefix="tritonserver-", suffix=".log")[1])
        self.control_dir = Path(control_dir) if control_dir else None  # control.py: drain and restart counts
        self.shm_prefix = f"specdec{os.getpid()}_{self.grpc_port}_"
        self.proc: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://localhost:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        backend_dir = assemble_backends(self.backend_dir)
        cmd = [
            str(tritonserver_binary()),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backend_dir}",
            f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}", f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true", "--allow-gpu-metrics=false", "--allow-cpu-metrics=false",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            "--model-control-mode=explicit", *[f"--load-model={m}" for m in self.models],
            "--strict-readiness=true",
            # a unique shared-memory prefix: several servers (tests, a user's serve) may run at once
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            "--log-verbose=1" if self.verbose else "--log-verbose=0",
            *self.extra_args,
        ]
        return cmd

    def start(self, timeout_s: float = 300.0) -> "TritonServer":
        log = open(self.log_path, "ab")
        env = server_env()
        if self.control_dir is not None:
            env[CONTROL_DIR_ENV] = str(self.control_dir)
        # its own process group (stop() kills the stubs with it; a Ctrl-C in the terminal reaches
        # only `specdec serve`, which drains first), but the caller's session: with scheduler
        # autogroups a new session would get its own CPU share, unlike the caller
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                     process_group=0, preexec_fn=die_with_parent(os.getpid()))
        log.close()
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(self.models)
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerExited(f"tritonserver exited with code {self.proc.returncode} before it was ready:\n"
                                   f"{self.log_tail()}", self.proc.returncode)
            pending = [m for m in pending if not _ok(f"http://{self.http_url}/v2/models/{m}/ready")]
            if not pending and _ok(f"http://{self.http_url}/v2/health/ready"):
                return
            if time.monotonic() > deadline:
                raise ServerError(f"models not ready after {timeout_s:.0f} s: {', '.join(pending)}\n{self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def post(self, path: str, timeout_s: float = 10.0) -> str:
        """POST to tritonserver's HTTP API (e.g. the repository extension); raises ServerError."""
        request = urllib.request.Request(f"http://{self.http_url}{path}", data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as r:
                return r.read().decode()
        except urllib.error.HTTPError as exc:
            raise ServerError(f"POST {path}: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise ServerError(f"POST {path}: {exc}") from None

    def unload_models(self, timeout_s: float = UNLOAD_TIMEOUT_S) -> None:
        """Unload every model and wait (bounded) until none is left: tritonserver then exits at once.
        Its own shutdown counts a decoupled model's streams as no in-flight inference, starts
        unloading and, at --exit-timeout-secs, exits while they still run ("Exit timeout expired.
        Exiting immediately"), which crashed it (`malloc(): unaligned tcache chunk detected`).
        Every model the server has ready, also those loaded later through the repository API (a
        canary router): one left loaded kept the wait to its timeout."""
        index = json.loads(self.post("/v2/repository/index"))
        for model in {m["name"] for m in index if m.get("state") == "READY"} | set(self.models):
            self.post(f"/v2/repository/models/{model}/unload")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(
                m.get("state") in ("READY", "UNLOADING") for m in json.loads(self.post("/v2/repository/index"))):
            time.sleep(0.05)

    def stop(self, timeout_s: float | None = None) -> int | None:
        """Unload the models, SIGINT (clean shutdown), then SIGKILL the whole process group if it lingers."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                self.unload_models()
            except (ServerError, ValueError):  # not serving (yet): nothing to unload
                pass
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout_s if timeout_s is not None else self.exit_timeout_s + 10)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        try:  # stubs left behind by a hung server die with the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for region in Path("/dev/shm").glob(f"{self.shm_prefix}*"):  # a killed server leaves its regions
            region.unlink(missing_ok=True)
        return self.proc.returncode

    def __enter__(self) -> "TritonServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    from specdec.serving.supervisor import DRAIN_TIMEOUT_S, Supervisor

    ap = argparse.ArgumentParser(prog="specdec serve", description="Serve a model repository on tritonserver.")
    ap.add_argument("--model-repository", default=str(MODEL_REPOSITORY))
    ap.add_argument("--models", nargs="*", help="load only these models (default: every model in the repository)")
    ap.add_argument("--http-port", type=int, default=HTTP_PORT)
    ap.add_argument("--grpc-port", type=int, default=GRPC_PORT)
    ap.add_argument("--metrics-port", type=int, default=METRICS_PORT)
    ap.add_argument("--exit-timeout-secs", type=int, default=5)
    ap.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S,
                    help="seconds running requests get to finish after SIGINT/SIGTERM/SIGHUP; the rest end with an error")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for every model to be ready")
    ap.add_argument("--log-file", help="tritonserver log (default: a temp file, its tail is shown on failure)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    console = Console()
    signals: list[int] = []
    starting = [True]

    def on_signal(signum, frame) -> None:  # noqa: ARG001
        signals.append(signum)
        if starting[0]:  # still loading models: give up at once (start() stops what it started)
            raise ServerError(f"stopped by {signal.Signals(signum).name} while starting")
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a closed terminal: SIGHUP
        signal.signal(signum, on_signal)
    with tempfile.TemporaryDirectory(prefix="specdec-control-") as control_dir:
        try:
            server = TritonServer(args.model_repository, args.models, args.http_port, args.grpc_port,
                                  args.metrics_port, args.exit_timeout_secs, args.log_file, args.verbose,
                                  control_dir=control_dir)
            check_checkpoints(server.model_repository, server.models)
            for port in (args.http_port, args.grpc_port, args.metrics_port):
                if not port_free(port):
                    raise ServerError(f"port {port} is in use (pick others with --http-port/--grpc-port/--metrics-port)")
        except ServerError as exc:
            console.error(f"error: {exc}")
            return 1
        supervisor = Supervisor(server, Path(control_dir), console.say, args.drain_timeout, args.timeout)
        try:
            console.say(f"starting tritonserver with {', '.join(server.models)} (log: {server.log_path}) ...")
            t0 = time.monotonic()
            supervisor.start()
            starting[0] = False
            console.say(
                f"ready in {time.monotonic() - t0:.0f} s\n"
                f"  gRPC     {server.grpc_url}\n"
                f"  HTTP     http://{server.http_url}   (POST /v2/models/<model>/generate, /generate_stream)\n"
                f"  metrics  {server.metrics_url}\n"
                f"  models   {', '.join(server.models)}\n"
                f"try: specdec client --model {server.models[0]} --url {server.grpc_url} \"def fib(n):\"\n"
                "Ctrl-C drains and stops the server.")
            supervisor.watch(lambda: bool(signals) or console.gone())
        except ServerError as exc:
            starting[0] = False
            console.error(f"error: {exc}")
            return 1
        finally:
            code = supervisor.drain_and_stop(hurry=lambda: len(signals) > 1)
    console.say(f"tritonserver stopped (exit code {code})")
    return 0 if code == 0 else 1


class Console:
    """stdout that never raises: a reader that went away (`specdec serve | head -1`) sets `broken`,
    which stops the server like a signal, instead of a BrokenPipeError outside any cleanup."""

    def __init__(self) -> None:
        self.broken = False

    def gone(self) -> bool:
        """True once stdout's reader has gone, also while nothing is printed (a pipe reports POLLERR)."""
        if not self.broken and stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode):
            poller = select.poll()
            poller.register(sys.stdout.fileno(), select.POLLERR)
            if poller.poll(0):
                self._lost(sys.stdout)
        return self.broken

    def say(self, text: str) -> None:
        self._write(sys.stdout, text)

    def error(self, text: str) -> None:
        self._write(sys.stderr, text)

    def _write(self, stream, text: str) -> None:
        if self.broken:
            return
        try:
            print(text, file=stream, flush=True)
        except (BrokenPipeError, OSError):
            self._lost(stream)

    def _lost(self, stream) -> None:
        self.broken = True
        devnull = os.open(os.devnull, os.O_WRONLY)  # Python's own flush at exit would raise again
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def check_checkpoints(repo: Path, models: list[str]) -> None:
    """Fail early, naming the folder, when a model's checkpoints are missing (e.g. no demo kit yet)."""
    from specdec.core.errors import ConfigurationError
    from specdec.serving.config import engine_config_for
    from specdec.serving.trtllm_repository import is_engine_model

    for model in models:
        if not is_engine_model(repo / model):  # contract models and BLS orchestrators load no engine here
            continue
        try:
            cfg = engine_config_for(repo / model)
        except ConfigurationError as exc:
            raise ServerError(f"{repo / model / 'config.pbtxt'}: {exc}") from None
        for key in ("target", "draft", "medusa", "eagle"):
            folder = getattr(cfg.checkpoints, key)
            if folder and not Path(folder).is_dir():
                raise ServerError(
                    f"model {model}: {key} checkpoint folder {folder} does not exist. Build the demo kit first "
                    "(make demo), or write a repository for your checkpoints: specdec build-repo --target DIR ...")


def port_free(port: int) -> bool:
    """Free for a server: SO_REUSEADDR as tritonserver binds, so connections of a server that just
    stopped (TIME_WAIT, up to 60 s) do not count."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


if __name__ == "__main__":  # python -m: run the imported module's main, so that the supervisor's
    from specdec.serving.server import main as imported_main  # ServerError is the one main catches

    sys.exit(imported_main())
