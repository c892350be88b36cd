"""Chat templates: the model's own (GGUF `tokenizer.chat_template`), else one for its family.

Templates are Jinja, rendered in a sandbox as Hugging Face and llama.cpp do. A model whose GGUF
carries no template (the default Gemma 3 270M is a base model) gets its family's published
turn format, so the prompt is the one the family was trained on; the source is reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

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


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    origin: str  # "gguf", "family:<arch>" or "chatml"
    bos_token: str
    eos_token: str

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            template = env.from_string(self.source)
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
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
