"""The QTI 3.0 export in a real QTI player: @citolab/qti-components (what delivery platforms
build on; `just setup-players` installs it) renders each item of a narrated package's export
in Debian's chromium, and its own response processing scores the key full marks and a wrong
answer none. The choices it shows are in the order the narration reads them."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from appliance.packages.exports import export_qti3
from appliance.packages.model import INTRO_NARRATION, ItemType
from tests.browser.chromium import CHROMIUM, open_browser
from tests.packages import lesson_audio, lesson_items, lesson_manifest, tone_wav

if TYPE_CHECKING:
    from playwright.async_api import Page

    from appliance.packages.model import Item

PLAYER = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    / "kovenlab-edge/npm/qti-components-7.27.4/package/cdn/index.global.js"
)

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        CHROMIUM is None, reason="needs Debian's chromium: run `.venv/bin/just setup-system`"
    ),
]

# What the player's item does with one response: its SCORE after response processing.
SCORE = """(response) => {
    const item = document.querySelector('item-container').shadowRoot
        .querySelector('qti-assessment-item');
    item.resetResponses();
    item.updateResponseVariable('RESPONSE', response);
    item.processResponse();
    return item.getOutcome('SCORE').value;
}"""
SHOWN = """() => {
    const item = document.querySelector('item-container').shadowRoot
        .querySelector('qti-assessment-item');
    const interaction = item.querySelector('qti-choice-interaction');
    return {
        identifier: item.identifier,
        shuffle: interaction ? interaction.getAttribute('shuffle') : null,
        choices: [...item.querySelectorAll('qti-simple-choice')].map(
            (c) => c.getAttribute('identifier')),
    };
}"""


def _right_and_wrong(item: Item) -> tuple[Any, Any]:
    """A response of the key, and one that is not."""
    if item.type is ItemType.short_answer:
        return item.correct[0].upper(), "carotene"  # case does not matter, a wrong word does
    if item.type is ItemType.multiple_choice:
        return sorted(item.correct), sorted(item.correct)[:1]  # all of them, or only one
    wrong = next(c.id for c in item.choices if c.id not in item.correct)
    return item.correct[0], wrong


async def _load(page: Page, xml: str, identifier: str) -> None:
    await page.evaluate("(xml) => { document.querySelector('item-container').itemXML = xml; }", xml)
    await page.wait_for_function(
        """(id) => {
            const root = document.querySelector('item-container').shadowRoot;
            const item = root && root.querySelector('qti-assessment-item');
            return item && item.identifier === id;
        }""",
        arg=identifier,
        timeout=30_000,
    )


async def test_the_player_scores_every_exported_item_and_shows_the_narrated_order(
    tmp_path: Path,
) -> None:
    assert PLAYER.is_file(), f"{PLAYER}: run `.venv/bin/just setup-players`"
    package_items = lesson_items()
    files = lesson_audio(package_items) | {INTRO_NARRATION: tone_wav(2.0, tone=9)}
    archive = zipfile.ZipFile(io.BytesIO(export_qti3(lesson_manifest(package_items, files), files)))
    async with open_browser(tmp_path / "profile") as context:
        page = await context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda err: errors.append(str(err)))
        await page.set_content("<html><body><qti-item><item-container></item-container>"
                               "</qti-item></body></html>")  # fmt: skip
        await page.add_script_tag(path=str(PLAYER))
        for item in package_items:
            await _load(page, archive.read(f"items/{item.id}.xml").decode(), item.id)
            shown = await page.evaluate(SHOWN)
            assert shown["identifier"] == item.id
            if item.type is not ItemType.short_answer:
                assert shown["choices"] == [c.id for c in item.choices], shown
                # narrated: read in this order, so shown in it (the player may not shuffle)
                assert shown["shuffle"] == ("false" if item.narration else "true"), shown
            right, wrong = _right_and_wrong(item)
            assert await page.evaluate(SCORE, right) == "1", (item.id, right)
            assert await page.evaluate(SCORE, wrong) == "0", (item.id, wrong)
    assert errors == []
