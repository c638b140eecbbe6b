"""The channel from `specdec serve` to the backend stubs: a folder of small files.

tritonserver offers no way to tell a Python-backend model "stop admitting, finish what you have":
unloading a decoupled model does not reach the backend while its streams run (Triton counts them
as 0 in-flight inferences), and its own shutdown drops them after --exit-timeout-secs. So the
supervisor (`supervisor.py`) and the backend (`model.py`) share a folder, named to the stubs by the
environment variable CONTROL_DIR_ENV (inherited from tritonserver):

- `drain` holds the drain deadline (Unix time). A backend that sees it refuses new requests and,
  once the deadline passes, ends its remaining requests with an error response.
- `drained-<stub pid>` is written by each backend instance that is draining and has no request left,
  so the supervisor stops waiting as soon as every live stub has written one.
- `restarts.json` counts the watchdog's restarts ({"models": {name: n}, "server": n}); a (re)loaded
  model publishes them as Prometheus counters on Triton's own metrics port.

Files, not a control request: the stubs poll it anyway (the cancellation watcher), it works while a
model's request queue is full, and it needs no port.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

CONTROL_DIR_ENV = "SPECDEC_CONTROL_DIR"


def control_dir() -> Path | None:
    """The folder named by the environment (None when the server was not started by `specdec serve`)."""
    value = os.environ.get(CONTROL_DIR_ENV)
    return Path(value) if value else None


def request_drain(folder: Path, deadline: float) -> None:
    _write(folder / "drain", repr(deadline))


def clear(folder: Path) -> None:
    """Forget a drain (a restarted tritonserver admits again); restart counts stay."""
    for path in folder.glob("drain*"):
        path.unlink(missing_ok=True)


def drain_deadline(folder: Path) -> float | None:
    try:
        return float((folder / "drain").read_text())
    except (OSError, ValueError):
        return None


def mark_drained(folder: Path, pid: int) -> None:
    _write(folder / f"drained-{pid}", "")


def drained(folder: Path, pid: int) -> bool:
    return (folder / f"drained-{pid}").exists()


def restarts(folder: Path | None) -> dict:
    try:
        return json.loads((folder / "restarts.json").read_text())
    except (OSError, ValueError, TypeError):
        return {"models": {}, "server": 0}


def count_restart(folder: Path, model: str | None = None) -> dict:
    """One more restart of `model` (None: of tritonserver); returns the new counts."""
    counts = restarts(folder)
    if model is None:
        counts["server"] = counts.get("server", 0) + 1
    else:
        counts["models"][model] = counts["models"].get(model, 0) + 1
    _write(folder / "restarts.json", json.dumps(counts))
    return counts


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")  # atomic: a reader never sees half a file
    tmp.write_text(text)
    os.replace(tmp, path)
