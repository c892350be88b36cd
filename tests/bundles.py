"""Site bundles as the tests upload them to a node's admin API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tests.waiting import until

if TYPE_CHECKING:
    from tests.conftest import Client

PIECE = 1 << 20


async def upload_bundle(
    client: Client, admin: str, bundle: bytes, cut_at: int | None = None
) -> Any:
    """The bundle uploaded in pieces (cut off once at `cut_at`, then resumed from where the
    node says it stands); the upload as the last piece left it."""
    headers = {"Authorization": f"Bearer {admin}"}
    created = await client.post("/v1/admin/bundles", headers=headers, json={"size": len(bundle)})
    assert created.status == 201, await created.text()
    upload_id = (await created.json())["id"]
    offset = 0
    while True:
        end = min(len(bundle), offset + PIECE)
        if cut_at is not None and offset < cut_at < end:
            end, cut_at = cut_at, None
            wrong = await client.patch(
                f"/v1/admin/bundles/{upload_id}",
                headers={**headers, "Upload-Offset": str(offset + 1)},
                data=bundle[offset:end],
            )
            assert wrong.status == 409
            assert (await wrong.json())["error"]["code"] == "upload_offset_mismatch"
        answer = await client.patch(
            f"/v1/admin/bundles/{upload_id}",
            headers={**headers, "Upload-Offset": str(offset)},
            data=bundle[offset:end],
        )
        assert answer.status == 200, await answer.text()
        body = await answer.json()
        if body["state"] != "open":
            return await _outcome(client, headers, upload_id)
        stands = await client.get(f"/v1/admin/bundles/{upload_id}", headers=headers)
        offset = (await stands.json())["offset"]


async def _outcome(client: Client, headers: dict[str, str], upload_id: str) -> Any:
    """The upload once it was checked and applied, or failed (in the background)."""

    async def ended() -> Any:
        answer = await client.get(f"/v1/admin/bundles/{upload_id}", headers=headers)
        body = await answer.json()
        return body if body["state"] in {"applied", "failed"} else None

    return await until(ended, "the bundle checked and applied", 120)
