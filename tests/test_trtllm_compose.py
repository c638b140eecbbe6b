"""docker-compose.yml can start: `docker compose config` accepts it where the tool exists; everywhere
the YAML is checked for what broke it before (a CUDA 13 torch wheel installed into a CUDA 12 image),
and build/gpu-check.sh is valid bash that downloads nothing."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"


def compose_available() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


def commands(service: dict) -> str:
    cmd = service.get("command", "")
    return "\n".join(cmd) if isinstance(cmd, list) else str(cmd)


def test_compose_yaml_starts_what_it_promises():
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert {"triton", "trtllm", "locust-master", "locust-worker", "loadtest"} <= set(services)
    for name in ("triton", "trtllm"):
        s = services[name]
        assert "trtllm-python-py3" in s["image"]  # the image whose preinstalled torch matches its CUDA
        text = commands(s)
        assert "--no-deps -e ." in text  # pip never replaces the image's torch
        assert not re.search(r"pip install[^\n]*\btorch\b", text), f"{name} installs a torch wheel"
        assert s["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
        assert "healthcheck" in s
    assert "build/trtllm/build_engines.py" in commands(services["trtllm"])
    assert services["trtllm"]["profiles"] == ["trtllm"]
    for name in ("locust-master", "locust-worker", "loadtest"):  # CPU clients: the CPU wheel, explicitly
        for line in commands(services[name]).splitlines():
            if re.search(r"pip install[^\n]*\btorch\b", line):
                assert "--index-url https://download.pytorch.org/whl/cpu" in line, line
    for path in ("build/trtllm/build_engines.py", "loadtest/locustfile.py", "build/demo-kit"):
        assert (ROOT / path).exists(), path


@pytest.mark.skipif(not compose_available(), reason="docker compose is not installed here (the YAML checks ran)")
def test_docker_compose_config_accepts_the_file():
    result = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "--profile", "trtllm", "config", "-q"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_gpu_check_script_is_valid_bash_and_offline():
    script = ROOT / "build" / "gpu-check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert not re.search(r"pip install|curl |wget |git clone", text)
    assert "--device cuda" in text and 'PYTHONPATH="$ROOT/backends' in text
