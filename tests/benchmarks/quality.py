"""Package quality: are the keys of the items a node ships right?

A fixed quality set of twelve topics, four subjects at three levels, whose facts a script
can check on its own (an oracle written here, apart from the appliance's checks): sums of
whole numbers and fractions, the capitals of countries, metric units and time, the states
of water and their changes. Each embedded model writes one three-item package per topic
(`packages.model` and so `packages.check_model`: single choice, true/false, short answer,
no narration) through a real appliance (`kvl appliance serve`, the embedding model on for
its on-topic check). For every item the oracle can read, it says whether the key is right:

- shipped items: right, wrong (`wrong_keys_shipped`: the figure that must be 0) or not
  judged (an item about something the oracle does not know);
- refused items (every attempt's, from the appliance's log: "package item refused"): the
  wrong keys the checks caught, and the right ones they refused as well;
- packages: shipped, or refused with the report (the 422 and its failed checks).

Run: ``python -m tests.benchmarks.quality [--models NAME ...] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from appliance.serving.catalog import CHAT_MODEL_NAME, DEFAULT_MODEL_NAME
from tests.benchmarks.packages import kvl, serve, stop
from tests.benchmarks.report import headline, table
from tests.benchmarks.serving import say, stamp

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "quality.json"
MODELS = (DEFAULT_MODEL_NAME, CHAT_MODEL_NAME)
SPEC = {"items": 3, "item_types": ["single_choice", "true_false", "short_answer"],
        "narration": False}  # fmt: skip
TOPICS: list[tuple[str, str, str]] = [  # (subject, level, topic)
    ("arithmetic", "beginner", "adding whole numbers"),
    ("arithmetic", "intermediate", "adding fractions"),
    ("arithmetic", "advanced", "multiplying fractions"),
    ("capitals", "beginner", "capital cities of Europe"),
    ("capitals", "intermediate", "capital cities of Asia"),
    ("capitals", "advanced", "capital cities of South America"),
    ("units", "beginner", "metric units of length"),
    ("units", "intermediate", "metric units of mass and volume"),
    ("units", "advanced", "converting units of time"),
    ("water", "beginner", "the states of water"),
    ("water", "intermediate", "the water cycle"),
    ("water", "advanced", "changes of state of water"),
]

Verdict = Literal["right", "wrong", "unjudged"]

# -- the oracle ---------------------------------------------------------------------------------

CAPITALS = {
    # Europe
    "albania": "tirana", "andorra": "andorra la vella", "austria": "vienna",
    "belarus": "minsk", "belgium": "brussels", "bosnia and herzegovina": "sarajevo",
    "bulgaria": "sofia", "croatia": "zagreb", "cyprus": "nicosia",
    "czech republic": "prague", "czechia": "prague", "denmark": "copenhagen",
    "estonia": "tallinn", "finland": "helsinki", "france": "paris", "germany": "berlin",
    "greece": "athens", "hungary": "budapest", "iceland": "reykjavik", "ireland": "dublin",
    "italy": "rome", "latvia": "riga", "liechtenstein": "vaduz", "lithuania": "vilnius",
    "luxembourg": "luxembourg", "malta": "valletta", "moldova": "chisinau",
    "monaco": "monaco", "montenegro": "podgorica", "netherlands": "amsterdam",
    "north macedonia": "skopje", "norway": "oslo", "poland": "warsaw",
    "portugal": "lisbon", "romania": "bucharest", "russia": "moscow",
    "san marino": "san marino", "serbia": "belgrade", "slovakia": "bratislava",
    "slovenia": "ljubljana", "spain": "madrid", "sweden": "stockholm",
    "switzerland": "bern", "ukraine": "kyiv", "united kingdom": "london",
    "england": "london", "scotland": "edinburgh", "wales": "cardiff",
    # Asia
    "afghanistan": "kabul", "bangladesh": "dhaka", "bhutan": "thimphu", "cambodia": "phnom penh",
    "china": "beijing", "india": "new delhi", "indonesia": "jakarta", "iran": "tehran",
    "iraq": "baghdad", "israel": "jerusalem", "japan": "tokyo", "jordan": "amman",
    "kazakhstan": "astana", "kuwait": "kuwait city", "laos": "vientiane", "lebanon": "beirut",
    "malaysia": "kuala lumpur", "mongolia": "ulaanbaatar", "myanmar": "naypyidaw",
    "nepal": "kathmandu", "north korea": "pyongyang", "oman": "muscat",
    "pakistan": "islamabad", "philippines": "manila", "qatar": "doha",
    "saudi arabia": "riyadh", "singapore": "singapore", "south korea": "seoul",
    "sri lanka": "sri jayawardenepura kotte", "syria": "damascus", "taiwan": "taipei",
    "thailand": "bangkok", "turkey": "ankara", "united arab emirates": "abu dhabi",
    "uzbekistan": "tashkent", "vietnam": "hanoi", "yemen": "sanaa",
    # South America
    "argentina": "buenos aires", "bolivia": "sucre", "brazil": "brasilia", "chile": "santiago",
    "colombia": "bogota", "ecuador": "quito", "guyana": "georgetown", "paraguay": "asuncion",
    "peru": "lima", "suriname": "paramaribo", "uruguay": "montevideo",
    "venezuela": "caracas",
}  # fmt: skip
# Other right names: a second capital, or a spelling in wide use.
ALSO = {
    "bolivia": {"la paz"}, "netherlands": {"the hague"}, "sri lanka": {"colombo"},
    "ukraine": {"kiev"}, "brazil": {"brasília"}, "colombia": {"bogotá"},
    "paraguay": {"asunción"}, "iceland": {"reykjavík"}, "moldova": {"chișinău"},
    "yemen": {"sana'a", "sana"}, "myanmar": {"nay pyi taw"}, "kazakhstan": {"nur-sultan"},
}  # fmt: skip
# Units in one base each: metres, grams, litres, seconds.
UNITS: dict[str, tuple[str, Fraction]] = {}
for names, base, factor in [
    (("millimetre", "millimeter", "mm"), "m", Fraction(1, 1000)),
    (("centimetre", "centimeter", "cm"), "m", Fraction(1, 100)),
    (("metre", "meter", "m"), "m", Fraction(1)),
    (("kilometre", "kilometer", "km"), "m", Fraction(1000)),
    (("milligram", "mg"), "g", Fraction(1, 1000)),
    (("gram", "g"), "g", Fraction(1)),
    (("kilogram", "kg"), "g", Fraction(1000)),
    (("tonne", "metric ton"), "g", Fraction(1_000_000)),
    (("millilitre", "milliliter", "ml"), "l", Fraction(1, 1000)),
    (("centilitre", "centiliter", "cl"), "l", Fraction(1, 100)),
    (("litre", "liter", "l"), "l", Fraction(1)),
    (("second", "sec"), "s", Fraction(1)),
    (("minute", "min"), "s", Fraction(60)),
    (("hour", "hr"), "s", Fraction(3600)),
    (("day",), "s", Fraction(86400)),
    (("week",), "s", Fraction(604800)),
]:
    for name in names:
        UNITS[name] = (base, factor)
_UNIT = "|".join(sorted((re.escape(u) for u in UNITS), key=len, reverse=True))
_HOW_MANY = re.compile(
    rf"how many (?P<small>{_UNIT})s? (?:are |is )?(?:there )?(?:in|make up|make|equal) "
    rf"(?:an? |one |(?P<count>\d+(?:\.\d+)?) )?(?P<big>{_UNIT})s?\b",
    re.IGNORECASE,
)
_THERE_ARE = re.compile(
    rf"(?P<value>\d+(?:\.\d+)?) (?P<small>{_UNIT})s? (?:are )?(?:in|make) "
    rf"(?:an? |one |(?P<count>\d+(?:\.\d+)?) )?(?P<big>{_UNIT})s?\b",
    re.IGNORECASE,
)
STATES = {"solid": "solid", "liquid": "liquid", "gas": "gas"}
SUBSTANCE_STATE = [  # what the prompt names, and its state
    (re.compile(r"\b(ice|snow|frost|hail)\b", re.I), "solid"),
    (re.compile(r"\b(steam|water vapou?r|vapou?r)\b", re.I), "gas"),
    (re.compile(r"\b(liquid water|rain|raindrops?)\b", re.I), "liquid"),
]
CHANGES = {  # (from, to): the change's name
    ("solid", "liquid"): "melting", ("liquid", "solid"): "freezing",
    ("liquid", "gas"): "evaporation", ("gas", "liquid"): "condensation",
    ("solid", "gas"): "sublimation", ("gas", "solid"): "deposition",
}  # fmt: skip
CHANGE_WORDS = {
    "melting": ("melt", "melts", "melting", "melted"),
    "freezing": ("freeze", "freezes", "freezing", "froze"),
    "evaporation": ("evaporation", "evaporate", "evaporates", "evaporating", "boiling", "boil"),
    "condensation": ("condensation", "condense", "condenses", "condensing"),
    "sublimation": ("sublimation", "sublimate", "sublimates"),
    "deposition": ("deposition",),
}


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s'-]", " ", text.casefold()).split()).removeprefix("the ")


def number(text: str) -> Fraction | None:
    """A number as an answer gives it ("7/8", "1 3/4", "0.5", "100 centimetres": the unit
    after it ignored), or None."""
    found = re.match(
        r"^\s*(\d+)\s+(\d+)\s*/\s*(\d+)\b|^\s*(\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)\b"
        r"|^\s*(\d+(?:\.\d+)?)\b",
        text.replace(",", ""),
    )
    if not found:
        return None
    whole, num, den, top, bottom, plain = found.groups()
    try:
        if whole is not None:
            return Fraction(int(whole)) + Fraction(int(num), int(den))
        if top is not None:
            return Fraction(top) / Fraction(bottom)
        return Fraction(plain)
    except ZeroDivisionError:
        return None


def _value(node: ast.AST) -> Fraction:
    """An arithmetic expression's exact value, read by Python's own parser (not the
    appliance's: the oracle is a second opinion)."""
    if isinstance(node, ast.Expression):
        return _value(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return Fraction(str(node.value))
    if isinstance(node, ast.BinOp):
        left, right = _value(node.left), _value(node.right)
        ops = {ast.Add: left + right, ast.Sub: left - right, ast.Mult: left * right}
        if type(node.op) in ops:
            return ops[type(node.op)]
        if isinstance(node.op, ast.Div) and right:
            return left / right
    raise ValueError("not arithmetic")


def arithmetic(prompt: str) -> tuple[Fraction, str | None] | None:
    """The value of the one expression in the prompt, and the value a statement gives it
    (after =, is, equals), or None."""
    text = prompt.replace("\u00d7", "*").replace("\u00f7", "/").replace("\u2212", "-")
    text = re.sub(r"(?<=\d)\s*x\s*(?=\d)", "*", text)
    found = re.findall(r"[\d(][\d\s.+\-*/()]*[+\-*/][\d\s.+\-*/()]*[\d)]", text)
    exprs = [e for e in found if re.search(r"\d\s*[+\-*]\s*\(?\d|\d\s*/\s*\d+\s*[+\-*/]", e)]
    if len(exprs) != 1:
        return None
    try:
        value = _value(ast.parse(exprs[0].strip(), mode="eval"))
    except (SyntaxError, ValueError):
        return None
    rest = text[text.index(exprs[0]) + len(exprs[0]) :]
    stated = re.match(r"\s*(?:=|is equal to|equals|is|makes)\s*(.+?)\s*[.!?]?\s*$", rest)
    return value, stated.group(1) if stated else None


def _countries(prompt: str) -> list[str]:
    text = f" {_norm(prompt)} "
    return [c for c in CAPITALS if f" {c} " in text]


def _capital_ok(country: str, answer: str) -> bool:
    said = _norm(answer).removesuffix(" city") if answer else ""
    names = {CAPITALS[country], *ALSO.get(country, set())}
    return said in names or said in {f"{n} city" for n in names}


def _choice_verdict(item: dict[str, Any], right: Any) -> Verdict:
    """A choice or short-answer item against `right(text) -> bool | None` (None: cannot
    tell): every key right, and (choices) every distractor not right."""
    if item["type"] == "short_answer":
        verdicts = [right(a) for a in item["correct"]]
        if any(v is None for v in verdicts):
            return "unjudged"
        return "right" if all(verdicts) else "wrong"
    keyed = [right(c["text"]) for c in item["choices"] if c["id"] in item["correct"]]
    others = [right(c["text"]) for c in item["choices"] if c["id"] not in item["correct"]]
    if any(v is None for v in keyed):
        return "unjudged"
    return "right" if all(keyed) and not any(v is True for v in others) else "wrong"


def _statement(item: dict[str, Any], truth: bool | None) -> Verdict:
    if truth is None:
        return "unjudged"
    return "right" if (item["correct"] == ["true"]) == truth else "wrong"


def judge(subject: str, item: dict[str, Any]) -> Verdict:
    """Whether the item's key is right, by the facts of its subject."""
    return JUDGES[subject](item)


def _arithmetic_verdict(item: dict[str, Any]) -> Verdict:
    found = arithmetic(item["prompt"])
    if found is None:
        return "unjudged"
    value, stated = found
    if item["type"] == "true_false":
        said = number(stated) if stated else None
        return _statement(item, None if said is None else said == value)
    return _choice_verdict(item, lambda t: None if number(t) is None else number(t) == value)


def _capitals_verdict(item: dict[str, Any]) -> Verdict:
    prompt = item["prompt"]
    countries = _countries(prompt)
    if len(countries) != 1 or "capital" not in prompt.casefold():
        return "unjudged"
    [country] = countries
    if item["type"] != "true_false":
        return _choice_verdict(item, lambda t: _capital_ok(country, t))
    names = [n for n in {CAPITALS[country], *ALSO.get(country, set())} if n != country]
    told = _norm(prompt)
    return _statement(item, any(re.search(rf"\b{re.escape(n)}\b", told) for n in names))


def _units_verdict(item: dict[str, Any]) -> Verdict:
    if item["type"] == "true_false":
        stated = _THERE_ARE.search(item["prompt"])
        ratio = _ratio(stated) if stated else None
        if stated is None or ratio is None:
            return "unjudged"
        return _statement(item, number(stated["value"]) == ratio)
    asked = _HOW_MANY.search(item["prompt"])
    value = _ratio(asked) if asked else None
    if value is None:
        return "unjudged"
    return _choice_verdict(item, lambda t: None if number(t) is None else number(t) == value)


def _water_verdict(item: dict[str, Any]) -> Verdict:
    """The state of a named form of water, or the name of a change of state."""
    prompt = item["prompt"]
    text = _norm(prompt)
    if "state" in text and _names_change(text) is None:
        named = {state for pattern, state in SUBSTANCE_STATE if pattern.search(prompt)}
        if len(named) != 1:
            return "unjudged"
        [state] = named
        if item["type"] == "true_false":
            states = {s for s in STATES if re.search(rf"\b{s}\b", text)}
            return _statement(item, None if len(states) != 1 else states == {state})
        return _choice_verdict(item, lambda t: _state_is(t, state))
    change = _change(text)
    if change is None:
        return "unjudged"
    if item["type"] == "true_false":
        said = _names_change(text)
        return _statement(item, None if said is None else said == change)
    return _choice_verdict(
        item,
        lambda t: None if _names_change(_norm(t)) is None else _names_change(_norm(t)) == change,
    )


JUDGES = {
    "arithmetic": _arithmetic_verdict,
    "capitals": _capitals_verdict,
    "units": _units_verdict,
    "water": _water_verdict,
}


def _ratio(found: re.Match[str]) -> Fraction | None:
    small, big = UNITS[found["small"].casefold()], UNITS[found["big"].casefold()]
    if small[0] != big[0]:
        return None
    count = Fraction(found["count"]) if found["count"] else Fraction(1)
    return count * big[1] / small[1]


def _state_is(text: str, state: str) -> bool | None:
    """Whether an answer names `state` (None: it names no state, or several)."""
    named = {s for s in STATES if re.search(rf"\b{s}\b", _norm(text))}
    return None if len(named) != 1 else named == {state}


def _change_is(text: str, change: str) -> bool | None:
    named = _names_change(_norm(text))
    return None if named is None else named == change


def _names_change(text: str) -> str | None:
    named = [c for c, ws in CHANGE_WORDS.items() if any(re.search(rf"\b{w}\b", text) for w in ws)]
    return named[0] if len(named) == 1 else None


def _change(text: str) -> str | None:
    """The change of state a question describes: "… when ice turns into liquid water" —
    two states named in order (from, to), by their names or their forms' names."""
    words = {"ice": "solid", "solid": "solid", "snow": "solid", "liquid": "liquid",
             "water vapour": "gas", "water vapor": "gas", "vapour": "gas", "vapor": "gas",
             "steam": "gas", "gas": "gas"}  # fmt: skip
    found = sorted(
        (m.start(), state)
        for word, state in words.items()
        for m in re.finditer(rf"\b{word}\b", text)
    )
    states: list[str] = []
    for _, state in found:
        if not states or states[-1] != state:
            states.append(state)
    if len(states) != 2 or not re.search(r"\b(turn|turns|change|changes|becomes|into|to)\b", text):
        return None
    return CHANGES.get((states[0], states[1]))


# -- the run ------------------------------------------------------------------------------------


def _ask(base: str, key: str, topic: str, level: str) -> tuple[float, int, dict[str, Any]]:
    body = {"topic": topic, "level": level, "spec": SPEC, "wait": True}
    request = urllib.request.Request(
        f"{base}/v1/packages", data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )  # fmt: skip
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=1800) as response:
            return time.perf_counter() - started, response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return time.perf_counter() - started, err.code, json.loads(err.read())


def _refused(log: Path, start: int) -> tuple[list[dict[str, Any]], int]:
    """The items the appliance refused since byte `start` of its log, and where it ends."""
    data = log.read_bytes()
    refused = [
        json.loads(line.split("package item refused: ", 1)[1])
        for line in data[start:].decode(errors="replace").splitlines()
        if "package item refused: " in line
    ]
    return refused, len(data)


def run_model(model: str, work: Path) -> dict[str, Any]:
    data = work / model
    env = {**os.environ, "KVL_DISCOVERY__ENABLED": "false", "KVL_EMBEDDINGS__THREADS": "1",
           "KVL_MODEL__N_THREADS": "2", "KVL_PACKAGES__MODEL": model}  # fmt: skip
    key = subprocess.run(
        kvl("appliance", "keys", "create", "--account", "bench", "--data-dir", str(data)),
        check=True, capture_output=True, text=True, env=env,
    ).stdout.strip()  # fmt: skip
    log = work / f"{model}.log"
    process, base = serve(data, env, log)
    packages: list[dict[str, Any]] = []
    try:
        offset = log.stat().st_size
        for subject, level, topic in TOPICS:
            say(f"quality: {model}: {topic} ({level})")
            seconds, status, answer = _ask(base, key, topic, level)
            refused, offset = _refused(log, offset)
            shipped = answer["manifest"]["items"] if status == 200 else []
            packages.append({
                "subject": subject, "level": level, "topic": topic, "status": status,
                "seconds": round(seconds, 1),
                "attempts": answer["manifest"]["validation"]["attempts"] if status == 200 else None,
                "error": answer.get("error", {}).get("message") if status != 200 else None,
                "shipped": [{"item": i, "verdict": judge(subject, i)} for i in shipped],
                "refused": [{"item": r["item"], "failed": r["failed"],
                             "verdict": judge(subject, r["item"])} for r in refused],
            })  # fmt: skip
    finally:
        stop(process)
    return {"model": model, "packages": packages, **tally(packages)}


def tally(packages: list[dict[str, Any]]) -> dict[str, Any]:
    shipped = [s["verdict"] for p in packages for s in p["shipped"]]
    refused = [r["verdict"] for p in packages for r in p["refused"]]
    wrong_shipped = shipped.count("wrong")
    caught = refused.count("wrong")
    return {
        "packages_asked": len(packages),
        "packages_shipped": sum(p["status"] == 200 for p in packages),
        "packages_refused": sum(p["status"] == 422 for p in packages),
        # anything else (a shed request, an error) is neither: the run says so
        "packages_other": sum(p["status"] not in {200, 422} for p in packages),
        "packages_confirmed": sum(
            p["status"] == 200 and all(s["verdict"] == "right" for s in p["shipped"])
            for p in packages
        ),
        "items_shipped": len(shipped),
        "shipped_right": shipped.count("right"),
        "wrong_keys_shipped": wrong_shipped,
        "shipped_unjudged": shipped.count("unjudged"),
        "items_refused": len(refused),
        "wrong_keys_caught": caught,
        "right_keys_refused": refused.count("right"),
        "refused_unjudged": refused.count("unjudged"),
        "caught_share": round(caught / (caught + wrong_shipped), 2)
        if caught + wrong_shipped
        else None,
        "seconds": round(sum(p["seconds"] for p in packages), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Content packages: are the shipped keys right?")
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="packages.model each")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result path")
    args = parser.parse_args(argv)
    started = stamp()  # the code measured: the commit as the run starts
    with tempfile.TemporaryDirectory(prefix="kvl-bench-quality-") as tmp:
        models = [run_model(model, Path(tmp)) for model in args.models]
    result = {**started, "settings": {"items": SPEC, "threads": 2}, "models": models}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    say(markdown(result))
    return 0


def markdown(result: dict[str, Any]) -> str:
    """The table docs/benchmarks.md shows, from a result."""
    rows = [
        [
            f"`{m['model']}`",
            (f"{m['packages_shipped']} of {m['packages_asked']} ({m['packages_confirmed']} "
             f"confirmed right), {m['packages_refused']} refused"
             + (f", {m['packages_other']} failed otherwise" if m.get("packages_other") else "")),
            (f"{m['shipped_right']} right, **{m['wrong_keys_shipped']} wrong**, "
             f"{m['shipped_unjudged']} not judged"),
            (f"{m['wrong_keys_caught']} wrong keys caught, {m['right_keys_refused']} right "
             f"ones refused too, {m['refused_unjudged']} not judged"),
            f"{m['seconds']:.0f} s",
        ]
        for m in result["models"]
    ]  # fmt: skip
    lines = [
        headline(result, "2 threads, 12 topics x 3 items"),
        "",
        *table(["writer and checker", "packages", "keys shipped", "items refused", "time"], rows),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
