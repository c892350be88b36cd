"""`response_format` → a GBNF grammar for decoding, and a check of the finished output.

llama.cpp and llama-cpp-python both fail open on structured output (a schema they cannot
convert silently becomes "any JSON"; output cut by max_tokens is returned as is). Here it
fails closed: a schema we cannot enforce is refused before generation, and output is only
returned as valid after it parses and validates against the schema, formats included
(``date``, ``date-time``, ``uri``... through jsonschema's checker for the schema's draft).
The grammar comes from appliance.validation.grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from appliance.validation.grammar import SchemaConversionError, json_schema_to_gbnf

# Any JSON object, with the converter's string rule (no raw control characters).
JSON_OBJECT_GBNF = json_schema_to_gbnf({"type": "object"})


class SchemaUnusableError(ValueError):
    """The requested JSON Schema is invalid or cannot be turned into a grammar."""


@dataclass(frozen=True)
class StructuredOutput:
    kind: Literal["json_object", "json_schema"]
    grammar: str
    schema: dict[str, Any] | None = None
    name: str | None = None
    _validator: Any = field(default=None, compare=False, repr=False)

    def problems(self, text: str) -> list[str]:
        """Why ``text`` is not valid output (an empty list when it is)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            return [f"not valid JSON: {err.msg} at position {err.pos}"]
        if self.kind == "json_object":
            return [] if isinstance(value, dict) else ["the output is not a JSON object"]
        found = sorted(self._validator.iter_errors(value), key=lambda e: list(e.absolute_path))
        return [
            f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in found[:10]
        ]


def json_object_output() -> StructuredOutput:
    return StructuredOutput(kind="json_object", grammar=JSON_OBJECT_GBNF)


def json_schema_output(schema: dict[str, Any], name: str | None = None) -> StructuredOutput:
    # jsonschema (about 9 MiB) on the first request with a schema, not in every gateway.
    import jsonschema  # noqa: PLC0415
    from jsonschema.exceptions import SchemaError  # noqa: PLC0415

    try:
        validator_cls = jsonschema.validators.validator_for(schema)
        validator_cls.check_schema(schema)
    except SchemaError as err:
        raise SchemaUnusableError(f"not a valid JSON Schema: {err.message}") from err
    try:
        grammar = json_schema_to_gbnf(schema)
    except SchemaConversionError as err:
        raise SchemaUnusableError(f"the schema cannot be enforced while decoding: {err}") from err
    return StructuredOutput(
        kind="json_schema",
        grammar=grammar,
        schema=schema,
        name=name,
        # Formats are annotations unless a checker is given; the draft's own checker knows
        # which formats that draft defines.
        _validator=validator_cls(schema, format_checker=validator_cls.FORMAT_CHECKER),
    )
