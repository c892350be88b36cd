"""Docs are tests: README.md, docs/*.md and the example configs cannot drift from the code.

Each kind of material is checked where it lives: the LAN API's routes and the error codes
in docs/api.md, the hub's routes in docs/hub.md, the command line in docs/operations.md,
the layout of the code in docs/README.md, the two commands in README.md. Across all of
them: every relative link leads to a file (and heading) that exists, no doc names a file
outside the repository, and every path, module and setting a doc names exists.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import click
import pytest
import yaml
from pydantic_settings import BaseSettings

from appliance.gateway.routes import ROUTES
from appliance.settings import EXAMPLE_HEADER as APPLIANCE_HEADER
from appliance.settings import ApplianceSettings
from hub.api.route_table import ROUTES as HUB_ROUTES
from hub.settings import EXAMPLE_HEADER as HUB_HEADER
from hub.settings import HubSettings
from shared.cli import main
from shared.config import example_yaml, iter_fields
from shared.errors import ErrorCode
from tests.benchmarks import concurrency
from tests.benchmarks.report import DASH, TIMES
from tests.benchmarks.tables import NOT_SHOWN, RESULTS, TABLES, Table
from tests.benchmarks.tables import block as results_block
from tests.docs import DOC_FILES, DOCS_DIR, REPO, TEXT

README_MD = TEXT[REPO / "README.md"]
API_DOC = (DOCS_DIR / "api.md").read_text()
HUB_DOC = (DOCS_DIR / "hub.md").read_text()
OPERATIONS_DOC = (DOCS_DIR / "operations.md").read_text()
LAYOUT_DOC = (DOCS_DIR / "README.md").read_text()

# Build and test outputs the docs name (ignored by git): they exist once made.
OUTPUTS = ("image/build/", "tests/browser/artifacts/")
# File names that end a dotted name which is a file, not a module: `appliance.db`.
SUFFIXES = {"db", "img", "json", "md", "py", "toml", "yaml"}
# Dotted names in the docs that look like settings and are not: background loops.
NOT_SETTINGS = {"jobs.runner", "jobs.webhooks", "console.prune"}

# The top-level packages (a folder with __init__.py), and every package inside them.
TOP_PACKAGES = sorted(
    p.name for p in REPO.iterdir() if (p / "__init__.py").is_file() and p.name != "tests"
)
# The repository's own top-level folders: a path a doc names starts with one of them
# (`.kvl/demo/` or `.venv/bin/kvl` are made by running it).
TOP_FOLDERS = {*TOP_PACKAGES, "tests", "docs", ".ci"}
PACKAGE_DIRS = sorted(
    init.parent.relative_to(REPO).as_posix()
    for top in TOP_PACKAGES
    for init in (REPO / top).rglob("__init__.py")
    # Not what a run leaves in ignored folders (an image build copies the sources into
    # `image/build/`, while other tests run beside it).
    if not {"__pycache__", "build", "dist"} & set(init.relative_to(REPO).parts)
)

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)
REPO_PATH = re.compile(r"[\w.-]+(?:/[\w.-]+)*/?")
MODULE = re.compile(rf"(?<![\w/.@:-])((?:{'|'.join(TOP_PACKAGES)}|tests)(?:\.[a-z_]\w*)+)")
SETTING = re.compile(r"[a-z_]+(?:\.[a-z0-9_]+)+")


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return FENCE.sub("", text)


def _code_spans(text: str) -> list[str]:
    """What every `code span` outside fenced blocks holds."""
    return [m.group(2).strip() for m in INLINE_CODE.finditer(_prose(text))]


def _code_lines(text: str) -> list[str]:
    """The lines of the fenced code blocks."""
    return [
        line.strip() for block in FENCE.finditer(text) for line in block.group(0).splitlines()[1:-1]
    ]


def _modules(text: str) -> list[str]:
    """Dotted module names in code spans, and in the imports and `python -m` lines of code
    blocks (not their other lines: in `hub.up()` the hub is a variable)."""
    spans = _code_spans(text) + [
        line
        for line in _code_lines(text)
        if line.startswith(("from ", "import ")) or "python -m " in line
    ]
    names = [m.group(1) for span in spans for m in MODULE.finditer(span)]
    return [name for name in names if name.rsplit(".", 1)[1] not in SUFFIXES]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = INLINE_CODE.sub(lambda m: m.group(2), heading).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for match in HEADING.finditer(_prose(text)):
        slug = _slug(match.group(1))
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _named_paths(text: str) -> list[str]:
    """Code spans that are a path in the repository: `hub/planning/`, `docs/api.md`."""
    return [
        span
        for span in _code_spans(text)
        if "/" in span and REPO_PATH.fullmatch(span) and span.split("/")[0] in TOP_FOLDERS
    ]


def _doc_id(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def test_api_doc_lists_every_route() -> None:
    for route in ROUTES:
        assert f"`{route.method} {route.path}`" in API_DOC, route.path


def _hub_route_documented(method: str, path: str) -> bool:
    # `GET /v1/node/state[?after=SERIAL]`: a query may follow the path
    if re.search(rf"`{method} {re.escape(path)}(\[\?[^`\]]*\])?`", HUB_DOC):
        return True
    # `POST /v1/node/offload/{chat/completions,completions}`: one route per alternative
    for match in re.finditer(rf"`{method} ([^`{{]*)\{{([^}}`]*)\}}`", HUB_DOC):
        prefix, alternatives = match.groups()
        if any(path == prefix + a for a in alternatives.split(",")):
            return True
    return False


def test_hub_doc_lists_every_route() -> None:
    for route in HUB_ROUTES:
        assert _hub_route_documented(route.method, route.path), route.path


def test_api_doc_lists_every_error_code_with_its_status() -> None:
    for code in ErrorCode:
        assert f"| {code.status} | `{code.value}` |" in API_DOC, code


@pytest.mark.parametrize(
    ("cls", "header", "path"),
    [
        (ApplianceSettings, APPLIANCE_HEADER, "appliance/config.example.yaml"),
        (HubSettings, HUB_HEADER, "hub/config.example.yaml"),
    ],
)
def test_example_config_is_complete_and_current(
    cls: type[BaseSettings], header: str, path: str
) -> None:
    text = (REPO / path).read_text()
    assert text == example_yaml(cls, header), f"regenerate {path} with `kvl … config --example`"
    data = yaml.safe_load(text)
    for key, field in iter_fields(cls):
        node = data
        for part in key.split("."):
            assert part in node, f"{key} missing from {path}"
            node = node[part]
        assert field.description, f"{key} has no description"
    cls.model_validate(data)  # the example itself is a valid configuration


def _leaf_commands(
    group: click.Group, ctx: click.Context, prefix: str
) -> list[tuple[str, click.Command]]:
    out: list[tuple[str, click.Command]] = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None
        path = f"{prefix} {name}"
        if isinstance(command, click.Group):
            out += _leaf_commands(command, ctx, path)
        else:
            out.append((path, command))
    return out


def test_every_command_takes_config_and_data_dir_and_is_documented() -> None:
    ctx = click.Context(main)
    commands = _leaf_commands(main, ctx, "kvl")
    assert len(commands) >= 9
    for path, command in commands:
        options = {opt for param in command.params for opt in getattr(param, "opts", [])}
        # The demo runs on the embedded defaults by design: no config file. `kvl image …`
        # works on an image file, `kvl bundle …` on a bundle file (made on any machine),
        # with neither settings nor a data directory.
        wanted = {"--data-dir"} if path == "kvl demo" else {"--config", "--data-dir"}
        if path.startswith(("kvl image ", "kvl bundle ")):
            wanted = set()
        assert wanted <= options, path
        assert f"`{path}" in OPERATIONS_DOC, f"{path} is not in docs/operations.md's command table"


def test_ci_runs_the_readmes_test_command() -> None:
    commands = re.findall(r"^(python3 -m venv .*just test)$", README_MD, flags=re.MULTILINE)
    assert len(commands) == 1
    assert commands[0] in (REPO / ".ci" / "run").read_text()
    assert re.search(r"^python3 -m venv .*just demo$", README_MD, flags=re.MULTILINE)


def test_the_docs_are_there() -> None:
    names = {_doc_id(path) for path in DOC_FILES}
    wanted = {"api", "hub", "image", "operations", "benchmarks", "README"}
    assert {f"docs/{name}.md" for name in wanted} | {"README.md"} <= names
    for name in sorted(names - {"README.md"}):
        assert f"]({name})" in README_MD, f"README.md does not link to {name}"


def test_layout_note_names_every_package_and_shared_module() -> None:
    assert {"appliance", "hub", "shared"} <= set(TOP_PACKAGES)
    named = set(_named_paths(LAYOUT_DOC))
    for package in PACKAGE_DIRS:
        assert f"{package}/" in named, f"docs/README.md does not name `{package}/`"
    modules = sorted(p for p in (REPO / "shared").glob("*.py") if p.name != "__init__.py")
    assert modules
    for module in modules:
        path = module.relative_to(REPO).as_posix()
        assert path in named, f"docs/README.md does not name `{path}`"


def test_layout_note_names_only_paths_that_exist() -> None:
    named = _named_paths(LAYOUT_DOC)
    assert named
    for path in named:
        assert (REPO / path).exists(), f"docs/README.md names `{path}`, which does not exist"


@pytest.mark.parametrize("doc", DOC_FILES, ids=_doc_id)
def test_every_path_and_module_a_doc_names_exists(doc: Path) -> None:
    text = TEXT[doc]
    for path in _named_paths(text):
        if not path.startswith(OUTPUTS):
            assert (REPO / path).exists(), f"{_doc_id(doc)} names `{path}`, which does not exist"
    for name in _modules(text):
        module = REPO.joinpath(*name.split("."))
        assert module.with_suffix(".py").is_file() or (module / "__init__.py").is_file(), (
            f"{_doc_id(doc)} names the module {name}, which does not exist"
        )


@pytest.mark.parametrize("doc", DOC_FILES, ids=_doc_id)
def test_every_setting_a_doc_names_exists(doc: Path) -> None:
    keys = {key for cls in (ApplianceSettings, HubSettings) for key, _ in iter_fields(cls)}
    sections = {key.split(".")[0] for key in keys}
    prefixes = {key.rsplit(".", n)[0] for key in keys for n in range(key.count(".") + 1)}
    for span in _code_spans(TEXT[doc]):
        if SETTING.fullmatch(span) and span.split(".")[0] in sections:
            assert span in prefixes or span in NOT_SETTINGS, (
                f"{_doc_id(doc)} names the setting `{span}`, which does not exist"
            )


@pytest.mark.parametrize("doc", DOC_FILES, ids=_doc_id)
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(doc: Path) -> None:
    prose = INLINE_CODE.sub("", _prose(TEXT[doc]))
    for target in LINK.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        where, _, anchor = target.partition("#")
        assert not where.startswith("/"), f"{_doc_id(doc)}: {target} is not relative"
        file = (doc.parent / where).resolve() if where else doc
        assert file.is_relative_to(REPO), f"{_doc_id(doc)}: {target} leaves the repository"
        assert file.exists(), f"{_doc_id(doc)}: {target} leads to no file"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file.read_text()), (
                f"{_doc_id(doc)}: {target}: no such heading in {_doc_id(file)}"
            )


@pytest.mark.parametrize("doc", DOC_FILES, ids=_doc_id)
def test_no_doc_names_a_file_outside_the_repository(doc: Path) -> None:
    text = TEXT[doc]
    assert "../" not in text, f"{_doc_id(doc)} names a file outside its folder (`../`)"
    # A document it names (`ARCHITECTURE.md`) is one of the repository's, from the doc's
    # folder or from the top.
    for span in _code_spans(text) + _code_lines(text):
        for name in re.findall(r"(?<![\w/.-])([\w./-]+\.md)\b", span):
            assert (doc.parent / name).is_file() or (REPO / name).is_file(), (
                f"{_doc_id(doc)} names `{name}`, which is not in the repository"
            )


@pytest.mark.parametrize("table", TABLES, ids=lambda table: table.name)
def test_each_results_table_is_what_its_results_write(table: Table) -> None:
    """Each marked block of results in the docs holds what its suite's `markdown` writes
    from its JSON result; `python -m tests.benchmarks.tables` rewrites them after a run."""
    for name in table.results:
        assert (RESULTS / name).is_file(), f"{table.name}: no results/{name}"
    shown = results_block(TEXT[REPO / table.doc], table.name)
    assert shown is not None, f"{table.doc} has no block `{table.name}` (its markers)"
    assert shown == table.text(), (
        f"{table.doc}: the block `{table.name}` differs from its results; "
        "run `python -m tests.benchmarks.tables`"
    )


def test_every_result_is_shown_or_said_why_not() -> None:
    """A new results file needs a block in the docs (tests/benchmarks/tables.py's TABLES)
    or a reason in NOT_SHOWN; and neither names a file that is not there."""
    files = {path.name for path in RESULTS.glob("*.json")}
    shown = {name for table in TABLES for name in table.results}
    assert files - shown - set(NOT_SHOWN) == set(), "results no table shows"
    assert set(NOT_SHOWN) <= files, "NOT_SHOWN names results that are not there"
    assert not shown & set(NOT_SHOWN), "results both shown and listed as not shown"
    assert len({table.name for table in TABLES}) == len(TABLES), "two blocks of one name"


def test_the_concurrency_table_shows_the_spread_of_repeats() -> None:
    """A result with repeats (concurrency.py's `--repeats`) shows each ratio as the median
    and range of its repeats, and a conversation workload with its turns; results from
    before the repeats keep their one ratio."""
    result = json.loads((RESULTS / "concurrency.json").read_text())
    repeated = copy.deepcopy(result)
    repeated["settings"]["conversation_turns"] = 6
    repeated["targets"]["conversation"] = 1.2
    repeated["workloads"]["conversation"] = copy.deepcopy(repeated["workloads"]["streams_8"])
    for row in repeated["workloads"].values():
        row["repeats"] = [{"aggregate_tok_s": 1.0}] * 3
        row["ratio_spread"] = {"min": 1.02, "median": 1.061, "max": 1.08}
    text = concurrency.markdown(repeated)
    assert f"ratio: median (min{DASH}max) of 3 repeats" in text
    assert f"| **1.06 (1.02{DASH}1.08)** | ≥ 1.2 |" in text
    assert f"| conversations, 8 streams {TIMES} 6 turns |" in text
    assert f"(1.02{DASH}1.08)" not in concurrency.markdown(result)
