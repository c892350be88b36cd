"""What every console page shares: its state under an AppKey, HTML rendering, the login
and CSRF checks (a decorator, not a middleware: only console routes pay for them), and
error pages, so a console failure is a page, never JSON or a traceback."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import jinja2
from aiohttp import web

from hub.appkeys import SETTINGS, STORE
from hub.console.auth import SESSION_COOKIE, LoginThrottle, same_origin, same_token, session_hash
from hub.state.console import Session
from hub.state.errors import ConflictError, NotFoundError

if TYPE_CHECKING:
    from multidict import MultiDictProxy

    from hub.settings import HubSettings
    from hub.state.nodes import Node
    from hub.state.store import AsyncHubStore

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class FleetSnapshot:
    """The node list the live streams share: read from the store at most once per
    `max_age_s` however many people watch."""

    def __init__(self) -> None:
        self._nodes: list[Node] = []
        self._at = float("-inf")
        self._lock = asyncio.Lock()

    async def nodes(self, store: AsyncHubStore, max_age_s: float) -> list[Node]:
        async with self._lock:
            if time.monotonic() - self._at >= max_age_s:
                self._nodes = await store.nodes()
                self._at = time.monotonic()
            return self._nodes


@dataclass
class ConsoleState:
    settings: HubSettings
    templates: jinja2.Environment
    throttle: LoginThrottle
    static: dict[str, tuple[bytes, str]]  # name -> (content, content type)
    closing: asyncio.Event = field(default_factory=asyncio.Event)  # set on shutdown
    snapshot: FleetSnapshot = field(default_factory=FleetSnapshot)


CONSOLE = web.AppKey("hub_console", ConsoleState)
SESSION = web.RequestKey("console_session", Session)
FORM = web.RequestKey("console_form", dict[str, str])

NOTICES = {
    "drained": "The node drains: its replicas move elsewhere and it gets no new ones.",
    "undrained": "The node takes replicas again.",
    "tenancy-set": "The node's tenancy is set: its accounts follow with the next state pull.",
    "tenant-invalid": "Nothing was set: a tenant is 1 to 100 letters, digits, spaces, dots, "
    "dashes or underscores.",
    "revoked": "The node is revoked: its calls are refused from now on.",
    "unconfirmed": "Nothing was revoked: tick the box to confirm.",
    "token-revoked": "The enrollment token is revoked.",
    "key-revoked": "The API key is revoked; every node refuses it after its next state pull.",
    "deployed": "Deployed: the placement reconciler picks the nodes within seconds.",
    "undeployed": "Undeployed: its replicas are unloaded from the nodes.",
    "silenced": "Silenced: matching alerts are recorded, not sent.",
    "silence-ended": "The silence ended: matching alerts are sent again.",
    "rollout-paused": "The rollout is paused: no node more is reached until it is resumed.",
    "rollout-resumed": "The rollout goes on (a halt's failed nodes are judged again).",
    "rollout-aborted": "The rollout is aborted: the nodes it reached get what they had before.",
    "rollout-finished": "The rollback is finished: the nodes that never confirmed are recorded.",
    "pull-started": "The pull is queued: its progress shows below, live.",
}


def templates() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["clock"] = lambda at: "-" if at is None else utc(float(at))
    env.filters["mib"] = mib
    env.filters["size"] = size
    return env


def utc(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


def mib(value: object) -> str:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "-"
    return f"{int(value):,} MiB"


def size(value: object) -> str:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "-"
    if value < 1024:
        return f"{value:.0f} B"
    amount = value / 1024
    for unit in ("KiB", "MiB"):
        if amount < 1024:
            return f"{amount:.1f} {unit}"
        amount /= 1024
    return f"{amount:.1f} GiB"


def console(request: web.Request) -> ConsoleState:
    return request.app[CONSOLE]


def hub_store(request: web.Request) -> AsyncHubStore:
    return request.app[STORE]


def hub_settings(request: web.Request) -> HubSettings:
    return request.app[SETTINGS]


def render(
    request: web.Request, template: str, *, status: int = 200, **context: Any
) -> web.Response:
    session = request.get(SESSION)
    html = (
        console(request)
        .templates.get_template(template)
        .render(
            session=session,
            csrf=session.csrf if session else "",
            path=request.path,
            now=time.time(),
            notice=NOTICES.get(request.query.get("notice", "")),
            **context,
        )
    )
    return web.Response(text=html, status=status, content_type="text/html")


def error_page(request: web.Request, status: int, title: str, message: str) -> web.Response:
    return render(request, "error.html", status=status, title=title, message=message)


def refused(request: web.Request) -> web.Response:
    return error_page(
        request,
        403,
        "Refused",
        "This form was not sent from a page of this console (a cross-site request, or a "
        "page older than your login). Nothing was changed. Reload the page and try again.",
    )


def see_other(location: str, notice: str | None = None) -> web.Response:
    if notice is not None:
        location += ("&" if "?" in location else "?") + f"notice={quote(notice)}"
    return web.Response(status=303, headers={"Location": location})


def login_url(request: web.Request) -> str:
    return f"/console/login?next={quote(request.path_qs, safe='')}"


async def current_session(request: web.Request) -> Session | None:
    token = request.cookies.get(SESSION_COOKIE)
    if not token or len(token) > 200:
        return None
    store = hub_store(request)
    return await store.run(store.sync.console.session, session_hash(token), time.time())


def from_here(request: web.Request) -> bool:
    return same_origin(request.headers, request.scheme, request.host)


async def read_form(request: web.Request) -> dict[str, str] | None:
    """The posted form's text fields (files ignored); None when it cannot be decoded."""
    try:
        form: MultiDictProxy[Any] = await request.post()
    except (ValueError, UnicodeDecodeError):
        return None
    return {k: v for k, v in form.items() if isinstance(v, str)}


def guarded(handler: Handler) -> Handler:
    """Domain errors become pages (404, 409); anything else a logged 500 page, never a
    traceback."""

    @functools.wraps(handler)
    async def wrapper(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except NotFoundError as err:
            return error_page(request, 404, "Not found", str(err))
        except ConflictError as err:
            return error_page(request, 409, "Conflict", str(err))
        except Exception:
            log.exception("console page %s %s failed", request.method, request.path)
            return error_page(
                request, 500, "Something went wrong", "The hub could not show this page; "
                "its log has the details. Try again in a moment."
            )  # fmt: skip

    return wrapper


def page(handler: Handler) -> Handler:
    """A console page for a logged-in user. GET without a login: to the login page. POST:
    from this console's origin, with the session's CSRF token, or refused (403); its form
    is at `request[FORM]`."""

    @guarded
    @functools.wraps(handler)
    async def wrapper(request: web.Request) -> web.StreamResponse:
        if request.method == "POST" and not from_here(request):
            return refused(request)
        session = await current_session(request)
        if session is None:
            return see_other(login_url(request) if request.method == "GET" else "/console/login")
        request[SESSION] = session
        if request.method == "POST":
            form = await read_form(request)
            if form is None:
                return error_page(request, 400, "Bad request", "The form could not be read.")
            if not same_token(form.get("csrf"), session.csrf):
                return refused(request)
            request[FORM] = form
        return await handler(request)

    return wrapper


async def not_found(request: web.Request) -> web.Response:
    return error_page(request, 404, "Not found", f"There is no console page at {request.path}.")


async def security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Every console answer: nothing from elsewhere, not framed, not cached."""
    if not request.path.startswith("/console"):
        return
    response.headers.setdefault(
        "Content-Security-Policy",
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    )
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("Referrer-Policy", "same-origin")
    response.headers.setdefault("X-Frame-Options", "DENY")
    if not request.path.startswith("/console/static/"):
        response.headers.setdefault("Cache-Control", "no-store")
