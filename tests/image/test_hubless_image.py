"""A site without a hub, on the appliance image booted under QEMU: a module of its own, so
that it boots on another worker while `test_image.py`'s four boots run."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.image.vm import GROW, Machine, copy_image, kvl

pytestmark = pytest.mark.image


@pytest.mark.timeout(3600)
def test_a_hubless_image_takes_a_key_made_over_the_lan(
    manifest: dict[str, Any], tmp_path: Path
) -> None:
    """A site without a hub: `kvl image configure --no-hub` writes a bootstrap admin key's
    hash into a copy; booted, the node serves its LAN alone, and that key makes an account
    and a key over the LAN, which the node then serves."""
    disk = copy_image(Path(manifest["image"]), tmp_path / "disk.img", GROW)
    admin = kvl("image", "configure", str(disk), "--no-hub", "--name", "lab-server").strip()
    with Machine(disk, tmp_path / "vm") as machine:
        machine.wait_ready()
        base = f"http://127.0.0.1:{machine.port}"
        made = lan_call(base, "/v1/admin/accounts", admin, {"name": "class-7b"})
        assert made["name"] == "class-7b", made
        key = lan_call(base, "/v1/admin/keys", admin, {"account": "class-7b"})["key"]
        models = lan_call(base, "/v1/models", key)
        assert models["object"] == "list", models
        assert models["data"], models  # the embedded models, served to the new key
        with pytest.raises(urllib.error.HTTPError) as refused:  # not an admin key
            lan_call(base, "/v1/admin/keys", key, {"account": "class-7b"})
        assert refused.value.code == 403
        refused.value.close()  # the error holds the answer's connection
        machine.power_off()


def lan_call(base: str, path: str, key: str, body: dict[str, Any] | None = None) -> Any:
    """A call to the node's LAN API: POST `body` as JSON, or GET without one."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        base + path, data=data, method="GET" if body is None else "POST"
    )
    request.add_header("Authorization", f"Bearer {key}")
    if body is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())
