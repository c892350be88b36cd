"""Each site's bandwidth for the files its nodes fetch from the hub (`kvl hub releases
bandwidth SITE`): one token bucket per site, shared by every download of the site's nodes
from this replica, so a site's narrow link is not filled by one release (or by two nodes
fetching a model at once). A second's worth may go at once; past it, each chunk waits for
its share. With several replicas, each paces its own downloads: give each the site's
share, or let one replica serve the site."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable


class _Bucket:
    def __init__(self, rate: int, now: float) -> None:
        self.rate = rate
        self.tokens = float(rate)  # a second's worth at once
        self.at = now

    def reserve(self, size: int, now: float) -> float:
        """Seconds to wait before `size` bytes may go (their tokens taken now)."""
        self.tokens = min(float(self.rate), self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= size
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


class SiteBandwidth:
    """The buckets of the sites that have a bandwidth, made as their downloads come."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._clock = clock
        self._sleep = sleep
        self._buckets: dict[str, _Bucket] = {}

    def pacer(self, site: str, bytes_per_s: int) -> Callable[[int], Awaitable[None]]:
        """What a download of `site` awaits before it sends each chunk."""
        bucket = self._buckets.get(site)
        if bucket is None or bucket.rate != bytes_per_s:
            bucket = self._buckets[site] = _Bucket(bytes_per_s, self._clock())

        async def pace(size: int) -> None:
            wait = bucket.reserve(size, self._clock())
            if wait > 0:
                await self._sleep(wait)

        return pace
