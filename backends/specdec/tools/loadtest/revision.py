"""`specdec loadtest --rev REV`: every model served twice, by this checkout and by another git
revision of specdec, in the same rounds of one server.

A change to the served engine (the adaptive policy, the server's threads) is judged served: the
in-process A/B (`tools.forward_ab --rev`) times the engine alone, and a change to the policy's
verify curve that read 0.98x-1.04x there ran the draft model 1.02x-1.06x as fast served at one
user (reports/engine-log.md, "The verify curve's 5-token point served"). Load tests run one after
the other differ by more than that (the draft model at 4 users read 0.93x and 1.14x the baseline
in two runs of the same code), so the two revisions run side by side: the revision's
`backends/specdec` (`git archive`) becomes a Triton backend of its own, `specdec_<sha7>`, whose
model.py puts it first on the stub's sys.path (every model runs in a stub process of its own, so
the two packages never meet), and each model gets a twin `<model>_<sha7>` on that backend, a
sibling folder in the repository. The report pairs each model with its twin round by round
(`revision_ratios`). Two instances of one model differ by more than their rounds' spread says:
`--rev HEAD` (the same code twice, 16 rounds) read the baseline 1.04x and 1.11x [1.04, 1.18] its
twin at 1 and 4 users, the draft model 1.02x and 0.94x, and at 4 users with a fresh server 1.00x
[0.96, 1.05] and 1.04x [1.00, 1.07]: an instance's, not the code's. A difference within that is
none; `--rev HEAD` shows how far it goes on a machine, and `--servers N` (the rounds over N fresh
servers, the intervals over them) whether a difference stays.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from pathlib import Path

from specdec.paths import REPO_ROOT
from specdec.tools.loadtest.intervals import round_ratios

BACKEND = "specdec"  # the backend every model of a repository names (`serving.repository`)
FIGURES = ("output_tokens_per_s", "tpot_p50", "ttft_p50")  # what the report pairs with the twin's


def resolve(rev: str) -> str:
    """The full commit id of `rev` in this checkout's git repository."""
    done = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"--rev {rev!r}: not a commit of {REPO_ROOT}")
    return done.stdout.strip()


def short(sha: str) -> str:
    return sha[:7]


def twin_name(model: str, sha: str) -> str:
    return f"{model}_{short(sha)}"


def export(sha: str, dest: Path) -> Path:
    """The revision's `backends/` (its specdec package alone) under `dest`; returns that folder."""
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", "--format=tar", sha, "backends/specdec"],
                             capture_output=True)
    if archive.returncode != 0:
        raise ValueError(f"--rev {short(sha)}: git archive failed: {archive.stderr.decode(errors='replace').strip()}")
    if dest.exists():
        shutil.rmtree(dest)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest / "backends"


def add_backend(backend_dir: Path, sha: str, package_root: Path) -> str:
    """A backend `specdec_<sha7>` in `backend_dir` (assembled: `serving.server.assemble_backends`)
    that serves the package under `package_root`; returns its name."""
    name = f"{BACKEND}_{short(sha)}"
    folder = backend_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    stub = backend_dir / BACKEND / "triton_python_backend_stub"
    shutil.copy2(stub, folder / stub.name)  # the Python backend runs the stub found next to model.py
    (folder / "model.py").write_text(
        f"import sys\n\nsys.path.insert(0, {str(package_root)!r})  # before this checkout's (PYTHONPATH)\n"
        "from specdec.serving.model import TritonPythonModel  # noqa: E402,F401\n")
    return name


def write_twins(repo: Path, models: list[str], sha: str, backend: str) -> list[Path]:
    """For each model, a sibling folder `<model>_<sha7>` with its config on `backend`; returns the folders."""
    folders = []
    for model in models:
        config = repo / model / "config.pbtxt"
        if not config.exists():
            raise ValueError(f"--rev: {config} does not exist (every model compared must be in the repository)")
        text = config.read_text()
        named, on = f'name: "{model}"', f'backend: "{BACKEND}"'
        if named not in text or on not in text:
            raise ValueError(f"--rev: {config} is not a specdec model named {model!r} ({named}, {on})")
        folder = repo / twin_name(model, sha)
        (folder / "1").mkdir(parents=True, exist_ok=True)
        (folder / "config.pbtxt").write_text(
            text.replace(named, f'name: "{folder.name}"', 1).replace(on, f'backend: "{backend}"', 1))
        folders.append(folder)
    return folders


def revision_ratios(cells: list[dict], sha: str) -> list[dict]:
    """Per workload, load level and model with a twin: each of FIGURES of the model over its twin's,
    paired by round (`intervals.round_ratios`): this checkout against the revision."""
    by = {(c["workload"], c["concurrency"], c["model"]): c for c in cells}
    rows = []
    for (workload, concurrency, model), c in by.items():
        twin = by.get((workload, concurrency, twin_name(model, sha)))
        if twin is None:
            continue
        rows.append({"workload": workload, "concurrency": concurrency, "model": model, "twin": twin["model"],
                     "ratios": round_ratios(c["trials"], twin["trials"], FIGURES)})
    return rows
