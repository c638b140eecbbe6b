"""The README's serving commands, run as written: `make serve` on the committed model_repository/
(default ports; every model answers), the client and curl lines against it, then `specdec build-repo ... && specdec
serve` with the demo kit's checkpoints in place of DIR. A README edit that breaks a command, or a
code change that breaks what the README promises, fails here."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from specdec.paths import DEMO_KIT, MODEL_REPOSITORY, REPO_ROOT
from specdec.serving.server import port_free

pytestmark = pytest.mark.slow

README = REPO_ROOT / "README.md"
DEFAULT_PORTS = (8000, 8001, 8002)


def serving_block() -> list[str]:
    """The commands of the README's "Serving on Triton in five lines" block (comments stripped,
    continuation lines joined)."""
    text = README.read_text()
    section = text.split("## Serving on Triton in five lines", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    block = re.sub(r"\\\n\s*", "", block)
    return [re.sub(r"\s+#\s.*$", "", line).strip() for line in block.splitlines() if line.strip()]


class Background:
    """A command in its own session with its output collected; ready when a line starts 'Ctrl-C'."""

    def __init__(self, command: str, cwd: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(command, shell=True, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(line.startswith("Ctrl-C") for line in self.lines):
            assert self.proc.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, f"not ready after {timeout_s} s:\n{''.join(self.lines)}"
            time.sleep(0.2)

    def interrupt(self, timeout_s: float = 120) -> int:
        """Ctrl-C as a terminal sends it: to the whole foreground group."""
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            return self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.reader.join(5)


def shell(command: str, cwd: Path, env: dict[str, str], timeout_s: float = 300) -> str:
    done = subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def test_the_readme_serving_commands_run_as_written(tmp_path):
    commands = serving_block()
    assert [c.split()[:2] for c in commands] == [["make", "serve"], ["specdec", "client"], ["curl", "-N"],
                                                 ["specdec", "build-repo"]], commands
    busy = [p for p in DEFAULT_PORTS if not port_free(p)]
    assert not busy, f"the README's commands use the default ports, and {busy} are in use on this machine"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert MODEL_REPOSITORY.is_dir()

    server = Background(commands[0], REPO_ROOT, env)  # make serve: the committed repository
    try:
        server.wait_ready(timeout_s=600)
        client_out = shell(commands[1], tmp_path, env)
        assert re.search(r"--- spec_eagle over grpc: [1-9]\d* tokens", client_out), client_out
        sse = shell(commands[2], tmp_path, env)
        events = [line for line in sse.splitlines() if line.startswith("data:")]
        assert len(events) > 1 and all('"text_output"' in e for e in events), sse
        assert re.search(r'"finish_reason":"(length|eos)"', events[-1].replace(" ", "")), events[-1]
        for model in sorted(p.name for p in MODEL_REPOSITORY.iterdir() if (p / "config.pbtxt").exists()):
            r = requests.post(f"http://localhost:{DEFAULT_PORTS[0]}/v2/models/{model}/generate",
                              json={"text_input": "def add(a, b):", "max_tokens": 4, "ignore_eos": True}, timeout=120)
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, (model, r.text)  # every model answers
    finally:
        stopped = server.interrupt()
    log = "".join(server.lines)
    assert stopped in (0, 130, -signal.SIGINT), log  # make says 130 for a Ctrl-C, the shell dies of it
    assert "tritonserver stopped (exit code 0)" in log and "Traceback" not in log, log

    # build-repo for your own checkpoints, then serve it (the demo kit's stand in for DIR)
    build_and_serve = commands[3].replace("--target DIR", f"--target {DEMO_KIT / 'target'}").replace(
        "--draft DIR", f"--draft {DEMO_KIT / 'draft'}")
    assert "DIR" not in build_and_serve
    server = Background(build_and_serve, tmp_path, env)
    try:
        server.wait_ready(timeout_s=600)
        written = sorted(p.name for p in (tmp_path / "my_repository").iterdir())
        assert {"baseline", "spec_draft"} <= set(written), written
        out = shell('specdec client "def add(a, b):" --model spec_draft --max-tokens 8 --json', tmp_path, env)
        assert re.search(r'"finish_reason": "(length|eos)"', out), out
    finally:
        stopped = server.interrupt()
    log = "".join(server.lines)
    assert stopped in (0, -signal.SIGINT) and "tritonserver stopped (exit code 0)" in log, log
