"""The project's docs as the tests read them: README.md and docs/*.md, each file's text,
and every doc one after the other."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS_DIR = REPO / "docs"
DOC_FILES = [REPO / "README.md", *sorted(DOCS_DIR.glob("*.md"))]
TEXT = {path: path.read_text() for path in DOC_FILES}
DOCS = "\n".join(TEXT.values())
