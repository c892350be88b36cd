"""The hub's tests run on both stores: SQLite in the hub's data directory, and a database
of its own on the session's PostgreSQL cluster (tests/postgres.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.postgres import Cluster

# Settings keys that put a hub's store on one backend: {} (SQLite) or its database_url.
HubDatabase = dict[str, Any]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def hub_database(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> HubDatabase:
    """Where the test's hub keeps its store; `kvl` commands the test runs get the same
    (KVL_HUB_DATABASE_URL)."""
    if request.param == "sqlite":
        monkeypatch.delenv("KVL_HUB_DATABASE_URL", raising=False)
        return {}
    cluster: Cluster = request.getfixturevalue("postgres")
    url = cluster.create()
    monkeypatch.setenv("KVL_HUB_DATABASE_URL", url)
    return {"database_url": url}
