"""`specdec serve`'s watchdog and shutdown: tritonserver and every model's backend stub stay up,
and a stop drains.

Watchdog (every POLL_S, in the caller's thread): the stubs are tritonserver's child processes
running `triton_python_backend_stub <repo>/<model>/<version>/model.py ...`; a stub that vanished
(or is a zombie) is a dead model: Triton 2.51's Python backend never restarts a decoupled model's
stub, keeps answering "Stub process ... is not healthy" and keeps `/v2/models/<m>/ready` at 200.
The supervisor unloads and loads that model through the repository API (the other models keep
serving), logs it and counts it (`specdec:model_restarts` on Triton's metrics port, via
`control.py`). If tritonserver itself exits, it is started again on the same ports
(`specdec:server_restarts`), also while a reload's request to it is still open (`post_watched`).

What a reload cannot do: the clients that dead stub was streaming to. Their response factories
live in tritonserver, and only the stub deletes them (python_backend r24.10 `python_be.cc`:
"TODO: Implement restart on decoupled"), so they end only when tritonserver exits.

Shutdown (`drain_and_stop`): write the drain deadline (the backends refuse new requests with a
"draining" error, let running ones finish, and end what is left at the deadline with an error),
wait until every live stub says it is drained, then `TritonServer.stop()` (every model unloaded
before tritonserver gets its SIGINT, so nothing is in flight when it exits).
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from specdec.serving import control
from specdec.serving.server import ServerError, TritonServer, start_retrying

DRAIN_TIMEOUT_S = 30.0  # `specdec serve --drain-timeout`: how long running requests may take to finish
POLL_S = 0.25  # the watchdog's period: a dead stub is noticed within this
ABORT_GRACE_S = 5.0  # after the drain deadline: time for the backends' error responses to go out
STUB = "triton_python_backend_stub"


def stub_pids(server_pid: int) -> dict[str, set[int]]:
    """Live backend stubs of a tritonserver process, by model name (a scan of /proc: ~20 ms)."""
    stubs: dict[str, set[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not is_child(int(entry.name), server_pid):
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if len(argv) < 2 or not argv[0].endswith(STUB.encode()):
            continue
        model = Path(argv[1].decode(errors="replace")).parent.parent.name  # <repo>/<model>/<version>/model.py
        stubs.setdefault(model, set()).add(int(entry.name))
    return stubs


def is_child(pid: int, parent: int) -> bool:
    """pid is a live (not zombie) child of parent: the watchdog's cheap per-tick check."""
    try:
        state, ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
    except (OSError, ValueError):
        return False
    return int(ppid) == parent and state not in ("Z", "X")


class Supervisor:
    def __init__(self, server: TritonServer, control_dir: Path, say: Callable[[str], None],
                 drain_timeout_s: float = DRAIN_TIMEOUT_S, ready_timeout_s: float = 600.0) -> None:
        self.server, self.control, self.say = server, control_dir, say
        self.drain_timeout_s, self.ready_timeout_s = drain_timeout_s, ready_timeout_s
        self.known: dict[str, set[int]] = {}

    def start(self) -> None:
        """Start tritonserver (`server.start_retrying`: again when a signal killed it while loading)."""
        start_retrying(self.server, self.ready_timeout_s, self.say)

    # ---- watchdog -------------------------------------------------------------------------------
    def watch(self, should_stop: Callable[[], bool]) -> None:
        """Keep everything up until should_stop() says so; raises ServerError when a restart fails."""
        self.known = stub_pids(self.server.proc.pid)
        while not should_stop():
            self.check()
            time.sleep(POLL_S)

    def check(self) -> None:
        """One look: restart tritonserver if it exited, reload every model whose stub died."""
        proc = self.server.proc
        if proc.poll() is not None:
            self.restart_server(proc.returncode)
            return
        for model in self.server.models:
            dead = {pid for pid in self.known.get(model, set()) if not is_child(pid, proc.pid)}
            if dead:
                self.reload(model, dead)
                self.known = stub_pids(proc.pid)

    def reload(self, model: str, dead: set[int]) -> None:
        t0 = time.monotonic()
        stuck = self._in_flight(model)
        self.say(f"watchdog: model {model}: backend stub (pid {', '.join(map(str, sorted(dead)))}) died "
                 f"with {'?' if stuck is None else int(stuck)} requests in flight; reloading it")
        counts = control.count_restart(self.control, model)
        try:
            self.post_watched(f"/v2/repository/models/{model}/unload")
            self.post_watched(f"/v2/repository/models/{model}/load", timeout_s=self.ready_timeout_s)
        except ServerError as exc:
            self.say(f"watchdog: model {model}: reload failed: {exc}")
            return
        self.say(f"watchdog: model {model} serves again after {time.monotonic() - t0:.1f} s "
                 f"(restart {counts['models'][model]}; requests that stub was serving end only when tritonserver stops)")

    def post_watched(self, path: str, **post_args: float) -> None:
        """`TritonServer.post`, watching tritonserver's process meanwhile; raises ServerError at once where
        it exits first. A tritonserver killed while it loaded a model left the load request open:
        the stub it had started inherited the connection and lived on, an orphan, so the watchdog
        waited out the whole load timeout (600 s) with a dead server and nothing serving."""
        failed: list[ServerError] = []

        def post() -> None:
            try:
                self.server.post(path, **post_args)
            except ServerError as exc:
                failed.append(exc)

        request = threading.Thread(target=post, daemon=True)  # ends with the connection (the stub
        request.start()  # dies with tritonserver's process group when it is restarted) or its timeout
        while request.is_alive():
            request.join(POLL_S)
            if request.is_alive() and self.server.proc.poll() is not None:
                raise ServerError(f"POST {path}: tritonserver exited with code {self.server.proc.returncode} meanwhile")
        if failed:
            raise failed[0]

    def restart_server(self, code: int) -> None:
        self.say(f"watchdog: tritonserver exited with code {code}; restarting it. Its log ends:\n"
                 f"{self.server.log_tail(15)}")
        counts = control.count_restart(self.control)
        self.server.stop()  # takes the stubs it left with it
        control.clear(self.control)
        t0 = time.monotonic()
        self.start()
        self.known = stub_pids(self.server.proc.pid)
        self.say(f"watchdog: tritonserver serves again after {time.monotonic() - t0:.0f} s (restart {counts['server']})")

    # ---- shutdown -------------------------------------------------------------------------------
    def drain_and_stop(self, hurry: Callable[[], bool] = lambda: False) -> int | None:
        """Drain, unload, stop; returns tritonserver's exit code. hurry() true (a second signal)
        moves the drain deadline to now."""
        proc = self.server.proc
        if proc is None or proc.poll() is not None:
            return self.server.stop()
        deadline = time.time() + self.drain_timeout_s
        control.request_drain(self.control, deadline)
        self.say(f"draining: no new requests; running ones have {self.drain_timeout_s:g} s to finish "
                 "(a second Ctrl-C ends them now)")
        hurried = False
        stubs = set().union(*stub_pids(proc.pid).values())
        while proc.poll() is None and time.time() < deadline + ABORT_GRACE_S:
            if not hurried and hurry():
                hurried, deadline = True, time.time()
                control.request_drain(self.control, deadline)
            if all(control.drained(self.control, pid) or not is_child(pid, proc.pid) for pid in stubs):
                break
            time.sleep(0.05)
        else:
            if proc.poll() is None:
                self.say("draining: some requests did not end in time")
        self.say("stopping tritonserver ...")
        return self.server.stop()  # unloads every model first: nothing is left in flight at its exit

    def _in_flight(self, model: str) -> float | None:
        """The dead stub's last running + waiting gauges (they live in tritonserver, not the stub)."""
        try:
            with urllib.request.urlopen(self.server.metrics_url, timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return None
        names = ("specdec:num_requests_running", "specdec:num_requests_waiting")
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(names) and f'model="{model}"' in line)
