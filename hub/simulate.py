"""A fleet simulator: many appliances, enrolled with a hub and heartbeating on a schedule,
from one process. `kvl hub simulate` drives it; `just bench fleet` measures with it.

Each simulated node enrolls as an appliance does (a WireGuard public key of its own, the
hub's certificate pinned) and then sends a heartbeat every `interval_s` at a random phase
of its own, so a fleet of N sends N / interval_s heartbeats a second, evenly. The load is
open loop: a heartbeat is sent at its time whether or not earlier ones were answered, and
its latency runs from that time, so a hub that falls behind shows it in the tail instead
of slowing the simulator down (no coordinated omission).

The simulator is not the appliance's client: it skips the tunnel (the hub must accept
node calls from any address, `server.require_overlay_source: false`) and shares a pool of
HTTPS connections among its nodes, as a proxy in front of the hub would.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from wireguard_tools import WireguardKey

from shared import __version__, pki

VERSIONS = {"kvl": __version__}


@dataclass(frozen=True)
class SimulatedNode:
    node_id: str
    token: str


@dataclass
class Latencies:
    """Seconds per call, and the calls that failed (by status or exception name)."""

    seconds: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)

    def fail(self, why: str) -> None:
        self.failures[why] = self.failures.get(why, 0) + 1

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.seconds)

        def quantile(q: float) -> float | None:
            if not ordered:
                return None
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)

        return {
            "calls": len(ordered) + sum(self.failures.values()),
            "ok": len(ordered),
            "failed": dict(self.failures),
            "p50_ms": quantile(0.50),
            "p90_ms": quantile(0.90),
            "p99_ms": quantile(0.99),
            "max_ms": round(ordered[-1] * 1000, 2) if ordered else None,
            "mean_ms": round(statistics.fmean(ordered) * 1000, 2) if ordered else None,
        }


def _capacity(rng: random.Random) -> dict[str, Any]:
    """What an appliance's heartbeat carries (see appliance/fleet/link.py)."""
    return {
        "cpu_percent": round(rng.uniform(2, 95), 1),
        "cpu_count": 16,
        "memory_total_mib": 65_536,
        "memory_available_mib": rng.randint(8_000, 60_000),
        "models": ["gemma-3-270m@1.0.0"],
        "queue_waiting": rng.randint(0, 4),
        "outbox_lag": 0,
        "outbox_alarm": False,
    }


class Simulator:
    def __init__(self, url: str, fingerprint: str, *, connections: int = 100) -> None:
        self._url = url.rstrip("/")
        self._ssl = aiohttp.Fingerprint(pki.fingerprint_bytes(fingerprint))
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=connections, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=30),
        )

    async def close(self) -> None:
        await self._session.close()

    async def __aenter__(self) -> Simulator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def enroll(
        self, token: str, count: int, *, prefix: str = "sim", concurrency: int = 16
    ) -> tuple[list[SimulatedNode], Latencies]:
        """Enroll `count` nodes with one token (of at least that many uses)."""
        nodes: list[SimulatedNode] = []
        latencies = Latencies()
        gate = asyncio.Semaphore(concurrency)

        async def one(index: int) -> None:
            async with gate:
                # The key is made inside the gate: made up front for every node, the keys
                # would hold the loop while the first calls' clocks ran.
                body = {
                    "token": token,
                    "name": f"{prefix}-{index:06d}",
                    "wg_public_key": str(WireguardKey.generate().public_key()),
                    "labels": {"simulated": "true"},
                    "versions": VERSIONS,
                }
                started = time.perf_counter()
                try:
                    async with self._session.post(
                        f"{self._url}/v1/enroll", json=body, ssl=self._ssl
                    ) as response:
                        answer = await response.json(content_type=None)
                        if response.status != 201:
                            latencies.fail(str(response.status))
                            return
                except (aiohttp.ClientError, TimeoutError) as err:
                    latencies.fail(type(err).__name__)
                    return
                latencies.seconds.append(time.perf_counter() - started)
                nodes.append(SimulatedNode(answer["node_id"], answer["node_token"]))

        await asyncio.gather(*(one(i) for i in range(count)))
        return nodes, latencies

    async def heartbeats(
        self,
        nodes: list[SimulatedNode],
        *,
        interval_s: float,
        duration_s: float,
        seed: int = 0,
    ) -> Latencies:
        """Every node heartbeats every `interval_s` for `duration_s`, open loop."""
        rng = random.Random(seed)  # noqa: S311 - load shaping, not security
        latencies = Latencies()
        start = time.perf_counter() + 0.5
        end = start + duration_s

        async def node_loop(node: SimulatedNode, phase: float) -> None:
            headers = {"Authorization": f"Bearer {node.token}"}
            due = start + phase
            calls = []
            while due < end:
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                body = {"versions": VERSIONS, "capacity": _capacity(rng)}
                calls.append(asyncio.create_task(self._beat(headers, body, due, latencies)))
                due += interval_s
            await asyncio.gather(*calls)

        await asyncio.gather(*(node_loop(n, rng.uniform(0, interval_s)) for n in nodes))
        return latencies

    async def _beat(
        self, headers: dict[str, str], body: dict[str, Any], due: float, latencies: Latencies
    ) -> None:
        try:
            async with self._session.post(
                f"{self._url}/v1/node/heartbeat", json=body, headers=headers, ssl=self._ssl
            ) as response:
                await response.read()
                if response.status != 200:
                    latencies.fail(str(response.status))
                    return
        except (aiohttp.ClientError, TimeoutError) as err:
            latencies.fail(type(err).__name__)
            return
        latencies.seconds.append(time.perf_counter() - due)
