"""Chat templates: the model's own (GGUF `tokenizer.chat_template`), else one for its family.

Templates are Jinja, rendered in a sandbox as Hugging Face and llama.cpp do. A model whose GGUF
carries no template (the default Gemma 3 270M is a base model) gets its family's published
turn format, so the prompt is the one the family was trained on; the source is reported.

Tool calling: a template that knows tools (it renders ``tools`` and ``tool_calls``) gets
them as Transformers passes them: ``tools`` as ``{"type": "function", "function": {...}}``
items, assistant ``tool_calls`` with their arguments as objects, ``tool`` messages with
``tool_call_id``. Any other template (Gemma's, ChatML) gets the same conversation as text
it can read: a call as the JSON the model was asked to write, and tool results folded
into a user turn, so Gemma's strict user/assistant alternation still holds.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from jinja2 import Template

# Gemma's published turn format (the template of the instruction-tuned Gemma 3 models,
# text parts only): a system message is folded into the first user turn.
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set first_user_prefix = '' -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}
{{- message['content'] | trim }}
{{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<start_of_turn>model\n' }}
{%- endif -%}"""

CHATML_TEMPLATE = """{%- for message in messages -%}
{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"""

_FAMILY_TEMPLATES = {"gemma": GEMMA_TEMPLATE, "gemma2": GEMMA_TEMPLATE, "gemma3": GEMMA_TEMPLATE}


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with the model's template (e.g. roles out of order)."""


def _raise(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Transformers' tojson: plain json.dumps (Jinja's own escapes <, > and & for HTML).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def call_arguments(call: dict[str, Any]) -> Any:
    """A tool call's arguments as an object (OpenAI sends them as a JSON string)."""
    function = call.get("function") or {}
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def calls_as_text(calls: list[dict[str, Any]]) -> str:
    """Prior tool calls as the JSON the generic tool format asks the model to write."""
    listed = [
        {"name": (c.get("function") or {}).get("name"), "arguments": call_arguments(c)}
        for c in calls
    ]
    return json.dumps({"tool_calls": listed}, ensure_ascii=False)


def result_as_text(message: dict[str, Any], names: dict[str, str]) -> str:
    call_id = message.get("tool_call_id") or ""
    name = message.get("name") or names.get(call_id, "")
    label = " ".join(p for p in (name, f"(call {call_id})" if call_id else "") if p)
    return f"Tool result{' ' + label if label else ''}:\n{message.get('content') or ''}"


def tools_as_text_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation for a template that knows no tools: calls written out as JSON in
    the assistant turn, tool results folded into a user turn (one for consecutive results,
    merged with a user turn beside them)."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"]
            for call in calls:
                names[call.get("id") or ""] = (call.get("function") or {}).get("name", "")
            text = "\n".join(p for p in (message.get("content") or "", calls_as_text(calls)) if p)
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            text = result_as_text(message, names)
            if out and out[-1]["role"] == "user":
                out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n\n{text}"}
            else:
                out.append({"role": "user", "content": text})
        else:
            if role == "user" and out and out[-1]["role"] == "user":
                merged = f"{out[-1]['content']}\n\n{message.get('content') or ''}"
                out[-1] = {"role": "user", "content": merged}
                continue
            out.append({k: v for k, v in message.items() if k != "tool_calls"})
    return out


def _native_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as Transformers hands them to a tool-aware template."""
    out = []
    for original in messages:
        message = original
        if message.get("tool_calls"):
            calls = [
                {
                    **call,
                    "type": call.get("type", "function"),
                    "function": {**(call.get("function") or {}), "arguments": call_arguments(call)},
                }
                for call in message["tool_calls"]
            ]
            message = {**message, "tool_calls": calls, "content": message.get("content") or ""}
        out.append(message)
    return out


@functools.lru_cache(maxsize=64)
def _compiled(source: str) -> Template:
    """A template's source compiled once, in the sandbox (about 5 ms a time: at every
    request, a burst's refusals waited behind it). A compiled template renders any number
    of times, from any thread; one that does not compile raises each time it is asked."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = _tojson
    return env.from_string(source)


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    origin: str  # "gguf", "family:<arch>" or "chatml"
    bos_token: str
    eos_token: str

    @property
    def knows_tools(self) -> bool:
        """Whether the template renders tools and tool calls itself."""
        return "tools" in self.source and "tool_call" in self.source

    @property
    def tool_format(self) -> str:
        """``hermes`` (``<tool_call>{json}</tool_call>``, Hermes/Qwen) or ``generic``."""
        return "hermes" if self.knows_tools and "<tool_call>" in self.source else "generic"

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt. ``tools`` (OpenAI's shape) reach only a template that knows tools;
        tool messages and calls reach any template, as text where it knows none."""
        # jinja2 (about 7 MiB) where prompts are rendered, the gateway: the model worker
        # holds a ChatTemplate with its vocabulary and never renders it.
        from jinja2 import TemplateError  # noqa: PLC0415

        native = self.knows_tools
        extra: dict[str, Any] = {}
        if native:
            messages = _native_messages(messages)
            if tools:
                extra["tools"] = tools
        elif any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
            messages = tools_as_text_messages(messages)
        try:
            template = _compiled(self.source)
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except ChatTemplateError:
            raise
        except TemplateError as err:
            raise ChatTemplateError(f"the chat template failed: {err}") from err


def select_template(
    gguf_template: str | None, architecture: str | None, bos_token: str, eos_token: str
) -> ChatTemplate:
    if gguf_template:
        return ChatTemplate(gguf_template, "gguf", bos_token, eos_token)
    if architecture in _FAMILY_TEMPLATES:
        return ChatTemplate(
            _FAMILY_TEMPLATES[architecture], f"family:{architecture}", bos_token, eos_token
        )
    return ChatTemplate(CHATML_TEMPLATE, "chatml", bos_token, eos_token)
