"""The house reads in one direction: no module imports another that imports it back
(directly or around a circle), no folder of the appliance or the hub does either, the
appliance and the hub never import each other, `shared/` imports neither, and no hub
module grows past 500 lines. The hub's schema is one list of migrations, and each of its
routes is declared once. docs/README.md says which way imports go."""

from __future__ import annotations

import ast
import re
import subprocess
from collections import defaultdict
from pathlib import Path

from tests.scheduling import HEAVIEST, PER_BACKEND

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("appliance", "hub", "image", "shared")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "build" in path.relative_to(ROOT).parts:  # an image build's copy (ignored)
                continue
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


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def _called(call: ast.Call) -> str:
    return str(getattr(call.func, "id", getattr(call.func, "attr", "")))


def test_the_hub_schema_is_one_migration_list() -> None:
    """Migrations are written only in hub/state/migrations/ (its MIGRATIONS, which both
    databases run); hub/state/sql.py runs them (through sqlite-utils' `Migrations` on
    SQLite). A second list, for one database, is how two schemas drift apart."""
    home, found = ROOT / "hub" / "state" / "migrations", []
    for path in sorted((ROOT / "hub").rglob("*.py")):
        if home in path.parents:
            continue
        where = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text())
        names = [(c.lineno, _called(c)) for c in _calls(tree)] + [
            (node.lineno, target.id.upper())
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        ]
        found += [
            f"{where}:{line} {name}"
            for line, name in names
            if name in {"Migration", "SQLMigration", "MIGRATIONS"}
            or (name == "Migrations" and where != "hub/state/sql.py")
        ]
    assert found == [], f"migrations outside hub/state/migrations/: {found}"


_ROUTE_MAKERS = {"get", "post", "put", "patch", "delete", "head", "route", "view", "static"}
_REGISTERS = {f"add_{kind}" for kind in (*_ROUTE_MAKERS, "resource")}


def test_hub_routes_are_made_only_from_their_declarations() -> None:
    """A hub route is a `Route` beside its handler; `route_defs` (hub/api/route_kinds.py)
    alone turns them into aiohttp's. The console registers its HTML pages itself."""
    found = []
    for path in sorted((ROOT / "hub").rglob("*.py")):
        if path.is_relative_to(ROOT / "hub" / "console"):
            continue
        tree = ast.parse(path.read_text())
        generator = {
            id(node)
            for function in ast.walk(tree)
            if isinstance(function, ast.FunctionDef) and function.name == "route_defs"
            for node in ast.walk(function)
        }
        for call in _calls(tree):
            if id(call) in generator or not isinstance(call.func, ast.Attribute):
                continue
            name, owner = call.func.attr, call.func.value
            made = name in _ROUTE_MAKERS and isinstance(owner, ast.Name) and owner.id == "web"
            bulk = name == "add_routes" and not (
                call.args
                and isinstance(call.args[0], ast.Call)
                and _called(call.args[0]) == "route_defs"
            )
            if made or bulk or name in _REGISTERS:
                found.append(f"{path.relative_to(ROOT)}:{call.lineno} {name}")
    assert found == []


def test_every_hub_route_is_declared_once(tmp_path: Path) -> None:
    """What the hub's app registers is exactly the route table, each route once, and every
    `Route` a hub/api module declares is in the table (none forgotten, none twice)."""
    import importlib  # noqa: PLC0415
    import pkgutil  # noqa: PLC0415
    from collections import Counter  # noqa: PLC0415

    import hub.api  # noqa: PLC0415
    from hub.api.route_kinds import Route  # noqa: PLC0415
    from hub.api.route_table import ROUTES  # noqa: PLC0415
    from hub.app import create_app  # noqa: PLC0415
    from tests.hubs import settings_for  # noqa: PLC0415

    app = create_app(settings_for(tmp_path))
    registered = Counter(
        (r.method, r.resource.canonical)
        for r in app.router.routes()
        if r.resource is not None
        and r.method != "HEAD"
        and not r.resource.canonical.startswith("/console")
    )
    assert [r for r, n in registered.items() if n > 1] == []
    assert set(registered) == {(r.method, r.registered) for r in ROUTES}
    documented = Counter((r.method, r.path) for r in ROUTES)
    assert [r for r, n in documented.items() if n > 1] == []
    held = [
        v
        for info in pkgutil.iter_modules(hub.api.__path__, "hub.api.")
        for value in vars(importlib.import_module(info.name)).values()
        for v in (value if isinstance(value, tuple) else (value,))
        if isinstance(v, Route)
    ]
    assert [f"{r.method} {r.path}" for r in held if r not in ROUTES] == []


_SERVICES = ("inference", "jobs", "packages", "quotas")


def _http_names(node: ast.stmt | ast.expr) -> list[str]:
    """What `node` names of HTTP: the HTTP layers' error type, or aiohttp's server."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        names = [f"{node.module}.{alias.name}" for alias in node.names]
    elif isinstance(node, ast.Name):
        names = [node.id]
    elif isinstance(node, ast.Attribute):
        names = [node.attr]
    return [
        name
        for name in names
        if name.rpartition(".")[2] == "ApiError"
        or name == "aiohttp.web"
        or name.startswith(("aiohttp.web.", "aiohttp.web_"))
    ]


def test_services_raise_domain_errors_and_know_nothing_of_http() -> None:
    """The services below the HTTP and gRPC layers raise domain errors (shared.errors),
    which the gateway and the gRPC server each map in one place: no module of theirs
    imports, raises or names ApiError, the HTTP layers' own error, nor imports aiohttp's
    server (`aiohttp.web`; a client, for webhooks, is theirs to use)."""
    found = [
        f"{path.relative_to(ROOT).as_posix()}:{node.lineno} {name}"
        for folder in _SERVICES
        for path in sorted((ROOT / "appliance" / folder).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.stmt | ast.expr)
        for name in _http_names(node)
    ]
    assert found == []


# A statement's first keyword (in any case), then what only a statement has after it,
# written as the hub writes its SQL, in capitals: SELECT … FROM, INSERT INTO, UPDATE t SET,
# DELETE FROM, CREATE/ALTER/DROP TABLE (INDEX, …), WITH n AS (. Prose that starts with
# "Delete" or "Select" has none of these.
_SQL = re.compile(
    r"""\s*(?:
        (?i:SELECT)\s.+?\sFROM\s
      | (?i:INSERT)\s+INTO\s
      | (?i:UPDATE)\s+\S+\s+SET\s
      | (?i:DELETE)\s+FROM\s
      | (?i:CREATE|ALTER|DROP)\s+(?:UNIQUE\s+)?(?:TABLE|INDEX|VIEW|SCHEMA|DATABASE|SEQUENCE)\s
      | (?i:WITH)\s+(?:RECURSIVE\s+)?\w+(?:\s*\([^)]*\))?\s+AS\s*\(
    )""",
    re.DOTALL | re.VERBOSE,
)
_STATEMENT_CALLS = {"execute", "executemany", "executescript"}


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """Every string literal, adjacent ones joined as Python joins them; an f-string with
    each placeholder as `x`."""
    fstrings = [node for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)]
    parts = {id(value) for node in fstrings for value in node.values}
    found = [
        (
            node.lineno,
            "".join(str(v.value) if isinstance(v, ast.Constant) else "x" for v in node.values),
        )
        for node in fstrings
    ]
    found += [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in parts
    ]
    return found


def test_only_hub_state_holds_sql() -> None:
    """The hub's SQL lives in hub/state/, its repositories (Headscale's `hscontrol/state`):
    no other hub module holds a statement or runs one."""
    home, found = ROOT / "hub" / "state", []
    for path in sorted((ROOT / "hub").rglob("*.py")):
        if home in path.parents:
            continue
        where = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text())
        found += [f"{where}:{n} {text[:60]!r}" for n, text in _strings(tree) if _SQL.match(text)]
        found += [
            f"{where}:{call.lineno} .{call.func.attr}()"
            for call in _calls(tree)
            if isinstance(call.func, ast.Attribute) and call.func.attr in _STATEMENT_CALLS
        ]
    assert found == [], f"SQL outside hub/state/: {found}"


def test_the_sql_check_knows_a_statement_from_prose() -> None:
    statements = [
        "SELECT id, name FROM nodes WHERE id = ?",
        "  insert INTO ledger (event_id) VALUES (?)",
        "UPDATE nodes SET draining = ? WHERE id = ?",
        "DELETE FROM console_sessions",
        "CREATE UNIQUE INDEX idx_nodes_name ON nodes (name)",
        "WITH recent AS (SELECT 1) SELECT * FROM recent",
    ]
    prose = [
        "Delete a console user; their logins end at once.",
        "Select the nodes from the site",
        "update windows set per site",
        "Drop the table of a site's nodes",
        "Create a console user; prompts for the password (at least 10 characters).",
    ]
    assert [bool(_SQL.match(s)) for s in statements] == [True] * len(statements)
    assert [bool(_SQL.match(s)) for s in prose] == [False] * len(prose)


def _imported_from(
    tree: ast.AST, modules: set[str]
) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """What a module imports of `modules`: (local name -> (module, name), local name of
    a module -> module)."""
    names: dict[str, tuple[str, str]] = {}
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                local = alias.asname or alias.name
                if f"{node.module}.{alias.name}" in modules:
                    aliases[local] = f"{node.module}.{alias.name}"
                elif node.module in modules:
                    names[local] = (node.module, alias.name)
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
    return names, aliases


def _origin(
    base: ast.expr, names: dict[str, tuple[str, str]], aliases: dict[str, str]
) -> tuple[str, str] | None:
    """The (module, name) a base class expression names, if it is one `_imported_from` saw."""
    while isinstance(base, ast.Subscript):  # a generic: Store[T]
        base = base.value
    if isinstance(base, ast.Name):
        return names.get(base.id)
    if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
        module = aliases.get(base.value.id)
        return None if module is None else (module, base.attr)
    return None


def test_no_module_of_hub_state_subclasses_another_modules_class() -> None:
    """The store is composed, not inherited: each repository is a plain class given the
    others it reads. A class of hub/state/ derives from no class of another hub/state/
    module, except the errors every repository shares (hub/state/errors.py)."""
    trees = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): (
            ast.parse(path.read_text())
        )
        for path in (ROOT / "hub" / "state").rglob("*.py")
    }
    classes = {
        (module, node.name)
        for module, tree in trees.items()
        for node in tree.body
        if isinstance(node, ast.ClassDef)
    }
    found = []
    for module, tree in sorted(trees.items()):
        names, aliases = _imported_from(tree, set(trees))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    origin = _origin(base, names, aliases)
                    if origin in classes and origin[0] not in {module, "hub.state.errors"}:
                        found.append(f"{module}.{node.name}({'.'.join(origin)})")
    assert found == [], f"hub/state/ classes that subclass another module's: {found}"


def test_no_test_module_imports_from_another_test_module() -> None:
    """What tests share lives in a module that says what it holds (tests/hubs.py,
    tests/console.py …): a `test_*` module is imported by pytest alone, so that running
    one file never runs, or depends on, another file's tests."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            if any(
                name.startswith("tests.") and name.split(".")[-1].startswith("test_")
                for name in names
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == [], f"imports from a test module: {found}"


def test_the_modules_the_scheduler_sends_first_exist() -> None:
    """tests/scheduling.py names the slowest modules; a rename must not leave it naming
    none, which would put them back at the end of the run."""
    missing = [m for m in (*HEAVIEST, *PER_BACKEND) if not (ROOT / m).is_file()]
    assert missing == [], f"tests/scheduling.py names modules that are not there: {missing}"
