"""The house reads in one direction: no module imports another that imports it back
(directly or around a circle), no folder of the appliance or the hub does either, the
appliance and the hub never import each other, `shared/` imports neither, and no hub
module grows past 500 lines. docs/README.md says which way imports go."""

from __future__ import annotations

import ast
import re
import subprocess
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("appliance", "hub", "image", "shared")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _imports() -> dict[str, set[str]]:
    """Every project module and the project modules it imports (TYPE_CHECKING ones too:
    a circle there is still a circle to a reader)."""
    modules = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            for imported in targets:
                target = imported
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node (Tarjan, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    nodes = set(edges) | {t for targets in edges.values() for t in targets}
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_module_imports_its_way_back_to_itself() -> None:
    assert _cycles(_imports()) == []


def test_no_folder_of_the_appliance_or_the_hub_imports_its_way_back() -> None:
    folders: dict[str, set[str]] = defaultdict(set)
    for module, targets in _imports().items():
        parts = module.split(".")
        if parts[0] not in {"appliance", "hub"} or len(parts) < 3:
            continue  # a top-level module (app, cli, settings) wires the folders
        for target in targets:
            other = target.split(".")
            if other[0] == parts[0] and len(other) >= 3 and other[1] != parts[1]:
                folders[".".join(parts[:2])].add(".".join(other[:2]))
    assert _cycles(folders) == []


def test_the_appliance_and_the_hub_import_only_shared_of_each_other() -> None:
    crossing = [
        (module, target)
        for module, targets in _imports().items()
        for target in targets
        if (module.split(".")[0], target.split(".")[0])
        in {("appliance", "hub"), ("hub", "appliance"), ("shared", "appliance"),
            ("shared", "hub")}
    ]  # fmt: skip
    assert crossing == []


def test_every_hub_module_is_under_500_lines() -> None:
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for path in (ROOT / "hub").rglob("*.py")
    }
    assert {path: n for path, n in sizes.items() if n >= 500} == {}


def test_no_tracked_file_holds_a_merge_conflict_marker() -> None:
    """A merge whose conflict was committed unresolved (it happened once, in two docs)
    breaks no import and no other test: look for the markers themselves."""
    tracked = (
        subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
        .stdout.decode()
        .split("\0")
    )
    marker = re.compile(r"^(<{7} |>{7} |={7}$)", re.MULTILINE)
    found = []
    for name in filter(None, tracked):
        path = ROOT / name
        if not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # not text
        found += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}" for m in marker.finditer(text)]
    assert not found, f"merge conflict markers: {found}"
