"""Noise detection from /proc: how much CPU the rest of the machine used during a trial, and how much
CPU the model's backend process spent per output token.

A trial's wall-clock figures are only as good as the machine was quiet. From two snapshots (the
start and the end of a trial's measurement window) this module computes
- busy cores: all CPU time the kernel accounted (/proc/stat) over the window, in cores;
- our cores: CPU time of our own processes (the tritonserver process tree with its backend stubs,
  and the load generator's process tree: the matrix, Locust and its workers);
- foreign cores = busy - ours: everything else on the machine (other people's jobs, a CPU hog).
  A trial whose foreign use exceeds FOREIGN_LOAD_CORES is flagged;
- model CPU seconds: CPU time of the served model's backend stubs, which divided by the tokens
  generated gives CPU ms per output token, a figure contention barely moves (a stalled process
  does not accumulate CPU time), shown beside the wall-clock ones.
Processes that start and end inside the window (a test run, a compiler) are counted in busy and,
not being ours, in foreign: exactly the load we want to see.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

FOREIGN_LOAD_CORES = 0.25  # a trial with more foreign CPU use than this is flagged "under foreign load"
STUB = b"triton_python_backend_stub"


@dataclass
class Snapshot:
    wall: float  # time.time()
    busy_ticks: int  # /proc/stat, all CPUs
    total_ticks: int
    cpus: int  # CPUs in /proc/stat
    procs: dict[int, tuple[int, int]]  # pid -> (parent pid, utime + stime ticks)


def snapshot() -> Snapshot:
    busy, total, cpus = _machine_ticks()
    return Snapshot(time.time(), busy, total, cpus, process_table())


def _machine_ticks() -> tuple[int, int, int]:
    lines = Path("/proc/stat").read_text().splitlines()
    fields = [int(x) for x in lines[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return total - idle, total, cpus


def process_table() -> dict[int, tuple[int, int]]:
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text()
        except OSError:
            continue  # ended meanwhile
        rest = text.rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid ... utime(12) stime(13)
        table[int(entry.name)] = (int(rest[1]), int(rest[11]) + int(rest[12]))
    return table


def tree(roots: list[int], procs: dict[int, tuple[int, int]]) -> set[int]:
    """The roots and all their descendants."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    seen, todo = set(), [r for r in roots if r in procs]
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(children.get(pid, []))
    return seen


def cpu_seconds(pids: set[int] | list[int], before: Snapshot, after: Snapshot) -> float:
    """CPU time these processes spent between the snapshots (a process new in `after` counts whole)."""
    ticks = 0
    for pid in pids:
        if pid in after.procs:
            ticks += after.procs[pid][1] - (before.procs[pid][1] if pid in before.procs else 0)
    return ticks / _hz()


def trial_cpu(before: Snapshot, after: Snapshot, own_roots: list[int], model_pids: list[int]) -> dict:
    """Busy, own, foreign cores over the window and the model's CPU seconds (see the docstring)."""
    wall = max(after.wall - before.wall, 1e-9)
    ticks = max(after.total_ticks - before.total_ticks, 1)
    busy = (after.busy_ticks - before.busy_ticks) / ticks * after.cpus  # cores
    ours_pids = tree(own_roots, before.procs) | tree(own_roots, after.procs)
    ours = cpu_seconds(ours_pids, before, after) / wall
    foreign = max(0.0, busy - ours)
    return {"busy_cores": round(busy, 3), "ours_cores": round(ours, 3), "foreign_cores": round(foreign, 3),
            "foreign_load": foreign > FOREIGN_LOAD_CORES, "cpus": after.cpus,
            "model_cpu_s": round(cpu_seconds(model_pids, before, after), 3) if model_pids else None}


def _hz() -> int:
    return os.sysconf("SC_CLK_TCK")


# ---- which processes serve what -------------------------------------------------------------------------
def cmdline(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def server_pid(grpc_url: str) -> int | None:
    """The local tritonserver listening on grpc_url's port (None when the server is not local)."""
    port = grpc_url.rsplit(":", 1)[-1].encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        args = cmdline(int(entry.name))
        if args and args[0].endswith(b"tritonserver") and (
                b"--grpc-port=" + port in args or (port == b"8001" and not any(a.startswith(b"--grpc-port") for a in args))):
            return int(entry.name)
    return None


def model_stubs(server: int | None, model: str, procs: dict[int, tuple[int, int]] | None = None) -> list[int]:
    """PIDs of the Python backend stubs serving `model` under this tritonserver (one per instance)."""
    if server is None:
        return []
    procs = procs if procs is not None else process_table()
    out = []
    for pid, (ppid, _) in procs.items():
        if ppid != server:
            continue
        args = cmdline(pid)
        if len(args) > 1 and args[0].endswith(STUB) and Path(args[1].decode(errors="replace")).parent.parent.name == model:
            out.append(pid)
    return out


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
