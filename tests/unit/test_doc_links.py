"""Every relative link in the Markdown docs (README, CHANGELOG, docs/) names a file that exists, and its ``#anchor``
a heading of that file."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")])

_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.MULTILINE)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but ``-`` and ``_``), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors on its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


@functools.cache
def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text())):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(path: Path) -> list[str]:
    text = _FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_the_docs_are_found() -> None:
    assert ROOT / "README.md" in DOCS and ROOT / "docs" / "transport.md" in DOCS


def test_the_slug_is_githubs() -> None:
    assert _slug("Placed outputs (receive buffers on the same-host channel)") == (
        "placed-outputs-receive-buffers-on-the-same-host-channel"
    )
    assert _slug("Command line: exit codes, `fetch --json`, child processes") == (
        "command-line-exit-codes-fetch---json-child-processes"
    )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in _links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("doc", [ROOT / "README.md", ROOT / "docs" / "results.md"], ids=lambda p: p.name)
def test_named_result_files_exist(doc: Path) -> None:
    # The results tables name their JSON files in code spans (globs allowed); each must be committed.
    results = ROOT / "benchmarks" / "results"
    names = set(re.findall(r"`([\w.*\[\]-]+\.json)`", doc.read_text()))
    assert names, f"{doc.name} names no result file"
    missing = sorted(n for n in names if not any(results.glob(n)))
    assert not missing, f"{doc.name} names result files that are not in benchmarks/results/: {missing}"
