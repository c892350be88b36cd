"""A package's attempts (appliance/packages/service.py `_items`): an item that fails a check
is generated again, an item is put to the checking model once it passes the checks of form
and not again, and the validation report of the attempt that passes holds every check of
every item shipped, those of items narrated in an earlier attempt too. The model's items and
the on-topic scores are scripted here (the subject is the attempts' bookkeeping); the checks,
the narration's audio check and the report are the real ones."""

from __future__ import annotations

import io
import wave
from typing import TYPE_CHECKING, Any, cast

from appliance.packages.checks import report
from appliance.packages.model import (
    Check,
    Choice,
    Feedback,
    Item,
    ItemType,
    PackageRequest,
    Spec,
)
from appliance.packages.service import PackageService
from appliance.packages.verify import Checker
from appliance.settings import PackageSettings

if TYPE_CHECKING:
    from appliance.packages.voice import Voice

PROMPTS = ("Water boils at 100 degrees Celsius at sea level.", "Ice is the solid form of water.")


def _item(n: int, attempt: int) -> Item:
    return Item(
        id=f"item-{n}",
        type=ItemType.true_false,
        prompt=PROMPTS[n - 1],
        choices=[Choice(id="true", text="True"), Choice(id="false", text="False")],
        correct=["true"],
        feedback=Feedback(correct=f"Right ({attempt}).", incorrect="Not quite."),
    )


class Narrator:
    """WAVs as long as a reading of the text takes (half a second a word)."""

    engine = "test"

    def __init__(self) -> None:
        self.read: list[str] = []

    async def speak(self, text: str, language: str) -> bytes:
        self.read.append(text)
        out = io.BytesIO()
        with wave.open(out, "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(8000)
            wav.writeframes(b"\1\0" * (4000 * len(text.split())))
        return out.getvalue()


async def test_a_report_after_attempts_keeps_the_narration_checks_of_earlier_ones() -> None:
    service = PackageService.__new__(PackageService)
    service._settings = PackageSettings(max_attempts=3)
    attempts: dict[int, int] = {}

    async def one_item(key: Any, **asked: Any) -> Item:
        n = asked["n"]
        attempts[n] = attempts.get(n, 0) + 1
        return _item(n, attempts[n])

    async def on_topic(req: PackageRequest, items: list[Item]) -> list[Check]:
        # item-2 is off topic the first time it is written
        return [Check(name="on_topic", passed=not (i.id == "item-2" and attempts[2] == 1),
                      item=i.id, detail="scripted") for i in items]  # fmt: skip

    verified: list[str] = []

    async def verify(req: PackageRequest, checker: Any, items: list[Item]) -> list[list[Check]]:
        verified.extend(i.id for i in items)
        return [[Check(name="answer_verified", passed=True, item=i.id)] for i in items]

    service._one_item = one_item  # type: ignore[method-assign]
    service._on_topic = on_topic  # type: ignore[method-assign]
    service._verify = verify  # type: ignore[method-assign]
    narrator = Narrator()
    request = PackageRequest(
        topic="The water cycle",
        spec=Spec(items=2, item_types=[ItemType.true_false], narration=True),
    )
    shipped, tries, checks, audio = await service._items(
        request,
        cast("Any", None),
        "model",
        Checker(cast("Any", None), cast("Any", None), "model", 3, 1),
        cast("Voice", narrator),
    )
    assert tries == 2
    assert [i.feedback.correct for i in shipped] == ["Right (1).", "Right (2)."]
    assert attempts == {1: 1, 2: 2}  # item-1 kept, item-2 written again
    assert narrator.read == [PROMPTS[0], PROMPTS[1]]  # item-1 narrated once, in attempt 1
    assert sorted(audio) == ["item-1", "item-2"]
    heard = sorted(c.item or "" for c in checks if c.name == "audio_plausible")
    assert heard == ["item-1", "item-2"], checks
    # item-2 is put to the checker once it passed the checks of form, item-1 only once
    assert verified == ["item-1", "item-2"]
    assert sorted(c.item or "" for c in checks if c.name == "answer_verified") == verified
    assert report(checks, tries).passed
