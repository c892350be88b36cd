"""Tool calling: OpenAI ``tools`` → a grammar, a prompt, and parsers of what comes back.

Two output formats, both enforced by a grammar while decoding (not hoped for):

* ``generic``, llama.cpp's approach for templates that know no tools: the answer is one
  JSON object, ``{"tool_calls": [{"name": ..., "arguments": {...}}]}`` or, when the model
  may answer instead (``tool_choice`` ``auto``), ``{"response": "text"}``. The tools and
  this format are described in the system prompt (llama.cpp's generic handler's words).
* ``hermes``, for templates that render tools themselves (Hermes, Qwen):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks; with
  ``auto`` the model may write text instead, which then cannot contain ``<t``, so that a
  call is always constrained by the grammar.

Arguments always fit their function's ``parameters`` schema (appliance.validation.grammar
builds their rules), and are checked again on parsing. ``arguments_json`` is the compact
form of what the model wrote (whitespace dropped, string escapes made canonical); the
stream's argument fragments are the same text, piece by piece.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from appliance.validation.grammar import GrammarBuilder, SchemaConversionError, literal

if TYPE_CHECKING:
    from collections.abc import Callable

    from shared.chat import ChatTemplate

# At most this many calls in one answer when parallel calls are allowed.
MAX_PARALLEL_CALLS = 8
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

ToolFormat = Literal["generic", "hermes"]


class ToolSpecError(ValueError):
    """``tools`` or ``tool_choice`` cannot be used (bad name, schema, unknown choice)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class ToolCallError(ValueError):
    """The output is not a valid answer in the tool format (cut short, or arguments
    that do not fit the function's schema)."""


@dataclass(frozen=True)
class FunctionTool:
    name: str
    parameters: dict[str, Any]
    description: str | None = None
    strict: bool = False

    def to_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments_json: str


@dataclass(frozen=True)
class ToolOutput:
    content: str | None
    calls: list[ToolCall]


@dataclass(frozen=True)
class ContentDelta:
    text: str

    def to_openai(self) -> dict[str, Any]:
        return {"content": self.text}


@dataclass(frozen=True)
class ToolCallDelta:
    """OpenAI's ``delta.tool_calls[]`` item: the first for a call names it (id, name,
    empty arguments); the next ones carry pieces of its arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        if self.id is not None:
            return {
                "index": self.index,
                "id": self.id,
                "type": "function",
                "function": {"name": self.name, "arguments": self.arguments},
            }
        return {"index": self.index, "function": {"arguments": self.arguments}}


Delta = ContentDelta | ToolCallDelta


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_tools(tools: list[dict[str, Any]]) -> list[FunctionTool]:
    """OpenAI's ``tools`` (``{"type": "function", "function": {...}}``) checked and read."""
    # jsonschema (about 9 MiB) on the first request with tools, not in every gateway.
    import jsonschema  # noqa: PLC0415
    from jsonschema.exceptions import SchemaError  # noqa: PLC0415

    parsed: list[FunctionTool] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise ToolSpecError("only function tools are supported", where)
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolSpecError("a function name is 1-64 of a-z, A-Z, 0-9, _ and -", where)
        if any(t.name == name for t in parsed):
            raise ToolSpecError(f"the function {name} is listed twice", where)
        parameters = function.get("parameters") or EMPTY_PARAMETERS
        try:
            jsonschema.validators.validator_for(parameters).check_schema(parameters)
        except SchemaError as err:
            raise ToolSpecError(
                f"not a valid JSON Schema: {err.message}", f"{where}.function.parameters"
            ) from err
        parsed.append(
            FunctionTool(
                name=name,
                parameters=parameters,
                description=function.get("description"),
                strict=bool(function.get("strict", False)),
            )
        )
    return parsed


def _chosen(tools: list[FunctionTool], tool_choice: Any) -> tuple[str, list[FunctionTool]]:
    """(mode, the functions the model may call): mode none, auto or required."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise ToolSpecError(f"tool_choice {tool_choice} needs tools", "tool_choice")
        return str(tool_choice), tools
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        named = [t for t in tools if t.name == name]
        if not named:
            raise ToolSpecError(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        return "required", named
    raise ToolSpecError(
        'tool_choice is "none", "auto", "required" or {"type": "function", ...}', "tool_choice"
    )


@dataclass(frozen=True)
class ToolPlan:
    """How one request's tools are offered, enforced and read back."""

    tools: list[FunctionTool]
    callable: list[FunctionTool]  # what the grammar lets the model call
    mode: str  # none | auto | required
    parallel: bool
    format: ToolFormat
    grammar: str | None
    system_prompt: str | None  # added to the system message (generic format)
    _validators: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def render(
        self,
        template: ChatTemplate,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt: the tools as the template shows them, or in the system prompt."""
        if self.format == "hermes":
            openai_tools = [t.to_openai() for t in self.tools] if self.mode != "none" else None
            return template.render(
                messages, add_generation_prompt=add_generation_prompt, tools=openai_tools
            )
        if self.system_prompt:
            messages = add_system(messages, self.system_prompt)
        return template.render(messages, add_generation_prompt=add_generation_prompt)

    def stream(self, new_id: Callable[[], str] = new_call_id) -> ToolStream:
        return ToolStream(self, new_id)

    def parse(self, text: str, new_id: Callable[[], str] = new_call_id) -> ToolOutput:
        """The finished output as content and calls; ToolCallError if it is not valid."""
        stream = self.stream(new_id)
        stream.feed(text)
        stream.finish()
        return stream.result()

    def check(self, name: str, arguments_json: str) -> None:
        validator = self._validators.get(name)
        if validator is None:
            raise ToolCallError(f"the model called {name!r}, which it was not offered")
        try:
            arguments = json.loads(arguments_json)
        except json.JSONDecodeError as err:
            raise ToolCallError(f"the arguments of {name} are not JSON: {err.msg}") from err
        errors = sorted(validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))
        if errors:
            where = "/".join(map(str, errors[0].absolute_path)) or "(root)"
            raise ToolCallError(f"the arguments of {name} do not fit: {where}: {errors[0].message}")


def plan_tools(
    tools: list[dict[str, Any]],
    tool_choice: Any = None,
    *,
    parallel_tool_calls: bool = True,
    template: ChatTemplate | None = None,
    tool_format: str = "auto",
) -> ToolPlan:
    """Everything a request with ``tools`` (OpenAI's shape) needs; ToolSpecError when it
    cannot be served. ``template`` decides the format (``auto``): its own (hermes) when it
    knows tools, else generic; a deployment's preset may choose generic, or hermes for a
    template that renders tools without the hermes markers."""
    parsed = parse_tools(tools)
    mode, callable_tools = _chosen(parsed, tool_choice)
    own: ToolFormat = (
        "hermes" if template is not None and template.tool_format == "hermes" else "generic"
    )
    fmt: ToolFormat = own
    if tool_format == "generic":
        fmt = "generic"
    elif tool_format == "hermes":
        if template is None or not template.knows_tools:
            raise ToolSpecError(
                "the model's preset asks for hermes tool calls, but its chat template does "
                "not render tools",
                "tools",
            )
        fmt = "hermes"
    import jsonschema  # noqa: PLC0415 - see parse_tools

    validators = {}
    for tool in callable_tools:
        cls = jsonschema.validators.validator_for(tool.parameters)
        validators[tool.name] = cls(tool.parameters, format_checker=cls.FORMAT_CHECKER)
    grammar = None
    prompt = None
    if mode != "none":
        try:
            grammar = (hermes_grammar if fmt == "hermes" else generic_grammar)(
                callable_tools, mode=mode, parallel=parallel_tool_calls
            )
        except SchemaConversionError as err:
            raise ToolSpecError(
                f"the parameters cannot be enforced while decoding: {err}", "tools"
            ) from err
        if fmt == "generic":
            prompt = generic_prompt(parsed, callable_tools, mode=mode)
    return ToolPlan(
        tools=parsed,
        callable=callable_tools,
        mode=mode,
        parallel=parallel_tool_calls,
        format=fmt,
        grammar=grammar,
        system_prompt=prompt,
        _validators=validators,
    )


def add_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``text`` appended to the system message (one is put first if there is none)."""
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        content = first.get("content") or ""
        return [{**first, "content": f"{content}\n\n{text}" if content else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


_EXAMPLE = {"tool_calls": [{"name": "tool_name", "arguments": {"arg1": "some_value"}}]}


def generic_prompt(
    tools: list[FunctionTool], callable_tools: list[FunctionTool], *, mode: str
) -> str:
    """llama.cpp's generic handler's system prompt (its tool polyfill and format line)."""
    listed = json.dumps([t.to_openai() for t in tools], indent=2, ensure_ascii=False)
    example = json.dumps(_EXAMPLE, indent=2)
    if mode == "required" and len(callable_tools) == 1 and len(tools) > 1:
        ask = f"Respond in JSON format with `tool_calls`, calling `{callable_tools[0].name}`"
    elif mode == "required":
        ask = "Respond in JSON format with `tool_calls` (a request to call tools)"
    else:
        ask = (
            "Respond in JSON format, either with `tool_calls` (a request to call tools) or "
            "with `response` reply to the user's request"
        )
    return (
        f"You can call any of the following tools to satisfy the user's requests: {listed}"
        f"\n\nExample tool call syntax:\n\n{example}\n\n{ask}"
    )


def _call_rules(builder: GrammarBuilder, tools: list[FunctionTool]) -> str:
    """A rule for one call object, ``{"name": ..., "arguments": ...}``, of any of ``tools``."""
    alternatives = []
    for tool in tools:
        arguments = builder.schema(f"{tool.name}-arguments", tool.parameters)
        alternatives.append(
            builder.rule(
                f"{tool.name}-call",
                f'"{{" space {literal(json.dumps("name"))} space ":" space '
                f'{literal(json.dumps(tool.name))} space "," space '
                f'{literal(json.dumps("arguments"))} space ":" space {arguments} space "}}"',
            )
        )
    return builder.rule("call", " | ".join(alternatives))


def generic_grammar(tools: list[FunctionTool], *, mode: str, parallel: bool) -> str:
    builder = GrammarBuilder()
    call = _call_rules(builder, tools)
    more = MAX_PARALLEL_CALLS - 1 if parallel else 0
    calls = builder.rule(
        "tool-calls",
        f'"{{" space {literal(json.dumps("tool_calls"))} space ":" space "[" space {call}'
        + (f' ( "," space {call} ){{0,{more}}}' if more else "")
        + ' space "]" space "}"',
    )
    if mode == "required":
        builder.rule("root", calls)
    else:
        text = builder.primitive("string")
        response = builder.rule(
            "response",
            f'"{{" space {literal(json.dumps("response"))} space ":" space {text} space "}}"',
        )
        builder.rule("root", f"{calls} | {response}")
    return builder.grammar()


HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"


def hermes_grammar(tools: list[FunctionTool], *, mode: str, parallel: bool) -> str:
    builder = GrammarBuilder()
    call = _call_rules(builder, tools)
    block = builder.rule(
        "block", f"{literal(HERMES_OPEN + chr(10))} {call} {literal(chr(10) + HERMES_CLOSE)}"
    )
    more = MAX_PARALLEL_CALLS - 1 if parallel else 0
    calls = builder.rule("blocks", block + (f' ( "\\n" {block} ){{0,{more}}}' if more else ""))
    if mode == "required":
        builder.rule("root", calls)
    else:
        # Text that cannot begin a call ("<t"), so any call is made under the grammar.
        prose = builder.rule("prose", '( [^<] | "<" [^t] )+')
        builder.rule("root", f'{calls} | {prose} ( "\\n" {calls} )?')
    return builder.grammar()


# -- reading the output back --------------------------------------------------------------


class _Compact:
    """Compact canonical JSON text, fed character by character: whitespace between tokens
    dropped, each string character written as ``json.dumps`` writes it."""

    def __init__(self) -> None:
        self._in_string = False
        self._escape: str | None = None  # an escape being read, from its backslash
        self._high: str | None = None  # a high surrogate waiting for its pair

    def feed(self, c: str) -> str:  # noqa: PLR0911 - one return per lexical case
        if not self._in_string:
            if c in " \t\r\n":
                return ""
            if c == '"':
                self._in_string = True
            return c
        if self._escape is not None:
            self._escape += c
            if self._escape[1] == "u" and len(self._escape) < 6:
                return ""
            escape, self._escape = self._escape, None
            decoded = json.loads(f'"{escape}"') if escape[1] != "u" else chr(int(escape[2:], 16))
            return self._char(decoded)
        if c == "\\":
            self._escape = c
            return ""
        if c == '"':
            self._in_string = False
            return self._flush() + c
        return self._char(c)

    def _char(self, c: str) -> str:
        if 0xD800 <= ord(c) <= 0xDBFF:
            pending = self._flush()
            self._high = c
            return pending
        if 0xDC00 <= ord(c) <= 0xDFFF and self._high is not None:
            pair = (self._high + c).encode("utf-16", "surrogatepass").decode("utf-16")
            self._high = None
            return json.dumps(pair, ensure_ascii=False)[1:-1]
        return self._flush() + json.dumps(c, ensure_ascii=False)[1:-1]

    def _flush(self) -> str:
        if self._high is None:
            return ""
        high, self._high = self._high, None
        return json.dumps(high)[1:-1]  # a lone surrogate stays an escape


Path = tuple[str | int, ...]


@dataclass
class _Frame:
    kind: str  # "{" or "["
    path: Path
    expect: str  # key | colon | value | comma
    key: str | int = 0


class _Scanner:
    """Incremental JSON: where each value starts and ends (its path), the decoded text of
    string values as it arrives, and the raw characters of one value being captured."""

    def __init__(self, listener: _StreamCore) -> None:
        self.listener = listener
        self.stack: list[_Frame] = []
        self.done = False
        self.capturing = False
        self._string: Path | None = None  # the path of the string being read
        self._is_key = False
        self._key = ""
        self._escape: str | None = None
        self._high = ""
        self._scalar: str | None = None
        self._scalar_path: Path = ()

    def feed(self, c: str) -> None:
        if self._scalar is not None and c in " \t\r\n,]}":
            self._value_end(self._scalar_path)
            self._scalar = None
        was = self.capturing
        self._consume(c)
        if was or self.capturing:
            self.listener.captured(c)

    def finish(self) -> None:
        if self._scalar is not None:
            self._value_end(self._scalar_path)
            self._scalar = None

    def _path(self) -> Path:
        if not self.stack:
            return ()
        top = self.stack[-1]
        return (*top.path, top.key)

    def _consume(self, c: str) -> None:  # noqa: PLR0911, PLR0912 - one branch per token
        if self._string is not None:
            self._string_char(c)
            return
        if self._scalar is not None:
            self._scalar += c
            return
        if c in " \t\r\n" or self.done:
            return
        top = self.stack[-1] if self.stack else None
        if top is not None and top.expect == "colon":
            if c == ":":
                top.expect = "value"
            return
        if top is not None and top.expect == "comma":
            if c == ",":
                if top.kind == "[":
                    top.key = int(top.key) + 1
                top.expect = "key" if top.kind == "{" else "value"
            elif c in "}]":
                self._close()
            return
        if top is not None and top.expect == "key":
            if c == '"':
                self._string, self._is_key, self._key = self._path(), True, ""
            elif c == "}":
                self._close()
            return
        if top is not None and top.kind == "[" and c == "]":
            self._close()  # an empty array
            return
        path = self._path()
        self.listener.value_start(path, c)
        if c in "{[":
            self.stack.append(_Frame(c, path, "key" if c == "{" else "value"))
        elif c == '"':
            self._string, self._is_key = path, False
        else:
            self._scalar, self._scalar_path = c, path

    def _close(self) -> None:
        frame = self.stack.pop()
        self._value_end(frame.path)

    def _value_end(self, path: Path) -> None:
        self.listener.value_end(path)
        if self.stack:
            self.stack[-1].expect = "comma"
        else:
            self.done = True

    def _string_char(self, c: str) -> None:
        path = self._string
        assert path is not None  # noqa: S101 - only called inside a string
        if self._escape is not None:
            self._escape += c
            if self._escape[1] == "u" and len(self._escape) < 6:
                return
            escape, self._escape = self._escape, None
            if escape[1] != "u":
                self._text(json.loads(f'"{escape}"'))
            elif 0xD800 <= int(escape[2:], 16) <= 0xDBFF:
                self._high = escape
            else:
                self._text(json.loads(f'"{self._high}{escape}"'))
                self._high = ""
            return
        if c == "\\":
            self._escape = c
            return
        if c == '"':
            self._string = None
            if self._is_key:
                top = self.stack[-1]
                top.key, top.expect = self._key, "colon"
            else:
                self._value_end(path)
            return
        self._text(c)

    def _text(self, text: str) -> None:
        if self._is_key:
            self._key += text
        elif self._string is not None:
            self.listener.string_text(self._string, text)


class _StreamCore:
    """What the scanner reports, turned into deltas, for calls at ``prefix`` paths."""

    def __init__(self, plan: ToolPlan, new_id: Callable[[], str]) -> None:
        self.plan = plan
        self.new_id = new_id
        self.out: list[Delta] = []
        self.content: list[str] = []
        self.names: dict[int, str] = {}
        self.arguments: dict[int, list[str]] = {}
        self.ids: dict[int, str] = {}
        self.waiting: dict[int, list[str]] = {}  # fragments before the name is known
        self.complete: set[int] = set()
        self.base = 0  # the index of the first call this scanner's calls map to
        self._capture: int | None = None
        self._compact = _Compact()
        self._name = ""

    def call_at(self, path: Path) -> tuple[int, str] | None:
        """(call index, "name" | "arguments") if ``path`` is one of those values."""
        if self.plan.format == "generic":
            if len(path) == 3 and path[0] == "tool_calls" and isinstance(path[1], int):
                return path[1], str(path[2])
            return None
        if len(path) == 1:
            return self.base, str(path[0])
        return None

    def value_start(self, path: Path, c: str) -> None:
        found = self.call_at(path)
        if found is not None and found[1] == "arguments":
            self._capture = found[0]
            self._compact = _Compact()
            self.scanner.capturing = True
        elif found is not None and found[1] == "name":
            self._name = ""

    def value_end(self, path: Path) -> None:
        found = self.call_at(path)
        if found is None:
            return
        index, part = found
        if part == "arguments" and self._capture == index:
            # The scanner still hands over the character that closed the value.
            self.scanner.capturing = False
            self.complete.add(index)
        elif part == "name":
            self.names[index] = self._name
            self.ids[index] = self.new_id()
            self.out.append(ToolCallDelta(index, "", id=self.ids[index], name=self._name))
            waiting = "".join(self.waiting.pop(index, []))
            if waiting:
                self.out.append(ToolCallDelta(index, waiting))

    def string_text(self, path: Path, text: str) -> None:
        found = self.call_at(path)
        if found is not None and found[1] == "name":
            self._name += text
        elif self.plan.format == "generic" and path == ("response",):
            self.content.append(text)
            self.out.append(ContentDelta(text))

    def captured(self, c: str) -> None:
        if self._capture is None:
            return
        piece = self._compact.feed(c)
        if not piece:
            return
        index = self._capture
        self.arguments.setdefault(index, []).append(piece)
        if index in self.names:
            self.out.append(ToolCallDelta(index, piece))
        else:
            self.waiting.setdefault(index, []).append(piece)

    def new_scanner(self) -> _Scanner:
        self.scanner = _Scanner(self)
        return self.scanner


class ToolStream:
    """Output text in, OpenAI-style deltas out: ``content`` text as the answer arrives and,
    for each call, one delta naming it, then its arguments in pieces."""

    def __init__(self, plan: ToolPlan, new_id: Callable[[], str] = new_call_id) -> None:
        self.plan = plan
        self._core = _StreamCore(plan, new_id)
        self._scanner = self._core.new_scanner()
        self._finished = False
        # hermes: "text" (content), "call" (a call's JSON), "close" (until </tool_call>)
        self._mode = "text"
        self._held = ""  # text that may be the start of <tool_call>
        self._calls = 0

    def feed(self, text: str) -> list[Delta]:
        if self.plan.mode == "none":
            if text:
                self._core.content.append(text)
                return [ContentDelta(text)]
            return []
        for c in text:
            if self.plan.format == "generic":
                self._scanner.feed(c)
            else:
                self._hermes(c)
        return self._take()

    def _hermes(self, c: str) -> None:
        core = self._core
        if self._mode == "call":
            self._scanner.feed(c)
            if self._scanner.done:
                self._calls += 1
                self._mode, self._held = "close", ""
            return
        self._held += c
        if self._mode == "close":
            if HERMES_CLOSE in self._held:
                self._mode, self._held = "text", ""
            return
        if HERMES_OPEN in self._held:
            self._emit_text(self._held[: self._held.index(HERMES_OPEN)].rstrip())
            self._mode, self._held = "call", ""
            core.base = self._calls
            self._scanner = core.new_scanner()
            return
        # Keep back what could still become "<tool_call>", and trailing whitespace: the
        # content before a call does not end in the newline that leads to it.
        keep = next(
            (
                k
                for k in range(min(len(self._held), len(HERMES_OPEN) - 1), 0, -1)
                if HERMES_OPEN.startswith(self._held[-k:])
            ),
            0,
        )
        ready = self._held[: len(self._held) - keep]
        text = ready.rstrip()
        if text:
            self._emit_text(text)
            self._held = self._held[len(text) :]

    def _emit_text(self, text: str) -> None:
        if text and not self._calls:  # text after the calls is not part of the answer
            self._core.content.append(text)
            self._core.out.append(ContentDelta(text))

    def _take(self) -> list[Delta]:
        """The deltas so far, neighbours of one kind merged (one per token, not per char)."""
        out: list[Delta] = []
        for delta in self._core.out:
            last = out[-1] if out else None
            if isinstance(delta, ContentDelta) and isinstance(last, ContentDelta):
                out[-1] = ContentDelta(last.text + delta.text)
            elif (
                isinstance(delta, ToolCallDelta)
                and isinstance(last, ToolCallDelta)
                and delta.id is None
                and last.id is None  # the naming delta keeps its empty arguments
                and last.index == delta.index
            ):
                out[-1] = ToolCallDelta(last.index, last.arguments + delta.arguments)
            else:
                out.append(delta)
        self._core.out = []
        return out

    def finish(self) -> list[Delta]:
        """The last deltas; ToolCallError if the output is not a complete, valid answer."""
        self._finished = True
        if self.plan.mode == "none":
            return []
        if self.plan.format == "generic":
            self._scanner.finish()
            if not self._scanner.done:
                raise ToolCallError("the output ended before its JSON did")
        else:
            if self._mode == "call":
                raise ToolCallError("the output ended inside a tool call")
            if self._mode == "text" and self._held:
                self._emit_text(self._held)
                self._held = ""
        core = self._core
        for index in sorted(core.names):
            if index not in core.complete:
                raise ToolCallError(f"tool call {index} has no complete arguments")
            self.plan.check(core.names[index], "".join(core.arguments[index]))
        if self.plan.mode == "required" and not core.names:
            raise ToolCallError("the output has no tool call")
        return self._take()

    def result(self) -> ToolOutput:
        if not self._finished:
            raise RuntimeError("finish() first")
        core = self._core
        content = "".join(core.content)
        calls = [
            ToolCall(core.ids[i], core.names[i], "".join(core.arguments[i]))
            for i in sorted(core.names)
        ]
        return ToolOutput(content=content or None, calls=calls)
