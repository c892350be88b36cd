"""`kvl hub …` (hub/cli/): the commands' own output, beyond what the feature tests read."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hub.state.store import open_store
from tests.conftest import kvl
from tests.hubs import PREFIX, new_key, settings_for

if TYPE_CHECKING:
    from pathlib import Path

    from tests.hub.conftest import HubDatabase


def test_nodes_list_prints_a_header_before_the_rows(
    tmp_path: Path, hub_database: HubDatabase
) -> None:
    store = open_store(settings_for(tmp_path, hub_database))
    try:
        for name in ("node-b", "node-a"):
            token = store.tokens.create("lab", uses=1, expires_in_s=60).plaintext
            store.nodes.enroll(
                token, name=name, wg_public_key=new_key(), overlay_prefix=PREFIX,
                labels={}, versions={},
            )  # fmt: skip
    finally:
        store.close()
    lines = kvl("hub", "nodes", "list", "--data-dir", str(tmp_path / "hub")).stdout.splitlines()
    assert lines[0].split() == ["NAME", "SITE", "STATUS", "ADDRESS", "TENANCY", "LAST", "SEEN"]
    assert [line.split()[:3] + line.split()[4:5] for line in lines[1:]] == [
        ["node-a", "lab", "offline", "shared"],
        ["node-b", "lab", "offline", "shared"],
    ]
    # The columns line up under their names.
    assert lines[1].index("lab") == lines[0].index("SITE")
    assert lines[1].index("shared") == lines[0].index("TENANCY")
    assert lines[1].index("never") == lines[0].index("LAST SEEN")
