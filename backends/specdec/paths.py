"""Where things live in a checkout: one place for the repository's own folders (the demo kit,
the shipped model repository, reports, caches), so no module computes them from its own depth."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # backends/: on PYTHONPATH, specdec imports without install
REPO_ROOT = PACKAGE_ROOT.parent
DEMO_KIT = REPO_ROOT / "build" / "demo-kit"
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
GUARDRAILS = REPO_ROOT / "loadtest" / "guardrails.yaml"
REPORTS = REPO_ROOT / "reports"
CACHE = Path(os.environ.get("SPECDEC_CACHE", REPO_ROOT / ".cache"))
