"""Alerts, silences and the webhook outbox (`alerts`, `alert_silences`,
`alert_deliveries`): what the alert loop (hub/alerting/) records of each rule's firings,
and the deliveries each change makes.

A change is recorded once whichever replica evaluates it first: a firing is an INSERT the
partial unique index on (rule, labels) of firing rows lets win once, a resolution an
UPDATE of a row still firing; each one's row count says whether this call made the
change, and only then are its deliveries made, in the same transaction."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hub.state.errors import NotFoundError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence

    from hub.state import sql


@dataclass(frozen=True)
class Firing:
    """A rule firing for one subject, as an evaluation found it."""

    rule: str
    labels: Mapping[str, str]
    severity: str
    value: float
    summary: str

    @property
    def key(self) -> tuple[str, str]:
        return self.rule, labels_text(self.labels)


@dataclass(frozen=True)
class AlertRecord:
    id: str
    rule: str
    labels: dict[str, str]
    severity: str
    state: str  # firing, resolved
    fired_at: float
    resolved_at: float | None
    value: float
    summary: str
    silenced: bool


@dataclass(frozen=True)
class Silence:
    id: str
    matchers: dict[str, str]
    until: float
    created_by: str
    comment: str
    created_at: float

    def matches(self, rule: str, labels: Mapping[str, str]) -> bool:
        """Every matcher's value is the alert's (`rule` names the rule)."""
        return all(
            (rule if key == "rule" else labels.get(key)) == value
            for key, value in self.matchers.items()
        )


@dataclass(frozen=True)
class Delivery:
    id: str
    alert_id: str
    event: str
    url: str
    payload: str
    attempts: int
    created_at: float


def labels_text(labels: Mapping[str, str]) -> str:
    """Labels as stored: JSON with sorted keys, so one subject is one text."""
    return json.dumps(dict(sorted(labels.items())), separators=(",", ":"))


def alert_payload(alert: AlertRecord, event: str) -> str:
    """A delivery's body: the change (`firing`, `resolved`) and the alert as it now is."""
    return json.dumps(
        {"event": f"alert.{event}", "alert": alert_body(alert)}, separators=(",", ":")
    )


def alert_body(alert: AlertRecord) -> dict[str, Any]:
    return {
        "id": alert.id,
        "rule": alert.rule,
        "labels": alert.labels,
        "severity": alert.severity,
        "state": alert.state,
        "fired_at": alert.fired_at,
        "resolved_at": alert.resolved_at,
        "value": alert.value,
        "summary": alert.summary,
        "silenced": alert.silenced,
    }


def _alert_of(row: Mapping[str, Any]) -> AlertRecord:
    return AlertRecord(
        id=row["id"],
        rule=row["rule"],
        labels=json.loads(row["labels"]),
        severity=row["severity"],
        state=row["state"],
        fired_at=row["fired_at"],
        resolved_at=row["resolved_at"],
        value=row["value"],
        summary=row["summary"],
        silenced=bool(row["silenced"]),
    )


def _silence_of(row: Mapping[str, Any]) -> Silence:
    return Silence(
        id=row["id"],
        matchers=json.loads(row["matchers"]),
        until=row["until"],
        created_by=row["created_by"],
        comment=row["comment"],
        created_at=row["created_at"],
    )


class Alerts:
    """The `alerts`, `alert_silences` and `alert_deliveries` tables."""

    def __init__(self, database: sql.Database, clock: Callable[[], float]) -> None:
        self._db = database
        self._clock = clock

    def all(self, state: str | None = None, limit: int = 500) -> list[AlertRecord]:
        """Alerts, newest first; `state`: only those firing (or resolved)."""
        where, params = ("", []) if state is None else (" WHERE state = ?", [state])
        rows = self._db.query(
            f"SELECT * FROM alerts{where} ORDER BY fired_at DESC, id LIMIT ?",  # noqa: S608 - constants
            [*params, limit],
        )
        return [_alert_of(r) for r in rows]

    def record(
        self,
        firing: Iterable[Firing],
        evaluated: Iterable[str],
        urls: Sequence[str],
    ) -> list[tuple[AlertRecord, str]]:
        """One evaluation's result: `firing`, what fires now, of the rules `evaluated`
        (a rule whose inputs could not be read this round resolves nothing). Alerts new
        to the list fire, those of evaluated rules no longer in it resolve; each change
        this call made (alert, `firing` or `resolved`) is returned, with a delivery to
        each of `urls` unless a silence matched it when it fired."""
        now = self._clock()
        found = {f.key: f for f in firing}
        rules = set(evaluated)
        changes: list[tuple[AlertRecord, str]] = []
        with self._db.transaction():
            silences = self.silences(active_at=now)
            current = {(a.rule, labels_text(a.labels)): a for a in self.all("firing", 100_000)}
            for key, alert in sorted(current.items()):
                if alert.rule in rules and key not in found:
                    done = self._db.execute(
                        "UPDATE alerts SET state = 'resolved', resolved_at = ?"
                        " WHERE id = ? AND state = 'firing'",
                        [now, alert.id],
                    ).rowcount
                    if done == 1:
                        resolved = _alert_of(
                            {**_row(alert), "state": "resolved", "resolved_at": now}
                        )
                        changes.append((resolved, "resolved"))
            for key, fire in sorted(found.items()):
                if key in current:
                    self._db.execute(
                        "UPDATE alerts SET value = ?, summary = ? WHERE id = ?",
                        [fire.value, fire.summary, current[key].id],
                    )
                    continue
                silenced = any(s.matches(fire.rule, fire.labels) for s in silences)
                alert = AlertRecord(
                    id=f"alrt_{uuid.uuid4().hex[:20]}",
                    rule=fire.rule,
                    labels=dict(sorted(fire.labels.items())),
                    severity=fire.severity,
                    state="firing",
                    fired_at=now,
                    resolved_at=None,
                    value=fire.value,
                    summary=fire.summary,
                    silenced=silenced,
                )
                row = _row(alert)
                done = self._db.execute(
                    "INSERT INTO alerts (id, rule, labels, severity, state, fired_at,"
                    " resolved_at, value, summary, silenced) VALUES (?, ?, ?, ?, ?, ?, ?, ?,"
                    " ?, ?) ON CONFLICT DO NOTHING",
                    list(row.values()),
                ).rowcount
                if done == 1:
                    changes.append((alert, "firing"))
            for alert, event in changes:
                if alert.silenced:
                    continue  # recorded, not delivered
                payload = alert_payload(alert, event)
                for url in urls:
                    self._db.execute(
                        "INSERT INTO alert_deliveries (id, alert_id, event, url, payload,"
                        " status, attempts, next_at, created_at) VALUES (?, ?, ?, ?, ?,"
                        " 'pending', 0, ?, ?)",
                        [f"dlv_{uuid.uuid4().hex[:20]}", alert.id, event, url, payload, now,
                         now],
                    )  # fmt: skip
        return changes

    # -- silences ------------------------------------------------------------------------

    def create_silence(
        self, matchers: Mapping[str, str], until: float, created_by: str, comment: str
    ) -> Silence:
        silence = Silence(
            id=f"sil_{uuid.uuid4().hex[:20]}",
            matchers=dict(sorted(matchers.items())),
            until=until,
            created_by=created_by,
            comment=comment,
            created_at=self._clock(),
        )
        with self._db.transaction():
            self._db.execute(
                "INSERT INTO alert_silences (id, matchers, until, created_by, comment,"
                " created_at) VALUES (?, ?, ?, ?, ?, ?)",
                [silence.id, json.dumps(silence.matchers), until, created_by, comment,
                 silence.created_at],
            )  # fmt: skip
        return silence

    def silences(self, active_at: float | None = None) -> list[Silence]:
        """Silences, newest first; `active_at`: only those still in force then."""
        if active_at is None:
            rows = self._db.query("SELECT * FROM alert_silences ORDER BY created_at DESC, id")
        else:
            rows = self._db.query(
                "SELECT * FROM alert_silences WHERE until > ? ORDER BY created_at DESC, id",
                [active_at],
            )
        return [_silence_of(r) for r in rows]

    def delete_silence(self, silence_id: str) -> None:
        with self._db.transaction():
            done = self._db.execute(
                "DELETE FROM alert_silences WHERE id = ?", [silence_id]
            ).rowcount
        if done == 0:
            raise NotFoundError(f"no silence {silence_id!r}")

    # -- the webhook outbox --------------------------------------------------------------

    def due_deliveries(self, now: float, limit: int = 100) -> list[Delivery]:
        rows = self._db.query(
            "SELECT * FROM alert_deliveries WHERE status = 'pending' AND next_at <= ?"
            " ORDER BY next_at, id LIMIT ?",
            [now, limit],
        )
        return [
            Delivery(r["id"], r["alert_id"], r["event"], r["url"], r["payload"], r["attempts"],
                     r["created_at"])
            for r in rows
        ]  # fmt: skip

    def delivery_attempted(
        self, delivery_id: str, *, error: str | None, next_at: float | None
    ) -> str:
        """An attempt's outcome: delivered (`error` None), pending again at `next_at`, or
        failed (given up: `next_at` None). The status it now has."""
        now = self._clock()
        status = "delivered" if error is None else ("pending" if next_at is not None else "failed")
        with self._db.transaction():
            self._db.execute(
                "UPDATE alert_deliveries SET status = ?, attempts = attempts + 1, next_at = ?,"
                " last_error = ?, delivered_at = ? WHERE id = ? AND status = 'pending'",
                [status, next_at if next_at is not None else now, error,
                 now if error is None else None, delivery_id],
            )  # fmt: skip
        return status

    def deliveries(self, alert_id: str | None = None) -> list[dict[str, Any]]:
        """The outbox's rows (an alert's, or all), oldest first: for the console and tests."""
        where, params = ("", []) if alert_id is None else (" WHERE alert_id = ?", [alert_id])
        return self._db.query(
            "SELECT id, alert_id, event, url, status, attempts, next_at, last_error,"  # noqa: S608 - constants
            f" created_at, delivered_at FROM alert_deliveries{where} ORDER BY created_at, id",
            params,
        )


def _row(alert: AlertRecord) -> dict[str, Any]:
    return {
        "id": alert.id,
        "rule": alert.rule,
        "labels": labels_text(alert.labels),
        "severity": alert.severity,
        "state": alert.state,
        "fired_at": alert.fired_at,
        "resolved_at": alert.resolved_at,
        "value": alert.value,
        "summary": alert.summary,
        "silenced": int(alert.silenced),
    }
