"""The site's network through the admin API (shared/site_network.py): what is in force, a
change asked for, and its confirmation. The appliance runs without root: it leaves the
change for the image's network agent (image/network.py), which tries it and keeps it only
once it is confirmed over the new setting, within the change's bound.

- `GET /v1/admin/network`: the setting in force, where it came from, and the last change
  (trying until its deadline, applied, rolled back, or refused, with the reason);
- `PUT /v1/admin/network`: a whole setting, with `confirm_within_s` (default 120): 202,
  the change's `id`; 409 `network_trial` while another is on trial, `network_not_managed`
  off the image;
- `POST /v1/admin/network/confirm` with the change's `id`, sent over the new setting: the
  change is kept; without it, the last working setting comes back at the deadline.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from appliance.gateway.appkeys import api_key
from appliance.gateway.parsing import read_json
from appliance.inference.schemas import parse_body
from shared.errors import ApiError, ErrorCode
from shared.site_network import (
    CONFIRM_DEFAULT_S,
    CONFIRM_MAX_S,
    CONFIRM_MIN_S,
    Paths,
    Request,
    SiteNetwork,
    State,
)

if TYPE_CHECKING:
    from pathlib import Path

# How long a confirmation waits to see the agent keep the change (it looks twice a second).
_KEPT_WITHIN_S = 5.0


class NetworkChange(SiteNetwork):
    """A whole network setting (what is left out is the default: DHCP, no proxy), and how
    long it is tried before it is rolled back unless confirmed."""

    confirm_within_s: int = Field(
        CONFIRM_DEFAULT_S,
        ge=CONFIRM_MIN_S,
        le=CONFIRM_MAX_S,
        description="Seconds to confirm the change over the new setting, else it is undone.",
    )


class NetworkConfirmation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="The change's `id`.")


class SiteNetworks:
    """The appliance's side of the agent's files; `paths` None off the image."""

    def __init__(self, paths: Paths | None) -> None:
        self.paths = paths

    def state(self) -> State | None:
        if self.paths is None:
            return None
        return State.read(self.paths.state)

    def _managed(self) -> tuple[Paths, State]:
        state = self.state()
        if self.paths is None or state is None:
            raise ApiError(
                ErrorCode.network_not_managed,
                "this node's network is not the appliance image's to set: no network agent "
                "keeps its state here (`network.agent_dir`)",
            )
        return self.paths, state

    def request(self, change: NetworkChange, asked_by: str) -> dict[str, Any]:
        paths, state = self._managed()
        trying = _trying(state)
        if trying is not None or paths.request.exists():
            which = f"change {trying}" if trying else "a change the agent has not taken yet"
            raise ApiError(
                ErrorCode.network_trial,
                f"{which} is on trial: confirm it, or wait for its deadline",
            )
        network = SiteNetwork.model_validate(change.model_dump(exclude={"confirm_within_s"}))
        request = Request(
            id=f"net_{secrets.token_hex(8)}",
            network=network,
            confirm_within_s=change.confirm_within_s,
            asked_by=asked_by,
        )
        _write(paths.request, request.model_dump_json())
        return {
            "object": "network_change",
            "id": request.id,
            "outcome": "requested",
            "confirm_within_s": request.confirm_within_s,
            "network": network.model_dump(mode="json"),
        }

    async def confirm(self, change: str) -> dict[str, Any]:
        paths, state = self._managed()
        if _trying(state) != change:
            raise ApiError(
                ErrorCode.network_trial,
                f"no change {change} is on trial (GET /v1/admin/network says what is)",
                param="id",
            )
        await asyncio.to_thread(_write, paths.confirmation(change), "")
        ends = time.monotonic() + _KEPT_WITHIN_S
        while time.monotonic() < ends:
            now = await asyncio.to_thread(self.state)
            state = now if now is not None else state
            if _trying(state) != change:
                break
            await asyncio.sleep(0.25)
        return self.view(state)

    def view(self, state: State | None = None) -> dict[str, Any]:
        state = state if state is not None else self.state()
        if state is None:
            return {"object": "network", "managed": False}
        return {"object": "network", "managed": True, **state.model_dump(mode="json")}


def _trying(state: State) -> str | None:
    """The change on trial: one the agent is trying and whose deadline has not passed."""
    last = state.last
    if last is None or last.outcome != "trying" or last.deadline is None:
        return None
    return last.id if last.deadline > datetime.now(UTC) else None


def _write(path: Path, text: str) -> None:
    """Whole or not at all: the agent is started when the file appears."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    partial.replace(path)


NETWORKS = web.AppKey("networks", SiteNetworks)


async def get_network(request: web.Request) -> web.Response:
    networks = request.app[NETWORKS]
    return web.json_response(await asyncio.to_thread(networks.view))


async def put_network(request: web.Request) -> web.Response:
    change = parse_body(NetworkChange, await read_json(request))
    key = api_key(request)
    asked_by = f"key {key.prefix} of {key.account.name}"
    answer = await asyncio.to_thread(request.app[NETWORKS].request, change, asked_by)
    return web.json_response(answer, status=202)


async def confirm_network(request: web.Request) -> web.Response:
    confirmation = parse_body(NetworkConfirmation, await read_json(request))
    return web.json_response(await request.app[NETWORKS].confirm(confirmation.id))
