"""The quality benchmark's oracle (tests/benchmarks/quality.py): it must call a right key
right, a wrong key wrong, and what it cannot read not judged; its figure `wrong_keys_shipped`
is only as good as this."""

from __future__ import annotations

from typing import Any

import pytest

from tests.benchmarks.quality import judge


def _choice(prompt: str, choices: list[str], key: int) -> dict[str, Any]:
    return {"type": "single_choice", "prompt": prompt, "correct": ["abcd"[key]],
            "choices": [{"id": "abcd"[i], "text": t} for i, t in enumerate(choices)]}  # fmt: skip


def _statement(prompt: str, *, true: bool) -> dict[str, Any]:
    return {"type": "true_false", "prompt": prompt, "choices": [],
            "correct": ["true" if true else "false"]}  # fmt: skip


def _short(prompt: str, *answers: str) -> dict[str, Any]:
    return {"type": "short_answer", "prompt": prompt, "choices": [], "correct": list(answers)}


@pytest.mark.parametrize(
    ("subject", "item", "verdict"),
    [
        ("arithmetic", _choice("What is 3/4 + 1/8?", ["7/8", "1", "5/8", "4/12"], 0), "right"),
        ("arithmetic", _choice("What is 3/4 + 1/8?", ["7/8", "1", "5/8", "4/12"], 3), "wrong"),
        ("arithmetic", _choice("What is 3/4 + 1/8?", ["7/8", "0.875", "5/8", "1"], 0), "wrong"),
        ("arithmetic", _statement("In sums, 12 + 30 = 42.", true=True), "right"),
        ("arithmetic", _statement("In sums, 12 + 30 = 43.", true=True), "wrong"),
        ("arithmetic", _short("How do you add whole numbers?", "carefully"), "unjudged"),
        (
            "capitals",
            _choice("What is the capital of France?", ["Paris", "Lyon", "Nice", "Lille"], 0),
            "right",
        ),
        (
            "capitals",
            _choice(
                "What is the capital of Australia?", ["Sydney", "Canberra", "Perth", "Hobart"], 0
            ),
            "unjudged",
        ),  # not in the quality set's tables
        ("capitals", _short("Which city is the capital of Bolivia?", "La Paz", "Sucre"), "right"),
        ("capitals", _statement("Lyon is the capital of France.", true=True), "wrong"),
        ("units", _short("How many centimetres are in a metre?", "100"), "right"),
        ("units", _short("How many minutes are in 2 hours?", "60"), "wrong"),
        ("units", _statement("There are 1000 grams in a kilogram.", true=True), "right"),
        ("water", _short("What state of matter is ice?", "solid"), "right"),
        ("water", _short("What state of matter is ice?", "liquid"), "wrong"),
        (
            "water",
            _short("What is it called when water vapour turns into liquid?", "condensation"),
            "right",
        ),
        (
            "water",
            _statement("When ice turns into liquid water it is called freezing.", true=True),
            "wrong",
        ),
    ],
)
def test_the_oracle_judges_keys_by_the_facts(
    subject: str, item: dict[str, Any], verdict: str
) -> None:
    assert judge(subject, item) == verdict
