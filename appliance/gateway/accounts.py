"""Admin routes for accounts and keys: list, make, disable and revoke them over the LAN, on
a site without a hub (`appliance/inference/accounts.py` decides; a node of a fleet only
lists them, its hub owns them). Behind an admin key, as every /v1/admin route."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from appliance.gateway.appkeys import ACCOUNTS
from appliance.gateway.parsing import read_json
from appliance.gateway.schemas import AccountPath, AccountRequest, KeyFilter, KeyPath, KeyRequest
from appliance.inference.schemas import parse_body
from shared.classes import ServiceClass

if TYPE_CHECKING:
    from appliance.state.store import Account, ApiKey


async def list_accounts(request: web.Request) -> web.Response:
    accounts = await request.app[ACCOUNTS].accounts()
    return web.json_response({"object": "list", "data": [account_view(a) for a in accounts]})


async def create_account(request: web.Request) -> web.Response:
    req = parse_body(AccountRequest, await read_json(request))
    account = await request.app[ACCOUNTS].create_account(
        req.name,
        ServiceClass(req.service_class),
        requests_per_minute=req.requests_per_minute,
        tokens_per_day=req.tokens_per_day,
    )
    return web.json_response(account_view(account), status=201)


async def disable_account(request: web.Request) -> web.Response:
    path = parse_body(AccountPath, dict(request.match_info))
    account = await request.app[ACCOUNTS].disable_account(path.name)
    return web.json_response(account_view(account))


async def list_keys(request: web.Request) -> web.Response:
    query = parse_body(KeyFilter, dict(request.query))
    keys = await request.app[ACCOUNTS].keys(query.account)
    return web.json_response({"object": "list", "data": [key_view(k) for k in keys]})


async def create_key(request: web.Request) -> web.Response:
    req = parse_body(KeyRequest, await read_json(request))
    key, plaintext = await request.app[ACCOUNTS].create_key(req.account, admin=req.admin)
    # The key itself is in this answer and nowhere else: only its hash is kept.
    return web.json_response({**key_view(key), "key": plaintext}, status=201)


async def revoke_key(request: web.Request) -> web.Response:
    path = parse_body(KeyPath, dict(request.match_info))
    key = await request.app[ACCOUNTS].revoke_key(path.prefix)
    return web.json_response(key_view(key))


def account_view(account: Account) -> dict[str, Any]:
    return {
        "object": "account",
        "name": account.name,
        "service_class": account.service_class.value,
        "requests_per_minute": account.requests_per_minute,
        "tokens_per_day": account.tokens_per_day,
        "fleet": account.fleet,
        "created_at": account.created_at,
        "disabled_at": account.disabled_at,
    }


def key_view(key: ApiKey) -> dict[str, Any]:
    return {
        "object": "api_key",
        "prefix": key.prefix,
        "account": key.account.name,
        "admin": key.admin,
        "created_at": key.created_at,
        "revoked_at": key.revoked_at,
    }
