"""The node's ring of recent log records (appliance/observability/logs.py) and its route
for the hub, `GET /v1/fleet/logs`, which nobody but the hub may call."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from appliance.app import create_app
from appliance.gateway.appkeys import LOGS
from appliance.observability import logs
from appliance.observability.logs import LogRing
from appliance.state.store import Store
from shared import protocol
from tests.conftest import make_settings
from tests.waiting import until

if TYPE_CHECKING:
    from pathlib import Path

    from pytest_aiohttp import AiohttpClient


def _logger(ring: LogRing, name: str = "kvl.test.ring") -> logging.Logger:
    logger = logging.getLogger(name)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # this ring only, not the process's
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.addHandler(ring)
    return logger


def test_the_ring_keeps_the_last_records_by_count_and_by_bytes_numbered() -> None:
    ring = LogRing(max_records=10, max_bytes=1 << 20)
    log = _logger(ring)
    for n in range(25):
        log.info("line %d", n)
    found = ring.read(0, limit=100)
    assert [r.seq for r in found.records] == list(range(16, 26))
    assert [r.message for r in found.records] == [f"line {n}" for n in range(15, 25)]
    assert (found.oldest, found.next_after, found.missed) == (16, 25, 15)
    tail = ring.read(0, limit=3, tail=True)
    assert [r.seq for r in tail.records] == [23, 24, 25]
    assert tail.next_after == 25
    assert [r.seq for r in ring.read(23, limit=5, tail=True).records] == [24, 25]
    assert ring.read(25).records == []
    assert ring.read(25).next_after == 25
    # By bytes: records of 10 KB each, a ring of 50 KB keeps fewer than 5.
    by_bytes = LogRing(max_records=1000, max_bytes=50_000)
    log = _logger(by_bytes, "kvl.test.bytes")
    for n in range(20):
        log.warning("%d %s", n, "x" * 5000)
    kept = by_bytes.read(0, limit=1000).records
    assert 1 <= len(kept) <= 10
    assert sum(k.size for k in kept) <= 50_000
    assert kept[-1].message.startswith("19 ")
    # An answer is bounded too: at most max_bytes of records, at least one.
    assert len(by_bytes.read(0, limit=1000, max_bytes=12_000).records) == 2
    assert len(by_bytes.read(0, limit=1000, max_bytes=10).records) == 1


def test_tracebacks_are_kept_cut_to_size_and_levels_filter() -> None:
    ring = LogRing()
    log = _logger(ring, "kvl.test.levels")
    log.debug("quiet")
    try:
        int("boom")
    except ValueError:
        log.exception("it failed %s", "y" * 20_000)
    log.info("after")
    log.warning("bad \x00 \udcff bytes")
    records = ring.read(0).records
    failed = records[1]
    assert failed.level == "ERROR"
    # A long message is cut; its traceback's end is kept: the exception, the frames near it.
    assert failed.message.startswith("it failed yyy")
    assert "characters cut]" in failed.message
    assert failed.message.endswith("ValueError: invalid literal for int() with base 10: 'boom'")
    # A shorter message keeps its traceback whole.
    try:
        int("boom")
    except ValueError:
        log.exception("it failed again")
    again = ring.read(4).records[0]
    assert again.message.startswith("it failed again\nTraceback (most recent call last)")
    assert again.message.endswith("ValueError: invalid literal for int() with base 10: 'boom'")
    assert len(failed.message) < protocol.MAX_LOG_MESSAGE
    warned = ring.read(0, level=logging.WARNING)
    assert [r.level for r in warned.records] == ["ERROR", "WARNING", "ERROR"]
    assert warned.next_after == 5
    # Every record fits the protocol (no NUL, no lone surrogate, cut to size).
    answer = protocol.LogsAnswer(
        records=[r.record() for r in records], next_after=4, oldest=1, missed=0
    )
    assert protocol.LogsAnswer.model_validate_json(answer.model_dump_json()) == answer
    # A seq beyond the last one is of an earlier run of the process: from the start.
    assert [r.seq for r in ring.read(1000).records] == [1, 2, 3, 4, 5]
    # A traceback itself too long: its end is what is kept.
    deep = logs.with_traceback("failed", "frame\n" * 5000 + "KeyError: 'x'")
    assert len(deep) <= logs.MAX_MESSAGE + 64
    assert deep.startswith("failed\n[")
    assert deep.endswith("frame\nKeyError: 'x'")
    assert logs.level_number("warning") == logging.WARNING
    assert logs.level_number("loud") is None


async def test_a_long_poll_answers_as_soon_as_a_record_at_its_level_comes() -> None:
    ring = LogRing()
    log = _logger(ring, "kvl.test.wait")
    log.info("old")
    waiting = asyncio.create_task(ring.wait(1, 20, level=logging.WARNING))
    await until(lambda: ring.waiting == 1, "the poll to wait")
    log.info("below the level: still waiting")
    await asyncio.sleep(0)  # (one turn of the loop: the poll sees the record and waits on)
    assert not waiting.done()
    assert ring.waiting == 1
    # From another thread, as a worker thread logs.
    await asyncio.to_thread(log.warning, "the one")
    found = await asyncio.wait_for(waiting, 5)
    assert [r.message for r in found.records] == ["the one"]
    assert found.next_after == 3
    assert ring.waiting == 0
    empty = await ring.wait(3, 0.05)
    assert empty.records == []


async def test_only_the_hub_reads_a_nodes_logs(
    aiohttp_client: AiohttpClient, tmp_path: Path
) -> None:
    settings = make_settings(
        tmp_path / "data", model={"default": "absent-model"}, embeddings={"enabled": False}
    )
    store = Store(settings.db_path)
    try:
        key = store.create_key("ops", admin=True).plaintext
    finally:
        store.close()
    app = create_app(settings)
    assert app[LOGS] is logs.ring()  # the process's, on the root logger
    client = await aiohttp_client(app)
    # On the LAN API, with no certificate (even with an admin key): refused.
    for headers in ({}, {"Authorization": f"Bearer {key}"}):
        response = await client.get("/v1/fleet/logs", headers=headers)
        assert response.status == 401
        assert (await response.json())["error"]["code"] == "client_certificate_required"
