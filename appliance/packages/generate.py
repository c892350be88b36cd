"""Making a package's parts: items from the local model with JSON-schema-constrained
decoding, narration with espeak-ng, and a cover drawn from the title.

Each item is one chat completion whose `response_format` is a JSON schema for that item
type, so the model can only answer in that shape (the grammar is enforced while
decoding, and the output is validated again after). The answer is then turned into an
`Item` with stable ids. The prompt template is versioned (`TEMPLATE_VERSION`): it is
part of a package's lineage and of its cache key.

Narration runs `espeak-ng` as a separate process (it is GPL-3.0; the appliance only
calls it), writing 16-bit PCM WAV; its output is byte-identical run to run.
"""

from __future__ import annotations

import hashlib
import html
import json
from typing import TYPE_CHECKING, Any

from appliance.inference.schemas import UNSUPPORTED_CHAT, ChatCompletionRequest, parse_body
from appliance.packages.model import Choice, Feedback, Item, ItemType, Level
from shared.errors import OutputInvalid

if TYPE_CHECKING:
    from collections.abc import Iterable

    from appliance.inference.completions import CompletionService
    from appliance.state.store import ApiKey

TEMPLATE_VERSION = "3"
ROUTE = "/v1/packages"
CHOICE_IDS = "abcdef"
PROMPT_MAX = {Level.beginner: 200, Level.intermediate: 300, Level.advanced: 500}
CHOICE_MAX = {Level.beginner: 80, Level.intermediate: 120, Level.advanced: 200}
TRUE_FALSE = {
    "en": ("True", "False"),
    "de": ("Wahr", "Falsch"),
    "fr": ("Vrai", "Faux"),
    "es": ("Verdadero", "Falso"),
    "nl": ("Waar", "Onwaar"),
    "it": ("Vero", "Falso"),
    "pt": ("Verdadeiro", "Falso"),
}
# How a wrong answer's feedback names the right one, per language.
ANSWER_IS = {
    "en": "The answer is",
    "de": "Die Antwort ist",
    "fr": "La réponse est",
    "es": "La respuesta es",
    "nl": "Het antwoord is",
    "it": "La risposta è",
    "pt": "A resposta é",
}
LANGUAGES = {
    "en": "English",
    "de": "German",
    "fr": "French",
    "es": "Spanish",
    "nl": "Dutch",
    "it": "Italian",
    "pt": "Portuguese",
}
_KIND = {
    ItemType.single_choice: "a multiple-choice question with exactly one correct answer",
    ItemType.multiple_choice: "a question with several correct answers among the choices",
    ItemType.true_false: "a true-or-false statement",
    ItemType.short_answer: "a question answered with one word or a short phrase",
}


def item_schema(kind: ItemType, choices: int, level: Level) -> dict[str, Any]:
    """The JSON schema the model's answer must follow, per item type."""
    text = {"type": "string", "minLength": 10, "maxLength": PROMPT_MAX[level]}
    choice = {"type": "string", "minLength": 1, "maxLength": CHOICE_MAX[level]}
    feedback = {"type": "string", "maxLength": 200}
    if kind is ItemType.true_false:
        properties: dict[str, Any] = {"statement": text, "answer": {"type": "boolean"}}
    elif kind is ItemType.short_answer:
        properties = {
            "question": text,
            "answers": {"type": "array", "items": choice, "minItems": 1, "maxItems": 3},
        }
    else:
        array = {"type": "array", "items": choice, "minItems": choices, "maxItems": choices}
        properties = {"question": text, "choices": array}
        # Letters from an enum: what a learner sees, and the grammar enforces it exactly.
        letter = {"type": "string", "enum": list(CHOICE_IDS[:choices])}
        if kind is ItemType.single_choice:
            properties["correct"] = letter
        else:
            properties["correct"] = {
                "type": "array",
                "items": letter,
                "minItems": 1,
                "maxItems": choices - 1,
                "uniqueItems": True,
            }
    properties["explanation"] = feedback
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


# Worked answers on three topics far apart: a small model copies an example's content as
# readily as its form, and shown one topic it writes about that topic whatever it is
# asked; shown several, each answering its own request, it follows the request's topic.
_EXAMPLES: dict[str, dict[ItemType, dict[str, Any]]] = {
    "the solar system": {
        ItemType.true_false: {"statement": "In the solar system, Mercury is the planet "
                              "closest to the Sun.", "answer": True},
        ItemType.short_answer: {"question": "In the solar system, which planet is closest "
                                "to the Sun?", "answers": ["Mercury"]},
        ItemType.single_choice: {"question": "In the solar system, which planet is closest "
                                 "to the Sun?", "choices": ["Mercury", "Venus", "Earth", "Mars",
                                 "Jupiter", "Saturn"], "correct": "a"},
        ItemType.multiple_choice: {"question": "In the solar system, which of these planets "
                                   "are rocky?", "choices": ["Mercury", "Venus", "Jupiter",
                                   "Saturn", "Uranus", "Neptune"], "correct": ["a", "b"]},
    },
    "cooking": {
        ItemType.true_false: {"statement": "In cooking, water boils at a lower temperature "
                              "high in the mountains.", "answer": True},
        ItemType.short_answer: {"question": "In cooking, what do you call bread that has been "
                                "toasted until crisp?", "answers": ["Toast"]},
        ItemType.single_choice: {"question": "In cooking, which ingredient makes bread dough "
                                 "rise?", "choices": ["Yeast", "Salt", "Sugar", "Butter",
                                 "Pepper", "Vinegar"], "correct": "a"},
        ItemType.multiple_choice: {"question": "In cooking, which of these are dairy "
                                   "products?", "choices": ["Cheese", "Butter", "Rice", "Bread",
                                   "Apples", "Beans"], "correct": ["a", "b"]},
    },
    "the human body": {
        ItemType.true_false: {"statement": "In the human body, the heart pumps blood through "
                              "the arteries.", "answer": True},
        ItemType.short_answer: {"question": "In the human body, which organ pumps blood?",
                                "answers": ["The heart"]},
        ItemType.single_choice: {"question": "In the human body, which organ pumps blood?",
                                 "choices": ["The heart", "The lungs", "The liver",
                                 "The stomach", "The skin", "The brain"], "correct": "a"},
        ItemType.multiple_choice: {"question": "In the human body, which of these are bones?",
                                   "choices": ["The skull", "The femur", "The heart",
                                   "The lungs", "The liver", "The skin"],
                                   "correct": ["a", "b"]},
    },
}  # fmt: skip


def example(kind: ItemType, choices: int, topic: str = "the solar system") -> str:
    """A worked answer of the item type on one of the example topics."""
    body = dict(_EXAMPLES[topic][kind])
    if "choices" in body:
        body["choices"] = body["choices"][:choices]
    explanation = f"This is a basic fact about {topic}."
    return json.dumps({**body, "explanation": explanation})


def messages(
    topic: str,
    level: Level,
    language: str,
    kind: ItemType,
    n: int,
    *,
    choices: int = 4,
    source: str | None = None,
) -> list[dict[str, str]]:
    """The prompt (template version TEMPLATE_VERSION): worked requests and answers on the
    example topics, then the request on the topic asked for (from `source`, a passage the
    teacher gave, when there is one)."""
    tongue = LANGUAGES.get(language.split("-", maxsplit=1)[0], language)

    def ask(about: str) -> str:
        return (f"Write {_KIND[kind]} about {about}. It must be about {about} and nothing "
                f"else; start it with \"In {about},\".")  # fmt: skip

    turns = [
        {
            "role": "system",
            "content": f"You write clear, correct quiz items for {level.value} learners, "
            f"in {tongue}. Answer with JSON only. `correct` names the right choice by its "
            "letter (a is the first); every choice is different.",
        }
    ]
    for shown in _EXAMPLES:
        turns += [{"role": "user", "content": ask(shown)},
                  {"role": "assistant", "content": example(kind, choices, shown)}]  # fmt: skip
    request = ask(topic)
    if source is not None:
        passage = " ".join(source.split())
        request += f" Write it from this passage, and keep to what it says: {passage}"
    return [*turns, {"role": "user", "content": request}]


def to_item(kind: ItemType, answer: dict[str, Any], n: int, language: str) -> Item:
    """The model's answer as an Item (ids `item-N`, choices `a`…, true/false `true`/`false`)."""
    explanation = " ".join(str(answer.get("explanation", "")).split())
    answer_is = ANSWER_IS.get(language.split("-", maxsplit=1)[0], ANSWER_IS["en"])
    if kind is ItemType.true_false:
        yes, no = TRUE_FALSE.get(language.split("-", maxsplit=1)[0], TRUE_FALSE["en"])
        return Item(
            id=f"item-{n}",
            type=kind,
            prompt=str(answer["statement"]).strip(),
            choices=[Choice(id="true", text=yes), Choice(id="false", text=no)],
            correct=["true" if answer["answer"] else "false"],
            feedback=_feedback(explanation, answer_is, yes if answer["answer"] else no),
        )
    if kind is ItemType.short_answer:
        return Item(
            id=f"item-{n}",
            type=kind,
            prompt=str(answer["question"]).strip(),
            correct=_distinct(str(a) for a in answer["answers"]),
            feedback=_feedback(explanation, answer_is, str(answer["answers"][0]).strip()),
        )
    choices = [
        Choice(id=CHOICE_IDS[i], text=str(t).strip()) for i, t in enumerate(answer["choices"])
    ]
    picked = answer["correct"] if isinstance(answer["correct"], list) else [answer["correct"]]
    ids = {c.id for c in choices}
    correct = sorted({str(letter) for letter in picked if str(letter) in ids})
    keyed = "; ".join(c.text for c in choices if c.id in correct)
    return Item(
        id=f"item-{n}",
        type=kind,
        prompt=str(answer["question"]).strip(),
        choices=choices,
        correct=correct,
        feedback=_feedback(explanation, answer_is, keyed),
    )


def _distinct(answers: Iterable[str]) -> list[str]:
    """Accepted answers, the same answer twice (any case or spacing) kept once, first."""
    kept: dict[str, str] = {}
    for answer in answers:
        spaced = " ".join(answer.split())
        kept.setdefault(spaced.casefold(), spaced)
    return list(kept.values())


def _feedback(explanation: str, answer_is: str, key: str) -> Feedback:
    """A right answer is told why; a wrong one is told the right answer too (the model's
    explanation alone, as both, told a wrong answer it was right)."""
    return Feedback(
        correct=explanation,
        incorrect=f"{answer_is} {key}. {explanation}".strip() if key else explanation,
    )


async def generate_item(
    completions: CompletionService,
    key: ApiKey,
    *,
    model: str,
    topic: str,
    level: Level,
    language: str,
    kind: ItemType,
    n: int,
    choices: int,
    seed: int,
    max_tokens: int,
    source: str | None = None,
) -> Item:
    """One item from the model; raises a DomainError as a completion would."""
    body = {
        "model": model,
        "messages": messages(topic, level, language, kind, n, choices=choices, source=source),
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": seed,
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": f"item_{kind.value}",
                "schema": item_schema(kind, choices, level),
                "strict": True,
            },
        },
    }
    req = parse_body(ChatCompletionRequest, body, UNSUPPORTED_CHAT)
    completed = await completions.run(req, key, ROUTE, max_tokens_limit=max_tokens)
    if completed.problems:
        raise OutputInvalid("; ".join(completed.problems))
    return to_item(kind, json.loads(completed.finished.text), n, language)


def cover_svg(title: str, subtitle: str) -> bytes:
    """A cover made from the title: colours from its hash, the title set large."""
    digest = hashlib.sha256(title.encode()).digest()
    hue = digest[0] * 360 // 256
    words, lines, line = title.split(), [], ""
    for word in words:
        if len(line) + len(word) > 22 and line:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    lines.append(line)
    text = "".join(
        f'<text x="60" y="{240 + 70 * i}" font-size="56" font-family="sans-serif" '
        f'font-weight="bold" fill="#fff">{html.escape(part)}</text>'
        for i, part in enumerate(lines[:4])
    )
    svg = (
        '<svg xmlns="http://www.w3.org/2000/svg" width="1200" height="630" viewBox="0 0 1200 630">'
        f'<rect width="1200" height="630" fill="hsl({hue},55%,32%)"/>'
        f'<circle cx="1050" cy="120" r="220" fill="hsl({(hue + 40) % 360},60%,45%)" opacity="0.6"/>'
        f"{text}"
        f'<text x="60" y="570" font-size="30" font-family="sans-serif" fill="#eee">'
        f"{html.escape(subtitle)}</text></svg>"
    )
    return svg.encode()
