"""A restarted hub's learning mode (`POST /v1/node/leases`)."""

from __future__ import annotations

import time


class Learning:
    """A restarted hub's learning mode: no new lease until every node that may still be
    spending one has reported, or one lease period has passed (its grants may lag what
    the nodes spent while it was down; their reports catch it up)."""

    def __init__(self, started_at: float, lease_s: float) -> None:
        self._until = started_at + lease_s
        self._heard: set[str] = set()
        self._done = False

    def heard(self, node_id: str) -> None:
        self._heard.add(node_id)

    def active(self, now: float, holders: set[str]) -> bool:
        if not self._done and (now >= self._until or holders <= self._heard):
            self._done = True
        return not self._done

    @property
    def retry_after_s(self) -> float:
        return max(1.0, self._until - time.time())
