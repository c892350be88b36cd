"""Answer verification: each item answered again by a model that does not see its key.

A key the writing model got wrong passes every check of form (checks.py): it is one of the
choices, there is one of it, it is on topic. So every item is put to a checking model as a
learner would meet it, without the key, several times (`packages.verify_samples`), and
must come out the same way each time; the package's checks fail closed on anything else:

- single choice: the model picks one choice among them shown in a new order each time, the
  key moved to another position each time (a model that always picks the first choice, or
  the one it wrote first, does not pass); every pick must be the key.
- multiple choice: every choice is judged on its own as an answer to the question; the
  keyed ones must be judged right and every distractor wrong.
- true/false: the statement is judged.
- short answer: every accepted answer is judged as an answer to the question (a key that
  does not answer it, or alternatives that contradict each other, fail).

An item that arithmetic alone decides (checks.py `arithmetic` computed its key, and every
answer it offers is a number: "What is 3/4 + 1/8?" with 7/8, 1/2, 5/8 and 1) is verified
by that computation, which is a proof where a model's answer is an opinion.

Judgements alternate their polarity ("is it correct?", then "is it wrong?"), so a model
that answers "yes" to everything is caught as surely as one that knows nothing.

With source passages (the request's `sources`), each item's key must also be supported by
one of them: the passage the embedding model finds closest to the item's question and key
(cosine at least `packages.source_min_similarity`), and the checking model's judgement,
in both polarities, that the passage says so. The check cites the passage.

A judgement is one chat completion held to a JSON schema ({"answer": "yes" | "no"} or a
letter); an answer that breaks the schema counts as a disagreement. The tokens are
charged to the requesting key's account, as the items' own.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from appliance.inference.schemas import UNSUPPORTED_CHAT, ChatCompletionRequest, parse_body
from appliance.packages.checks import decided_by_arithmetic
from appliance.packages.generate import CHOICE_IDS, ROUTE
from appliance.packages.model import Check, Item, ItemType

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from appliance.inference.completions import CompletionService
    from appliance.state.store import ApiKey

    # The embedding model's similarity of each text to an anchor (None: not computed).
    Similarity = Callable[[str, Sequence[str]], Awaitable[list[float] | None]]

CHECK = "answer_verified"
SOURCE_CHECK = "source_supported"
SYSTEM = (
    "You check quiz items for a teacher. Judge only what is asked, from what you know. "
    "Answer with JSON only."
)
YES_NO: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
MAX_TOKENS = 24


@dataclass(frozen=True, slots=True)
class Checker:
    """Who checks: the model (name or name@version) and how many times each item is put."""

    completions: CompletionService
    key: ApiKey
    model: str
    samples: int
    seed: int


def _letter_schema(n: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": list(CHOICE_IDS[:n])}},
        "required": ["answer"],
        "additionalProperties": False,
    }


async def _ask(checker: Checker, user: str, schema: dict[str, Any], seed: int) -> str | None:
    """The checking model's answer to one question (the `answer` field), or None when its
    output broke the schema."""
    body = {
        "model": checker.model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.5,
        "seed": seed,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "judgement", "schema": schema, "strict": True},
        },
    }
    req = parse_body(ChatCompletionRequest, body, UNSUPPORTED_CHAT)
    completed = await checker.completions.run(req, checker.key, ROUTE, max_tokens_limit=MAX_TOKENS)
    if completed.problems:
        return None
    try:
        answer = json.loads(completed.finished.text)["answer"]
    except (ValueError, KeyError, TypeError):
        return None
    return answer if isinstance(answer, str) else None


def pick_prompt(question: str, shown: Sequence[str]) -> str:
    """A single-choice item as the checker sees it: no key, the choices in the order given."""
    lines = "".join(f"{CHOICE_IDS[i]}) {text}\n" for i, text in enumerate(shown))
    return (
        f"Question: {question}\nChoices:\n{lines}"
        "Which choice answers the question correctly? Give its letter."
    )


def judge_prompt(question: str, answer: str, *, positive: bool) -> str:
    """One proposed answer to judge, asked as "correct?" or as "wrong?"."""
    asked = "correct" if positive else "wrong"
    return (
        f"Question: {question}\nProposed answer: {answer}\n"
        f"Is the proposed answer {asked}? Answer yes or no."
    )


def statement_prompt(statement: str, *, positive: bool) -> str:
    asked = "true" if positive else "false"
    return f"Statement: {statement}\nIs the statement {asked}? Answer yes or no."


def support_prompt(passage: str, claim: str, *, positive: bool) -> str:
    asked = (
        "Does the passage say that the answer is right"
        if positive
        else "Does the passage leave the answer unsupported or contradict it"
    )
    return f"Passage: {passage}\nQuestion and answer: {claim}\n{asked}? Answer yes or no."


def orders(n: int, key: int, samples: int, seed: int) -> list[list[int]]:
    """`samples` orders of n choices (indices), the key at another position in each (round
    the positions from a seeded start), the others shuffled."""
    rng = random.Random(seed)  # noqa: S311 - an order to show, not a secret
    start = rng.randrange(n)
    result = []
    for s in range(samples):
        others = [i for i in range(n) if i != key]
        rng.shuffle(others)
        others.insert((start + s) % n, key)
        result.append(others)
    return result


def _verdict(item: Item, detail: str, *, passed: bool) -> Check:
    """The item's `answer_verified` check."""
    return Check(name=CHECK, passed=passed, item=item.id, detail=detail)


def _both_ways(ask: Callable[..., str], *, yes: bool, samples: int) -> list[tuple[str, bool]]:
    """`samples` questions asked in turn as "is it so?" and as "is it not?" (`ask(positive=
    …)`), each with whether the answer that agrees with the key (`yes`: it is so) is "yes"."""
    return [(ask(positive=s % 2 == 0), yes == (s % 2 == 0)) for s in range(samples)]


async def _judged(checker: Checker, prompts: Sequence[tuple[str, bool]], seed: int) -> list[bool]:
    """Per (prompt, expected yes) whether the checker answered as expected."""
    verdicts = []
    for i, (prompt, yes) in enumerate(prompts):
        answer = await _ask(checker, prompt, YES_NO, seed + i)
        verdicts.append(answer == ("yes" if yes else "no"))
    return verdicts


async def verify_item(checker: Checker, item: Item, seed: int) -> Check:
    """`answer_verified` for one item: passed only when every one of the checker's answers
    agrees with the item's key (or arithmetic alone decides the item)."""
    computed = decided_by_arithmetic(item)
    if computed is not None:  # a proof, not an opinion: no model is asked
        detail = f"{computed}: the key and every other answer computed, no model asked"
        return _verdict(item, detail, passed=True)
    if item.type is ItemType.single_choice:
        return await _verify_pick(checker, item, seed)
    if item.type is ItemType.true_false:
        return await _verify_statement(checker, item, seed)
    return await _verify_answers(checker, item, seed)


async def _verify_pick(checker: Checker, item: Item, seed: int) -> Check:
    """A single choice item: the key picked in every order."""
    samples, by = checker.samples, f"checked by {checker.model}"
    texts = [c.text for c in item.choices]
    key = next(i for i, c in enumerate(item.choices) if c.id in item.correct)
    picked: list[str] = []
    for s, order in enumerate(orders(len(texts), key, samples, seed)):
        letter = await _ask(
            checker,
            pick_prompt(item.prompt, [texts[i] for i in order]),
            _letter_schema(len(texts)),
            seed + s,
        )
        index = CHOICE_IDS.find(letter) if letter and len(letter) == 1 else -1
        picked.append(texts[order[index]] if 0 <= index < len(order) else "(no answer)")
    agree = sum(text == texts[key] for text in picked)
    if agree == samples:
        detail = f"{agree}/{samples} picks, each in another order, chose the key ({by})"
        return _verdict(item, detail, passed=True)
    others = sorted({t for t in picked if t != texts[key]})
    return _verdict(
        item,
        (
            f"Answered without its key, the item got {agree}/{samples} picks of the key "
            f"{texts[key]!r} (others: {', '.join(map(repr, others))}; {by}); the key or "
            "the choices are doubtful: write the item again."
        ),
        passed=False,
    )


async def _verify_statement(checker: Checker, item: Item, seed: int) -> Check:
    """A true/false statement: judged as keyed, asked both ways."""
    samples, by = checker.samples, f"checked by {checker.model}"
    truth = item.correct == ["true"]
    prompts = _both_ways(partial(statement_prompt, item.prompt), yes=truth, samples=samples)
    agree = sum(await _judged(checker, prompts, seed))
    if agree == samples:
        detail = f"judged {'true' if truth else 'false'} {agree}/{samples} times ({by})"
        return _verdict(item, detail, passed=True)
    return _verdict(
        item,
        (
            f"The statement is keyed {'true' if truth else 'false'} but only {agree} of "
            f"{samples} judgements agreed ({by}); write the item again."
        ),
        passed=False,
    )


async def _verify_answers(checker: Checker, item: Item, seed: int) -> Check:
    """Multiple choice: every choice judged; short answer: every accepted answer judged."""
    samples, by = checker.samples, f"checked by {checker.model}"
    if item.type is ItemType.multiple_choice:
        proposals = [(c.text, c.id in item.correct) for c in item.choices]
    else:
        proposals = [(answer, True) for answer in item.correct]
    wrong: list[str] = []
    for p, (text, right) in enumerate(proposals):
        prompts = _both_ways(partial(judge_prompt, item.prompt, text), yes=right, samples=samples)
        verdicts = await _judged(checker, prompts, seed + 101 * p)
        if not all(verdicts):
            wrong.append(
                f"{text!r} ({'keyed right' if right else 'a distractor'}, "
                f"{sum(verdicts)}/{samples} judgements agreed)"
            )
    if not wrong:
        judged = len(proposals) * samples
        detail = f"{judged} judgements of {len(proposals)} answers agreed with the key ({by})"
        return _verdict(item, detail, passed=True)
    return _verdict(
        item,
        (
            f"Judged without its key, the item's answers disagree with it: {'; '.join(wrong)} "
            f"({by}); write the item again."
        ),
        passed=False,
    )


async def verify_sources(
    checker: Checker,
    item: Item,
    sources: Sequence[str],
    similarity: Similarity | None,
    *,
    minimum: float,
    seed: int,
) -> Check:
    """`source_supported`: the passage closest to the item's question and key (the
    embedding model's cosine, at least `minimum`) supports the key in the checker's
    judgement, asked both ways. Fails closed when no similarity can be computed."""
    claim = _claim(item)
    scores = await similarity(claim, sources) if similarity is not None else None
    if scores is None:
        return Check(
            name=SOURCE_CHECK,
            passed=False,
            item=item.id,
            detail="The sources could not be compared (the embedding model is off or not "
            "loaded); the item's key is not shown to be supported.",
        )
    best = max(range(len(sources)), key=lambda i: scores[i])
    cited = f"source {best + 1} ({scores[best]:.2f}): {_excerpt(sources[best])!r}"
    if scores[best] < minimum:
        return Check(
            name=SOURCE_CHECK,
            passed=False,
            item=item.id,
            detail=f"No source is close to the item (best: {cited}; at least {minimum:.2f} "
            "needed); write it from the sources.",
        )
    prompts = _both_ways(
        partial(support_prompt, sources[best], claim), yes=True, samples=max(2, checker.samples)
    )
    verdicts = await _judged(checker, prompts, seed + 7)
    if all(verdicts):
        return Check(
            name=SOURCE_CHECK,
            passed=True,
            item=item.id,
            detail=f"supported by {cited} (checked by {checker.model})",
        )
    return Check(
        name=SOURCE_CHECK,
        passed=False,
        item=item.id,
        detail=f"The closest passage, {cited}, does not support the key in "
        f"{len(verdicts) - sum(verdicts)} of {len(verdicts)} judgements (checked by "
        f"{checker.model}); write the item from the sources.",
    )


def _claim(item: Item) -> str:
    """The item's question with its key, as a sentence to find support for."""
    if item.type is ItemType.true_false:
        return f"{item.prompt} ({'true' if item.correct == ['true'] else 'false'})"
    keys = [c.text for c in item.choices if c.id in item.correct] or item.correct[:1]
    return f"{item.prompt} Answer: {'; '.join(keys)}"


def _excerpt(text: str, limit: int = 80) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


async def verify(
    checker: Checker,
    items: Sequence[Item],
    *,
    sources: Sequence[str] = (),
    similarity: Similarity | None = None,
    source_min_similarity: float = 0.0,
) -> list[Check]:
    """Every item's `answer_verified` (and `source_supported` with sources), in order.
    Raises what a completion raises (a full queue, a model gone): the package fails as
    its generation would."""
    checks = []
    for n, item in enumerate(items):
        seed = checker.seed + 1009 * n
        checks.append(await verify_item(checker, item, seed))
        if sources:
            checks.append(
                await verify_sources(
                    checker,
                    item,
                    sources,
                    similarity,
                    minimum=source_min_similarity,
                    seed=seed,
                )
            )
    return checks
