"""The package layout is the architecture: core never imports serving or tools, and a client that
only talks to Triton does not load torch."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "backends" / "specdec"


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name a file imports (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text())
    own = ["specdec", *path.relative_to(PACKAGE).with_suffix("").parts]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = own[: len(own) - node.level]
                names.add(".".join(base + ([node.module] if node.module else [])))
            else:
                names.add(node.module)
    return names


def test_core_never_imports_serving_or_tools():
    offenders = []
    for path in sorted((PACKAGE / "core").rglob("*.py")):
        for name in imported_modules(path):
            if name.startswith(("specdec.serving", "specdec.tools", "specdec.cli")):
                offenders.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_imported_modules_sees_a_forbidden_import(tmp_path):
    """The check above can fail: an import of specdec.serving is found, relative or absolute."""
    fake = PACKAGE / "core" / "_layout_probe.py"
    fake.write_text("from ..serving import client\nimport specdec.tools.bench\n")
    try:
        assert {"specdec.serving", "specdec.tools.bench"} <= imported_modules(fake)
    finally:
        fake.unlink()
