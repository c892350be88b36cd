"""What the hub sets of its nodes' settings (protocol.NodeSettings): values fleet-wide, per
site and per node (`node_settings`), the most specific winning for each key; and what a
settings rollout has given the nodes it reached so far (hub/state/rollouts.py keeps the
rollout; its change counts for those nodes only until it is done, when it is written here).

Keys: `chat_default`, `default` (model names, `name` or `name@version`),
`aliases.ALIAS` (the model an alias names), `objectives.CLASS.OBJECTIVE` (seconds: a
service class's `admit_s`, `first_token_s` or `complete_s`; and, for nodes of protocol 8
on, its allowances per token `first_token_per_token_s` and `complete_per_token_s`) and
`packages.FIELD` (the content packages' `model`, `max_attempts`, `item_max_tokens`,
`topic_min_similarity`, `cache_max_mb`, nodes of protocol 8 on; `check_model`,
`verify_samples`, `source_min_similarity`, nodes of protocol 11 on). A scope is `fleet`,
`site:NAME` or `node:ID`."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import ValidationError

from hub.state.errors import InvalidError, NotFoundError
from shared import protocol

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

    from hub.state import sql
    from hub.state.nodes import Node
    from hub.state.serials import Serials

FLEET = "fleet"
_ALIAS = re.compile(r"^aliases\.([^@\s]{1,200})$")
_OBJECTIVE = re.compile(
    r"^objectives\.(S[0-4])\."
    r"(admit_s|first_token_s|complete_s|first_token_per_token_s|complete_per_token_s)$"
)
_PER_TOKEN = re.compile(r"^objectives\.S[0-4]\.(first_token|complete)_per_token_s$")
_PACKAGES = re.compile(
    r"^packages\.(model|max_attempts|item_max_tokens|topic_min_similarity|cache_max_mb"
    r"|check_model|verify_samples|source_min_similarity)$"
)
# The packages' answer verification: nodes of protocol 11 on.
_VERIFY = re.compile(r"^packages\.(check_model|verify_samples|source_min_similarity)$")


@dataclass(frozen=True)
class Setting:
    scope: str  # fleet, site:NAME, node:ID
    key: str
    value: str


def scope_of(site: str | None = None, node_id: str | None = None) -> str:
    if node_id is not None:
        return f"node:{node_id}"
    return FLEET if site is None else f"site:{site}"


def check(key: str, value: str | None) -> None:
    """InvalidError unless `key` is one the hub sets and `value` one it may have."""
    known = key in {"chat_default", "default"} or any(
        pattern.match(key) for pattern in (_ALIAS, _OBJECTIVE, _PACKAGES)
    )
    if not known:
        raise InvalidError(
            f"{key!r} is not a node setting the hub sets: chat_default, default, "
            "aliases.ALIAS, objectives.CLASS.admit_s|first_token_s|complete_s|"
            "first_token_per_token_s|complete_per_token_s, or "
            "packages.model|max_attempts|item_max_tokens|topic_min_similarity|cache_max_mb|"
            "check_model|verify_samples|source_min_similarity",
            param="key",
        )
    if value is not None:
        try:
            settings_of({key: value})
        except ValidationError as err:
            raise InvalidError(
                f"{value!r} is not a value of {key}: {err.errors()[0]['msg']}", param="value"
            ) from err


def settings_of(values: Mapping[str, str]) -> protocol.NodeSettings:
    """The settings the keys' values make (ValidationError for a value out of bounds)."""
    aliases = {m.group(1): v for k, v in values.items() if (m := _ALIAS.match(k))}
    objectives: dict[str, dict[str, str]] = {}
    for key, value in sorted(values.items()):
        if found := _OBJECTIVE.match(key):
            objectives.setdefault(found.group(1), {})[found.group(2)] = value
    packages = {m.group(1): v for k, v in values.items() if (m := _PACKAGES.match(k))}
    return protocol.NodeSettings.model_validate({
        "chat_default": values.get("chat_default"), "default": values.get("default"),
        "aliases": dict(sorted(aliases.items())), "objectives": objectives,
        "packages": packages,
    })  # fmt: skip


def key_protocol(key: str) -> int:
    """The first protocol whose nodes take `key`."""
    if _VERIFY.match(key):
        return 11
    return 8 if _PACKAGES.match(key) or _PER_TOKEN.match(key) else 7


def node_protocol(node: Node) -> int:
    """The protocol `node`'s last heartbeat named (0: none it could read)."""
    raw = node.versions.get("protocol", "")
    return int(raw) if raw.isdigit() and len(raw) < 6 else 0


def digest_for(settings: protocol.NodeSettings, node: Node) -> str:
    """The digest `node` reports once it applied `settings`: of the fields its protocol
    takes (the hub answers an older node without the others)."""
    wire = protocol.dump_for(settings, node_protocol(node))
    return protocol.NodeSettings.model_validate_json(wire).digest()


def _rank(scope: str, node: Node) -> int | None:
    """How specific a scope is for `node` (None: not its)."""
    if scope == FLEET:
        return 0
    if scope == f"site:{node.site}":
        return 1
    if scope == f"node:{node.id}":
        return 2
    return None


class Configuration:
    """The `node_settings` table, and the changes of settings rollouts in flight."""

    def __init__(
        self, database: sql.Database, clock: Callable[[], float], serials: Serials
    ) -> None:
        self._db = database
        self._clock = clock
        self._serials = serials

    def set(self, scope: str, key: str, value: str | None, *, by: str) -> int:
        """Set (or with None unset) one key at one scope; the new serial. InvalidError for
        a key or value the hub does not set; NotFoundError to unset what is not set."""
        check(key, value)
        with self._db.transaction():
            if value is None:
                gone = self._db.execute(
                    "DELETE FROM node_settings WHERE scope = ? AND key = ?", [scope, key]
                ).rowcount
                if gone == 0:
                    raise NotFoundError(f"{key} is not set for {scope}", param="key")
            else:
                self._db.execute(
                    "INSERT INTO node_settings (scope, key, value, set_by, set_at)"
                    " VALUES (?, ?, ?, ?, ?) ON CONFLICT (scope, key) DO UPDATE SET"
                    " value = excluded.value, set_by = excluded.set_by, set_at = excluded.set_at",
                    [scope, key, value, by, self._clock()],
                )
            return self._serials.bump()

    def all(self) -> list[Setting]:
        rows = self._db.execute(
            "SELECT scope, key, value FROM node_settings ORDER BY scope, key"
        ).fetchall()
        return [Setting(*r) for r in rows]

    def staged(self, node: Node) -> list[Setting]:
        """The changes settings rollouts have given `node` so far (oldest first): those of
        rollouts not yet done nor rolled back, that reached it."""
        rows = self._db.execute(
            "SELECT r.target FROM rollouts r JOIN rollout_nodes n ON n.rollout_id = r.id"
            " WHERE r.kind = 'settings' AND n.node_id = ?"
            " AND r.state IN ('pending', 'running', 'paused', 'halted')"
            " AND n.state IN ('targeted', 'updated', 'failed') ORDER BY r.created_at",
            [node.id],
        ).fetchall()
        targets = [json.loads(r[0]) for r in rows]
        return [Setting(t["scope"], t["key"], t["value"]) for t in targets]

    def effective(
        self, node: Node, extra: Iterable[Setting] = ()
    ) -> tuple[dict[str, str], dict[str, str]]:
        """`node`'s values by key, and the scope each came from: the most specific scope
        of the node's wins; `extra` (changes in flight) over the stored ones."""
        values: dict[str, str] = {}
        origins: dict[str, str] = {}
        ranks: dict[str, tuple[int, int]] = {}
        candidates = [(0, s) for s in self.all()] + [(1, s) for s in extra]
        for staged, setting in candidates:
            rank = _rank(setting.scope, node)
            if rank is None:
                continue
            # The most specific scope first; at one scope, a change in flight over the value.
            weight = (rank, staged)
            if setting.key not in ranks or weight >= ranks[setting.key]:
                ranks[setting.key] = weight
                values[setting.key] = setting.value
                origins[setting.key] = setting.scope + (" (rollout)" if staged else "")
        return values, origins

    def desired(self, node: Node, *, staged: bool = True) -> protocol.NodeSettings:
        """What `node` should apply (`staged`: with what rollouts gave it so far)."""
        values, _ = self.effective(node, self.staged(node) if staged else ())
        try:
            return settings_of(values)
        except ValidationError:  # checked when set; a bound since tightened leaves it out
            return protocol.NodeSettings()
