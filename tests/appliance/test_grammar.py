"""JSON Schema → GBNF (appliance.validation.grammar), judged by llama.cpp's own grammar
engine over the real model's vocabulary (no weights): each grammar compiles, takes the
texts that fit, refuses those that do not, and whatever a random walk through it
produces validates against the schema, formats included."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import jsonschema
import numpy as np
import pytest

from appliance.serving.engine import LlamaVocabulary
from appliance.validation.grammar import (
    GrammarBuilder,
    SchemaConversionError,
    json_schema_to_gbnf,
    pattern_rule,
)
from appliance.validation.structured import (
    SchemaUnusableError,
    json_object_output,
    json_schema_output,
)
from tests.appliance.grammar_check import Walker, accepts, compiles

if TYPE_CHECKING:
    from collections.abc import Iterator

    from appliance.state.records import ModelRecord


@pytest.fixture(scope="module")
def vocab(default_model: ModelRecord) -> Iterator[LlamaVocabulary]:
    loaded = LlamaVocabulary.load(default_model)
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def walker(vocab: LlamaVocabulary) -> Walker:
    return Walker(vocab)


OBJECT = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name"],
}
# One schema per feature; each must compile, and random walks through it must validate.
FEATURES: dict[str, dict[str, Any]] = {
    "integer-bounds": {"type": "integer", "minimum": 1, "maximum": 5},
    "integer-exclusive": {"type": "integer", "exclusiveMinimum": -10, "exclusiveMaximum": 1000},
    "integer-min-only": {"type": "integer", "minimum": 42},
    "integer-max-only-negative": {"type": "integer", "maximum": -7},
    "integer-draft4-exclusive": {"type": "integer", "minimum": 0, "exclusiveMinimum": True},
    "number-unit": {"type": "number", "minimum": 0, "maximum": 1},
    "number-exclusive": {"type": "number", "exclusiveMinimum": -1.5, "exclusiveMaximum": 2.25},
    "number-min-only": {"type": "number", "minimum": -3.75},
    "number-max-only": {"type": "number", "maximum": 0.001},
    "number-narrow": {"type": "number", "minimum": 0.1, "maximum": 0.1004},
    "string-lengths": {"type": "string", "minLength": 2, "maxLength": 6},
    "pattern-anchored": {"type": "string", "pattern": r"^[A-Z]{2}-\d{3}(-[a-z]+)?$"},
    "pattern-unanchored": {"type": "string", "pattern": r"^[0-9]+kg"},
    "pattern-quotes": {"type": "string", "pattern": r'^(a|b"c|\\)+[\s.]$'},
    "pattern-negated": {"type": "string", "pattern": r"^[^@\s]{1,8}@[^@]{1,8}$"},
    "date": {"type": "string", "format": "date"},
    "time": {"type": "string", "format": "time"},
    "date-time": {"type": "string", "format": "date-time"},
    "uuid": {"type": "string", "format": "uuid"},
    "email": {"type": "string", "format": "email"},
    "uri": {"type": "string", "format": "uri"},
    "ipv4": {"type": "string", "format": "ipv4"},
    "enum": {"enum": ["red", 2, None, {"k": [1, "two"]}, 'quo"te']},
    "const": {"const": {"a": [True, False]}},
    "any-of": {"anyOf": [{"type": "null"}, {"type": "integer", "maximum": 0}, OBJECT]},
    "one-of": {"oneOf": [{"type": "boolean"}, {"type": "string", "maxLength": 3}]},
    "all-of": {
        "allOf": [
            OBJECT,
            {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
        ]
    },
    "type-list": {"type": ["string", "null"], "maxLength": 4},
    "ref-defs": {
        "type": "object",
        "properties": {"home": {"$ref": "#/$defs/place"}, "work": {"$ref": "#/$defs/place"}},
        "required": ["home"],
        "$defs": {
            "place": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            }
        },
    },
    "recursive-ref": {
        "$ref": "#/definitions/node",
        "definitions": {
            "node": {
                "type": "object",
                "properties": {
                    "value": {"type": "integer"},
                    "next": {"$ref": "#/definitions/node"},
                },
                "required": ["value"],
                "additionalProperties": False,
            }
        },
    },
    "additional-typed": {
        "type": "object",
        "properties": {"name": {"type": "string"}},
        "additionalProperties": {"type": "integer"},
    },
    "additional-false": {**OBJECT, "additionalProperties": False},
    "required-undescribed": {"type": "object", "properties": {}, "required": ["x"]},
    "any-object": {"type": "object"},
    "array-bounds": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "tuple": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "number"}]},
    "nested": {
        "type": "object",
        "properties": {
            "people": {"type": "array", "items": OBJECT, "maxItems": 2},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
        },
        "required": ["people"],
    },
    "free-string": {"type": "string"},
    "true-schema": {},
}


def validator(schema: dict[str, Any]) -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


@pytest.mark.parametrize("schema", FEATURES.values(), ids=FEATURES.keys())
def test_each_feature_compiles_and_every_walk_validates(
    vocab: LlamaVocabulary, walker: Walker, schema: dict[str, Any]
) -> None:
    grammar = json_schema_to_gbnf(schema)
    assert compiles(vocab, grammar), grammar
    check = validator(schema)
    rng = np.random.default_rng(7)
    produced = [walker.walk(grammar, rng, max_steps=150) for _ in range(8)]
    texts = [t for t in produced if t is not None]
    assert len(texts) >= 4, produced  # most walks end: the grammar lets them
    for text in texts:
        value = json.loads(text)  # strict: a raw control character would fail here
        errors = [e.message for e in check.iter_errors(value)]
        assert not errors, (text, errors)


ACCEPTS: list[tuple[dict[str, Any], list[str], list[str]]] = [
    (
        FEATURES["integer-bounds"],
        ["1", "3", "5"],
        ["0", "6", "-1", "10", "4040307826599456", "1.0"],
    ),
    (FEATURES["integer-exclusive"], ["-9", "0", "999"], ["-10", "1000", "-11", "-0"]),
    ({"type": "integer", "minimum": -5}, ["-5", "0", "7"], ["-6", "-0", "01"]),
    (FEATURES["integer-draft4-exclusive"], ["1", "20"], ["0", "-1"]),
    (
        FEATURES["number-unit"],
        ["0", "1", "0.5", "1.0", "0.999", "0.0"],
        ["1.01", "-0.1", "2", "1.5", "1e0", "-0"],
    ),
    (
        FEATURES["number-exclusive"],
        ["-1.4", "0", "2.2", "2.24", "-1", "1"],
        ["-1.5", "2.25", "2.3", "-2", "3"],
    ),
    (FEATURES["number-min-only"], ["-3.75", "-3", "0", "123.4"], ["-3.8", "-4"]),
    (FEATURES["number-max-only"], ["0.001", "-5", "0.0005"], ["0.0011", "1"]),
    (
        FEATURES["date"],
        ['"2024-02-29"', '"2000-02-29"', '"2023-02-28"', '"0001-01-31"', '"2023-04-30"'],
        ['"2023-02-29"', '"1900-02-29"', '"2023-04-31"', '"0000-01-01"', '"2023-13-01"'],
    ),
    (
        FEATURES["date-time"],
        ['"2024-01-02T03:04:05Z"', '"2024-01-02T03:04:05.123+01:00"'],
        ['"2024-01-02 03:04:05Z"', '"2024-01-02T03:04:05"'],
    ),
    (FEATURES["pattern-anchored"], ['"AB-123"', '"XY-000-abc"'], ['"AB-12"', '"ab-123"']),
    (FEATURES["pattern-quotes"], ['"ab\\"c\\\\ "', '"a."'], ['"ab"c\\\\ "', '"a"']),
    (FEATURES["pattern-unanchored"], ['"12kg"', '"3kg net"'], ['"kg"', '"about 3kg"']),
    (FEATURES["string-lengths"], ['"ab"', '"abcdef"', '"\\n\\u0041"'], ['"a"', '"abcdefg"']),
    (FEATURES["free-string"], ['"tab\\there"'], ['"tab\there"', '"bell\x07"', '"line\nbreak"']),
    (FEATURES["email"], ['"a.b@example.org"'], ['"a@b"', '"@example.org"']),
    (FEATURES["uri"], ['"https://example.com/a/b?x=1#f"'], ['"not a uri"']),
    (FEATURES["ipv4"], ['"192.168.0.255"'], ['"256.1.1.1"', '"1.2.3"']),
    (
        FEATURES["additional-typed"],
        ['{"name": "x", "k": 1}', "{}", '{"nam": 2}', '{"names": 3}'],
        ['{"name": 1}', '{"k": "s"}'],
    ),
    (FEATURES["additional-false"], ['{"name": "x"}'], ['{"name": "x", "z": 1}']),
    (FEATURES["required-undescribed"], ['{"x": [1]}'], ["{}"]),
    (
        FEATURES["array-bounds"],
        ["[1]", "[1, 2, 3]"],
        ["[]", "[1, 2, 3, 4]"],
    ),
    (FEATURES["enum"], ['"red"', "2", "null", '{"k":[1,"two"]}', '"quo\\"te"'], ['"blue"']),
]


@pytest.mark.parametrize(
    ("schema", "good", "bad"), ACCEPTS, ids=[json.dumps(a[0])[:40] for a in ACCEPTS]
)
def test_the_grammar_takes_what_fits_and_refuses_what_does_not(
    vocab: LlamaVocabulary, schema: dict[str, Any], good: list[str], bad: list[str]
) -> None:
    grammar = json_schema_to_gbnf(schema)
    for text in good:
        assert accepts(vocab, grammar, text), (text, grammar)
    for text in bad:
        assert not accepts(vocab, grammar, text), (text, grammar)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer", "minimum": 5, "maximum": 1},
        {"type": "number", "exclusiveMinimum": 1, "maximum": 1},
        {"type": "string", "minLength": 5, "maxLength": 1},
        {"type": "array", "minItems": 3, "maxItems": 2},
        {"type": "object", "properties": {"a": False}, "required": ["a"]},
        {"allOf": [{"type": "string"}, {"type": "integer"}]},
        {"$ref": "#/$defs/missing"},
        {"$ref": "https://example.com/schema.json"},
        {"type": "frobnicate"},
        {"enum": []},
    ],
    ids=str,
)
def test_schemas_no_grammar_can_enforce_are_refused(schema: dict[str, Any]) -> None:
    with pytest.raises(SchemaConversionError):
        json_schema_to_gbnf(schema)


def test_an_untranslatable_pattern_falls_back_to_any_string_and_is_validated(
    vocab: LlamaVocabulary,
) -> None:
    schema = {"type": "string", "pattern": "^(?!admin).+$"}  # a lookahead
    structured = json_schema_output(schema)
    assert compiles(vocab, structured.grammar)
    assert accepts(vocab, structured.grammar, '"administrator"')
    assert structured.problems('"administrator"')  # ... which the validator refuses
    assert structured.problems('"root"') == []


def test_patterns_match_the_decoded_string() -> None:
    # A quote or backslash the pattern allows is written escaped, never raw.
    assert pattern_rule('^"$') == '("\\\\\\"")'
    assert pattern_rule(r"^\\$") == '("\\\\\\\\")'
    assert pattern_rule("^a+$") == '("a"+)'
    assert pattern_rule("abc") == 'char* ("abc") char*'


def test_the_builder_keeps_each_schemas_refs_apart(vocab: LlamaVocabulary) -> None:
    """Two documents may both say #/$defs/x and mean different things."""
    builder = GrammarBuilder()
    ints = builder.schema(
        "a", {"$ref": "#/$defs/x", "$defs": {"x": {"type": "integer", "maximum": 3}}}
    )
    strs = builder.schema("b", {"$ref": "#/$defs/x", "$defs": {"x": {"enum": ["s"]}}})
    builder.rule("root", f'{ints} " " {strs}')
    grammar = builder.grammar()
    assert accepts(vocab, grammar, '3 "s"')
    assert not accepts(vocab, grammar, '"s" 3')
    assert not accepts(vocab, grammar, '4 "s"')


def test_structured_output_validates_formats() -> None:
    schema = {
        "type": "object",
        "properties": {"day": {"type": "string", "format": "date"}},
        "required": ["day"],
    }
    structured = json_schema_output(schema)
    assert structured.problems('{"day": "2024-02-29"}') == []
    problems = structured.problems('{"day": "2023-02-30"}')
    assert problems
    assert problems[0].startswith("day:")
    assert "date" in problems[0]


def test_an_unenforceable_schema_is_refused_as_unusable() -> None:
    with pytest.raises(SchemaUnusableError, match="cannot be enforced"):
        json_schema_output({"type": "integer", "minimum": 2, "maximum": 1})
    with pytest.raises(SchemaUnusableError, match="not a valid JSON Schema"):
        json_schema_output({"type": 12})


def test_json_object_output_has_no_raw_control_characters(vocab: LlamaVocabulary) -> None:
    grammar = json_object_output().grammar
    assert accepts(vocab, grammar, '{"a": "x\\ny"}')
    assert not accepts(vocab, grammar, '{"a": "x\ny"}')
    assert not accepts(vocab, grammar, "[1]")
