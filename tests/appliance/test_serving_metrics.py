"""Serving metrics: slots, batch sizes, tokens/s, queue time, inter-token latency and the
tokens a shared prefix saved, scraped from /metrics after real traffic."""

from __future__ import annotations

import asyncio
import re

import pytest

from tests.conftest import Client

pytestmark = pytest.mark.model

SYSTEM = "You answer questions about the school library in one short sentence. " * 8


def sample(text: str, name: str) -> float:
    """The value of the first sample of ``name`` (labels ignored)."""
    match = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name} is not exposed"
    return float(match.group(1))


async def test_serving_metrics_after_concurrent_requests(client: Client, api_key: str) -> None:
    async def ask(question: str) -> None:
        response = await client.post(
            "/v1/chat/completions",
            headers={"Authorization": f"Bearer {api_key}"},
            json={
                "model": "gemma-3-270m",
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": question},
                ],
                "max_tokens": 8,
                "temperature": 0,
            },
        )
        assert response.status == 200, await response.text()

    await asyncio.gather(*(ask(q) for q in ("Hours?", "Fines?", "Wi-Fi?", "Printing?", "Cafe?")))
    # Batch sizes and token rates travel with the worker's heartbeat (once a second).
    for _ in range(50):
        text = await (await client.get("/metrics")).text()
        if "kvl_batch_tokens_count{" in text and "kvl_prefix_tokens_reused_total{" in text:
            break
        await asyncio.sleep(0.1)
    assert sample(text, "kvl_slots") == 4
    assert sample(text, "kvl_slots_busy") >= 0
    # Several sequences decoded in one call at least once, and the system prompt was
    # computed once: the other requests copied it.
    assert sample(text, "kvl_batch_tokens_count") > 0
    assert sample(text, "kvl_batch_tokens_sum") > sample(text, "kvl_batch_tokens_count")
    assert sample(text, "kvl_prefix_tokens_reused_total") > 0
    assert sample(text, "kvl_queue_duration_seconds_count") == 5
    assert sample(text, "kvl_time_per_output_token_seconds_count") == 5
    assert "kvl_decode_tokens_per_second" in text
