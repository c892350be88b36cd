"""Validation of generated content: pure checks that fail closed.

Every rule yields one `Check` per item (and the package-wide `schema` check one more with
no item), named stably so that reports can be compared across generations:

- `schema`: the package holds `spec.items` items (one check, no item); per item, its type
  is one of `spec.item_types` and its id is not used by another item.
- `prompt_nonempty`: the prompt has some non-whitespace text.
- `prompt_length`: the stripped prompt and every stripped choice text have a length in
  characters within the level's bounds (`PROMPT_LENGTH`, `CHOICE_LENGTH`):

  ============  ==========  ==========
  level         prompt      choice
  ============  ==========  ==========
  beginner      10..200     1..80
  intermediate  10..300     1..120
  advanced      10..500     1..200
  ============  ==========  ==========

- `choices_count`: single and multiple choice items have exactly `spec.choices` choices;
  true/false items exactly two, with the ids "true" and "false"; short answers none.
- `choices_unique`: no two choices share an id, or a text once case and spacing are
  ignored.
- `answer_among_choices`: every id in `correct` names one of the item's choices (choice
  types; short answers pass as not applicable).
- `one_correct_answer`: single choice and true/false list exactly one correct id; multiple
  choice at least one and fewer than all choices, none twice; a short answer at least one
  non-empty accepted answer.
- `language`: the item's prompt and choices read as `spec.language` (its primary
  subtag), judged by `detect_language`. A text of fewer than 5 words, one with no known
  function words, and a language without a word list in `STOPWORDS` pass, each saying it
  was not judged; a text that reads as another language fails naming that language.

- `plain_text`: no text of the item (prompt, choices, accepted answers, feedback) holds
  markup: a tag (`<b>`, `</a>`, `<!--`) or an entity (`&amp;`, `&#39;`). Every export
  writes an item's text as text (an LMS would show the tags literally) and the narration
  would read them out. "3 < 5" is text and passes.
- `choices_meaningful`: no choice or accepted answer is a lone letter (unless the prompt
  is about letters or symbols, units, elements, notes: "M", "N", "O" as choices say
  nothing), an instruction to the screen
  ("Tap the buttons", "Click the box"), or "all/none of the above" (the exports shuffle
  choices that are not narrated, so "above" means nothing).
- `answer_not_in_prompt`: a short answer's accepted answer is not a phrase the question
  itself names, unless the question offers alternatives ("… a star or a planet?"):
  "What do you call turning carbon dioxide into glucose?" does not accept "glucose".
- `feedback_distinct`: the feedback for a right and for a wrong answer differ when both
  are given.
- `arithmetic`: an item asking the value of an arithmetic expression of whole numbers,
  decimals and fractions (`3/4 + 1/8`, `12 * 3`, `7 - 2.5`, the typographic times,
  division and minus signs too) has it computed here: the key must be that value (a
  number, fraction or mixed number) and no distractor may be; a true/false statement
  "expression = value" must be keyed by its truth. Items with no such expression, or
  whose key is not a number, pass saying they were not computed.

`check_on_topic` judges each item against the topic from similarities computed elsewhere
(the appliance's sentence-embedding model): `on_topic` fails an item whose prompt and
answer read as about something else (cosine similarity below the minimum; "Which planet
is closest to the Sun?" under "fractions" scores 0.05, on-topic items 0.3 to 0.8). With no
similarities (the embedding model off or loading, or a language other than English, which
the model was not trained for) every item passes, saying it was not judged.

`check_audio` checks one narration file and `report` folds checks into the package's
`ValidationReport`. Nothing here writes; `check_audio` reads a file only when given a path.
"""

from __future__ import annotations

import io
import re
import wave
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

from appliance.packages.model import Check, Item, ItemType, Level, Spec, ValidationReport

if TYPE_CHECKING:
    from collections.abc import Sequence
    from os import PathLike

CHOICE_TYPES = frozenset({ItemType.single_choice, ItemType.multiple_choice, ItemType.true_false})
TRUE_FALSE_IDS = frozenset({"true", "false"})

# Inclusive bounds in characters of the stripped text. Prompts need at least a short
# sentence; longer bounds at higher levels leave room for context and terminology.
PROMPT_LENGTH: dict[Level, tuple[int, int]] = {
    Level.beginner: (10, 200),
    Level.intermediate: (10, 300),
    Level.advanced: (10, 500),
}
CHOICE_LENGTH: dict[Level, tuple[int, int]] = {
    Level.beginner: (1, 80),
    Level.intermediate: (1, 120),
    Level.advanced: (1, 200),
}

# Narration duration bounds, in seconds, for a text of `words` words: the lower bound
# allows about 500 words a minute (faster than any voice speaks), the upper 40 words a
# minute plus two seconds of lead-in and trailing silence (slower than any voice reads).
AUDIO_MIN_SECONDS = 0.3
AUDIO_MIN_SECONDS_PER_WORD = 0.12
AUDIO_MAX_SECONDS_PER_WORD = 1.5
AUDIO_MAX_PADDING_SECONDS = 2.0

# Texts shorter than this many words are not judged: a handful of words carries too few
# function words to tell related languages apart.
LANGUAGE_MIN_WORDS = 5


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# About thirty of the most frequent function words (articles, prepositions, conjunctions,
# pronouns, auxiliaries, question words) of each language. Words shared between languages
# ("de", "la", "en", "in", "a") are kept because they are frequent in each; they count for
# every language that has them.
STOPWORDS: dict[str, frozenset[str]] = {
    "en": _words(
        "the of and to a in is it that for was on are with as be by this which what or from"
        " an not at have has how does do can why who when these its"
    ),
    "de": _words(
        "der die das und ist nicht ein eine zu den von mit sich des auf für im dem es auch"
        " welche welcher wie was sind bei oder aus wird werden einen nach am"
    ),
    "fr": _words(
        "le la les de des du un une et est en que qui dans pour pas sur au aux avec ce cette"
        " il elle sont par plus quel quelle quels ou comment pourquoi"
    ),
    "es": _words(
        "el la los las de del que y en un una es por con para se no al lo como más su sus son"
        " cuál qué cómo o este esta entre"
    ),
    "nl": _words(
        "de het een en van is in dat op te zijn met voor niet die aan er om ook als bij wat"
        " welke hoe worden wordt door naar dit deze of"
    ),
    "it": _words(
        "il lo la i gli le di del della che e è un una per in non con si sono da al alla dei"
        " come quale qual cosa questo questa nel nella"
    ),
    "pt": _words(
        "o a os as de do da dos das que e é um uma em no na para com não por se mais ao como"
        " qual quais são foi este esta pelo pela"
    ),
}

_WORD = re.compile(r"[^\W\d_]+")


@dataclass(frozen=True, slots=True)
class LanguageGuess:
    """What `detect_language` found: the best-scoring language (None when no profiled
    function word occurs or the text is too short), the words it counted, and the hits
    per language."""

    language: str | None
    words: int
    scores: dict[str, int]


def detect_language(text: str) -> LanguageGuess:
    """Guess the language of `text` by counting, for each language in `STOPWORDS`, how
    many of its words are function words of that language; the highest count wins.

    Limits: it knows only the languages in `STOPWORDS`; closely related languages (es/pt,
    nl/de) share function words, so short texts may tie or lean the wrong way; texts made
    of terms, names or numbers have few function words and tell little. It says which
    language is most likely among those it knows, never that a text is well written.
    """
    words = [w.casefold() for w in _WORD.findall(text)]
    scores = {lang: sum(w in stop for w in words) for lang, stop in STOPWORDS.items()}
    if len(words) < LANGUAGE_MIN_WORDS or not any(scores.values()):
        return LanguageGuess(None, len(words), scores)
    best = max(scores, key=lambda lang: scores[lang])
    return LanguageGuess(best, len(words), scores)


def check_items(items: Sequence[Item], spec: Spec, level: Level) -> list[Check]:
    """Every rule of this module for the package's items, in a stable order: the
    package-wide `schema` check first, then per item the rules in the order documented
    above."""
    checks = [_package_schema(items, spec)]
    id_counts = Counter(item.id for item in items)
    for item in items:
        checks += [
            _item_schema(item, spec, id_counts[item.id]),
            _prompt_nonempty(item),
            _prompt_length(item, level),
            _choices_count(item, spec),
            _choices_unique(item),
            _answer_among_choices(item),
            _one_correct_answer(item),
            _language(item, spec.language),
            _plain_text(item),
            _choices_meaningful(item),
            _answer_not_in_prompt(item),
            _feedback_distinct(item),
            _arithmetic(item),
        ]
    return checks


def topic_text(item: Item) -> str:
    """What an item is about: its prompt and its correct answers."""
    answers = [c.text for c in item.choices if c.id in item.correct] if item.choices else []
    if not item.choices:
        answers = list(item.correct)
    return " ".join([item.prompt, *answers])


def check_on_topic(
    items: Sequence[Item], similarity: Sequence[float] | None, *, minimum: float, why_not: str
) -> list[Check]:
    """`on_topic` per item; `similarity[i]` of item i's `topic_text` to the topic, or
    None when it could not be judged (`why_not` says why)."""
    if similarity is None:
        return [Check(name="on_topic", passed=True, item=i.id, detail=f"not judged: {why_not}")
                for i in items]  # fmt: skip
    return [
        Check(
            name="on_topic",
            passed=score >= minimum,
            item=item.id,
            detail=f"similarity to the topic {score:.2f} (at least {minimum:.2f})"
            + ("" if score >= minimum else "; the item is about something else"),
        )
        for item, score in zip(items, similarity, strict=True)
    ]


def check_audio(
    path_or_bytes: bytes | str | PathLike[str], *, text: str, item: str | None = None
) -> Check:
    """`audio_plausible`: the narration is a PCM WAV file the stdlib `wave` module decodes
    completely, and its duration fits the text it reads: at least
    max(0.3 s, words * 0.12 s) and at most words * 1.5 s + 2 s."""
    name = "audio_plausible"
    data = path_or_bytes if isinstance(path_or_bytes, bytes) else Path(path_or_bytes).read_bytes()
    try:
        with wave.open(io.BytesIO(data), "rb") as wav:
            frames, rate = wav.getnframes(), wav.getframerate()
            frame_size = wav.getsampwidth() * wav.getnchannels()
            complete = len(wav.readframes(frames)) == frames * frame_size
    # `wave` raises a bare RuntimeError when a chunk claims more bytes than the file holds.
    except (wave.Error, EOFError, RuntimeError) as err:
        return Check(
            name=name,
            passed=False,
            item=item,
            detail=f"The narration is not a PCM WAV file ({err}); synthesise it again as WAV.",
        )
    if rate <= 0 or not complete:
        return Check(
            name=name,
            passed=False,
            item=item,
            detail="The narration WAV is truncated or has no sample rate; synthesise it again.",
        )
    words = len(text.split())
    seconds = frames / rate
    low = max(AUDIO_MIN_SECONDS, words * AUDIO_MIN_SECONDS_PER_WORD)
    high = words * AUDIO_MAX_SECONDS_PER_WORD + AUDIO_MAX_PADDING_SECONDS
    if not low <= seconds <= high:
        return Check(
            name=name,
            passed=False,
            item=item,
            detail=(
                f"The narration lasts {seconds:.2f} s but {words} words need between "
                f"{low:.2f} s and {high:.2f} s; check the text given to the voice."
            ),
        )
    return Check(name=name, passed=True, item=item, detail=f"{seconds:.2f} s for {words} words")


def report(checks: list[Check], attempts: int) -> ValidationReport:
    """The package's report: passed when every check passed. Fails closed: a report with
    no checks at all has shown nothing and does not pass."""
    return ValidationReport(
        passed=bool(checks) and all(check.passed for check in checks),
        checks=checks,
        attempts=attempts,
    )


def _check(name: str, item: Item | None, problems: list[str], ok: str = "") -> Check:
    """A check that passes when `problems` is empty; otherwise its detail is the first
    problem (each one sentence)."""
    return Check(
        name=name,
        passed=not problems,
        item=None if item is None else item.id,
        detail=problems[0] if problems else ok,
    )


def _package_schema(items: Sequence[Item], spec: Spec) -> Check:
    problems = []
    if len(items) != spec.items:
        problems.append(
            f"The package has {len(items)} items but the spec asks for {spec.items}; "
            "generate the missing items or drop the extra ones."
        )
    return _check("schema", None, problems)


def _item_schema(item: Item, spec: Spec, id_count: int) -> Check:
    problems = []
    if item.type not in spec.item_types:
        allowed = ", ".join(t.value for t in spec.item_types)
        problems.append(
            f"Item type {item.type.value} is not among the requested types ({allowed})."
        )
    if id_count > 1:
        problems.append(f"Item id {item.id!r} is used by {id_count} items; give each its own.")
    return _check("schema", item, problems)


def _prompt_nonempty(item: Item) -> Check:
    problems = [] if item.prompt.strip() else ["The prompt is empty; write the question."]
    return _check("prompt_nonempty", item, problems)


def _prompt_length(item: Item, level: Level) -> Check:
    problems = []
    low, high = PROMPT_LENGTH[level]
    length = len(item.prompt.strip())
    if not low <= length <= high:
        problems.append(
            f"The prompt has {length} characters; a {level.value} prompt needs {low} to {high}."
        )
    low, high = CHOICE_LENGTH[level]
    for choice in item.choices:
        length = len(choice.text.strip())
        if not low <= length <= high:
            problems.append(
                f"Choice {choice.id!r} has {length} characters; a {level.value} choice "
                f"needs {low} to {high}."
            )
    return _check("prompt_length", item, problems)


def _choices_count(item: Item, spec: Spec) -> Check:
    count = len(item.choices)
    problems = []
    if item.type is ItemType.short_answer:
        if count:
            problems.append(f"A short answer has no choices but this one has {count}.")
    elif item.type is ItemType.true_false:
        ids = sorted(c.id for c in item.choices)
        if count != 2 or set(ids) != TRUE_FALSE_IDS:
            problems.append(
                f"A true/false item needs exactly the choices 'true' and 'false', not {ids}."
            )
    elif count != spec.choices:
        problems.append(f"The item has {count} choices but the spec asks for {spec.choices}.")
    return _check("choices_count", item, problems)


def _normalised(text: str) -> str:
    return " ".join(text.split()).casefold()


def _choices_unique(item: Item) -> Check:
    problems = []
    for choice_id, n in Counter(c.id for c in item.choices).items():
        if n > 1:
            problems.append(f"Choice id {choice_id!r} is used {n} times; give each its own id.")
    seen: dict[str, str] = {}
    for choice in item.choices:
        key = _normalised(choice.text)
        if key in seen:
            problems.append(
                f"Choices {seen[key]!r} and {choice.id!r} have the same text "
                f"{choice.text.strip()!r}; reword one."
            )
        else:
            seen[key] = choice.id
    return _check("choices_unique", item, problems)


def _answer_among_choices(item: Item) -> Check:
    if item.type not in CHOICE_TYPES:
        return _check("answer_among_choices", item, [], "not applicable to short answers")
    ids = {c.id for c in item.choices}
    problems = [
        f"Correct answer {answer!r} is not one of the choices {sorted(ids)}."
        for answer in item.correct
        if answer not in ids
    ]
    return _check("answer_among_choices", item, problems)


def _one_correct_answer(item: Item) -> Check:
    problems = []
    twice = sorted(a for a, n in Counter(item.correct).items() if n > 1)
    if item.type is ItemType.short_answer:
        said = Counter(_normalised(answer) for answer in item.correct if answer.strip())
        if not said:
            problems.append("A short answer needs at least one non-empty accepted answer.")
        elif said.most_common(1)[0][1] > 1:
            problems.append(
                f"Accepted answer {said.most_common(1)[0][0]!r} is listed more than once."
            )
    elif twice:
        problems.append(f"Correct answer {twice[0]!r} is listed more than once.")
    elif item.type is ItemType.multiple_choice:
        n = len(item.correct)
        if n == 0:
            problems.append("A multiple choice item needs at least one correct answer.")
        elif n >= len(item.choices):
            problems.append(
                f"All {n} choices are marked correct; a multiple choice item needs a wrong one."
            )
    elif len(item.correct) != 1:
        problems.append(
            f"A {item.type.value} item needs exactly one correct answer, not {len(item.correct)}."
        )
    return _check("one_correct_answer", item, problems)


def _language(item: Item, language: str) -> Check:
    asked = language.split("-", 1)[0].casefold()
    if asked not in STOPWORDS:
        return _check("language", item, [], f"no word list for {asked}; not checked")
    guess = detect_language(" ".join([item.prompt, *(c.text for c in item.choices)]))
    if guess.words < LANGUAGE_MIN_WORDS:
        return _check("language", item, [], "too short to tell")
    if guess.language is None:
        return _check("language", item, [], "no common function words; cannot tell")
    if guess.scores[asked] == guess.scores[guess.language]:
        return _check("language", item, [], f"reads as {asked}")
    return _check(
        "language",
        item,
        [f"The text reads as {guess.language}, not {asked}; write it in {asked}."],
    )


# A tag (opening, closing, comment, doctype) or a character entity.
_MARKUP = re.compile(
    r"<\s*[/!?]?\s*[A-Za-z][^<>]*>|<\s*/"
    r"|&(?:[A-Za-z][A-Za-z0-9]{1,31}|#[0-9]{1,7}|#[xX][0-9A-Fa-f]{1,6});"
)
_SCREEN = re.compile(
    r"\b(tap|click|press|drag|select|choose|pick)\b.*\b(button|buttons|box|boxes|option|"
    r"options|answer|answers|below|above|screen)\b",
    re.IGNORECASE,
)
_ABOVE = re.compile(r"\b(all|none|both|neither) of (the )?(above|these|them)\b", re.IGNORECASE)
# Questions whose answers may be one letter: about letters, or about symbols (units "m",
# elements "C", notes "A", variables "x", grades "B").
_LETTER_TOPIC = re.compile(
    r"\b(letters?|alphabet|spell|spelling|vowels?|consonants?|symbols?|abbreviat\w*|units?|"
    r"elements?|notes?|variables?|grades?)\b",
    re.IGNORECASE,
)


def _texts(item: Item) -> list[tuple[str, str]]:
    """Every text of an item with what it is."""
    parts = [("the prompt", item.prompt)]
    parts += [(f"choice {c.id!r}", c.text) for c in item.choices]
    if item.type is ItemType.short_answer:
        parts += [(f"accepted answer {a!r}", a) for a in item.correct]
    parts += [("the feedback", item.feedback.correct), ("the feedback", item.feedback.incorrect)]
    return parts


def _plain_text(item: Item) -> Check:
    problems = [
        f"{what.capitalize()} holds markup ({found.group(0)!r}); items are plain text: "
        "write it without tags or entities."
        for what, text in _texts(item)
        if (found := _MARKUP.search(text))
    ]
    return _check("plain_text", item, problems[:1])


def _answers(item: Item) -> list[tuple[str, str]]:
    if item.type is ItemType.short_answer:
        return [(f"Accepted answer {a!r}", a) for a in item.correct]
    if item.type is ItemType.true_false:
        return []
    return [(f"Choice {c.id!r}", c.text) for c in item.choices]


def _choices_meaningful(item: Item) -> Check:
    problems = []
    about_letters = bool(_LETTER_TOPIC.search(item.prompt))
    for what, text in _answers(item):
        bare = text.strip().strip(".!?\"'")
        if len(bare) == 1 and bare.isalpha() and not about_letters:
            problems.append(f"{what} is a lone letter; write the answer itself.")
        elif _SCREEN.search(bare):
            problems.append(f"{what} is an instruction to the screen, not an answer.")
        elif _ABOVE.search(bare):
            problems.append(
                f"{what} refers to the other choices, which are shown in another order; "
                "write an answer of its own."
            )
    return _check("choices_meaningful", item, problems)


def _answer_not_in_prompt(item: Item) -> Check:
    if item.type is not ItemType.short_answer:
        return _check("answer_not_in_prompt", item, [], "not applicable to choice items")
    prompt = f" {' '.join(_WORD.findall(item.prompt.casefold()))} "
    if " or " in prompt:
        return _check("answer_not_in_prompt", item, [], "the question offers alternatives")
    problems = []
    for answer in item.correct:
        words = " ".join(_WORD.findall(answer.casefold()))
        if words and f" {words} " in prompt:
            problems.append(
                f"Accepted answer {answer!r} is named in the question itself; a short "
                "answer must not be given away (or the key answers another question)."
            )
    return _check("answer_not_in_prompt", item, problems)


def _feedback_distinct(item: Item) -> Check:
    right, wrong = (_normalised(t) for t in (item.feedback.correct, item.feedback.incorrect))
    problems = []
    if right and wrong and right == wrong:
        problems.append(
            "The feedback for a right and a wrong answer is the same; a wrong answer "
            "should be told the right one."
        )
    return _check("feedback_distinct", item, problems)


# -- arithmetic ----------------------------------------------------------------------------

_NUMBER = r"\d+(?:\.\d+)?"
# The typographic signs models write: times, division, minus and en dash.
_SIGNS = "\u00d7\u00f7\u2212\u2013"
_OPERATOR = rf"[-+*/x{_SIGNS}]"
# An expression: a number, then at least one operator and number, parentheses allowed.
_EXPRESSION = re.compile(rf"\(?\s*{_NUMBER}\s*\)?(?:\s*{_OPERATOR}\s*\(?\s*{_NUMBER}\s*\)?)+")
_VALUE = re.compile(
    rf"^\s*(-?)\s*(?:(\d+)\s+(\d+)\s*/\s*(\d+)|({_NUMBER})\s*/\s*({_NUMBER})|({_NUMBER}))\s*$"
)
# A statement's value after its expression: "3/4 + 1/8 = 7/8", "… is 7/8", "… equals 7/8".
_STATED = re.compile(
    r"\s*(?:=|equals|is equal to|is|makes|gives)\s+(?P<value>.+?)\s*[.!]?\s*$"
    r"|\s*=\s*(?P<v2>.+?)\s*[.!]?\s*$",
    re.IGNORECASE,
)
_FRACTION = re.compile(r"\d+\s*/\s*\d+")
_OPERATION = re.compile(rf"{_NUMBER}\s*\)?\s*{_OPERATOR}\s*\(?\s*{_NUMBER}")
# What may follow the expression a question asks the value of.
_ASKED = re.compile(
    r"\s*(=|\?|\.|$|in (its )?(simplest|lowest) (form|terms)|equals?\b|is equal to)",
    re.IGNORECASE,
)
_TOKEN = re.compile(rf"{_NUMBER}|[-+*/x{_SIGNS}()]")


def evaluate(expression: str) -> Fraction | None:
    """The exact value of an arithmetic expression (+ - * /, their
    typographic signs and parentheses; / a fraction bar or division alike), or None when
    it is not one or divides by zero."""
    tokens = _TOKEN.findall(expression.replace(" ", ""))
    if "".join(tokens) != expression.replace(" ", ""):
        return None
    pos = 0

    def atom() -> Fraction:
        nonlocal pos
        if pos < len(tokens) and tokens[pos] == "(":
            pos += 1
            value = sum_()
            if pos >= len(tokens) or tokens[pos] != ")":
                raise ValueError(expression)
            pos += 1
            return value
        if pos < len(tokens) and tokens[pos][0].isdigit():
            pos += 1
            return Fraction(tokens[pos - 1])
        raise ValueError(expression)

    def product() -> Fraction:
        nonlocal pos
        value = atom()
        while pos < len(tokens) and tokens[pos] in "*/x\u00d7\u00f7":
            op = tokens[pos]
            pos += 1
            right = atom()
            value = value * right if op in "*x\u00d7" else value / right
        return value

    def sum_() -> Fraction:
        nonlocal pos
        value = product()
        while pos < len(tokens) and tokens[pos] in "+-\u2212\u2013":
            op = tokens[pos]
            pos += 1
            value = value + product() if op == "+" else value - product()
        return value

    try:
        value = sum_()
    except (ValueError, ZeroDivisionError):
        return None
    return value if pos == len(tokens) else None


def parse_value(text: str) -> Fraction | None:
    """A number as an answer states it: whole, decimal, fraction or mixed number ("1 3/4"),
    a trailing full stop allowed; None for anything else."""
    found = _VALUE.match(text.strip().rstrip("."))
    if not found:
        return None
    sign, whole, num, den, top, bottom, plain = found.groups()
    try:
        if whole is not None:
            value = Fraction(int(whole)) + Fraction(int(num), int(den))
        elif top is not None:
            value = Fraction(top) / Fraction(bottom)
        else:
            value = Fraction(plain)
    except ZeroDivisionError:
        return None
    return -value if sign else value


def _expression(prompt: str) -> tuple[str, Fraction] | None:
    """The expression the prompt asks the value of, and that value: one arithmetic
    expression with an operator besides a fraction bar ("1/2 of 10" is not one), followed
    by the end of the question ("?", "=", "in simplest form"); None otherwise, or when
    there are several."""
    found = [
        m.group(0).strip()
        for m in _EXPRESSION.finditer(prompt)
        if _OPERATION.search(_FRACTION.sub("1", m.group(0))) and _ASKED.match(prompt[m.end() :])
    ]
    if len(found) != 1:
        return None
    value = evaluate(found[0])
    return None if value is None else (found[0], value)


def _statement(prompt: str) -> tuple[str, Fraction, Fraction] | None:
    """A statement's expression, its value, and the value the statement gives it."""
    for m in _EXPRESSION.finditer(prompt):
        if not _OPERATION.search(_FRACTION.sub("1", m.group(0))):
            continue
        rest = _STATED.match(prompt[m.end() :])
        said = parse_value(rest.group("value") or rest.group("v2")) if rest else None
        value = evaluate(m.group(0).strip())
        if said is not None and value is not None:
            return m.group(0).strip(), value, said
    return None


def _arithmetic(item: Item) -> Check:  # noqa: PLR0911 - a verdict per kind of item
    name = "arithmetic"
    if item.type is ItemType.true_false:
        stated = _statement(item.prompt)
        if stated is None:
            return _check(name, item, [], "no expression and value to compute")
        expression, value, said = stated
        truth, keyed = value == said, item.correct == ["true"]
        problems = []
        if truth != keyed:
            problems.append(
                f"{expression} = {_shown(value)}, so the statement is {str(truth).lower()}, "
                f"but it is keyed {str(keyed).lower()}."
            )
        return _check(name, item, problems, f"computed: {expression} = {_shown(value)}")
    found = _expression(item.prompt)
    if found is None:
        return _check(name, item, [], "no expression to compute")
    expression, value = found
    if item.type is ItemType.short_answer:
        accepted = [(a, parse_value(a)) for a in item.correct]
        if any(v is None for _, v in accepted):
            return _check(name, item, [], "an accepted answer is not a number; not computed")
        problems = [
            f"{expression} = {_shown(value)}, not {a!r}; the accepted answer is wrong."
            for a, v in accepted
            if v != value
        ]
        return _check(name, item, problems, f"computed: {expression} = {_shown(value)}")
    values = [(c, parse_value(c.text)) for c in item.choices]
    if any(v is None for c, v in values if c.id in item.correct):
        return _check(name, item, [], "a keyed choice is not a number; not computed")
    problems = []
    for choice, v in values:
        if choice.id in item.correct and v != value:
            problems.append(
                f"{expression} = {_shown(value)}, not {choice.text!r}; the key is wrong."
            )
        elif choice.id not in item.correct and v == value:
            problems.append(
                f"{expression} = {_shown(value)}: distractor {choice.text!r} is right too."
            )
    return _check(name, item, problems, f"computed: {expression} = {_shown(value)}")


def decided_by_arithmetic(item: Item) -> str | None:
    """What was computed, when arithmetic alone decides the whole item: its `arithmetic`
    check passes having computed the key, and every answer it offers is a number, so each
    distractor was computed wrong as well; None otherwise (a model must judge it)."""
    check = _arithmetic(item)
    if not check.passed or not check.detail.startswith("computed: "):
        return None
    if any(
        parse_value(c.text) is None for c in item.choices if item.type is not ItemType.true_false
    ):
        return None
    return check.detail


def _shown(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value}"
