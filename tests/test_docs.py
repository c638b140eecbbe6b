"""The documents stay true: README.md is a short user's document without a lab notebook's clock
times; every relative link in README.md, docs/ and the reports' logs resolves, to a heading where
it names one; every section the code or the documents cite by title exists; and docs/serving.md's
reference tables are what the code's own tables generate."""

from __future__ import annotations

import re
from pathlib import Path

from specdec.tools import docs

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "reports").glob("*-log.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# a section cited in prose or a comment: `docs/engine.md, "Title"` (the title opens a heading or a bold item)
CITATION = re.compile(r"((?:docs/|reports/)?[\w-]+\.md), \"([^\"]+)\"")
# a clock time (06:07, 6:07 UTC) or a calendar date (2026-11-30): the marks of a dated run
DATED = re.compile(r"\b(?:[01]?\d|2[0-3]):[0-5]\d\b|\b(?:19|20)\d\d-[01]\d-[0-3]\d\b|\bUTC\b")


def local_targets(path: Path) -> list[str]:
    """Link targets in a Markdown file that are not URLs: files in the checkout, anchors, or both."""
    return [t for t in LINK.findall(path.read_text()) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def relative_links(path: Path) -> list[str]:
    """Link targets in a Markdown file that point into the checkout (not URLs, not pure anchors)."""
    return [t.split("#", 1)[0] for t in local_targets(path) if not t.startswith("#")]


def test_readme_is_short_and_undated():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 12 * 1024, f"README.md is {len(text.encode())} bytes"
    assert not DATED.findall(text), DATED.findall(text)


def test_dated_marks_are_caught():
    assert DATED.findall("run at 06:07 UTC on 2026-11-30") == ["06:07", "UTC", "2026-11-30"]
    assert not DATED.findall("k=4, 1.53x, --shape text_input:1, batch 1,8")


def test_every_relative_link_resolves():
    missing = [f"{path.relative_to(ROOT)}: {target}"
               for path in DOCUMENTS for target in relative_links(path)
               if not (path.parent / target).exists()]
    assert not missing, "\n".join(missing)
    assert any(relative_links(path) for path in DOCUMENTS)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        fenced ^= line.startswith("```")
        heading = None if fenced else re.match(r"^#{1,6}\s+(.*)$", line)
        if heading:
            name, n = slug(heading.group(1)), 0
            while (name if n == 0 else f"{name}-{n}") in found:
                n += 1
            found.add(name if n == 0 else f"{name}-{n}")
    return found


def broken_anchors(path: Path) -> list[str]:
    """Links `page.md#part` (or `#part`) whose page has no heading with that anchor."""
    broken = []
    for target in (t for t in local_targets(path) if "#" in t):
        page, part = target.split("#", 1)
        page_path = (path.parent / page) if page else path
        if page_path.suffix == ".md" and page_path.exists() and part not in anchors(page_path):
            broken.append(f"{path.name}: {target}")
    return broken


def test_every_anchor_names_a_heading():
    """Sections move (the trials went from docs/ to reports/*-log.md): a link must follow."""
    missing = [b for path in DOCUMENTS for b in broken_anchors(path)]
    assert not missing, "\n".join(missing)


def test_every_cited_section_exists():
    """The code and the documents cite sections by title (`reports/benchmarks-log.md, "Title"`);
    each title must open a heading or a bold item of that file."""
    sources = [*DOCUMENTS, *(ROOT / "backends").rglob("*.py")]
    missing = []
    for source in sources:
        for page, title in CITATION.findall(source.read_text()):
            candidates = [ROOT / page] if "/" in page else [source.parent / page, ROOT / "docs" / page,
                                                            ROOT / "reports" / page]
            target = next((c for c in candidates if c.exists()), None)
            words = r"\s+".join(re.escape(w) for w in title.split() if w != "#")  # a comment's line breaks
            pattern = re.compile(r"^(?:#+\s+|\s*- \*\*)" + words, re.M | re.I)
            if target is None or not pattern.search(target.read_text()):
                missing.append(f"{source.relative_to(ROOT)}: {page}, \"{title}\"")
    assert not missing, "\n".join(missing)


def test_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[ok](https://example.com) [a](#x) [b](missing.md#part) ![c](img/plot.png \"title\")")
    assert relative_links(page) == ["missing.md", "img/plot.png"]
    (tmp_path / "other.md").write_text("# Top\n## A `code` part, (x)\n")
    page.write_text("[a](other.md#a-code-part-x) [b](other.md#gone) [c](#top)")
    assert [b.split(": ")[1] for b in broken_anchors(page)] == ["other.md#gone", "#top"]


def test_serving_reference_is_generated_from_the_code():
    """docs/serving.md's tables come from INPUTS/OUTPUTS, the config settings and the metric
    families; after changing one, run `python -m specdec.tools.docs`."""
    committed = docs.generated_part(docs.SERVING_MD.read_text())
    assert committed == docs.reference()


def test_reference_lists_every_name():
    from specdec.core.config import SETTINGS
    from specdec.serving.interface import INPUTS, OUTPUTS
    from specdec.serving.metrics import FAMILIES

    text = docs.reference()
    for name in [*(f.name for f in INPUTS), *(f.name for f in OUTPUTS), *SETTINGS, "stream_interval", *FAMILIES]:
        assert f"`{name}`" in text, name


def test_no_document_cites_a_missing_design_file():
    """The code once cited a DESIGN.md that is not in the repository; the design notes are docs/design.md."""
    sources = [*DOCUMENTS, *(ROOT / "backends").rglob("*.py")]
    offenders = [str(p.relative_to(ROOT)) for p in sources if "DESIGN.md" in p.read_text()]
    assert not offenders, offenders
