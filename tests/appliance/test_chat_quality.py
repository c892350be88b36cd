"""The embedded chat model follows short instructions (tests.benchmarks.chat_quality's) in
a real appliance about as often as the committed measurement says, and the README states
that measurement."""

from __future__ import annotations

import json
import re
import urllib.error

import pytest

from appliance.serving.catalog import CHAT_MODEL_NAME, DEFAULT_MODEL_NAME
from appliance.serving.evaluation import INSTRUCTIONS, judge, tally
from tests.benchmarks.chat_quality import DEFAULT_OUT, reply
from tests.benchmarks.tables import block
from tests.conftest import REPO, ApplianceProcess

# Greedy output follows the CPU's kernels (AVX-512 or not): a reply or two may differ from
# the machine that measured, and with it the counts.
MARGIN = 2


def _recorded() -> dict[str, dict[str, object]]:
    models: dict[str, dict[str, object]] = json.loads(DEFAULT_OUT.read_text())["models"]
    return models


def test_the_readme_states_the_measured_figures() -> None:
    # The figures table, which tests/benchmarks/tables.py writes from the result.
    readme = block((REPO / "README.md").read_text(), "chat-quality")
    assert readme is not None, "README.md has no chat-quality results block"
    result = json.loads(DEFAULT_OUT.read_text())
    assert result["commit"] in readme
    for model, figures in result["models"].items():
        row = re.search(rf"^\| `{re.escape(model)}` \|.*$", readme, re.MULTILINE)
        assert row is not None, f"the chat-quality block has no row for {model}"
        cells = [cell.strip() for cell in row.group(0).strip("|").split("|")]
        total = figures["total"]
        # model, followed, on topic, load, worker memory
        assert cells[1:5] == [
            f"{figures['followed']}/{total}",
            f"{figures['on_topic']}/{total}",
            f"{figures['load_s_median']} s",
            f"{round(figures['worker_resident_mib'])} MiB",
        ], model
        # The counts are the recorded replies judged by today's checks: a changed check
        # needs a new measurement.
        judged = [
            judge(i, r["reply"]) for i, r in zip(INSTRUCTIONS, figures["results"], strict=True)
        ]
        assert tally(judged) == {k: figures[k] for k in ("followed", "on_topic", "total")}
    chat, base = result["models"][CHAT_MODEL_NAME], result["models"][DEFAULT_MODEL_NAME]
    assert chat["followed"] > base["followed"]
    assert chat["on_topic"] > base["on_topic"]


@pytest.mark.model
def test_the_chat_model_follows_instructions_in_a_real_appliance(
    appliance_process: ApplianceProcess,
) -> None:
    base, key = appliance_process.base_url, appliance_process.key
    # Not registered in this fresh data dir: the first request registers and loads it.
    results = [judge(i, reply(base, key, CHAT_MODEL_NAME, i.prompt)) for i in INSTRUCTIONS]
    counts, recorded = tally(results), _recorded()[CHAT_MODEL_NAME]
    assert isinstance(recorded["followed"], int)
    assert isinstance(recorded["on_topic"], int)
    assert counts["followed"] >= recorded["followed"] - MARGIN, results
    assert counts["on_topic"] >= recorded["on_topic"] - MARGIN, results


@pytest.mark.model
def test_a_version_of_an_embedded_model_that_is_not_installed_is_not_found(
    appliance_process: ApplianceProcess,
) -> None:
    with pytest.raises(urllib.error.HTTPError) as caught:
        reply(appliance_process.base_url, appliance_process.key, f"{CHAT_MODEL_NAME}@0.0.0", "Hi")
    assert caught.value.code == 404
    assert json.loads(caught.value.read())["error"]["code"] == "model_not_found"
