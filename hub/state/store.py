"""The hub's store: one façade, `HubStore`, holding one repository per aggregate (the modules
beside this one: `tokens`, `nodes`, `certificates`, `operators`, `accounts` with their API
keys, `leases`, `ledger`, `packages`, `deployments`, `pulls` and `uploads` (model files
coming in), `rollouts`,
`configuration` (what the hub sets of its nodes' settings), `objectives`, `alerts`,
`console`, and `desired`, the desired state drawn from several), each a plain class given
the one connection and what else it reads (the clock, the serials, the repositories it draws
on), composed here; and its async facade, `AsyncHubStore`, on one writer thread per process
(shared.db.AsyncStore) with a second connection for reads of the whole fleet. The modules of
hub/state/ are the only hub modules that hold SQL.

The same statements run on SQLite (the default: one file, one writer) and on PostgreSQL
(`database_url`: several hub replicas on one database) through hub.state.sql. What must stay
right when replicas write at once is made so by the database, never by a lock in this
process: a single-use token is spent by a conditional UPDATE whose row count says whether
it was; an overlay address is taken by an INSERT that a UNIQUE index lets win once; a
ledger event is stored by an INSERT … ON CONFLICT DO NOTHING whose row count says whether
it was new; lease grants of an account take its row FOR UPDATE first (on SQLite a
transaction is BEGIN IMMEDIATE, which already lets one writer in at a time)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from hub.state import sql
from hub.state.accounts import Accounts, ForeignAccountError
from hub.state.alerts import Alerts
from hub.state.certificates import Certificates
from hub.state.configuration import Configuration
from hub.state.console import Console
from hub.state.deployments import Deployments
from hub.state.desired import DesiredStates
from hub.state.leases import ForeignLeaseError, Leases
from hub.state.ledger import Ledger, LedgerRow, ledger_rows
from hub.state.migrations import MIGRATION_SET, MIGRATIONS
from hub.state.nodes import Nodes
from hub.state.objectives import Objectives
from hub.state.operators import Operators
from hub.state.packages import Packages
from hub.state.pulls import Pulls
from hub.state.rollouts import Rollouts
from hub.state.serials import Serials
from hub.state.tokens import Tokens
from hub.state.uploads import Uploads
from shared import db, protocol
from shared.keys import NODE_TOKEN, hash_key, parse_prefix

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from hub.planning.slo import Ingested
    from hub.settings import HubSettings
    from hub.state.nodes import Heartbeat, Node

P = ParamSpec("P")
T = TypeVar("T")


def open_database(settings: HubSettings) -> sql.Database:
    """The hub's database, migrated by the one list of migrations: PostgreSQL at
    `database_url` when set, otherwise the SQLite file in the data directory."""
    if settings.database_url is not None:
        return sql.PostgresDatabase(settings.database_url, MIGRATIONS)
    return sql.SQLiteDatabase(settings.db_path, MIGRATIONS, migration_set=MIGRATION_SET)


def open_store(settings: HubSettings, *, clock: Callable[[], float] = time.time) -> HubStore:
    """The hub's store on the database its settings name."""
    return HubStore(open_database(settings), clock=clock)


class HubStore:
    """One repository per aggregate on one connection (`store.sync.nodes.enroll` on the
    writer thread), and the clock every write that records a time reads (tests may give
    another: no sleeping to make time pass). A transaction (`db.transaction()`) spans
    repositories where one change does: a key made and the desired serial moved, say; the
    repository that owns such a write is given the others it reads."""

    def __init__(self, database: sql.Database, *, clock: Callable[[], float] = time.time) -> None:
        self.db = database
        self.clock = clock
        self.serials = Serials(database)
        self.tokens = Tokens(database, clock)
        self.nodes = Nodes(database, clock, self.serials)
        self.certificates = Certificates(database, clock)
        self.operators = Operators(database, clock)
        self.accounts = Accounts(database, clock, self.serials)
        self.leases = Leases(database, self.accounts)
        self.packages = Packages(database, clock, self.serials)
        self.ledger = Ledger(database, clock, self.packages)
        self.deployments = Deployments(database, clock, self.serials)
        self.pulls = Pulls(database, clock)
        self.uploads = Uploads(database, clock, self.deployments)
        self.rollouts = Rollouts(database, clock, self.serials)
        self.configuration = Configuration(database, clock, self.serials)
        self.desired = DesiredStates(
            database,
            self.serials,
            accounts=self.accounts,
            deployments=self.deployments,
            packages=self.packages,
            rollouts=self.rollouts,
            configuration=self.configuration,
        )
        self.objectives = Objectives(database, clock)
        self.alerts = Alerts(database, clock)
        self.console = Console(database)

    def close(self) -> None:
        self.db.close()

    @sql.retrying()
    def heartbeats(
        self, beats: Sequence[Heartbeat], counted: Sequence[Heartbeat] | None = None
    ) -> Ingested:
        """A flush of waiting heartbeats: the nodes' rows, and the objectives of `counted`
        (default: of `beats`) counted into the buckets, in one transaction; what the
        objectives added. Soft state, committed without waiting for the disk: a crash that
        loses it loses a second of `last_seen`, and counts that move back with their cursors
        (the nodes' next heartbeats carry the same counters, and more)."""
        with self.db.transaction(durable=False):
            if beats:
                self.nodes.record_heartbeats(beats)
            return self.objectives.ingest(beats if counted is None else counted)


# Every id acknowledged, how many were new, and how many of each kind.
EventsAnswer = tuple[list[str], int, dict[str, int]]
GROUP_EVENTS = 20_000  # at most this many events in one group commit


class AsyncHubStore(db.AsyncStore[HubStore]):
    """The hub's store on its writer thread, on the database the settings name; and a
    second connection on a thread of its own for snapshots of the whole fleet (`read`),
    so the placement reconciler's and the console's reads of ten thousand nodes never
    hold up the node calls queued on the writer."""

    _NODES_REMEMBERED = 200_000

    def __init__(self, settings: HubSettings) -> None:
        super().__init__(open_store, settings)
        self._reader = db.AsyncStore(open_store, settings)
        self._waiting: list[_Batch] = []
        self._committer: asyncio.Task[None] | None = None
        # Node tokens already checked, by their hash: the node they belong to. Dropped
        # whenever the authentication revision moves (a revocation, by any process).
        self._nodes_by_token: dict[str, Node] = {}
        self._certified: set[str] = set()  # nodes issued a certificate (node_has_certificate)
        self._auth_revision = -1
        self._auth_epoch = 0  # moves whenever the remembered answers are dropped
        # Each node's account names as of a desired serial (all dropped when it moves: a
        # binding change moves it), and which node each lease seen was granted to (None:
        # never stored): what a node may report usage for is checked without a read per
        # sync.
        self._accounts: dict[str, frozenset[str]] = {}
        self._desired_serial = -1
        # Each lease id's (node, account), or None for an id the hub never stored.
        self._lease_owner: dict[str, tuple[str, str] | None] = {}
        # Told each call's operation (the function's name) and seconds, waiting for the
        # thread included: the application's metrics (kvl_hub_db_duration_seconds).
        self.timed: Callable[[str, float], None] | None = None

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`db.AsyncStore.run`, timed by operation."""
        if self.timed is None:
            return await super().run(fn, *args, **kwargs)
        started = time.perf_counter()
        try:
            return await super().run(fn, *args, **kwargs)
        finally:
            self.timed(_operation(fn), time.perf_counter() - started)

    async def open(self) -> None:
        await super().open()
        await self._reader.open()

    @property
    def reader(self) -> HubStore:
        """The store on the reading connection: what `read` runs (`store.sync` is the
        writer's, what `run` runs)."""
        return self._reader.sync

    async def read(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(…)` on the reading connection's thread: a method of `store.reader`'s
        repositories (`store.read(store.reader.nodes.all)`), or a function given
        `store.reader`; reads only (SQLite's WAL and PostgreSQL both let it read what was
        committed while the writer writes)."""
        if self.timed is None:
            return await self._reader.run(fn, *args, **kwargs)
        started = time.perf_counter()
        try:
            return await self._reader.run(fn, *args, **kwargs)
        finally:
            self.timed(_operation(fn), time.perf_counter() - started)

    async def nodes(self) -> list[Node]:
        """Every node (`Nodes.all`), read beside the writer: how the API, the console and
        the loops read the fleet."""
        return await self.read(self.reader.nodes.all)

    async def node_names(self) -> dict[str, str]:
        """Each node's name by its id (`Nodes.names`), read beside the writer."""
        return await self.read(self.reader.nodes.names)

    async def authenticate_node(self, token: str) -> Node | None:
        """`Nodes.authenticate`, remembered (by the token's sha256): a node's
        heartbeat or sync does not look its token up again, and never waits behind the
        writer's commits (a miss is read on the reading connection). A revocation holds
        on the revoking replica's next call; made by another replica or by the CLI,
        within the second in which the heartbeat flusher reads the authentication
        revision (`note_serials`).
        (Checked on every call, the revision cost a read per call: a SQLite file changes
        with every commit of the fleet's heartbeats and events.)"""
        if parse_prefix(token, NODE_TOKEN) is None:
            return None
        digest = hash_key(token)
        if (known := self._nodes_by_token.get(digest)) is not None:
            return known
        epoch = self._auth_epoch
        node = await self.read(self.reader.nodes.authenticate, token)
        if node is not None and epoch == self._auth_epoch:
            if len(self._nodes_by_token) >= self._NODES_REMEMBERED:
                self._nodes_by_token.clear()
            self._nodes_by_token[digest] = node
        return node

    async def node_has_certificate(self, node_id: str) -> bool:
        """Whether the hub has issued ``node_id`` a certificate (then every call of it
        must present one). Remembered once true: a certificate, once issued, stays on
        record."""
        if node_id in self._certified:
            return True
        if await self.read(self.reader.certificates.issued_to, node_id):
            self.note_certificate(node_id)
            return True
        return False

    def note_certificate(self, node_id: str) -> None:
        if len(self._certified) >= self._NODES_REMEMBERED:
            self._certified.clear()
        self._certified.add(node_id)

    async def revoke_node(self, node_id: str) -> Node:
        """`Nodes.revoke`; this replica forgets the node's token at once."""
        node = await self.run(self.sync.nodes.revoke, node_id)
        self._forget_nodes()
        return node

    def note_serials(self, serials: tuple[int, int]) -> None:
        """The serials just read (`Serials.current`): a moved authentication revision
        drops the remembered node tokens, a moved desired serial the account names."""
        if serials[0] != self._desired_serial:
            self._desired_serial = serials[0]
            self._accounts = {}
        self._note_auth_revision(serials[1])

    async def node_accounts(self, node: Node, names: Iterable[str] = ()) -> frozenset[str]:
        """`Accounts.node_accounts`, each node's remembered until the desired serial moves;
        read again when one of `names` is not among them (an account made a moment ago, on
        another replica, before this one's flusher saw the serial move)."""
        known = self._accounts.get(node.id)
        if known is None or not known.issuperset(names):
            accounts = self._accounts
            known = frozenset(await self.read(self.reader.accounts.node_accounts, node))
            if accounts is self._accounts:  # not dropped while this read
                if len(accounts) >= self._NODES_REMEMBERED:
                    accounts.clear()
                accounts[node.id] = known
        return known

    async def check_reports(
        self, node: Node, accounts: Iterable[str], leases: Iterable[tuple[str, str]]
    ) -> None:
        """What a node reports (usage of `accounts`, spends under `leases`: (lease id,
        the account of the usage)) is its own: accounts its desired state gives it,
        leases granted to it for that very account (usage of one account under another's
        lease would be counted in neither's budget). ForeignAccountError or
        ForeignLeaseError otherwise."""
        accounts = set(accounts)
        if accounts:
            foreign = accounts - await self.node_accounts(node, accounts)
            if foreign:
                raise ForeignAccountError(
                    f"account {min(foreign)!r} is not one this node serves", min(foreign)
                )
        pairs = set(leases)
        unknown = {lease for lease, _ in pairs} - self._lease_owner.keys()
        if unknown:
            owners = await self.read(self.reader.leases.owners, unknown)
            if len(self._lease_owner) >= self._NODES_REMEMBERED:
                self._lease_owner.clear()
            # A lease id the hub never stored stays unknown: ids are made by the hub when
            # it grants, and a node learns one only after the grant committed.
            self._lease_owner.update({lease: owners.get(lease) for lease in unknown})
        for lease, account in sorted(pairs):
            owner = self._lease_owner.get(lease)
            if owner is None:
                continue
            if owner[0] != node.id:
                raise ForeignLeaseError(f"lease {lease} was not granted to this node", lease)
            if owner[1] != account:
                raise ForeignLeaseError(
                    f"lease {lease} is for account {owner[1]!r}, not {account!r}: usage is "
                    "reported under its own account's lease",
                    lease,
                )

    def _note_auth_revision(self, revision: int) -> None:
        if revision != self._auth_revision:
            self._auth_revision = revision
            self._forget_nodes()

    def _forget_nodes(self) -> None:
        self._nodes_by_token.clear()
        self._auth_epoch += 1

    async def ingest(self, node_id: str, events: Iterable[protocol.Event]) -> EventsAnswer:
        """`Ledger.ingest`, committed in groups: the batches that arrive while a commit is
        being made go together in the next one. A thousand nodes syncing in a second then
        cost a few durable commits, not a thousand (one writer thread makes them all), and
        no batch waits on a timer. Each is answered once its commit is durable."""
        events = list(events)
        rows = ledger_rows(node_id, events, self.sync.clock())  # a malformed batch fails alone
        future: asyncio.Future[EventsAnswer] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Batch(node_id, events, rows, future))
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit(), name="kvl-hub-ledger")
        return await future

    async def _commit(self) -> None:
        while self._waiting:
            group: list[_Batch] = []
            size = 0
            while self._waiting and (
                not group or size + len(self._waiting[0].rows) <= GROUP_EVENTS
            ):
                group.append(self._waiting.pop(0))
                size += len(group[-1].rows)
            try:
                answers = await self.run(self.sync.ledger.store_events, [w.stored for w in group])
            except sql.DatabaseError:
                # Again one at a time, so only a batch at fault fails.
                for waiting in group:
                    await self._commit_one(waiting)
                continue
            except Exception as err:  # noqa: BLE001 - handed to every caller waiting on it
                for waiting in group:
                    _settle(waiting.answer, error=err)
                continue
            for waiting, answer in zip(group, answers, strict=True):
                _settle(waiting.answer, answer)

    async def _commit_one(self, waiting: _Batch) -> None:
        try:
            [answer] = await self.run(self.sync.ledger.store_events, [waiting.stored])
        except Exception as err:  # noqa: BLE001 - handed to the caller waiting on it
            _settle(waiting.answer, error=err)
        else:
            _settle(waiting.answer, answer)

    async def close(self) -> None:
        if self._committer is not None:
            with contextlib.suppress(Exception):
                await self._committer
        await self._reader.close()
        await super().close()


def _operation(fn: Callable[..., object]) -> str:
    """A store call's name for its timing: the method's, with its repository's class
    (`HubStore.heartbeats`, `Ledger.store_events`), or the function's; a lambda wrapping
    one is `lambda`."""
    name = getattr(fn, "__qualname__", "") or getattr(fn, "__name__", "") or "call"
    name = name.rpartition("<locals>.")[2]
    return "lambda" if name == "<lambda>" else name


@dataclass(frozen=True)
class _Batch:
    """A node's batch of events waiting for the next group commit."""

    node_id: str
    events: list[protocol.Event]
    rows: list[LedgerRow]
    answer: asyncio.Future[EventsAnswer]

    @property
    def stored(self) -> tuple[str, list[protocol.Event], list[LedgerRow]]:
        return self.node_id, self.events, self.rows


def _settle(
    future: asyncio.Future[EventsAnswer],
    answer: EventsAnswer | None = None,
    *,
    error: BaseException | None = None,
) -> None:
    if future.done():  # its caller went away; the events are stored all the same
        return
    if error is not None:
        future.set_exception(error)
    elif answer is not None:
        future.set_result(answer)
