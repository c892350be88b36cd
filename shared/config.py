"""Settings from a YAML file and ``KVL_`` environment variables, validated all at once.

Precedence, highest first: command-line flags, environment (``KVL_SECTION__KEY``), the
YAML file, defaults. A configuration that does not validate raises :class:`ConfigError`
holding *every* problem, each naming the key, what is wrong and how to fix it; the CLI
prints them and exits with status 2.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml
from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel, ValidationError
from pydantic_settings import BaseSettings, EnvSettingsSource, InitSettingsSource

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

ENV_PREFIX = "KVL_"
ENV_DELIMITER = "__"

S = TypeVar("S", bound=BaseSettings)


@dataclass(frozen=True)
class Problem:
    key: str
    what: str
    fix: str
    source: str

    def render(self) -> str:
        return f"  {self.key}: {self.what}\n    from: {self.source}\n    fix:  {self.fix}"


class ConfigError(Exception):
    def __init__(self, problems: list[Problem]) -> None:
        super().__init__(f"{len(problems)} configuration problem(s)")
        self.problems = problems

    def render(self) -> str:
        lines = [f"invalid configuration ({len(self.problems)} problem(s)):"]
        lines += [p.render() for p in self.problems]
        return "\n".join(lines)


def env_prefix(cls: type[BaseModel]) -> str:
    """The environment prefix of a settings class: `KVL_`, or its own (the hub's `KVL_HUB_`)."""
    prefix = cls.model_config.get("env_prefix")
    return prefix if isinstance(prefix, str) and prefix else ENV_PREFIX


def env_name(key: str, prefix: str = ENV_PREFIX) -> str:
    """The environment variable that sets a dotted settings key."""
    return prefix + key.replace(".", ENV_DELIMITER).upper()


def load_settings(
    cls: type[S],
    *,
    config_file: Path | None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> S:
    """Build ``cls`` from (lowest first) defaults, the YAML file, the environment, overrides.

    ``overrides`` is a nested mapping of values given as command-line flags.
    """
    file_data, file_label = _read_yaml(config_file)
    environ = os.environ if environ is None else environ
    sources = (
        InitSettingsSource(cls, dict(overrides or {})),
        _EnvSource(cls, environ, env_prefix(cls)),
        InitSettingsSource(cls, file_data),
    )
    try:
        return cls(_build_sources=(sources, {}))
    except ValidationError as err:
        raise ConfigError(
            [
                _problem(cls, err_item, file_label, environ, overrides or {})
                for err_item in err.errors()
            ]
        ) from err


class _EnvSource(EnvSettingsSource):
    """The environment source, reading a given mapping so tests need not touch os.environ."""

    def __init__(
        self, settings_cls: type[BaseSettings], environ: Mapping[str, str], prefix: str
    ) -> None:
        self._environ = environ
        super().__init__(
            settings_cls,
            env_prefix=prefix,
            env_nested_delimiter=ENV_DELIMITER,
            case_sensitive=False,
        )

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {k.lower(): v for k, v in self._environ.items()}


def _read_yaml(path: Path | None) -> tuple[dict[str, Any], str]:
    if path is None:
        return {}, "defaults"
    label = f"config file {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(
            [
                Problem(
                    "--config", f"cannot read {path}: {err.strerror}", "pass a readable file", label
                )
            ]
        ) from err
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        where = ""
        mark = getattr(err, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        raise ConfigError(
            [Problem("--config", f"not valid YAML{where}", "fix the YAML syntax", label)]
        ) from err
    if data is None:
        return {}, label
    if not isinstance(data, dict):
        raise ConfigError(
            [
                Problem(
                    "--config", "the top level is not a mapping", "write `key: value` lines", label
                )
            ]
        )
    return data, label


def _problem(
    cls: type[BaseModel],
    item: Any,
    file_label: str,
    environ: Mapping[str, str],
    overrides: Mapping[str, Any],
) -> Problem:
    loc = [str(part) for part in item["loc"]]
    key = ".".join(loc)
    env_key = env_name(key, env_prefix(cls))
    if _lookup(overrides, loc) is not _MISSING:
        source = "command line"
    elif any(k.upper() == env_key for k in environ):
        source = f"environment {env_key}"
    else:
        source = file_label
    field = _field_at(cls, loc)
    if item["type"] == "extra_forbidden":
        parent = _model_at(cls, loc[:-1])
        known = list(parent.model_fields) if parent is not None else []
        close = difflib.get_close_matches(loc[-1], known, n=1)
        fix = f"did you mean `{'.'.join([*loc[:-1], close[0]])}`?" if close else "remove it"
        return Problem(key, "unknown setting", fix, source)
    what = f"{item['msg']} (got {item.get('input')!r})"
    return Problem(key, what, _fix(key, field), source)


def _fix(key: str, field: FieldInfo | None) -> str:
    if field is None:
        return f"see the example config for `{key}`"
    bounds = describe_bounds(field)
    text = field.description or ""
    return f"set `{key}` {bounds}; {text}".replace(" ;", ";").strip("; ")


def describe_bounds(field: FieldInfo) -> str:
    parts = []
    for meta in field.metadata:
        match meta:
            case Ge(ge=v):
                parts.append(f">= {v}")
            case Gt(gt=v):
                parts.append(f"> {v}")
            case Le(le=v):
                parts.append(f"<= {v}")
            case Lt(lt=v):
                parts.append(f"< {v}")
            case MinLen(min_length=v):
                parts.append(f"at least {v} long")
            case MaxLen(max_length=v):
                parts.append(f"at most {v} long")
            case _:
                pass
    return ("to a value " + " and ".join(parts)) if parts else "to a valid value"


_MISSING = object()


def _lookup(data: Mapping[str, Any], loc: list[str]) -> Any:
    node: Any = data
    for part in loc:
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _model_at(cls: type[BaseModel], loc: list[str]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = cls
    for part in loc:
        if model is None or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        model = (
            annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel)
            else None
        )
    return model


def _field_at(cls: type[BaseModel], loc: list[str]) -> FieldInfo | None:
    parent = _model_at(cls, loc[:-1])
    if parent is None or not loc:
        return None
    return parent.model_fields.get(loc[-1])


def iter_fields(cls: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every leaf setting as (dotted key, field), depth first, in declaration order."""
    for name, field in cls.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from iter_fields(annotation, key + ".")
        else:
            yield key, field


def example_yaml(cls: type[BaseModel], header: str) -> str:
    """A complete, commented YAML config of every setting at its default.

    The example configs in the repository are this function's output (a test checks),
    so they can never miss a setting or describe it differently from the code.
    """
    lines = [f"# {line}".rstrip() for line in header.strip().splitlines()]
    lines.append("")
    _example_lines(cls, cls.model_construct(), (), lines, env_prefix(cls))
    return "\n".join(lines).rstrip() + "\n"


def _example_lines(
    cls: type[BaseModel], values: BaseModel, path: tuple[str, ...], lines: list[str], prefix: str
) -> None:
    pad = "  " * len(path)
    for name, field in cls.model_fields.items():
        annotation = field.annotation
        value = getattr(values, name)
        description = field.description or ""
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines += [f"{pad}# {description}", f"{pad}{name}:"]
            _example_lines(annotation, value, (*path, name), lines, prefix)
            lines.append("")
            continue
        bounds = describe_bounds(field)
        if bounds != "to a valid value":
            description += f" (allowed: {bounds.removeprefix('to a value ')})"
        rendered = yaml.safe_dump({name: _plain(value)}, default_flow_style=True, width=10_000)
        lines += [
            f"{pad}# {description}",
            f"{pad}# env: {env_name('.'.join((*path, name)), prefix)}",
            f"{pad}{rendered.strip().removeprefix('{').removesuffix('}')}",
        ]


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):  # a list of sections (the hub's alert windows)
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value
