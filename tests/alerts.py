"""A webhook receiver that keeps what a hub's alerts deliver, and the secret they are
signed with."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from shared.webhooks import DELIVERY_HEADER, SIGNATURE_HEADER, verify

SECRET = "a-webhook-secret-of-the-test"


class Receiver:
    """A webhook receiver on loopback: verifies each delivery's signature with
    shared/webhooks.py, and answers `status` (503 while it is "down")."""

    def __init__(self) -> None:
        self.status = 200
        self.received: list[dict[str, Any]] = []
        self.refused = 0
        self.app = web.Application()
        self.app.add_routes([web.post("/hook", self.hook)])

    async def hook(self, request: web.Request) -> web.Response:
        body = await request.read()
        verify(SECRET, body, request.headers.get(SIGNATURE_HEADER))  # raises if forged
        if self.status != 200:
            self.refused += 1
            return web.Response(status=self.status)
        self.received.append({"id": request.headers[DELIVERY_HEADER], **json.loads(body)})
        return web.Response(status=204)

    def events(self) -> list[tuple[str, str]]:
        return [(r["event"], r["alert"]["labels"].get("node", "")) for r in self.received]
