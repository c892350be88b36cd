"""Lesson packages made by hand (a manifest and its files), and the scripted model that
makes ones passing every check."""

from __future__ import annotations

import hashlib
import io
import json
import wave
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.app import create_app
from appliance.gateway.appkeys import REGISTRY
from appliance.packages.generate import _KIND, CHOICE_IDS, example
from appliance.packages.model import (
    Check,
    Choice,
    Feedback,
    FileEntry,
    Item,
    ItemType,
    Level,
    Lineage,
    Manifest,
    ModelLineage,
    Spec,
    ValidationReport,
    VoiceLineage,
)
from appliance.serving.catalog import register_file
from appliance.state.store import Store
from tests.conftest import SCRIPTED, make_settings, write_script

if TYPE_CHECKING:
    from pathlib import Path

    from aiohttp.web import Application
    from pytest_aiohttp import AiohttpClient

    from appliance.state.records import ModelRecord
    from tests.conftest import Client


def package(
    n: int,
    *,
    version: str = "0123456789ab",
    topic: str | None = None,
    files: dict[str, bytes] | None = None,
    day: int | None = None,
) -> tuple[Manifest, dict[str, bytes]]:
    """Package number ``n``: its manifest and its files (manifest.json aside)."""
    files = {"items.json": f"items of package {n}".encode() * 10} if files is None else files
    item = Item(
        id="q1",
        type=ItemType.single_choice,
        prompt="What do plants take in?",
        choices=[Choice(id="a", text="Carbon dioxide"), Choice(id="b", text="Salt")],
        correct=["a"],
    )
    manifest = Manifest(
        id=f"pkg_{n:024x}",
        version=version,
        title=f"Lesson {n}",
        topic=topic or f"Topic {n}",
        level=Level.beginner,
        spec=Spec(items=1),
        items=[item],
        files=[
            FileEntry(
                path=path,
                sha256=hashlib.sha256(data).hexdigest(),
                size=len(data),
                media_type="audio/wav" if path.endswith(".wav") else "application/json",
            )
            for path, data in files.items()
        ],
        lineage=Lineage(
            model=ModelLineage(name="gemma3-270m", version="1", sha256="0" * 64),
            voice=VoiceLineage(engine="espeak-ng", voice="en", version="1.51"),
            prompt_template_version="1",
            seed=n,
            appliance_id="appliance-1",
        ),
        validation=ValidationReport(passed=True, checks=[Check(name="one_correct", passed=True)]),
        created_at=f"2024-01-{(day or n) % 28 + 1:02d}T08:00:00+00:00",
        request_digest=f"{n:064x}",
    )
    return manifest, files


# The worked answers' keys (tests.packages' items are the solar system's examples).
KEYS = ("Mercury", "Venus")


def checker_rules(keys: tuple[str, ...] = KEYS) -> list[dict[str, str]]:
    """A scripted checker that knows `keys` are the right answers and nothing else is: it
    picks a key's letter wherever the choices put it, judges a key right and anything else
    wrong, and a statement true (the worked true/false statement is)."""
    yes, no = '{"answer": "yes"}', '{"answer": "no"}'
    rules = [
        {"contains": f"{letter}) {text}\n", "reply": json.dumps({"answer": letter})}
        for text in keys
        for letter in CHOICE_IDS
    ]
    for text in keys:
        rules += [
            {"contains": f"Proposed answer: {text}\nIs the proposed answer correct", "reply": yes},
            {"contains": f"Proposed answer: {text}\nIs the proposed answer wrong", "reply": no},
        ]
    return [
        *rules,
        {"contains": "Is the proposed answer correct", "reply": no},
        {"contains": "Is the proposed answer wrong", "reply": yes},
        {"contains": "Is the statement true", "reply": yes},
        {"contains": "Is the statement false", "reply": no},
    ]


def package_script(path: Path, *, checker: list[dict[str, str]] | None = None) -> Path:
    """The script of `package_model`, written to `path`."""
    rules = checker_rules() if checker is None else checker
    rules += [{"contains": _KIND[kind], "reply": example(kind, 4)} for kind in ItemType]
    return write_script(path, rules=rules)


def package_model(folder: Path, *, checker: list[dict[str, str]] | None = None) -> ModelRecord:
    """SCRIPTED, registered (in a catalog of its own in ``folder``), answering each item
    type's request (every prompt names its type) with a worked answer of that type, four
    choices where it has choices: an item that passes every check; and checking items as
    `checker_rules` (or `checker`) does."""
    script = package_script(folder / "packages.json", checker=checker)
    store = Store(folder / "catalog.db")
    try:
        return register_file(store, script, SCRIPTED, "1")
    finally:
        store.close()


async def package_client(
    aiohttp_client: AiohttpClient,
    tmp_path: Path,
    record: ModelRecord,
    **packages: Any,
) -> tuple[Client, str, Application]:
    """An appliance serving `record` for packages (no embedding model), a teacher's key,
    and the app."""
    settings = make_settings(
        tmp_path / "data",
        # (a scripted token is a byte: the worked examples of a prompt take 1,800)
        model={"default": record.name, "chat_default": record.name, "n_ctx": 4096},
        embeddings={"enabled": False},
        packages={"max_attempts": 5, **packages},
    )
    store = Store(settings.db_path)
    store.add_model(record)
    key = store.create_key("teacher").plaintext
    store.close()
    app = create_app(settings)
    client: Client = await aiohttp_client(app)
    await app[REGISTRY].wait_loaded()
    return client, key, app


# -- a lesson as the export tests read it ----------------------------------------------------

TRICKY = "Is 3 < 4 & \"five\" > 'two'?"


def tone_wav(seconds: float, tone: int) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(8000)
        out.writeframes(bytes([tone, 0]) * round(seconds * 8000))
    return buffer.getvalue()


def choices_of(*texts: str) -> list[Choice]:
    return [Choice(id=cid, text=text) for cid, text in zip("abcdef", texts, strict=False)]


def lesson_items(*, narration: bool = True) -> list[Item]:
    def audio(item_id: str) -> str | None:
        return f"audio/{item_id}.wav" if narration else None

    return [
        Item(
            id="q1",
            type=ItemType.single_choice,
            prompt="Which gas do plants give off during photosynthesis?",
            choices=choices_of("Oxygen", "Nitrogen", "Carbon dioxide", "Helium"),
            correct=["a"],
            feedback=Feedback(correct="Yes: oxygen.", incorrect="No: plants give off oxygen."),
            narration=audio("q1"),
        ),
        Item(
            id="q2",
            type=ItemType.multiple_choice,
            prompt="Which of these are parts of a plant cell?",
            choices=choices_of("The cell wall", "The chloroplast", "A feather", "A scale"),
            correct=["a", "b"],
            narration=audio("q2"),
        ),
        Item(
            id="q3",
            type=ItemType.multiple_choice,
            prompt="Which of these are gases at room temperature?",
            choices=choices_of("Oxygen", "Nitrogen", "Argon", "Iron"),
            correct=["a", "b", "c"],
            narration=audio("q3"),
        ),
        Item(
            id="q4",
            type=ItemType.true_false,
            prompt="Plants need light to make their own food.",
            choices=[Choice(id="true", text="True"), Choice(id="false", text="False")],
            correct=["false"],
            feedback=Feedback(correct="Right.", incorrect="They do need light."),
            narration=audio("q4"),
        ),
        Item(
            id="q5",
            type=ItemType.short_answer,
            prompt="What is the green pigment in the leaves of a plant called?",
            correct=["chlorophyll", "chlorophyl"],
            feedback=Feedback(correct="Well done.", incorrect="It is chlorophyll."),
            narration=audio("q5"),
        ),
        Item(
            id="q6",
            type=ItemType.single_choice,
            prompt=TRICKY,
            choices=choices_of("Yes <b>", "No & never", 'Only "sometimes"', "Don't know"),
            correct=["a"],
            feedback=Feedback(correct="3 < 4 & so on."),
        ),
    ]


def lesson_audio(package_items: list[Item]) -> dict[str, bytes]:
    return {
        item.narration: tone_wav(1.0 + index, tone=index + 1)
        for index, item in enumerate(package_items)
        if item.narration is not None
    }


def lesson_manifest(package_items: list[Item], files: dict[str, bytes] | None = None) -> Manifest:
    files = files or {}
    return Manifest(
        id="pkg_0123456789abcdef01234567",
        version="0123456789ab",
        title="Photosynthesis / plants & light",
        topic="Photosynthesis",
        level=Level.beginner,
        spec=Spec(items=len(package_items), item_types=list(ItemType), language="en-GB", choices=4),
        items=package_items,
        files=[
            FileEntry(
                path=path,
                sha256=hashlib.sha256(data).hexdigest(),
                size=len(data),
                media_type="audio/wav",
            )
            for path, data in sorted(files.items())
        ],
        lineage=Lineage(
            model=ModelLineage(name="gemma3-270m", version="1", sha256="0" * 64),
            voice=VoiceLineage(engine="espeak-ng", voice="en", version="1.51"),
            prompt_template_version="1",
            seed=7,
            appliance_id="app-1",
        ),
        validation=ValidationReport(passed=True, checks=[Check(name="schema", passed=True)]),
        created_at="2025-01-01T00:00:00Z",
        request_digest="f" * 64,
    )
