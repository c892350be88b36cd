"""The short evaluation a node runs on a model the hub placed on it, and the chat-quality
benchmark runs on the embedded models: twelve fixed instructions (:data:`INSTRUCTIONS`),
each with two mechanical checks of the reply: on topic (a keyword of the right answer) and
in the form asked for (one word, JSON with keys a and b, three lines, just the number, ...);
followed means both.

On a node (:func:`evaluate`) each instruction is one user message, with the system prompt
and stop strings of the model's preset, greedy, at most :data:`MAX_TOKENS` tokens, at the
lowest priority (a client's request is served first); the score, with the model's load time
and memory, goes to the hub in heartbeats, where a model rollout can require a minimum.
Greedy output depends on the CPU's kernels (with AVX-512 or without): a count may move by
one or two across machines.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from appliance.serving.engine import Finished, GenerationRequest
from appliance.serving.sampling_options import Sampling
from shared import protocol

if TYPE_CHECKING:
    from appliance.serving.registry import LoadedModel

MAX_TOKENS = 96


def words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z0-9']+", text)


def lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().splitlines() if line.strip()]


Check = Callable[[str], bool]


def has(*keywords: str) -> Check:
    """Any of the keywords, as a whole word, in any case."""
    pattern = re.compile(rf"\b(?:{'|'.join(keywords)})\b", re.IGNORECASE)
    return lambda reply: pattern.search(reply) is not None


def at_most(n: int) -> Check:
    return lambda reply: 0 < len(words(reply)) <= n


def only(expected: str) -> Check:
    """Exactly this and nothing else, but for surrounding punctuation and space."""
    return lambda reply: reply.strip().strip(".!'\"") == expected


def one_word(reply: str) -> bool:
    return len(words(reply)) == 1


def three_lines(reply: str) -> bool:
    return len(lines(reply)) == 3


def json_with_keys_a_and_b(reply: str) -> bool:
    text = re.sub(r"^```(?:json)?\s*|\s*```$", "", reply.strip())  # a fenced block is JSON too
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == {"a", "b"}


FRUITS = has(
    "apples?", "bananas?", "oranges?", "pears?", "grapes?", "grapefruits?", "mangoe?s?",
    "strawberry", "strawberries", "cherry", "cherries", "peach", "peaches", "plums?",
    "kiwis?", "lemons?", "limes?", "pineapples?", "watermelons?", "melons?", "blueberry",
    "blueberries", "raspberry", "raspberries", "apricots?", "papayas?", "figs?",
    "pomegranates?", "avocados?", "coconuts?",
)  # fmt: skip


def a_fruit_a_line(reply: str) -> bool:
    return three_lines(reply) and all(FRUITS(line) for line in lines(reply))


def answers_yes_or_no(reply: str) -> bool:
    found = words(reply)
    return bool(found) and found[0].lower() in ("yes", "no")


def one_to_five(reply: str) -> bool:
    return all(re.search(rf"\b{n}\b", reply) for n in "12345")


def with_commas(reply: str) -> bool:
    return re.search(r"\b1\s*,\s*2\s*,\s*3\s*,\s*4\s*,\s*5\b", reply) is not None


def one_sentence(reply: str) -> bool:
    text = reply.strip()
    return "\n" not in text and len(re.findall(r"[.!?](?=\s|$)", text)) == 1


@dataclass(frozen=True)
class Instruction:
    """One instruction, and how its reply is judged: ``topic`` (a keyword of the right
    answer) and ``form`` (the format asked for); followed means both."""

    id: str
    prompt: str
    topic: Check
    form: Check
    passes_when: str


INSTRUCTIONS: tuple[Instruction, ...] = (
    Instruction(
        "one_word_capital",
        "What is the capital of France? Answer with one word.",
        has("paris"),
        one_word,
        "Paris, in one word",
    ),
    Instruction(
        "json_keys",
        "Reply in JSON with keys a and b, where a is 1 and b is 2. Reply with the JSON only.",
        lambda reply: '"a"' in reply and '"b"' in reply,
        json_with_keys_a_and_b,
        'names "a" and "b"; the reply parses as a JSON object with exactly those keys',
    ),
    Instruction(
        "three_fruits",
        "List three fruits, one per line, and nothing else.",
        FRUITS,
        a_fruit_a_line,
        "names a fruit; three lines, a fruit on each",
    ),
    Instruction(
        "haiku_sea",
        "Write a haiku about the sea.",
        has("seas?", "oceans?", "waves?", "tides?", "shores?", "surf"),
        three_lines,
        "about the sea (sea, ocean, waves, tide, shore, surf); three lines",
    ),
    Instruction(
        "translate_french",
        "Translate 'good morning' to French.",
        has("bonjour"),
        at_most(12),
        "bonjour; 12 words or fewer",
    ),
    Instruction(
        "number_only",
        "What is 7 plus 5? Answer with just the number.",
        has("12"),
        only("12"),
        "12, and nothing else",
    ),
    Instruction(
        "yes_or_no",
        "Is the sun a star? Answer yes or no.",
        lambda reply: answers_yes_or_no(reply) and words(reply)[0].lower() == "yes",
        answers_yes_or_no,
        "the first word is yes or no; yes",
    ),
    Instruction(
        "opposite",
        "What is the opposite of hot? Answer with one word.",
        has("cold"),
        one_word,
        "cold, in one word",
    ),
    Instruction(
        "count_commas",
        "Count from 1 to 5, separated by commas.",
        one_to_five,
        with_commas,
        "the numbers 1 to 5; as 1, 2, 3, 4, 5",
    ),
    Instruction(
        "capitals",
        "Write the word 'hello' in capital letters, and nothing else.",
        has("hello"),
        only("HELLO"),
        "hello; HELLO, and nothing else",
    ),
    Instruction(
        "bees",
        "What do bees make? Answer in a few words.",
        has("honey"),
        at_most(20),
        "honey; 20 words or fewer",
    ),
    Instruction(
        "one_sentence_cat",
        "Describe a cat in one sentence.",
        has("cats?"),
        one_sentence,
        "about a cat; one sentence, one line",
    ),
)


def judge(instruction: Instruction, reply: str) -> dict[str, Any]:
    # The instruction echoed back is not on topic: a base model repeats its prompt.
    on_topic = instruction.topic(reply.replace(instruction.prompt, ""))
    in_form = instruction.form(reply)
    return {
        "id": instruction.id,
        "followed": on_topic and in_form,
        "on_topic": on_topic,
        "form": in_form,
        "reply": reply,
    }


def tally(results: list[dict[str, Any]]) -> dict[str, int]:
    return {
        "followed": sum(r["followed"] for r in results),
        "on_topic": sum(r["on_topic"] for r in results),
        "total": len(results),
    }


async def evaluate(deployment: LoadedModel) -> protocol.Evaluation:
    """The instructions run on a loaded model, judged; with its load time and memory.
    Raises what a request to it would (a full queue, a worker gone)."""
    started = time.monotonic()
    vocab = deployment.require_vocab()
    preset = deployment.preset
    results = []
    for instruction in INSTRUCTIONS:
        messages = [{"role": "user", "content": instruction.prompt}]
        if preset is not None and preset.system_prompt:
            messages.insert(0, {"role": "system", "content": preset.system_prompt})
        tokens = vocab.tokenize(vocab.chat_template.render(messages), chat=True)
        room = deployment.n_ctx - len(tokens)
        if room < 1:
            results.append(judge(instruction, ""))
            continue
        run = deployment.submit(
            GenerationRequest(
                prompt_tokens=tuple(tokens),
                max_tokens=min(MAX_TOKENS, room),
                sampling=Sampling(temperature=0.0),
                stop=tuple(preset.stop) if preset is not None else (),
                priority=0,
            )
        )
        text = ""
        async for event in run:
            if isinstance(event, Finished):
                text = event.text
        results.append(judge(instruction, text))
    counts = tally(results)
    memory = deployment.measured_mb() or deployment.memory_mb
    return protocol.Evaluation(
        followed=counts["followed"],
        on_topic=counts["on_topic"],
        total=counts["total"],
        load_s=round(deployment.load_s or 0.0, 2),
        memory_mib=round(memory),
        eval_s=round(time.monotonic() - started, 2),
    )
