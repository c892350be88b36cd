"""A content package as data: the request that asks for one, its items (modelled on QTI
3.0 semantics: identifier, cardinality, choices, correct response, feedback), and the
manifest that describes a finished package: every file with its sha256 and size, the
lineage of what made it, and the report of the checks it passed.

These are the shapes the generator fills, the validator checks, the cache stores and the
exports read. Nothing here does I/O.
"""

from __future__ import annotations

import hashlib
import json
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints


class ItemType(StrEnum):
    single_choice = "single_choice"  # one correct choice (QTI cardinality single)
    multiple_choice = "multiple_choice"  # one or more correct choices (cardinality multiple)
    true_false = "true_false"  # choices "true" and "false", one correct
    short_answer = "short_answer"  # free text matched against accepted answers


class Level(StrEnum):
    beginner = "beginner"
    intermediate = "intermediate"
    advanced = "advanced"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Spec(_Model):
    """What the package holds."""

    items: int = Field(5, ge=1, le=50, description="How many items.")
    item_types: list[ItemType] = Field(
        default_factory=lambda: [ItemType.single_choice],
        min_length=1,
        max_length=4,
        description="The item types to use, in turn.",
    )
    language: str = Field(
        "en", pattern=r"^[a-z]{2,3}(-[A-Za-z0-9]{2,8})?$", description="BCP 47 language tag."
    )
    narration: bool = Field(default=True, description="Narration audio per item and intro.")
    choices: int = Field(4, ge=2, le=6, description="Choices per choice item.")


Source = Annotated[str, StringConstraints(strip_whitespace=True, min_length=20, max_length=4000)]


class PackageRequest(_Model):
    """`POST /v1/packages`."""

    topic: str = Field(min_length=2, max_length=200)
    level: Level = Level.beginner
    spec: Spec = Field(default_factory=Spec)
    sources: list[Source] = Field(
        default_factory=list,
        max_length=20,
        description="Passages of text the items are written from; each item's key must "
        "be supported by one of them, and the report cites it.",
    )
    wait: bool = Field(
        default=False, description="Answer with the finished package instead of a job."
    )

    def digest(self) -> str:
        """sha256 of the normalised request (topic case and spacing do not matter): with
        the model's and voice's digests it is the cache key."""
        canonical: dict[str, object] = {
            "topic": " ".join(self.topic.split()).casefold(),
            "level": self.level.value,
            "spec": self.spec.model_dump(mode="json"),
        }
        if self.sources:  # absent when none: the digests of requests without stay as they were
            canonical["sources"] = [" ".join(text.split()) for text in self.sources]
        return hashlib.sha256(json.dumps(canonical, sort_keys=True).encode()).hexdigest()


class Choice(_Model):
    id: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")
    text: str


class Feedback(_Model):
    correct: str = ""
    incorrect: str = ""


class Item(_Model):
    """One question. For choice items `correct` holds choice ids; for short answers, the
    accepted answers (matched case- and space-insensitively)."""

    id: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")
    type: ItemType
    prompt: str
    choices: list[Choice] = Field(default_factory=list)
    correct: list[str] = Field(default_factory=list)
    feedback: Feedback = Field(default_factory=Feedback)
    narration: str | None = Field(None, description="Path of the item's audio in the package.")


# The package's introduction read aloud (its title and how many questions), when narrated
INTRO_NARRATION = "audio/intro.wav"


class FileEntry(_Model):
    path: str  # relative, forward slashes: "items.json", "audio/item-1.wav", "cover.png"
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)
    media_type: str


class ModelLineage(_Model):
    name: str
    version: str
    sha256: str


class VoiceLineage(_Model):
    engine: str  # "espeak-ng"
    voice: str  # the voice name
    version: str


class Lineage(_Model):
    model: ModelLineage
    voice: VoiceLineage | None
    prompt_template_version: str
    seed: int
    appliance_id: str


class Check(_Model):
    """One validation check and its outcome."""

    name: str  # "one_correct_answer", "choices_unique", …
    passed: bool
    item: str | None = None  # the item it concerns, if one
    detail: str = ""


class ValidationReport(_Model):
    passed: bool
    checks: list[Check]
    attempts: int = Field(1, ge=1, description="Generations tried before this one passed.")
    writer: str | None = Field(None, description="The model that wrote the items (name@version).")
    checker: str | None = Field(
        None, description="The model that answered them again without their keys."
    )


class Manifest(_Model):
    """The finished package's description (`manifest.json` in the package)."""

    schema_version: Literal[1] = 1
    id: str  # "pkg_" + 24 hex: stable for the same normalised request
    version: str  # 12 hex: changes with the model, the voice or the template
    title: str
    topic: str
    level: Level
    spec: Spec
    items: list[Item]
    files: list[FileEntry]
    lineage: Lineage
    validation: ValidationReport
    created_at: str  # ISO 8601
    request_digest: str
