"""A hub's backups as the tests restore them: where a restored hub keeps its store, and
`kvl hub …` on it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from tests.conftest import kvl

if TYPE_CHECKING:
    from tests.hub.conftest import HubDatabase
    from tests.postgres import Cluster


def fresh_database(request: pytest.FixtureRequest, database: HubDatabase) -> HubDatabase:
    """Where a restored hub keeps its store: on PostgreSQL a database of its own."""
    if not database:
        return {}
    cluster: Cluster = request.getfixturevalue("postgres")
    return {"database_url": cluster.create()}


def hub_cli(*args: str, database: HubDatabase, check: bool = True) -> Any:
    """`kvl hub …` as a real process, on the store `database` names."""
    env = {"KVL_HUB_DATABASE_URL": database["database_url"]} if database else None
    return kvl("hub", *args, env=env, check=check)
