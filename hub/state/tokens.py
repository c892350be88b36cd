"""Enrollment tokens: made by the operator, spent by a node's enrollment (hub/state/nodes.py).
Only a hash is stored; the plaintext is shown once."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from hub.state.errors import NotFoundError
from shared.keys import ENROLLMENT_TOKEN, NewKey, generate_key

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from hub.state import sql


class TokenProblem(StrEnum):
    """Why an enrollment token was refused."""

    unknown = "unknown"
    used = "used"
    expired = "expired"
    revoked = "revoked"


class TokenRefusedError(Exception):
    def __init__(self, problem: TokenProblem, prefix: str | None) -> None:
        what = {
            TokenProblem.unknown: "is not a token this hub issued",
            TokenProblem.used: "was already used",
            TokenProblem.expired: "has expired",
            TokenProblem.revoked: "was revoked",
        }[problem]
        super().__init__(
            f"the enrollment token {prefix or ''} {what}; create a new one with "
            "`kvl hub tokens create --site SITE`".replace("  ", " ")
        )
        self.problem = problem


@dataclass(frozen=True)
class EnrollmentToken:
    prefix: str
    site: str
    uses_left: int
    expires_at: float
    created_at: float
    revoked_at: float | None
    # The tenancy of the nodes it enrolls, the operator's to give (hub/planning/tenancy.py):
    # dedicated to `tenant` (S3), or, `private`, on that tenant's private site (S4).
    tenant: str | None = None
    private: bool = False

    def state(self, now: float) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.uses_left <= 0:
            return "used"
        if now >= self.expires_at:
            return "expired"
        return "active"


def token_of(row: Mapping[str, Any]) -> EnrollmentToken:
    return EnrollmentToken(
        prefix=row["prefix"],
        site=row["site"],
        uses_left=row["uses_left"],
        expires_at=row["expires_at"],
        created_at=row["created_at"],
        revoked_at=row["revoked_at"],
        tenant=row.get("tenant") or None,
        private=bool(row.get("private")),
    )


class Tokens:
    """The `enrollment_tokens` table."""

    def __init__(self, database: sql.Database, clock: Callable[[], float]) -> None:
        self._db = database
        self._clock = clock

    def create(
        self,
        site: str,
        *,
        uses: int,
        expires_in_s: float,
        tenant: str | None = None,
        private: bool = False,
    ) -> NewKey:
        """A new token for ``site``; the nodes it enrolls are dedicated to ``tenant``
        (S3) or, ``private``, on a private site (S4): what a node sends of its own
        tenancy grants it nothing."""
        now = self._clock()
        new = generate_key(ENROLLMENT_TOKEN)
        self._db.execute(
            "INSERT INTO enrollment_tokens (prefix, hash, site, uses_left, expires_at,"
            " revoked_at, created_at, tenant, private) VALUES (?, ?, ?, ?, ?, NULL, ?, ?, ?)",
            [new.prefix, new.hash, site, uses, now + expires_in_s, now, tenant or None,
             int(private)],
        )  # fmt: skip
        return new

    def all(self) -> list[EnrollmentToken]:
        rows = self._db.query("SELECT * FROM enrollment_tokens ORDER BY created_at")
        return [token_of(r) for r in rows]

    def revoke(self, prefix: str) -> EnrollmentToken:
        self._db.execute(
            "UPDATE enrollment_tokens SET revoked_at = ? WHERE prefix = ? AND revoked_at IS NULL",
            [self._clock(), prefix],
        )
        rows = list(self._db.query("SELECT * FROM enrollment_tokens WHERE prefix = ?", [prefix]))
        if not rows:
            raise NotFoundError(f"no enrollment token {prefix!r}")
        return token_of(rows[0])
