"""JSON as both sides read it from a peer: standard JSON only (no NaN or Infinity, which
Python's json accepts and which then overflow a later conversion) and a bounded nesting
depth (a deeply nested body otherwise ends in a RecursionError, far from the reader, in
whatever walks the value next)."""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64


class JsonLimitError(ValueError):
    """The text is JSON, but not what a peer may send: too deep, or a non-finite number."""


def _refuse_constant(name: str) -> Any:
    raise JsonLimitError(f"{name} is not a JSON number")


def loads(raw: bytes | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """`json.loads`, refusing NaN, Infinity and nesting deeper than `max_depth`.
    Raises json.JSONDecodeError (not JSON) or JsonLimitError (JSON past the limits)."""
    try:
        value = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError as err:
        raise JsonLimitError(f"nested deeper than {max_depth} levels") from err
    if depth(value, max_depth) > max_depth:
        raise JsonLimitError(f"nested deeper than {max_depth} levels")
    return value


def depth(value: object, limit: int = MAX_DEPTH) -> int:
    """How deeply `value` nests lists and objects (a scalar: 0), counted without
    recursion; stops counting once past `limit`."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        level += 1
        deepest = max(deepest, level)
        if deepest > limit:
            return deepest
        stack.extend((child, level) for child in children if isinstance(child, dict | list))
    return deepest
