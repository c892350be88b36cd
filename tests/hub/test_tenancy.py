"""Tenancy and isolation on the hub: which nodes' desired states give an account (and its
keys), what a node may report for, the operator API and CLI that bind accounts, the m010
migration on a database made before it, and the placement planner honouring isolation
levels. Real SQLite files (and PostgreSQL where the fixture runs), a real hub app."""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import closing
from typing import TYPE_CHECKING, Any, cast

import pytest
from sqlite_utils import Database

from hub.app import create_app
from hub.planning.placement import plan
from hub.planning.snapshots import Deployment, NodeSnapshot
from hub.planning.tenancy import Tenancy, account_reaches
from hub.state.accounts import ForeignAccountError
from hub.state.migrations import MIGRATION_SET, MIGRATIONS
from hub.state.nodes import Heartbeat
from hub.state.sql import sqlite_migrations
from hub.state.store import AsyncHubStore, HubStore, open_store
from shared import protocol
from shared.classes import IsolationLevel
from tests.conftest import kvl
from tests.hubs import PREFIX, new_key, settings_for

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpClient

    from hub.settings import HubSettings
    from hub.state.nodes import Node
    from tests.hub.conftest import HubDatabase

# A node's tenancy, the operator's: (its tenant, private).
NodeTenancy = tuple[str | None, bool]
SHARED: NodeTenancy = (None, False)
ACME: NodeTenancy = ("acme", False)
GLOBEX: NodeTenancy = ("globex", False)
ACME_PRIVATE: NodeTenancy = ("acme", True)
PRIVATE: NodeTenancy = (None, True)


@pytest.mark.parametrize(
    ("tenancy", "site", "node", "reaches"),
    [
        # A shared account: every shared node, no dedicated or private one.
        (Tenancy(), "a", SHARED, True),
        (Tenancy(), "a", ACME, False),
        (Tenancy(), "a", PRIVATE, False),
        # A tenant's account: its own dedicated and private nodes, and shared nodes...
        (Tenancy("acme"), "a", ACME, True),
        (Tenancy("acme"), "a", ACME_PRIVATE, True),
        (Tenancy("acme"), "a", SHARED, True),
        (Tenancy("acme"), "a", GLOBEX, False),
        # ... but not shared ones when restricted to its dedicated nodes.
        (Tenancy("acme", dedicated=True), "a", SHARED, False),
        (Tenancy("acme", dedicated=True), "a", ACME, True),
        (Tenancy("acme", dedicated=True), "a", GLOBEX, False),
        # Sites hold whatever else does.
        (Tenancy("acme", ("b",)), "a", ACME, False),
        (Tenancy(sites=("a",)), "a", SHARED, True),
        (Tenancy(sites=("a",)), "b", SHARED, False),
        # A private node without a tenant: only accounts that name its site.
        (Tenancy(sites=("a",)), "a", PRIVATE, True),
        (Tenancy("acme", ("a",), dedicated=True), "a", PRIVATE, False),
    ],
)
def test_which_nodes_an_account_reaches(
    tenancy: Tenancy, site: str, node: NodeTenancy, *, reaches: bool
) -> None:
    assert account_reaches(tenancy, site, *node) is reaches


def test_an_account_restricted_to_dedicated_nodes_names_its_tenant() -> None:
    with pytest.raises(ValueError, match="names its tenant"):
        Tenancy(dedicated=True)


def _node(store: HubStore, name: str, site: str, tenancy: NodeTenancy) -> Node:
    """A node enrolled with a token of ``tenancy`` (the operator's to give)."""
    tenant, private = tenancy
    token = store.tokens.create(
        site, uses=1, expires_in_s=60, tenant=tenant, private=private
    ).plaintext
    return store.nodes.enroll(
        token, name=name, wg_public_key=new_key(), overlay_prefix=PREFIX, labels={},
        versions={},
    ).node  # fmt: skip


def _seen(store: HubStore, *nodes: Node) -> None:
    """Heartbeats of `nodes`, now: they called while what reaches them did."""
    store.heartbeats([Heartbeat(n.id, time.time(), {}, protocol.Capacity()) for n in nodes])


def _fleet(settings: HubSettings) -> tuple[HubStore, dict[str, Node], dict[str, str]]:
    """Nodes of every kind, accounts of every binding, a key each."""
    store = open_store(settings)
    nodes = {
        "shared-a": _node(store, "shared-a", "a", SHARED),
        "shared-b": _node(store, "shared-b", "b", SHARED),
        "acme": _node(store, "acme-1", "a", ACME),
        "globex": _node(store, "globex-1", "a", GLOBEX),
        "acme-private": _node(store, "acme-home", "acme-hq", ACME_PRIVATE),
    }
    keys = {}
    for name, tenancy in {
        "public": Tenancy(),
        "acme-staff": Tenancy("acme"),
        "acme-secret": Tenancy("acme", dedicated=True),
        "globex-staff": Tenancy("globex", dedicated=True),
        "site-b": Tenancy(sites=("b",)),
    }.items():
        store.accounts.put(name, "S1")
        store.accounts.set_tenancy(name, tenancy)
        keys[name] = store.accounts.create_key(name).prefix
    return store, nodes, keys


def test_each_node_is_given_only_the_accounts_and_keys_that_reach_it(
    tmp_path: Path, hub_database: HubDatabase
) -> None:
    store, nodes, keys = _fleet(settings_for(tmp_path, hub_database))
    try:
        given = {}
        for kind, node in nodes.items():
            state = store.desired.of(node)
            accounts = {a.name for a in state.accounts}
            # Keys follow their account: none of another's.
            assert {k.account for k in state.keys} == accounts
            assert {k.prefix for k in state.keys} == {keys[a] for a in accounts}
            given[kind] = accounts
        assert given == {
            "shared-a": {"public", "acme-staff"},
            "shared-b": {"public", "acme-staff", "site-b"},
            "acme": {"acme-staff", "acme-secret"},
            "globex": {"globex-staff"},
            "acme-private": {"acme-staff", "acme-secret"},
        }
    finally:
        store.close()


def test_a_rebinding_moves_an_account_and_its_usage_stays_reportable(
    tmp_path: Path, hub_database: HubDatabase
) -> None:
    store, nodes, _ = _fleet(settings_for(tmp_path, hub_database))
    try:
        shared = nodes["shared-a"]
        _seen(store, *nodes.values())
        serial = store.serials.desired()
        assert "acme-staff" in store.accounts.served(shared)
        # acme's staff account is restricted to acme's nodes: the shared node loses it...
        assert store.accounts.set_tenancy("acme-staff", Tenancy("acme", dedicated=True)) > serial
        assert "acme-staff" not in {a.name for a in store.desired.of(shared).accounts}
        # ... but what it served before stays its to report.
        assert "acme-staff" in store.accounts.node_accounts(shared)
        assert "acme-staff" not in store.accounts.node_accounts(nodes["globex"])  # never had it
        # A node that has not called since it was given an account never served it.
        quiet = _node(store, "quiet", "a", SHARED)
        assert store.accounts.served(quiet) == {"public"}
        # Shared again: given again, and no longer a departure.
        _seen(store, nodes["acme"])
        store.accounts.set_tenancy("acme-staff", Tenancy())
        assert "acme-staff" in store.accounts.served(shared)
        # Which withdrew it from acme's dedicated node, which had it.
        assert "acme-staff" not in store.accounts.served(nodes["acme"])
        assert "acme-staff" in store.accounts.node_accounts(nodes["acme"])
        with pytest.raises(LookupError, match="no account"):
            store.accounts.set_tenancy("nobody", Tenancy())
    finally:
        store.close()


async def test_what_a_node_may_report_is_its_own_and_follows_a_rebinding(
    tmp_path: Path, hub_database: HubDatabase
) -> None:
    settings = settings_for(tmp_path, hub_database)
    store, nodes, _ = _fleet(settings)
    _seen(store, nodes["acme"])
    store.close()
    hub = AsyncHubStore(settings)
    await hub.open()
    try:
        # The replica remembers each node's accounts apart: one node's are not another's.
        await hub.check_reports(nodes["acme"], accounts={"acme-secret"}, leases=())
        with pytest.raises(ForeignAccountError):
            await hub.check_reports(nodes["globex"], accounts={"acme-secret"}, leases=())
        await hub.check_reports(nodes["shared-a"], accounts={"public"}, leases=())
        with pytest.raises(ForeignAccountError):
            await hub.check_reports(nodes["shared-a"], accounts={"acme-secret"}, leases=())
        # A binding change moves the serial; the replica's flusher reads it, and what it
        # remembered is dropped: globex's node may now report for the account it serves.
        await hub.run(hub.sync.accounts.set_tenancy, "acme-secret", Tenancy("globex"))
        hub.note_serials(await hub.run(hub.sync.serials.current))
        await hub.check_reports(nodes["globex"], accounts={"acme-secret"}, leases=())
        # And acme's node still may, for what it served before.
        await hub.check_reports(nodes["acme"], accounts={"acme-secret"}, leases=())
    finally:
        await hub.close()


def test_the_migration_applies_on_a_database_made_before_it(tmp_path: Path) -> None:
    """A hub file at m009 with an account and a key: m010 makes it a shared account,
    still given to every shared node."""
    settings = settings_for(tmp_path, {})
    settings.data_dir.mkdir(parents=True)
    db = Database(settings.db_path)
    sqlite_migrations(MIGRATIONS, MIGRATION_SET).apply(db, stop_before="m010_tenancy")
    db.execute("INSERT INTO accounts (name, service_class, created_at) VALUES ('old', 'S1', 0)")
    db.execute(
        "INSERT INTO api_keys (prefix, hash, account, admin, created_at)"
        " VALUES ('p', 'h', 'old', 0, 0)"
    )
    db.conn.commit()
    db.close()
    store = open_store(settings)
    try:
        [row] = store.accounts.all()
        assert (row["tenant"], row["sites"], row["dedicated"]) == (None, [], False)
        node = _node(store, "n", "a", SHARED)
        state = store.desired.of(node)
        assert ([a.name for a in state.accounts], [k.prefix for k in state.keys]) == (
            ["old"],
            ["p"],
        )
        assert store.accounts.served(_node(store, "d", "a", ACME)) == set()
    finally:
        store.close()
    with closing(sqlite3.connect(settings.db_path)) as conn:
        names = [r[0] for r in conn.execute("SELECT name FROM _sqlite_migrations")]
    assert "m010_tenancy" in names


def test_nodes_keep_their_tenancy_and_names_compare_without_case_after_m015(
    tmp_path: Path,
) -> None:
    """A hub file at m014: a node that its labels made tenant acme's private node keeps
    that tenancy (now the operator's to change), a shared one stays shared; of two case
    variants of one claimed name, the lowercase claim is kept."""
    settings = settings_for(tmp_path, {})
    settings.data_dir.mkdir(parents=True)
    db = Database(settings.db_path)
    sqlite_migrations(MIGRATIONS, MIGRATION_SET).apply(
        db, stop_before="m015_tenancy_from_the_operator"
    )
    for node_id, labels in (("n1", '{"tenant": "acme", "private": "true"}'), ("n2", "{}")):
        db.execute(
            "INSERT INTO nodes (id, name, site, labels, wg_public_key, overlay_address,"
            " token_prefix, token_hash) VALUES (?, ?, 's', ?, ?, ?, ?, 'h')",
            [node_id, node_id, labels, f"k{node_id}", f"100.64.0.{node_id[1]}", node_id],
        )
    for name, node_id in (("honest-b", "n1"), ("HONEST-B", "n2"), ("Lab.Local", "n2")):
        db.execute("INSERT INTO node_names (name, node_id, until) VALUES (?, ?, 1)",
                   [name, node_id])  # fmt: skip
    db.conn.commit()
    db.close()
    store = open_store(settings)
    try:
        assert (store.nodes.get("n1").tenant, store.nodes.get("n1").private) == ("acme", True)
        assert (store.nodes.get("n2").tenant, store.nodes.get("n2").private) == (None, False)
        names = store.db.execute("SELECT name, node_id FROM node_names ORDER BY name").fetchall()
    finally:
        store.close()
    assert sorted(map(tuple, names)) == [
        ("HONEST-B", "n2"),
        ("honest-b", "n1"),
        ("lab.local", "n2"),
    ]


async def test_the_operator_binds_an_account_over_the_api(
    aiohttp_client: AiohttpClient, tmp_path: Path, hub_database: HubDatabase
) -> None:
    settings = settings_for(tmp_path, hub_database)
    store = open_store(settings)
    try:
        store.accounts.put("acme-staff", "S1")
        token = store.operators.create("ops").plaintext
    finally:
        store.close()
    client = await aiohttp_client(create_app(settings))
    auth = {"Authorization": f"Bearer {token}"}
    path = "/v1/admin/accounts/acme-staff/tenancy"

    async def put(body: Any, where: str = path) -> tuple[int, Any]:
        response = await client.put(where, data=json.dumps(body), headers=auth)
        return response.status, await response.json()

    status, account = await put({"tenant": "acme", "sites": ["a", "a", "b"], "dedicated": True})
    assert status == 200, account
    assert (account["tenant"], account["sites"], account["dedicated"]) == ("acme", ["a", "b"], True)
    listed = await (await client.get("/v1/admin/accounts", headers=auth)).json()
    assert listed["data"][0]["tenant"] == "acme"
    status, account = await put({})  # shared again, every site
    assert (status, account["tenant"], account["sites"]) == (200, None, [])

    bodies: tuple[Any, ...] = (
        {"dedicated": True},  # no tenant to be dedicated to
        {"tenant": ""},
        {"sites": [""]},
        {"tenant": "a\x00b"},
        {"sites": ["x"] * 101},
        {"owner": "acme"},
        [],
    )
    for body in bodies:
        status, answer = await put(body)
        assert status == 400, body
        assert answer["error"]["code"] in {"invalid_value", "bad_request"}, answer
    status, answer = await put({}, "/v1/admin/accounts/nobody/tenancy")
    assert status == 404
    assert answer["error"]["code"] == "not_found"
    response = await client.put(path, data="{}")  # no operator token
    assert response.status == 401


def test_the_cli_binds_and_unbinds_an_account(tmp_path: Path, hub_database: HubDatabase) -> None:
    data = str(tmp_path / "hub")
    kvl("hub", "accounts", "set", "acme-staff", "--data-dir", data)
    bound = kvl("hub", "accounts", "bind", "acme-staff", "--tenant", "acme", "--site", "a",
                "--dedicated", "--data-dir", data).stdout  # fmt: skip
    assert "tenant acme (its dedicated nodes only), sites a" in bound
    assert (
        "tenancy acme (dedicated) at a" in kvl("hub", "accounts", "list", "--data-dir", data).stdout
    )
    refused = kvl("hub", "accounts", "bind", "acme-staff", "--dedicated", "--data-dir", data,
                  check=False)  # fmt: skip
    assert refused.returncode == 2
    assert "names its --tenant" in refused.stderr
    missing = kvl("hub", "accounts", "bind", "nobody", "--data-dir", data, check=False)
    assert missing.returncode == 1
    assert "no account" in missing.stderr
    assert "shared, every site" in kvl("hub", "accounts", "unbind", "acme-staff", "--data-dir",
                                       data).stdout  # fmt: skip
    assert "tenancy shared" in kvl("hub", "accounts", "list", "--data-dir", data).stdout


# -- isolation levels in placement ----------------------------------------------------------


def _snapshot(node_id: str, isolation: str = "I1", **fields: Any) -> NodeSnapshot:
    return NodeSnapshot(
        id=node_id, site="a", region=None, labels={}, memory_mib=8000, gpus=(), last_seen=100.0,
        isolation=IsolationLevel(isolation), **fields,
    )  # fmt: skip


def _plan(deployment: Deployment, nodes: list[NodeSnapshot]) -> Any:
    return plan([deployment], nodes, [], now=100.0, stale_after_s=60, offline_grace_s=300)


def test_the_planner_places_each_isolation_level_only_where_it_can_run() -> None:
    nodes = [
        _snapshot("plain"),
        _snapshot("cgroups", "I2"),
        _snapshot("acme-plain", tenant="acme"),
        _snapshot("acme-cgroups", "I2", tenant="acme"),
    ]

    def placed(**fields: Any) -> set[str]:
        d = Deployment(
            id="d", model="m", version="1", service_class=fields.pop("service_class", "S1"),
            replicas=4, memory_mib=100, **fields,
        )  # fmt: skip
        return {a.node_id for a in _plan(d, nodes).assignments}

    assert placed() == {"plain", "cgroups"}
    assert placed(isolation=IsolationLevel.I2) == {"cgroups"}
    s3 = {"service_class": "S3", "tenant": "acme"}
    assert placed(**s3) == {"acme-plain", "acme-cgroups"}
    assert placed(**s3, isolation=IsolationLevel.I2) == {"acme-cgroups"}
    assert placed(**s3, isolation=IsolationLevel.I3) == {"acme-cgroups"}

    # Why a deployment is short says so.
    d = Deployment(
        id="d",
        model="m",
        version="1",
        service_class="S1",
        replicas=2,
        memory_mib=100,
        isolation=IsolationLevel.I2,
    )
    why = _plan(d, nodes).unplaced["d"]
    assert (
        why
        == "1 of 2 replicas placed: only 1 matching node runs isolation I2 (one replica per node)."
    )

    # A replica on a node that stops reporting I2 moves (its cgroup is gone).
    d = Deployment(
        id="d",
        model="m",
        version="1",
        service_class="S1",
        replicas=1,
        memory_mib=100,
        isolation=IsolationLevel.I2,
    )
    first = _plan(d, nodes)
    assert [a.node_id for a in first.assignments] == ["cgroups"]
    later = plan([d], [_snapshot("cgroups"), _snapshot("other", "I2")], list(first.assignments),
                 now=100.0, stale_after_s=60, offline_grace_s=300)  # fmt: skip
    assert [a.node_id for a in later.assignments] == ["other"]


def test_a_deployment_names_a_known_level_and_i3_its_tenant() -> None:
    with pytest.raises(ValueError, match="unknown isolation level"):
        Deployment(
            id="d",
            model="m",
            version="1",
            service_class="S1",
            replicas=1,
            memory_mib=1,
            isolation=cast("IsolationLevel", "I9"),
        )
    with pytest.raises(ValueError, match="I3 deployment needs a tenant"):
        Deployment(
            id="d",
            model="m",
            version="1",
            service_class="S1",
            replicas=1,
            memory_mib=1,
            isolation=IsolationLevel.I3,
        )


async def test_the_operator_deploys_at_a_level(
    aiohttp_client: AiohttpClient, tmp_path: Path, hub_database: HubDatabase
) -> None:
    settings = settings_for(tmp_path, hub_database)
    store = open_store(settings)
    try:
        from hub.state.deployments import ModelArtifact  # noqa: PLC0415

        store.deployments.add_model(ModelArtifact("m", "1", "ab" * 32, 10, "gguf", 600))
        token = store.operators.create("ops").plaintext
    finally:
        store.close()
    client = await aiohttp_client(create_app(settings))
    auth = {"Authorization": f"Bearer {token}"}
    made = await client.post("/v1/admin/deployments", json={"model": "m@1"}, headers=auth)
    assert (await made.json())["isolation"] == "I1"  # the default
    made = await client.post(
        "/v1/admin/deployments", json={"model": "m@1", "isolation": "I2"}, headers=auth
    )
    assert made.status == 201
    assert (await made.json())["isolation"] == "I2"
    for body in ({"model": "m@1", "isolation": "I3"}, {"model": "m@1", "isolation": "I4"}):
        refused = await client.post("/v1/admin/deployments", json=body, headers=auth)
        assert refused.status == 400, body
        assert (await refused.json())["error"]["code"] == "invalid_value"
