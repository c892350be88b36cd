"""The results tables of the docs, written from the benchmarks' JSON results.

Each table in docs/benchmarks.md and README.md that shows a benchmark's figures is a block
between two HTML comments, invisible once rendered:

    <!-- results: serving -->
    …what tests.benchmarks.serving.markdown writes from results/serving.json…
    <!-- /results: serving -->

TABLES says which results file(s) and which `markdown` function write each block, and
where it is. `python -m tests.benchmarks.tables` rewrites every block from its JSON
(`just bench` runs it after the suites); `--check` changes nothing and exits 1, naming
the blocks that differ. tests/test_docs.py holds the docs to the results the same way, and
every results file to a block (or to NOT_SHOWN, with its reason), so a new result cannot
go undocumented.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.benchmarks import (
    api,
    chat_quality,
    concurrency,
    embeddings,
    fleet,
    http2,
    image,
    memory,
    models,
    offload,
    overload,
    packages,
    placement,
    quality,
    serving,
    site_fetch,
    structured,
    sync,
)

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "tests" / "benchmarks" / "results"
BENCHMARKS_MD = "docs/benchmarks.md"
README_MD = "README.md"


@dataclass(frozen=True)
class Table:
    """One generated block: its name in the markers, the document it is in, the results
    files it is written from (relative to RESULTS, passed to `render` in that order)."""

    name: str
    doc: str
    results: tuple[str, ...]
    render: Callable[..., str]

    def text(self) -> str:
        """The block's content, from its results as they are now."""
        loaded = [json.loads((RESULTS / name).read_text()) for name in self.results]
        return self.render(*loaded).strip("\n")


TABLES: tuple[Table, ...] = (
    Table("serving", BENCHMARKS_MD, ("serving.json",), serving.markdown),
    Table("memory", BENCHMARKS_MD, ("memory.json",), memory.markdown),
    Table("concurrency", BENCHMARKS_MD, ("concurrency.json",), concurrency.markdown),
    Table("overload", BENCHMARKS_MD, ("overload.json",), overload.markdown),
    Table("overload-door", BENCHMARKS_MD, ("overload.json",), overload.door_markdown),
    Table("sync", BENCHMARKS_MD, ("sync.json",), sync.markdown),
    Table("fleet", BENCHMARKS_MD, ("fleet.json",), fleet.markdown),
    Table("fleet-handshakes", BENCHMARKS_MD, ("fleet-handshakes.json",), fleet.handshakes_markdown),
    Table("fleet-objectives", BENCHMARKS_MD, ("fleet-objectives.json",), fleet.baseline_markdown),
    Table(
        "fleet-objectives-repeat",
        BENCHMARKS_MD,
        ("fleet-objectives-repeat.json",),
        fleet.baseline_markdown,
    ),
    Table(
        "fleet-objectives-10000",
        BENCHMARKS_MD,
        ("fleet-objectives-10000.json",),
        fleet.baseline_markdown,
    ),
    Table("placement", BENCHMARKS_MD, ("placement.json",), placement.markdown),
    Table("offload", BENCHMARKS_MD, ("offload.json",), offload.markdown),
    Table("packages", BENCHMARKS_MD, ("packages.json",), packages.markdown),
    Table("quality", BENCHMARKS_MD, ("quality.json",), quality.markdown),
    # The in-process column is a design measured at one commit and not kept: its result
    # stays, and the table says which run each column comes from.
    Table("http2", BENCHMARKS_MD, ("http2.json", "http2-in-process.json"), http2.markdown),
    Table("embeddings", BENCHMARKS_MD, ("embeddings.json",), embeddings.markdown),
    Table("image", BENCHMARKS_MD, ("image.json",), image.markdown),
    Table("site-fetch", BENCHMARKS_MD, ("site-fetch.json",), site_fetch.markdown),
    Table("api", BENCHMARKS_MD, ("api.json",), api.markdown),
    Table("structured", BENCHMARKS_MD, ("structured.json",), structured.markdown),
    Table("models", BENCHMARKS_MD, ("models.json",), models.markdown),
    Table("chat-quality", README_MD, ("chat-quality.json",), chat_quality.markdown),
)

# Results files no block shows, each with its reason.
NOT_SHOWN: dict[str, str] = {
    # `serving --llama-server-defaults`: llama-server with its own defaults rather than the
    # appliance's, kept to show the alignment matters; the docs describe the aligned run.
    "serving-llama-server-defaults.json": "llama-server's defaults, not the aligned comparison",
    # `serving --baseline e6a7d3d`: the serving path before and after the objectives were
    # counted, a check of one change; the single-stream table is serving.json's.
    "serving-objectives.json": "a before/after check of one change",
}


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- results: {name} -->", f"<!-- /results: {name} -->"


def block(text: str, name: str) -> str | None:
    """What the document holds between the markers of `name`, or None without them."""
    start, end = _markers(name)
    found = re.search(rf"^{re.escape(start)}\n(.*?)^{re.escape(end)}$", text, re.M | re.S)
    return found.group(1).strip("\n") if found else None


def replace(text: str, name: str, content: str) -> str:
    """The document with the block of `name` holding `content` (a blank line each side, so
    the table is its own paragraph whatever a renderer makes of the comments)."""
    start, end = _markers(name)
    pattern = rf"^{re.escape(start)}\n.*?^{re.escape(end)}$"
    if not re.search(pattern, text, re.M | re.S):
        raise KeyError(f"no block `{name}` (markers {start} … {end})")
    return re.sub(pattern, lambda _: f"{start}\n\n{content}\n\n{end}", text, flags=re.M | re.S)


def stale(tables: tuple[Table, ...] = TABLES) -> list[str]:
    """The blocks that differ from what their results write now (or are missing)."""
    docs: dict[str, str] = {}
    out = []
    for entry in tables:
        text = docs.setdefault(entry.doc, (REPO / entry.doc).read_text())
        if block(text, entry.name) != entry.text():
            out.append(f"{entry.doc}: {entry.name}")
    return out


def write(tables: tuple[Table, ...] = TABLES) -> None:
    """Every block rewritten from its results; each document written once."""
    docs: dict[str, str] = {}
    for entry in tables:
        text = docs.setdefault(entry.doc, (REPO / entry.doc).read_text())
        docs[entry.doc] = replace(text, entry.name, entry.text())
    for doc, text in docs.items():
        path = REPO / doc
        if path.read_text() != text:
            path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The docs' results tables, from the results.")
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if a block differs"
    )
    args = parser.parse_args(argv)
    if args.check:
        differ = stale()
        for name in differ:
            print(f"differs from its results: {name}", file=sys.stderr)  # noqa: T201
        return 1 if differ else 0
    write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
