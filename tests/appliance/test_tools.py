"""Tool calling's building blocks (appliance.validation.tools, the tool side of
shared.chat): grammars llama.cpp compiles over the real vocabulary, which take
the calls each tool_choice allows and nothing else; every text a grammar lets through
parses into valid calls; streamed deltas reassemble into exactly what the parse returns.
With the real model: test_structured_output.py."""

from __future__ import annotations

import itertools
import json
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from appliance.serving.engine import LlamaVocabulary
from appliance.validation.tools import (
    MAX_PARALLEL_CALLS,
    ContentDelta,
    ToolCallDelta,
    ToolCallError,
    ToolOutput,
    ToolPlan,
    ToolSpecError,
    plan_tools,
)
from shared.chat import (
    CHATML_TEMPLATE,
    GEMMA_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
)
from tests.appliance.grammar_check import Walker, accepts, compiles

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from appliance.state.records import ModelRecord

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["utc_offset"],
        },
    },
}
TOOLS = [WEATHER, TIME]

# A Hermes-style template of our own (the shape of Hermes 2 Pro's and Qwen 2.5's): tools
# listed in the system turn, calls as <tool_call> JSON, results in <tool_response>.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

GEMMA = ChatTemplate(GEMMA_TEMPLATE, "family:gemma3", "<bos>", "<eos>")
CHATML = ChatTemplate(CHATML_TEMPLATE, "chatml", "", "")
HERMES = ChatTemplate(HERMES_TEMPLATE, "gguf", "", "<|im_end|>")

CALL_WEATHER = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
CALL_TIME = '{"name": "get_time", "arguments": {"utc_offset": 2}}'


def generic(*calls: str) -> str:
    return '{"tool_calls": [' + ", ".join(calls) + "]}"


def hermes(*calls: str) -> str:
    return "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)


def counter() -> Callable[[], str]:
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


@pytest.fixture(scope="module")
def vocab(default_model: ModelRecord) -> Iterator[LlamaVocabulary]:
    loaded = LlamaVocabulary.load(default_model)
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def walker(vocab: LlamaVocabulary) -> Walker:
    return Walker(vocab)


CHOICES: list[Any] = ["auto", "required", {"type": "function", "function": {"name": "get_time"}}]


@pytest.mark.parametrize("template", [GEMMA, HERMES], ids=["generic", "hermes"])
@pytest.mark.parametrize("parallel", [False, True], ids=["single", "parallel"])
@pytest.mark.parametrize("choice", CHOICES, ids=["auto", "required", "named"])
def test_every_tool_choice_compiles(
    vocab: LlamaVocabulary, template: ChatTemplate, parallel: bool, choice: Any
) -> None:
    plan = plan_tools(TOOLS, choice, parallel_tool_calls=parallel, template=template)
    assert plan.grammar is not None
    assert compiles(vocab, plan.grammar), plan.grammar


def test_tool_choice_none_leaves_decoding_free() -> None:
    plan = plan_tools(TOOLS, "none", template=GEMMA)
    assert plan.grammar is None
    assert plan.system_prompt is None
    assert plan.parse("Just words.") == ToolOutput("Just words.", [])


def test_the_generic_grammar_takes_what_each_choice_allows(vocab: LlamaVocabulary) -> None:
    response = '{"response": "It is sunny."}'

    def grammar(choice: Any, *, parallel: bool) -> str:
        plan = plan_tools(TOOLS, choice, parallel_tool_calls=parallel, template=GEMMA)
        assert plan.grammar is not None
        return plan.grammar

    auto = grammar("auto", parallel=False)
    assert accepts(vocab, auto, response)
    assert accepts(vocab, auto, generic(CALL_WEATHER))
    assert not accepts(vocab, auto, generic(CALL_WEATHER, CALL_TIME))  # not parallel
    required = grammar("required", parallel=False)
    assert not accepts(vocab, required, response)
    assert accepts(vocab, required, generic(CALL_TIME))
    assert not accepts(vocab, required, generic())
    named = grammar(CHOICES[2], parallel=True)
    assert accepts(vocab, named, generic(CALL_TIME, CALL_TIME))
    assert not accepts(vocab, named, generic(CALL_WEATHER))
    parallel = grammar("required", parallel=True)
    assert accepts(vocab, parallel, generic(CALL_WEATHER, CALL_TIME))
    assert accepts(vocab, parallel, generic(*[CALL_TIME] * MAX_PARALLEL_CALLS))
    assert not accepts(vocab, parallel, generic(*[CALL_TIME] * (MAX_PARALLEL_CALLS + 1)))
    # Arguments fit the function's schema: the enum, the bounds, no extra keys.
    for wrong in (
        '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "kelvin"}}',
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
        '{"name": "get_time", "arguments": {"utc_offset": 15}}',
        '{"name": "get_sun", "arguments": {}}',
    ):
        assert not accepts(vocab, parallel, generic(wrong)), wrong


def test_the_hermes_grammar_takes_blocks_or_prose(vocab: LlamaVocabulary) -> None:
    auto = plan_tools(TOOLS, "auto", parallel_tool_calls=False, template=HERMES).grammar
    required = plan_tools(TOOLS, "required", parallel_tool_calls=True, template=HERMES).grammar
    assert auto is not None
    assert required is not None
    assert accepts(vocab, auto, hermes(CALL_WEATHER))
    assert accepts(vocab, auto, "It is sunny in Oslo.")
    assert accepts(vocab, auto, "Let me look.\n" + hermes(CALL_WEATHER))
    assert not accepts(vocab, auto, "<tool_call>{not json}</tool_call>")
    assert not accepts(vocab, auto, hermes(CALL_WEATHER, CALL_TIME))
    assert accepts(vocab, required, hermes(CALL_WEATHER, CALL_TIME))
    assert not accepts(vocab, required, "It is sunny.")


def reassemble(deltas: list[ContentDelta | ToolCallDelta]) -> tuple[str, dict[int, list[Any]]]:
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: dict[int, list[Any]] = {}
    for delta in deltas:
        if isinstance(delta, ToolCallDelta):
            calls.setdefault(delta.index, []).append(delta)
    return content, calls


def check_stream(plan: ToolPlan, text: str, rng: np.random.Generator) -> ToolOutput:
    """Feed ``text`` in random pieces; the deltas must add up to the stream's result and
    to a plain parse of the same text."""
    stream = plan.stream(counter())
    deltas: list[ContentDelta | ToolCallDelta] = []
    at = 0
    while at < len(text):
        step = int(rng.integers(1, 8))
        deltas += stream.feed(text[at : at + step])
        at += step
    deltas += stream.finish()
    result = stream.result()
    content, calls = reassemble(deltas)
    assert content == (result.content or "")
    assert sorted(calls) == list(range(len(result.calls)))
    for index, call in enumerate(result.calls):
        first, *rest = calls[index]
        assert first.to_openai() == {
            "index": index,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        assert all(d.id is None for d in rest)
        assert "".join(d.arguments for d in rest) == call.arguments_json
        assert json.loads(call.arguments_json) is not None
        assert call.arguments_json == json.dumps(
            json.loads(call.arguments_json), separators=(",", ":"), ensure_ascii=False
        )
    plain = plan.parse(text, counter())
    assert plain == result
    return result


@pytest.mark.parametrize("template", [GEMMA, HERMES], ids=["generic", "hermes"])
@pytest.mark.parametrize("choice", CHOICES, ids=["auto", "required", "named"])
def test_whatever_the_grammar_lets_through_parses_into_valid_calls(
    walker: Walker, template: ChatTemplate, choice: Any
) -> None:
    """Random walks through the grammar: each text is an answer the parser reads whole,
    streamed or not, with arguments that fit their schemas."""
    plan = plan_tools(TOOLS, choice, parallel_tool_calls=True, template=template)
    assert plan.grammar is not None
    rng = np.random.default_rng(11)
    texts = [walker.walk(plan.grammar, rng, max_steps=200) for _ in range(10)]
    done = [t for t in texts if t is not None]
    assert len(done) >= 5, texts
    for text in done:
        result = check_stream(plan, text, rng)
        if plan.mode == "required":
            assert result.calls
        for call in result.calls:
            assert call.name in {t.name for t in plan.callable}


def test_streams_decode_escapes_and_reassemble() -> None:
    rng = np.random.default_rng(3)
    plan = plan_tools(TOOLS, "auto", parallel_tool_calls=True, template=GEMMA)
    text = (
        '{ "tool_calls": [ {"name": "get_weather", "arguments": '
        '{ "city": "Z\\u00fcrich \\"old\\" \\ud83d\\ude00", "unit": "celsius" } },\n'
        '  {"name": "get_time", "arguments": {"utc_offset": -3}} ] }'
    )
    result = check_stream(plan, text, rng)
    assert [c.name for c in result.calls] == ["get_weather", "get_time"]
    assert json.loads(result.calls[0].arguments_json)["city"] == 'Zürich "old" 😀'
    assert result.calls[1].arguments_json == '{"utc_offset":-3}'
    answer = check_stream(plan, '{"response": "Line one\\nline \\"two\\" \\u00e9"}', rng)
    assert answer == ToolOutput('Line one\nline "two" é', [])
    hermes_plan = plan_tools(TOOLS, "auto", template=HERMES)
    prose = check_stream(hermes_plan, "No call <b>here</b>, just text.", rng)
    assert prose == ToolOutput("No call <b>here</b>, just text.", [])
    mixed = check_stream(hermes_plan, "Checking.\n" + hermes(CALL_WEATHER), rng)
    assert mixed.content == "Checking."
    assert mixed.calls[0].arguments_json == '{"city":"Oslo","unit":"celsius"}'


@pytest.mark.parametrize(
    "text",
    [
        generic(CALL_WEATHER)[:-3],  # cut by max_tokens
        generic('{"name": "get_weather", "arguments": {"city": 7, "unit": "celsius"}}'),
        generic('{"name": "get_sun", "arguments": {}}'),
        '{"response": "unfinished',
        '{"tool_calls": []}',
    ],
    ids=["cut", "bad-arguments", "unknown-function", "cut-response", "no-call"],
)
def test_an_answer_that_is_not_valid_raises(text: str) -> None:
    plan = plan_tools(TOOLS, "required", template=GEMMA)
    with pytest.raises(ToolCallError):
        plan.parse(text)


def test_a_hermes_call_cut_short_raises() -> None:
    plan = plan_tools(TOOLS, "auto", template=HERMES)
    with pytest.raises(ToolCallError, match="inside a tool call"):
        plan.parse('<tool_call>\n{"name": "get_weather", "argu')


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([], "required", "tool_choice"),
        ([WEATHER, WEATHER], "auto", "tools[1]"),
        ([{"type": "code_interpreter"}], "auto", "tools[0]"),
        ([{"type": "function", "function": {"name": "bad name"}}], "auto", "tools[0]"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
            "auto",
            "tools[0].function.parameters",
        ),
        (
            [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "integer", "minimum": 3, "maximum": 1},
                    },
                }
            ],
            "auto",
            "tools",
        ),
    ],
    ids=[
        "unknown-name",
        "bad-choice",
        "no-tools",
        "twice",
        "not-function",
        "bad-name",
        "bad-schema",
        "unenforceable",
    ],
)
def test_tools_that_cannot_be_served_are_refused(
    tools: list[dict[str, Any]], choice: Any, param: str
) -> None:
    with pytest.raises(ToolSpecError) as refused:
        plan_tools(tools, choice, template=GEMMA)
    assert refused.value.param == param


def test_the_generic_prompt_lists_the_tools_and_the_format() -> None:
    plan = plan_tools(TOOLS, "auto", template=GEMMA)
    assert plan.format == "generic"
    assert plan.system_prompt is not None
    assert plan.system_prompt.startswith(
        "You can call any of the following tools to satisfy the user's requests: ["
    )
    assert '"name": "get_weather"' in plan.system_prompt
    assert "Example tool call syntax:" in plan.system_prompt
    assert plan.system_prompt.endswith(
        "Respond in JSON format, either with `tool_calls` (a request to call tools) or "
        "with `response` reply to the user's request"
    )
    named = plan_tools(TOOLS, CHOICES[2], template=GEMMA)
    assert named.system_prompt is not None
    assert named.system_prompt.endswith("calling `get_time`")


CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather and time in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city":"Oslo","unit":"celsius"}',
                },
            },
            {
                "id": "call_b",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"utc_offset":1}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_a", "content": "4 degrees, rain"},
    {"role": "tool", "tool_call_id": "call_b", "content": "14:05"},
    {"role": "user", "content": "Thanks. Anything else?"},
]


def test_gemma_reads_calls_and_results_as_text_in_alternating_turns() -> None:
    plan = plan_tools(TOOLS, "auto", template=GEMMA)
    prompt = plan.render(GEMMA, CONVERSATION)
    turns = prompt.split("<start_of_turn>")[1:]
    assert [t.split("\n", 1)[0] for t in turns] == ["user", "model", "user", "model"]
    assert turns[0].startswith("user\nBe brief.\n\nYou can call any of the following tools")
    assert '"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"' in turns[1]
    assert "Tool result get_weather (call call_a):\n4 degrees, rain" in turns[2]
    assert "Tool result get_time (call call_b):\n14:05" in turns[2]
    assert "Thanks. Anything else?" in turns[2]
    assert turns[3] == "model\n"
    # The same conversation without folding breaks Gemma's alternation.
    with pytest.raises(ChatTemplateError):
        GEMMA.render(
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        )


def test_chatml_fallback_reads_tool_results_as_a_user_turn() -> None:
    prompt = CHATML.render(CONVERSATION)
    assert "<|im_start|>tool" not in prompt
    assert "<|im_start|>user\nTool result get_weather (call call_a):" in prompt


def test_a_template_that_knows_tools_gets_them_as_transformers_passes_them() -> None:
    assert HERMES.knows_tools
    assert HERMES.tool_format == "hermes"
    assert not GEMMA.knows_tools
    plan = plan_tools(TOOLS, "auto", template=HERMES)
    assert plan.system_prompt is None  # the template shows the tools itself
    prompt = plan.render(HERMES, CONVERSATION)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n")
    assert json.dumps(plan.tools[0].to_openai()) in prompt  # plain JSON, not HTML-escaped
    # Arguments reach the template as objects, so its tojson writes JSON, not a string.
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
        in prompt
    )
    assert "<tool_response>\n14:05\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
