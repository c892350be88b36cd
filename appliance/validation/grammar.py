"""JSON Schema → GBNF, the grammar llama.cpp's sampler enforces while decoding.

A port of llama.cpp's JSON Schema converter (common/json-schema.cpp and
common/json-schema-to-grammar.cpp as vendored in llama-cpp-python 0.3.36; upstream's
examples/json_schema_to_grammar.py is its Python twin), trimmed to what the appliance uses
and typed. llama-cpp-python's own bundled converter predates most of it: no numeric bounds,
and a string rule that let raw control characters into JSON strings.

Where this goes beyond upstream, so the grammar's language stays inside the schema's:
numbers take their bounds (upstream bounds integers only); dates are real calendar dates
(no 02-30, leap years exact); email, uri and ipv4 formats; a pattern is matched on the
decoded string, so every character a pattern allows is written as JSON would (quotes,
backslashes and control characters escaped, never raw), ``\\d \\w \\s`` and unanchored
patterns are supported; an object's required property that it does not list is still
produced; ``allOf`` of one schema is that schema. What the grammar does not enforce (e.g.
``multipleOf``, ``uniqueItems``, a pattern it cannot translate) the validator still checks.

Upstream's licence, for the ported parts:

    MIT License

    Copyright (c) 2023-2026 The ggml authors

    Permission is hereby granted, free of charge, to any person obtaining a copy
    of this software and associated documentation files (the "Software"), to deal
    in the Software without restriction, including without limitation the rights
    to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
    copies of the Software, and to permit persons to whom the Software is
    furnished to do so, subject to the following conditions:

    The above copyright notice and this permission notice shall be included in all
    copies or substantial portions of the Software.

    THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
    IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
    FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
    AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
    LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
    OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
    SOFTWARE.
"""

from __future__ import annotations

import json
import math
import re
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from typing import Any

# llama.cpp refuses a repetition count above this (MAX_REPETITION_THRESHOLD).
MAX_REPETITION = 2000
# Digits after the decimal point a number may have (upstream's decimal-part).
FRACTION_DIGITS = 16

# Whitespace between tokens, bounded so a model cannot run away in it (upstream's).
SPACE_RULE = '| " " | "\\n"{1,2} [ \\t]{0,20}'

_PRIMITIVES: dict[str, tuple[str, tuple[str, ...]]] = {
    "boolean": ('("true" | "false")', ()),
    "decimal-part": ("[0-9]{1,16}", ()),
    "integral-part": ("[0] | [1-9] [0-9]{0,15}", ()),
    "number": (
        '("-"? integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)?',
        ("integral-part", "decimal-part"),
    ),
    "integer": ('("-"? integral-part)', ("integral-part",)),
    "value": (
        "object | array | string | number | boolean | null",
        ("object", "array", "string", "number", "boolean", "null"),
    ),
    "object": (
        '"{" space ( string ":" space value ("," space string ":" space value)* )? space "}"',
        ("string", "value"),
    ),
    "array": ('"[" space ( value ("," space value)* )? space "]"', ("value",)),
    # JSON forbids raw control characters in strings: only escapes.
    "char": ('[^"\\\\\\x7F\\x00-\\x1F] | [\\\\] (["\\\\bfnrt] | "u" [0-9a-fA-F]{4})', ()),
    "string": ('"\\"" char* "\\""', ("char",)),
    "null": ('"null"', ()),
}

_LEAP_YY = "[02468] [48] | [2468] [0] | [13579] [26]"  # two digits divisible by 4, not 00
_FORMATS: dict[str, tuple[str, tuple[str, ...]]] = {
    # Years 0001-9999 (Python's date and RFC 3339 have no year 0); days per month, 02-29
    # only in leap years.
    "date-year": ('[1-9] [0-9]{3} | "0" ([1-9] [0-9]{2} | "0" ([1-9] [0-9] | "0" [1-9]))', ()),
    "date-leap-year": (f"[0-9]{{2}} ({_LEAP_YY}) | ({_LEAP_YY}) [0] [0]", ()),
    "date": (
        (
            'date-year "-" ( ("0" [13578] | "1" [02]) "-" ("0" [1-9] | [12] [0-9] | "3" [01])'
            ' | ("0" [469] | "11") "-" ("0" [1-9] | [12] [0-9] | "30")'
            ' | "02-" ("0" [1-9] | "1" [0-9] | "2" [0-8]) ) | date-leap-year "-02-29"'
        ),
        ("date-year", "date-leap-year"),
    ),
    "time": (
        (
            '([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{3} )?'
            ' ( "Z" | ( "+" | "-" ) ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )'
        ),
        (),
    ),
    "date-time": ('date "T" time', ("date", "time")),
    "uuid": (
        (
            '[0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4}'
            ' "-" [0-9a-fA-F]{12}'
        ),
        (),
    ),
    # A dot-atom address, the common subset of RFC 5321 (bounded: no runaway addresses).
    "email-atom": ("[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]{1,64}", ()),
    "email-label": ("[A-Za-z0-9] [A-Za-z0-9-]{0,62}", ()),
    "email": (
        (
            'email-atom ("." email-atom){0,8} "@" email-label ("." email-label){0,6}'
            ' "." [A-Za-z]{2,24}'
        ),
        ("email-atom", "email-label"),
    ),
    # An absolute URI with an authority (RFC 3986's URI, the usual http(s)-like subset).
    "uri-pchar": ('[A-Za-z0-9._~!$&\'()*+,;=:@-] | "%" [0-9A-Fa-f]{2}', ()),
    "uri": (
        (
            '[A-Za-z] [A-Za-z0-9+.-]{0,31} "://" [A-Za-z0-9] [A-Za-z0-9.-]{0,252}'
            ' (":" [0-9]{1,5})? ("/" uri-pchar*)* ("?" (uri-pchar | [/?])*)?'
            ' ("#" (uri-pchar | [/?])*)?'
        ),
        ("uri-pchar",),
    ),
    "ipv4-octet": ('[0-9] | [1-9] [0-9] | "1" [0-9]{2} | "2" [0-4] [0-9] | "25" [0-5]', ()),
    "ipv4": ('ipv4-octet "." ipv4-octet "." ipv4-octet "." ipv4-octet', ("ipv4-octet",)),
}
_FORMAT_ALIASES = {f"uuid{n}": "uuid" for n in range(1, 6)}
STRING_FORMATS = frozenset(("date", "time", "date-time", "uuid", "email", "uri", "ipv4"))

_RESERVED = frozenset(("root", "space", "dot", *_PRIMITIVES, *_FORMATS))
_INVALID_RULE_CHARS = re.compile(r"[^a-zA-Z0-9-]+")
_LITERAL_ESCAPE = re.compile(r'[\r\n"\\]')
_LITERAL_ESCAPES = {"\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}
_PLACEHOLDER = "\0"  # a rule name reserved while its body is built ($ref cycles)


class SchemaConversionError(ValueError):
    """The schema cannot be turned into a grammar (contradictory, or not a schema)."""


def literal(text: str) -> str:
    """A GBNF literal matching ``text`` exactly."""
    return '"' + _LITERAL_ESCAPE.sub(lambda m: _LITERAL_ESCAPES[m.group(0)], text) + '"'


def json_schema_to_gbnf(schema: dict[str, Any] | bool) -> str:
    """The grammar (start rule ``root``) of the JSON texts that fit ``schema``."""
    builder = GrammarBuilder()
    builder.schema("", schema)
    return builder.grammar()


def build_repetition(item: str, min_items: int, max_items: int | None, sep: str = "") -> str:
    """``item`` repeated min..max times (max None: unbounded), ``sep`` between (upstream's)."""
    if max_items == 0:
        return ""
    if min_items == 0 and max_items == 1:
        return f"{item}?"
    if not sep:
        if min_items == 1 and max_items is None:
            return f"{item}+"
        if min_items == 0 and max_items is None:
            return f"{item}*"
        return f"{item}{{{min_items},{max_items if max_items is not None else ''}}}"
    rest = build_repetition(
        f"({sep} {item})",
        min_items - 1 if min_items > 0 else 0,
        max_items - 1 if max_items is not None else None,
    )
    result = f"{item} {rest}"
    return f"({result})?" if min_items == 0 else result


class GrammarBuilder:
    """Rules for several schemas in one grammar (the tool-call formats combine them).

    Each :meth:`schema` call is its own document: its ``$ref``s resolve inside it.
    """

    def __init__(self) -> None:
        self._rules: dict[str, str] = {"space": SPACE_RULE}
        self._refs: dict[tuple[int, str], str] = {}
        self._documents: list[Any] = []

    # -- the public surface -------------------------------------------------------------

    def schema(self, name: str, schema: dict[str, Any] | bool) -> str:
        """The name of a rule for one JSON value fitting ``schema`` ("" names it root)."""
        self._documents.append(schema)
        return self._visit(schema, name, len(self._documents) - 1)

    def rule(self, name: str, body: str) -> str:
        """Add ``name ::= body`` (renamed if the name is taken by another body)."""
        return self._add_rule(name, body)

    def primitive(self, name: str) -> str:
        """A built-in rule (``string``, ``value``, ``space``, ...) and what it needs."""
        if name == "space":
            return name
        return self._add_builtin(name)

    def grammar(self) -> str:
        if "root" not in self._rules:
            raise SchemaConversionError("the grammar has no root rule")
        return "".join(f"{name} ::= {body}\n" for name, body in sorted(self._rules.items()))

    # -- rules ----------------------------------------------------------------------------

    def _add_rule(self, name: str, body: str) -> str:
        key = _INVALID_RULE_CHARS.sub("-", name)
        existing = self._rules.get(key)
        if existing is not None and existing not in (body, _PLACEHOLDER):
            i = 0
            while self._rules.get(f"{key}{i}") not in (None, body):
                i += 1
            key = f"{key}{i}"
        self._rules[key] = body
        return key

    def _add_builtin(self, name: str, as_name: str | None = None) -> str:
        body, deps = _PRIMITIVES.get(name) or _FORMATS[name]
        key = self._add_rule(as_name or name, body)
        for dep in deps:
            if dep not in self._rules:
                self._add_builtin(dep)
        return key

    # -- schemas --------------------------------------------------------------------------

    def _visit(self, schema: Any, name: str, doc: int) -> str:  # noqa: PLR0911, PLR0912
        rule_name = f"{name}-" if name in _RESERVED else (name or "root")
        sub = f"{name}-" if name else ""
        if schema is True or schema == {}:
            return self._add_rule(rule_name, self._add_builtin("value"))
        if schema is False:
            raise SchemaConversionError("the schema `false` admits no value")
        if not isinstance(schema, dict):
            raise SchemaConversionError("a schema must be an object or a boolean")

        if "$ref" in schema:
            return self._add_rule(rule_name, self._resolve_ref(schema["$ref"], doc))
        for key in ("oneOf", "anyOf"):
            if key in schema:
                alternatives = _schemas(schema[key], key)
                return self._add_rule(
                    rule_name,
                    " | ".join(
                        self._visit(alt, f"{name}{'-' if name else 'alternative-'}{i}", doc)
                        for i, alt in enumerate(alternatives)
                    ),
                )
        kind = schema.get("type")
        if isinstance(kind, list):
            if not kind:
                raise SchemaConversionError("type must not be an empty list")
            return self._add_rule(
                rule_name,
                " | ".join(self._visit({**schema, "type": t}, f"{sub}{t}", doc) for t in kind),
            )
        if "const" in schema:
            return self._add_rule(rule_name, _constant(schema["const"]))
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaConversionError("enum must be a non-empty list")
            return self._add_rule(rule_name, "(" + " | ".join(map(_constant, values)) + ")")
        if kind is not None and not isinstance(kind, str):
            raise SchemaConversionError("type must be a string or a list of strings")

        has_properties = "properties" in schema or (
            "additionalProperties" in schema and schema["additionalProperties"] is not True
        )
        if kind is None:
            # Without a type the structural keywords decide, in upstream's order.
            if has_properties:
                kind = "object"
            elif "allOf" in schema:
                return self._visit_all_of(schema["allOf"], name, rule_name, doc)
            elif "items" in schema or "prefixItems" in schema:
                kind = "array"
            elif any(k in schema for k in ("pattern", "minLength", "maxLength", "format")):
                kind = "string"
            elif any(k in schema for k in ("minimum", "maximum")) or any(
                k in schema for k in ("exclusiveMinimum", "exclusiveMaximum")
            ):
                kind = "number"
            else:
                return self._add_rule(rule_name, self._add_builtin("value"))
        if kind in ("object", "string") and "allOf" in schema and not has_properties:
            return self._visit_all_of(schema["allOf"], name, rule_name, doc)
        if kind == "object":
            return self._visit_object(schema, name, rule_name, doc)
        if kind == "array":
            return self._visit_array(schema, sub, rule_name, doc)
        if kind == "string":
            return self._visit_string(schema, rule_name)
        if kind == "integer":
            low, high = _integer_bounds(schema)
            if low is None and high is None:
                return self._primitive(rule_name, "integer")
            if low is not None and high is not None and low > high:
                raise SchemaConversionError(f"no integer is in [{low}, {high}]")
            return self._add_rule(rule_name, "(" + _int_range(low, high) + ")")
        if kind == "number":
            bounds = _number_bounds(schema)
            if bounds is None:
                return self._primitive(rule_name, "number")
            return self._add_rule(rule_name, "(" + _number_range(*bounds) + ")")
        if kind in ("boolean", "null"):
            return self._primitive(rule_name, kind)
        raise SchemaConversionError(f"unrecognised type {kind!r}")

    def _primitive(self, rule_name: str, kind: str) -> str:
        return self._add_builtin(kind, "root" if rule_name == "root" else None)

    def _resolve_ref(self, ref: Any, doc: int) -> str:
        known = self._refs.get((doc, ref))
        if known is not None:
            return known
        target = self._ref_target(ref, doc)
        # Reserve the name first: a cycle back to this $ref refers to it.
        name = self._add_rule("ref" + _INVALID_RULE_CHARS.sub("-", ref[1:]), _PLACEHOLDER)
        self._refs[(doc, ref)] = name
        body = self._visit(target, name, doc)
        if body != name:
            self._rules[name] = body
        return name

    def _visit_all_of(self, parts: Any, name: str, rule_name: str, doc: int) -> str:
        components = _schemas(parts, "allOf")
        if len(components) == 1:
            return self._add_rule(rule_name, self._visit(components[0], name, doc))
        properties: list[tuple[str, Any]] = []
        required: set[str] = set()
        enum_counts: dict[str, int] = {}
        objects = 0

        def add(component: Any, is_required: bool) -> None:
            nonlocal objects
            while isinstance(component, dict) and "$ref" in component:
                component = self._ref_target(component["$ref"], doc)
            if not isinstance(component, dict):
                return
            if "properties" in component or component.get("type") == "object":
                objects += 1
                for prop, prop_schema in (component.get("properties") or {}).items():
                    properties.append((prop, prop_schema))
                    if is_required and prop in (component.get("required") or []):
                        required.add(prop)
            elif "enum" in component or "const" in component:
                values = component.get("enum", [component.get("const")])
                for value in values:
                    key = _constant(value)
                    enum_counts[key] = enum_counts.get(key, 0) + 1

        for component in components:
            if isinstance(component, dict) and "anyOf" in component:
                for alt in _schemas(component["anyOf"], "anyOf"):
                    add(alt, is_required=False)
            else:
                add(component, is_required=True)
        if enum_counts:
            common = [v for v, n in enum_counts.items() if n == len(components)]
            if common:
                return self._add_rule(rule_name, "(" + " | ".join(common) + ")")
        if not objects:
            raise SchemaConversionError("allOf is only supported over object schemas")
        return self._add_rule(rule_name, self._object_rule(properties, required, name, None, doc))

    def _ref_target(self, ref: Any, doc: int) -> Any:
        if not isinstance(ref, str):
            raise SchemaConversionError("$ref must be a string")
        if ref != "#" and not ref.startswith("#/"):
            raise SchemaConversionError(
                f"unsupported $ref {ref}: only references into the same schema are"
            )
        target: Any = self._documents[doc]
        for token in ref[2:].split("/") if ref != "#" else []:
            selector = token.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and selector in target:
                target = target[selector]
            elif isinstance(target, list) and selector.isdigit() and int(selector) < len(target):
                target = target[int(selector)]
            else:
                raise SchemaConversionError(f"cannot resolve $ref {ref}")
        return target

    def _visit_object(self, schema: dict[str, Any], name: str, rule_name: str, doc: int) -> str:
        properties = schema.get("properties") or {}
        if not isinstance(properties, dict):
            raise SchemaConversionError("properties must be an object")
        additional: Any
        if "additionalProperties" in schema:
            additional = schema["additionalProperties"]
            if additional is False:
                additional = None
            elif not isinstance(additional, dict | bool):
                raise SchemaConversionError("additionalProperties must be a boolean or a schema")
        else:
            # {"type": "object"} on its own is any object (upstream's reading).
            additional = None if properties else True
        required = {r for r in schema.get("required") or [] if isinstance(r, str)}
        if not properties and not required and additional is True:
            return self._add_rule(rule_name, self._add_builtin("object"))
        items = list(properties.items())
        # Required but not described: any value (or what additionalProperties allows).
        undescribed = additional if isinstance(additional, dict) else True
        items.extend((missing, undescribed) for missing in sorted(required - set(properties)))
        return self._add_rule(rule_name, self._object_rule(items, required, name, additional, doc))

    def _object_rule(
        self,
        properties: list[tuple[str, Any]],
        required: set[str],
        name: str,
        additional: Any,
        doc: int,
    ) -> str:
        prefix = f"{name}-" if name else ""
        kv_rules: dict[str, str] = {}
        required_names: list[str] = []
        optional_names: list[str] = []
        for prop, prop_schema in properties:
            value = self._visit(prop_schema, f"{prefix}{prop}", doc)
            kv_rules[prop] = self._add_rule(
                f"{prefix}{prop}-kv", f'{literal(json.dumps(prop))} space ":" space {value}'
            )
            (required_names if prop in required else optional_names).append(prop)
        if additional is not None and additional is not False:
            value = (
                self._add_builtin("value")
                if additional is True or additional == {}
                else self._visit(additional, f"{prefix}additional-value", doc)
            )
            names = [p for p, _ in properties]
            if not names or any(_needs_escape(n) for n in names):
                key = self._add_builtin("string")
            else:
                key = self._add_rule(f"{prefix}additional-k", self._not_strings(names))
            kv_rules["*"] = self._add_rule(f"{prefix}additional-kv", f'{key} ":" space {value}')
            optional_names.append("*")
        if not required_names and not optional_names:
            return '"{" space "}"'

        rule = '"{" space ' + ' "," space '.join(kv_rules[p] for p in required_names)
        if optional_names:

            def rest(keys: list[str], *, first_is_optional: bool) -> str:
                key = keys[0]
                kv = kv_rules[key]
                comma = f'( "," space {kv} )'
                if first_is_optional:
                    out = comma + ("*" if key == "*" else "?")
                else:
                    out = kv + (f" {comma}*" if key == "*" else "")
                if len(keys) > 1:
                    out += " " + self._add_rule(
                        f"{prefix}{key}-rest", rest(keys[1:], first_is_optional=True)
                    )
                return out

            alternatives = " | ".join(
                rest(optional_names[i:], first_is_optional=False)
                for i in range(len(optional_names))
            )
            if required_names:
                rule += f' ( "," space ( {alternatives} ) )?'
            else:
                rule += f"( {alternatives} )?"
        return rule + ' space "}"'

    def _not_strings(self, strings: list[str]) -> str:
        """A JSON string that is none of ``strings`` (an object key beside the listed ones)."""
        trie: dict[str, Any] = {}
        for s in strings:
            node = trie
            for c in s:
                node = node.setdefault(c, {})
            node[""] = {}  # end of a string
        char = self._add_builtin("char")
        escape = '[\\\\] (["\\\\bfnrt] | "u" [0-9a-fA-F]{4})'

        def visit(node: dict[str, Any]) -> str:
            out: list[str] = []
            rejects = "".join(c for c in sorted(node) if c)
            for c in sorted(node):
                if not c:
                    continue
                child = node[c]
                body = f"[{_class_char(ord(c))}]"
                if any(k for k in child):
                    # The prefix so far may itself be a key unless it is one of the names.
                    body += f" ({visit(child)})" + ("" if "" in child else "?")
                else:
                    body += f" {char}+"
                out.append(body)
            raw = f'[^"\\\\\\x7F\\x00-\\x1F{"".join(_class_char(ord(c)) for c in rejects)}]'
            out.append(f"({raw} | {escape}) {char}*")
            return " | ".join(out)

        return f'["] ( {visit(trie)} ){"" if "" in trie else "?"} ["]'

    def _visit_array(self, schema: dict[str, Any], sub: str, rule_name: str, doc: int) -> str:  # noqa: PLR0912
        min_items = _count(schema, "minItems")
        max_items = _count_or_none(schema, "maxItems")
        items = schema.get("items")
        prefix = schema.get("prefixItems")
        if isinstance(items, list):  # drafts before 2020-12: a list of items is a tuple
            prefix, items = items, schema.get("additionalItems", True)
        if isinstance(prefix, list):
            if max_items is not None:
                prefix = prefix[:max_items]
            parts = [self._visit(s, f"{sub}tuple-{i}", doc) for i, s in enumerate(prefix)]
            rule = '"[" space ' + ' "," space '.join(parts)
            more = max(0, min_items - len(prefix))
            if more:
                if items is False:
                    raise SchemaConversionError("minItems exceeds the tuple's items")
                item = self._visit(True if items is None else items, f"{sub}item", doc)
                if parts:
                    rule += f' ( "," space {item} ){{{more}}}'
                else:
                    rule += build_repetition(item, more, more, '"," space')
            return self._add_rule(rule_name, rule + ' space "]"')
        if items is None or items is True or items == {}:
            if min_items == 0 and max_items is None:
                return self._primitive(rule_name, "array")
            item = self._add_builtin("value")
        else:
            item = self._visit(items, f"{sub}item", doc)
        if max_items is not None and min_items > max_items:
            raise SchemaConversionError("minItems is greater than maxItems")
        if min_items > MAX_REPETITION:
            raise SchemaConversionError(f"minItems above {MAX_REPETITION} cannot be enforced")
        if max_items is not None and max_items > MAX_REPETITION:
            max_items = None  # llama.cpp's limit; the validator still checks the count
        body = build_repetition(item, min_items, max_items, '"," space')
        return self._add_rule(rule_name, f'"[" space {body} space "]"')

    def _visit_string(self, schema: dict[str, Any], rule_name: str) -> str:
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            try:
                body = pattern_rule(pattern)
            except UnsupportedPatternError:
                pass  # any string below; the validator checks the pattern
            else:
                self._add_builtin("char")  # an unanchored end is any characters
                return self._add_rule(rule_name, f'"\\"" ({body}) "\\""')
        fmt = schema.get("format")
        fmt = _FORMAT_ALIASES.get(fmt, fmt) if isinstance(fmt, str) else None
        if fmt in STRING_FORMATS:
            return self._add_rule(rule_name, f'"\\"" {self._add_builtin(fmt)} "\\""')
        min_length = _count(schema, "minLength")
        max_length = _count_or_none(schema, "maxLength")
        if max_length is not None and min_length > max_length:
            raise SchemaConversionError("minLength is greater than maxLength")
        if max_length is not None and max_length > MAX_REPETITION:
            max_length = None
        if min_length > MAX_REPETITION:
            raise SchemaConversionError(f"minLength above {MAX_REPETITION} cannot be enforced")
        if min_length == 0 and max_length is None:
            return self._primitive(rule_name, "string")
        char = self._add_builtin("char")
        body = build_repetition(char, min_length, max_length)
        return self._add_rule(rule_name, f'"\\"" {body} "\\""')


def _schemas(value: Any, key: str) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise SchemaConversionError(f"{key} must be a non-empty list of schemas")
    return value


def _constant(value: Any) -> str:
    return literal(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def _needs_escape(text: str) -> bool:
    return any(c in '"\\\x7f' or ord(c) < 0x20 for c in text)


def _count(schema: dict[str, Any], key: str) -> int:
    """A non-negative count keyword (0 when absent)."""
    return _count_or_none(schema, key) or 0


def _count_or_none(schema: dict[str, Any], key: str) -> int | None:
    if key not in schema:
        return None
    value = schema[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SchemaConversionError(f"{key} must be a non-negative integer")
    return value


# -- numbers ------------------------------------------------------------------------------


def _bound(schema: dict[str, Any], key: str) -> Decimal | None:
    value = schema.get(key)
    if value is None or isinstance(value, bool):
        return None
    if not isinstance(value, int | float) or (
        isinstance(value, float) and not math.isfinite(value)
    ):
        raise SchemaConversionError(f"{key} must be a finite number")
    return Decimal(str(value)) if isinstance(value, float) else Decimal(value)


def _limits(schema: dict[str, Any]) -> tuple[Decimal | None, bool, Decimal | None, bool]:
    """(low, low exclusive, high, high exclusive); the tighter of inclusive and exclusive."""
    low, high = _bound(schema, "minimum"), _bound(schema, "maximum")
    low_x = high_x = False
    # Draft 4 wrote exclusiveness as booleans beside minimum/maximum.
    if schema.get("exclusiveMinimum") is True and low is not None:
        low_x = True
    if schema.get("exclusiveMaximum") is True and high is not None:
        high_x = True
    ex_low, ex_high = _bound(schema, "exclusiveMinimum"), _bound(schema, "exclusiveMaximum")
    if ex_low is not None and (low is None or ex_low >= low):
        low, low_x = ex_low, True
    if ex_high is not None and (high is None or ex_high <= high):
        high, high_x = ex_high, True
    return low, low_x, high, high_x


def _integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    low, low_x, high, high_x = _limits(schema)
    lo = None if low is None else int(low.to_integral_value(ROUND_CEILING))
    hi = None if high is None else int(high.to_integral_value(ROUND_FLOOR))
    if lo is not None and low_x and lo == low:
        lo += 1
    if hi is not None and high_x and hi == high:
        hi -= 1
    return lo, hi


def _number_bounds(
    schema: dict[str, Any],
) -> tuple[Decimal | None, bool, Decimal | None, bool] | None:
    low, low_x, high, high_x = _limits(schema)
    if low is None and high is None:
        return None
    # Bounds finer than the digits we let a number have are moved inwards to them.
    quantum = Decimal(1).scaleb(-(FRACTION_DIGITS - 2))
    if low is not None and low != (q := low.quantize(quantum, ROUND_CEILING)):
        low, low_x = q, False
    if high is not None and high != (q := high.quantize(quantum, ROUND_FLOOR)):
        high, high_x = q, False
    if low is not None and high is not None and (low > high or (low == high and (low_x or high_x))):
        raise SchemaConversionError(f"no number is in the range {low}..{high}")
    return low, low_x, high, high_x


def _number_range(low: Decimal | None, low_x: bool, high: Decimal | None, high_x: bool) -> str:
    """JSON numbers (plain decimals, no exponent) in the range: a subset of all of them."""
    alternatives: list[str] = []
    zero = Decimal(0)
    if low is None or low < zero:
        # Negative numbers: a minus sign and a magnitude, bounds mirrored; zero itself is
        # left to the non-negative side (no "-0").
        if high is not None and high < zero:
            magnitude = _magnitude_range(
                -high, None if low is None else -low, low_x=high_x, high_x=low_x
            )
        else:
            magnitude = _magnitude_range(
                zero, None if low is None else -low, low_x=True, high_x=low_x
            )
        if magnitude:
            alternatives.append(f'"-" ({magnitude})')
    if high is None or high > zero or (high == zero and not high_x):
        if low is None or low < zero:
            alternatives.append(_magnitude_range(zero, high, low_x=False, high_x=high_x))
        else:
            alternatives.append(_magnitude_range(low, high, low_x=low_x, high_x=high_x))
    return " | ".join(a for a in alternatives if a)


def _split(value: Decimal) -> tuple[int, str]:
    whole = int(value.to_integral_value(ROUND_FLOOR))
    fraction = format(value - whole, "f")
    digits = fraction.split(".")[1].rstrip("0") if "." in fraction else ""
    return whole, digits


def _magnitude_range(low: Decimal, high: Decimal | None, *, low_x: bool, high_x: bool) -> str:
    """Non-negative decimals in the range, as ``integer ("." fraction)?``."""
    low_int, low_frac = _split(low)
    if high is not None:
        high_int, high_frac = _split(high)
        if high_int == low_int:
            frac = _fraction(low_frac, high_frac, low_x=low_x, high_x=high_x)
            return "" if frac is None else f'"{low_int}" {frac}'.strip()
    alternatives = []
    frac = _fraction(low_frac, None, low_x=low_x, high_x=False)
    if frac is not None:
        alternatives.append(f'"{low_int}" {frac}'.strip())
    middle_high = None if high is None else high_int - 1
    if middle_high is None or low_int + 1 <= middle_high:
        any_fraction = f'("." [0-9]{{1,{FRACTION_DIGITS}}})?'
        alternatives.append(f"({_int_range(low_int + 1, middle_high)}) {any_fraction}")
    if high is not None:
        frac = _fraction("", high_frac, low_x=False, high_x=high_x)
        if frac is not None:
            alternatives.append(f'"{high_int}" {frac}'.strip())
    return " | ".join(alternatives)


def _fraction(low: str, high: str | None, *, low_x: bool, high_x: bool) -> str | None:
    """What may follow an integer part, for fractions in [0.low, 0.high] (high None: below
    1), as GBNF; None when nothing may. Works on the first p digits: a fraction whose
    p-digit prefix lies strictly inside the range may go on with any digits; one equal to
    the upper bound's prefix must stop there. Leaves out a few fractions next to an
    exclusive bound (a subset is safe)."""
    p = max(len(low), len(high or ""), 1) + (1 if low_x or high_x else 0)
    first = int(low.ljust(p, "0")) + (1 if low_x else 0)
    if high is None:
        last, exact = 10**p - 1, None
    else:
        upper = int(high.ljust(p, "0"))
        last = upper - 1
        exact = None if high_x else str(upper).zfill(p)
    parts = []
    if first <= last:
        more = FRACTION_DIGITS - p
        tail = f" [0-9]{{0,{more}}}" if more > 0 else ""
        parts.append(f"({_uniform_range(str(first).zfill(p), str(last).zfill(p))}){tail}")
    if exact is not None:
        parts.append(f'"{exact}"')
    top = int(exact) if exact is not None else last
    for k in range(1, p):  # shorter fractions, as if padded with zeros: 1.4 for 1.40
        scale = 10 ** (p - k)
        lo, hi = -(-first // scale), top // scale
        if lo <= hi:
            parts.append(f"({_uniform_range(str(lo).zfill(k), str(hi).zfill(k))})")
    may_stop = not low.strip("0") and not low_x  # the integer itself is in the range
    if high is not None and high_x and not high.strip("0"):
        may_stop = False
    if not parts:
        return "" if may_stop else None
    body = f'"." ({" | ".join(parts)})'
    return f"({body})?" if may_stop else body


# -- integers (upstream's _generate_min_max_int) ------------------------------------------


def _int_range(low: int | None, high: int | None) -> str:
    out: list[str] = []
    _min_max_int(low, high, out)
    return "".join(out)


def _digit_range(out: list[str], lo: str, hi: str) -> None:
    out.append(f"[{lo}]" if lo == hi else f"[{lo}-{hi}]")


def _more_digits(out: list[str], min_digits: int, max_digits: int | None) -> None:
    out.append("[0-9]")
    if min_digits == max_digits == 1:
        return
    out.append("{" + str(min_digits))
    if max_digits != min_digits:
        out.append("," + ("" if max_digits is None else str(max_digits)))
    out.append("}")


def _uniform_range(lo: str, hi: str) -> str:
    """Digit strings of one length from ``lo`` to ``hi`` (leading zeros allowed)."""
    out: list[str] = []
    _uniform(out, lo, hi)
    return "".join(out)


def _uniform(out: list[str], lo: str, hi: str) -> None:
    i = 0
    while i < len(lo) and lo[i] == hi[i]:
        i += 1
    if i > 0:
        out.append(f'"{lo[:i]}"')
    if i >= len(lo):
        return
    if i > 0:
        out.append(" ")
    sub_len = len(lo) - i - 1
    if sub_len <= 0:
        out.append(f"[{lo[i]}-{hi[i]}]")
        return
    lo_sub, hi_sub = lo[i + 1 :], hi[i + 1 :]
    zeros, nines = "0" * sub_len, "9" * sub_len
    reached = False
    out.append("(")
    if lo_sub == zeros:
        _digit_range(out, lo[i], chr(ord(hi[i]) - 1))
        out.append(" ")
        _more_digits(out, sub_len, sub_len)
    else:
        out.append(f"[{lo[i]}] (")
        _uniform(out, lo_sub, nines)
        out.append(")")
        if ord(lo[i]) < ord(hi[i]) - 1:
            out.append(" | ")
            if hi_sub == nines:
                _digit_range(out, chr(ord(lo[i]) + 1), hi[i])
                reached = True
            else:
                _digit_range(out, chr(ord(lo[i]) + 1), chr(ord(hi[i]) - 1))
            out.append(" ")
            _more_digits(out, sub_len, sub_len)
    if not reached:
        out.append(" | ")
        _digit_range(out, hi[i], hi[i])
        out.append(" ")
        _uniform(out, zeros, hi_sub)
    out.append(")")


def _min_max_int(  # noqa: PLR0912, PLR0915 - upstream's shape, kept for comparison
    low: int | None, high: int | None, out: list[str], decimals_left: int = 16, top: bool = True
) -> None:
    if low is not None and high is not None:
        if low < 0 and high < 0:
            out.append('"-" (')
            _min_max_int(-high, -low, out, decimals_left, top=True)
            out.append(")")
            return
        if low < 0:
            # Upstream's magnitude starts at 0 here, which writes zero as "-0" too.
            out.append('"-" (')
            _min_max_int(1, -low, out, decimals_left, top=True)
            out.append(") | ")
            low = 0
        lo_s, hi_s = str(low), str(high)
        for digits in range(len(lo_s), len(hi_s)):
            _uniform(out, lo_s, "9" * digits)
            lo_s = "1" + "0" * digits
            out.append(" | ")
        _uniform(out, lo_s, hi_s)
        return
    less = max(decimals_left - 1, 1)
    if low is not None:
        if low < 0:
            out.append('"-" (')
            _min_max_int(1, -low, out, decimals_left, top=True)  # upstream's allowed "-0"
            out.append(") | [0] | [1-9] ")
            _more_digits(out, 0, decimals_left - 1)
        elif low == 0:
            if top:
                out.append("[0] | [1-9] ")
                _more_digits(out, 0, less)
            else:
                _more_digits(out, 1, decimals_left)
        elif low <= 9:
            c = str(low)
            start = "1" if top else "0"
            if c > start:
                _digit_range(out, start, chr(ord(c) - 1))
                out.append(" ")
                _more_digits(out, 1, less)
                out.append(" | ")
            _digit_range(out, c, "9")
            out.append(" ")
            _more_digits(out, 0, less)
        else:
            low_s = str(low)
            c = low_s[0]
            if c > "1":
                _digit_range(out, "1" if top else "0", chr(ord(c) - 1))
                out.append(" ")
                _more_digits(out, len(low_s), less)
                out.append(" | ")
            _digit_range(out, c, c)
            out.append(" (")
            _min_max_int(int(low_s[1:]), None, out, less, top=False)
            out.append(")")
            if c < "9":
                out.append(" | ")
                _digit_range(out, chr(ord(c) + 1), "9")
                out.append(" ")
                _more_digits(out, len(low_s) - 1, less)
        return
    if high is not None:
        if high >= 0:
            if top:
                out.append('"-" [1-9] ')
                _more_digits(out, 0, less)
                out.append(" | ")
            _min_max_int(0, high, out, decimals_left, top=True)
        else:
            # Upstream passes top=False here, which lets the magnitude start with 0 ("-040").
            out.append('"-" (')
            _min_max_int(-high, None, out, decimals_left, top=True)
            out.append(")")
        return
    raise SchemaConversionError("an integer range needs a bound")


# -- patterns -----------------------------------------------------------------------------


class UnsupportedPatternError(ValueError):
    """A regular expression with no grammar equivalent here (lookaround, backreference,
    inline flags...)."""


_MAX_CODEPOINT = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)
# What a JSON string cannot hold raw: it is written escaped.
_JSON_ESCAPED = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F))
_PRINTABLE_ASCII = ((0x20, 0x7E),)
_CLASSES: dict[str, tuple[tuple[int, int], ...]] = {
    "d": ((0x30, 0x39),),
    "w": ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)),
    "s": ((0x09, 0x0D), (0x20, 0x20)),
}
_CHAR_ESCAPES = {"t": 0x09, "n": 0x0A, "r": 0x0D, "f": 0x0C, "v": 0x0B, "0": 0x00}
Ranges = list[tuple[int, int]]


def _normalise(ranges: Ranges) -> Ranges:
    merged: Ranges = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _subtract(ranges: Ranges, minus: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in _normalise(ranges):
        pieces = [(lo, hi)]
        for m_lo, m_hi in minus:
            pieces = [
                part
                for a, b in pieces
                for part in ((a, min(b, m_lo - 1)), (max(a, m_hi + 1), b))
                if part[0] <= part[1]
            ]
        out.extend(pieces)
    return out


def _intersect(ranges: Ranges, other: Ranges) -> Ranges:
    return [
        (max(a, c), min(b, d))
        for a, b in _normalise(ranges)
        for c, d in _normalise(other)
        if max(a, c) <= min(b, d)
    ]


def _class_char(cp: int) -> str:
    if chr(cp).isascii() and chr(cp).isalnum():
        return chr(cp)
    if cp < 0x100:
        return f"\\x{cp:02X}"
    if cp < 0x10000:
        return f"\\u{cp:04X}"
    return f"\\U{cp:08X}"


def _char_set(ranges: Ranges, *, escapes: bool) -> str:
    """GBNF for one character of a JSON string from ``ranges``: raw where JSON allows it,
    else (``escapes``) its JSON escape. Raises when nothing is left."""
    raw = _subtract(ranges, list(_JSON_ESCAPED))
    alternatives = []
    if raw:
        body = "".join(
            _class_char(lo) if lo == hi else f"{_class_char(lo)}-{_class_char(hi)}"
            for lo, hi in raw
        )
        alternatives.append(f"[{body}]")
    if escapes:
        for lo, hi in _intersect(ranges, list(_JSON_ESCAPED)):
            alternatives.extend(literal(json.dumps(chr(cp))[1:-1]) for cp in range(lo, hi + 1))
    if not alternatives:
        raise UnsupportedPatternError("a character class with nothing JSON can hold")
    return alternatives[0] if len(alternatives) == 1 else "(" + " | ".join(alternatives) + ")"


def _json_text(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


class _PatternParser:
    """Regular expression (Python ``re`` / ECMA 262 subset) → GBNF over JSON string text."""

    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.i = 0

    def parse(self) -> str:
        anchored_start = self.p.startswith("^")
        # A final "$" anchors unless escaped (an odd run of backslashes before it).
        slashes = len(self.p[:-1]) - len(self.p[:-1].rstrip("\\"))
        anchored_end = self.p.endswith("$") and slashes % 2 == 0
        if anchored_start:
            self.i = 1
        end = len(self.p) - (1 if anchored_end and len(self.p) > int(anchored_start) else 0)
        self.end = end
        body = self._alternatives()
        if self.i != end:
            raise UnsupportedPatternError(f"unexpected {self.p[self.i]!r}")
        # JSON Schema patterns match anywhere in the string; an unanchored side may hold
        # anything (upstream gave up on these).
        parts = [
            "" if anchored_start else "char*",
            f"({body})" if body else "",
            "" if anchored_end else "char*",
        ]
        return " ".join(p for p in parts if p) or '""'

    def _peek(self) -> str:
        return self.p[self.i] if self.i < self.end else ""

    def _alternatives(self) -> str:
        options = [self._sequence()]
        while self._peek() == "|":
            self.i += 1
            options.append(self._sequence())
        if len(options) == 1:
            return options[0]
        return " | ".join(o or '""' for o in options)

    def _sequence(self) -> str:
        items: list[tuple[str, bool]] = []  # (text, is a plain literal)
        while (c := self._peek()) and c not in "|)":
            atom, is_literal = self._atom()
            quantified = self._quantifier(atom if not is_literal else literal(atom))
            if quantified is None:
                if is_literal and items and items[-1][1]:
                    items[-1] = (items[-1][0] + atom, True)
                else:
                    items.append((atom, is_literal))
            else:
                items.append((quantified, False))
        return " ".join(literal(text) if is_lit else text for text, is_lit in items)

    def _quantifier(self, atom: str) -> str | None:
        c = self._peek()
        if c in ("*", "+", "?"):
            self.i += 1
            result = f"{atom}{c}"
        elif c == "{" and re.match(r"\{\d*(,\d*)?\}", self.p[self.i : self.end]):
            m = re.match(r"\{(\d*)(?:(,)(\d*))?\}", self.p[self.i : self.end])
            if m is None:
                raise UnsupportedPatternError("a malformed repetition")
            self.i += m.end()
            low = int(m.group(1) or 0)
            high = None if m.group(2) and not m.group(3) else int(m.group(3) or m.group(1) or 0)
            if low > MAX_REPETITION or (high is not None and high > MAX_REPETITION):
                raise UnsupportedPatternError("a repetition above llama.cpp's limit")
            result = build_repetition(atom, low, high) or '""'
        else:
            return None
        if self._peek() in ("?", "+"):  # lazy or possessive: the same strings
            self.i += 1
        return result

    def _atom(self) -> tuple[str, bool]:  # noqa: PLR0912 - one branch per syntax
        c = self.p[self.i]
        if c == "(":
            self.i += 1
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.p.startswith("?P<", self.i) or (
                self.p.startswith("?<", self.i) and self.p[self.i + 2 : self.i + 3] not in "=!"
            ):
                close = self.p.find(">", self.i)
                if close < 0:
                    raise UnsupportedPatternError("an unterminated group name")
                self.i = close + 1
            elif self._peek() == "?":
                raise UnsupportedPatternError("lookaround or inline flags")
            body = self._alternatives()
            if self._peek() != ")":
                raise UnsupportedPatternError("unbalanced parentheses")
            self.i += 1
            return f"({body or chr(34) * 2})", False
        if c == "[":
            return self._class(), False
        if c == ".":
            self.i += 1
            universe = _subtract([(0, _MAX_CODEPOINT)], [(0x0A, 0x0A), _SURROGATES])
            return _char_set(universe, escapes=False), False
        if c in "^$":
            raise UnsupportedPatternError("an anchor inside the pattern")
        if c in "*+?{":
            raise UnsupportedPatternError(f"nothing to repeat at {self.i}")
        if c == ")":
            raise UnsupportedPatternError("unbalanced parentheses")
        if c == "\\":
            ranges, is_class = self._escape()
            if is_class:
                return _char_set(ranges, escapes=True), False
            return _json_text(chr(ranges[0][0])), True
        self.i += 1
        return _json_text(c), True

    def _escape(self) -> tuple[Ranges, bool]:
        """After a backslash: (ranges, whether a class) of what it stands for."""
        if self.i + 1 >= len(self.p):
            raise UnsupportedPatternError("a trailing backslash")
        c = self.p[self.i + 1]
        self.i += 2
        if c.lower() in _CLASSES:
            ranges = list(_CLASSES[c.lower()])
            if c.isupper():  # \D \W \S: only ASCII, where re's Unicode classes agree
                ranges = _subtract(list(_PRINTABLE_ASCII), ranges)
            return ranges, True
        if c in _CHAR_ESCAPES:
            return [(_CHAR_ESCAPES[c],) * 2], False
        if c in "xu":
            digits = 2 if c == "x" else 4
            code = self.p[self.i : self.i + digits]
            if len(code) != digits or not all(h in "0123456789abcdefABCDEF" for h in code):
                raise UnsupportedPatternError(f"a bad \\{c} escape")
            self.i += digits
            return [(int(code, 16),) * 2], False
        if c.isalnum():
            raise UnsupportedPatternError(f"the escape \\{c}")
        return [(ord(c),) * 2], False

    def _class(self) -> str:  # noqa: PLR0912 - one branch per syntax
        self.i += 1
        negated = self._peek() == "^"
        if negated:
            self.i += 1
        ranges: Ranges = []
        shorthand = False
        first = True
        while True:
            if self.i >= self.end:
                raise UnsupportedPatternError("an unterminated character class")
            c = self.p[self.i]
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            if c == "\\":
                item, is_class = self._escape()
                if is_class:
                    ranges.extend(item)
                    shorthand = True
                    continue
                lo = item[0][0]
            else:
                if c == "[" and self.p[self.i + 1 : self.i + 2] in (":", "=", "."):
                    raise UnsupportedPatternError("POSIX classes")
                lo = ord(c)
                self.i += 1
            if self._peek() == "-" and self.p[self.i + 1 : self.i + 2] not in ("]", ""):
                self.i += 1
                if self.p[self.i] == "\\":
                    item, is_class = self._escape()
                    if is_class:
                        raise UnsupportedPatternError("a range ending in a class")
                    hi = item[0][0]
                else:
                    hi = ord(self.p[self.i])
                    self.i += 1
                if hi < lo:
                    raise UnsupportedPatternError("a reversed range")
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        if negated:
            # Beside \w \d \s the complement stays ASCII: re's classes are Unicode.
            universe = list(_PRINTABLE_ASCII) if shorthand else [(0, _MAX_CODEPOINT)]
            ranges = _subtract(universe, [*ranges, _SURROGATES])
            return _char_set(ranges, escapes=False)
        return _char_set(ranges, escapes=True)


def pattern_rule(pattern: str) -> str:
    """GBNF for the inside of a JSON string (between its quotes) whose decoded value
    matches ``pattern``. Raises :class:`UnsupportedPatternError` when it cannot. Refers to
    the ``char`` rule for unanchored ends."""
    return _PatternParser(pattern).parse()
