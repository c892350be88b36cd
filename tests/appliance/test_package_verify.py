"""Answer verification (appliance/packages/verify.py): a package ships only when a checking
model, answering each item without its key, agrees with every key; otherwise it is refused
with the failed checks (422 `package_validation_failed`), and nothing is cached.

The writer and the checker are scripted (tests.packages: the worked examples' items, and a
checker that knows their keys); what is tested is what verification makes of a checker
that knows the keys, one that believes another answer, one that always picks the first
choice, one that says yes to everything, and sources that do or do not support the keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import pytest

from appliance.gateway.packages import PACKAGES
from appliance.packages.checks import decided_by_arithmetic
from appliance.packages.model import Choice, Item, ItemType
from appliance.packages.verify import Checker, orders, verify_item
from tests.gateway import auth
from tests.packages import checker_rules, package_client, package_model

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    from aiohttp.web import Application
    from pytest_aiohttp import AiohttpClient

    from appliance.packages.verify import Similarity

ASK = {
    "topic": "The Solar System",
    "level": "beginner",
    "wait": True,
    "spec": {"items": 4, "narration": False,
             "item_types": ["single_choice", "multiple_choice", "true_false", "short_answer"]},
}  # fmt: skip
YES, NO = '{"answer": "yes"}', '{"answer": "no"}'


async def _ask(
    aiohttp_client: AiohttpClient, tmp_path: Path, checker: list[dict[str, str]], **body: object
) -> tuple[int, dict[str, Any], Application]:
    model = package_model(tmp_path, checker=checker)
    client, key, app = await package_client(aiohttp_client, tmp_path, model, max_attempts=2)
    response = await client.post("/v1/packages", headers=auth(key), json={**ASK, **body})
    return response.status, await response.json(), app


async def test_a_checker_that_knows_the_keys_passes_every_item(
    aiohttp_client: AiohttpClient, tmp_path: Path
) -> None:
    status, package, _ = await _ask(aiohttp_client, tmp_path, checker_rules())

    assert status == 200, package
    report = package["manifest"]["validation"]
    assert (report["writer"], report["checker"]) == ("scripted@1", "scripted@1")
    verified = {c["item"]: c["detail"] for c in report["checks"] if c["name"] == "answer_verified"}
    assert sorted(verified) == ["item-1", "item-2", "item-3", "item-4"]
    assert (
        "3/3 picks, each in another order, chose the key (checked by scripted@1)"
        in (verified["item-1"])
    )
    assert "12 judgements of 4 answers agreed" in verified["item-2"]  # every choice, 3 times


@pytest.mark.parametrize(
    ("checker", "failing", "says"),
    [
        # believes Venus is closest to the Sun: the single choice and the short answer fail
        (checker_rules(keys=("Venus",)), {"item-1", "item-2", "item-4"}, "'Mercury'"),
        # always picks the first choice: the key is moved to another place each time
        ([{"contains": "Which choice answers", "reply": '{"answer": "a"}'}, *checker_rules()],
         {"item-1"}, "1/3 picks of the key"),
        # yes to everything: asked both ways, it contradicts itself
        ([{"contains": "Answer yes or no", "reply": YES}],
         {"item-1", "item-2", "item-3", "item-4"}, "agreed"),
        # a checker whose answers break the schema agrees with nothing
        ([{"contains": "Answer yes or no", "reply": "Sure!"},
          {"contains": "Which choice answers", "reply": "Sure!"}],
         {"item-1", "item-2", "item-3", "item-4"}, "checked by scripted@1"),
    ],
    ids=["believes-another-answer", "picks-the-first", "says-yes", "breaks-its-schema"],
)  # fmt: skip
async def test_a_key_the_checker_does_not_confirm_is_refused(
    aiohttp_client: AiohttpClient,
    tmp_path: Path,
    checker: list[dict[str, str]],
    failing: set[str],
    says: str,
) -> None:
    status, answer, app = await _ask(aiohttp_client, tmp_path, checker)

    assert status == 422, answer
    error = answer["error"]
    assert error["code"] == "package_validation_failed"
    assert "after 2 attempts" in error["message"]
    named = {f"item-{n}" for n in range(1, 5) if f"answer_verified (item-{n})" in error["message"]}
    assert named == failing
    assert says in error["message"]
    assert not app[PACKAGES].cache.list()  # nothing kept


def _similarity(scores: Sequence[float]) -> Similarity:
    """The embedding model's similarities, scripted: each item on the topic, and `scores`
    of the sources to an item."""

    async def similarity(text: str, passages: Sequence[str]) -> list[float]:
        if text == ASK["topic"]:  # the on_topic check
            return [0.9] * len(passages)
        return list(scores)

    return similarity


SOURCES = [
    "Mars is red because of iron oxide dust on its surface, which scatters red light.",
    "Mercury is the planet closest to the Sun; Venus is the second and the hottest planet.",
]
SUPPORTS = [
    {"contains": "Does the passage say that the answer is right", "reply": YES},
    {"contains": "Does the passage leave the answer unsupported", "reply": NO},
]


@pytest.mark.parametrize(
    ("scores", "support", "passed", "says"),
    [
        ([0.2, 0.7], SUPPORTS, True, "supported by source 2 (0.70): 'Mercury is the planet"),
        ([0.2, 0.3], SUPPORTS, False, "No source is close to the item (best: source 2 (0.30)"),
        ([0.2, 0.7], [SUPPORTS[0], {**SUPPORTS[1], "reply": YES}], False,
         "does not support the key in 1 of 3 judgements"),
        (None, SUPPORTS, False, "The sources could not be compared"),
    ],
    ids=["supported", "no-passage-close", "not-supported", "no-embedding-model"],
)  # fmt: skip
async def test_keys_are_found_in_the_sources_the_request_gives(  # noqa: PLR0917 - its cases
    aiohttp_client: AiohttpClient,
    tmp_path: Path,
    scores: list[float] | None,
    support: list[dict[str, str]],
    passed: bool,
    says: str,
) -> None:
    model = package_model(tmp_path, checker=[*support, *checker_rules()])
    client, key, app = await package_client(aiohttp_client, tmp_path, model, max_attempts=1)
    if scores is not None:
        app[PACKAGES].similarity = _similarity(scores)
    body = {**ASK, "spec": {**ASK["spec"], "items": 1, "item_types": ["single_choice"]}}  # type: ignore[dict-item]
    response = await client.post(
        "/v1/packages", headers=auth(key), json={**body, "sources": SOURCES}
    )
    answer = await response.json()

    if passed:
        assert response.status == 200, answer
        checks = answer["manifest"]["validation"]["checks"]
        [cited] = [c["detail"] for c in checks if c["name"] == "source_supported"]
        assert says in cited
    else:
        assert response.status == 422, answer
        assert "source_supported (item-1)" in answer["error"]["message"]
        assert says in answer["error"]["message"]


async def test_sources_make_another_package(aiohttp_client: AiohttpClient, tmp_path: Path) -> None:
    model = package_model(tmp_path, checker=[*SUPPORTS, *checker_rules()])
    client, key, app = await package_client(aiohttp_client, tmp_path, model)
    app[PACKAGES].similarity = _similarity([0.9, 0.9])
    plain = await (await client.post("/v1/packages", headers=auth(key), json=ASK)).json()
    sourced = await client.post("/v1/packages", headers=auth(key), json={**ASK, "sources": SOURCES})
    assert sourced.status == 200
    assert (await sourced.json())["id"] != plain["id"]
    short = await client.post("/v1/packages", headers=auth(key), json={**ASK, "sources": ["Hi."]})
    assert short.status == 400
    assert (await short.json())["error"]["param"].startswith("sources")


@pytest.mark.parametrize("n", [2, 4, 6])
def test_each_order_puts_the_key_somewhere_else(n: int) -> None:
    for key in range(n):
        shown = orders(n, key, samples=min(3, n), seed=key + n)
        assert all(sorted(order) == list(range(n)) for order in shown)
        places = [order.index(key) for order in shown]
        assert len(set(places)) == len(places), shown


async def test_an_item_arithmetic_decides_is_verified_without_a_model() -> None:
    """A computed key is a proof: no model is asked (here there is none to ask)."""
    item = Item(
        id="q1",
        type=ItemType.single_choice,
        prompt="What is 3/4 + 1/8?",
        choices=[
            Choice(id=i, text=t) for i, t in zip("abcd", ("7/8", "1/2", "5/8", "1"), strict=True)
        ],
        correct=["a"],
    )
    nobody = Checker(cast("Any", None), cast("Any", None), "nobody", 3, 1)

    check = await verify_item(nobody, item, seed=1)

    assert check.passed
    assert "computed: 3/4 + 1/8 = 7/8" in check.detail
    # An answer that is not a number is not decided by the computation: a model judges it.
    worded = item.model_copy(update={"choices": [*item.choices[:3], Choice(id="d", text="one")]})
    assert decided_by_arithmetic(worded) is None
    statement = Item(id="q2", type=ItemType.true_false, prompt="In sums, 2 + 2 = 4.",
                     choices=item.choices[:0], correct=["true"])  # fmt: skip
    assert decided_by_arithmetic(statement) == "computed: 2 + 2 = 4"
