"""Tool-call grammars (powertrain_recipe.grammar) run through llguidance's own matcher:
the texts a model may write are accepted, the malformed ones are not; and what a grammar
accepts, the request's stream parser reads back as calls whose arguments validate."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from powertrain.interfaces.sampling import StructuredOutput
from powertrain_recipe import RecipeAdapter
from powertrain_recipe.grammar import forced_call, tool_call_grammar

llguidance = pytest.importorskip("llguidance")

FIXTURES = Path(__file__).parent / "fixtures"
TOKENIZER = FIXTURES / "smollm2" / "tokenizer.json"
BEGIN, END = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL, CALL_END = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"
ZONE = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"name": "get_time", "parameters": ZONE, "strict": True},
    {"name": "note", "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}},
]


def call(name: str, arguments: str) -> str:
    return f"{BEGIN}{CALL}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}{END}"


@functools.cache
def smollm2_tokenizer() -> Any:
    return llguidance.LLTokenizer(TOKENIZER.read_text(), eos_token=0)


def accepts(grammar: str, text: str) -> bool:
    """Whether the grammar allows exactly ``text`` and then the end."""
    tokenizer = smollm2_tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.tokenize_str(text)
    return matcher.consume_tokens(ids) and matcher.is_accepting()


def request(choice: dict, tools: list[dict] = TOOLS, **conversation: Any) -> dict:
    return {"conversation": {"tools": tools, "tool_choice": choice, **conversation}}


def test_a_required_call_must_be_well_formed_and_follow_the_schema() -> None:
    grammar = tool_call_grammar("deepseek_v3", request({"type": "required"}))
    assert accepts(grammar, call("get_time", '{"zone": "UTC"}'))
    assert accepts(grammar, call("note", '{"text": "anything", "extra": 1}'))  # its schema allows more keys
    # A forced call follows the schema of a tool not marked strict too.
    assert not accepts(grammar, call("note", '{"text": 5}'))
    assert not accepts(grammar, call("get_time", '{"zone": "PST"}'))
    assert not accepts(grammar, call("unknown", "{}"))
    assert not accepts(grammar, "Just text.")


def test_a_named_call_allows_only_that_tool() -> None:
    grammar = tool_call_grammar("deepseek_v3", request({"type": "named", "name": "get_time"}))
    assert accepts(grammar, call("get_time", '{"zone": "CET"}'))
    assert not accepts(grammar, call("note", '{"text": "x"}'))


def test_auto_with_a_strict_tool_allows_text_or_one_well_formed_call() -> None:
    grammar = tool_call_grammar("deepseek_v3", request({"type": "auto"}))
    assert accepts(grammar, "The time zone is UTC.")
    assert accepts(grammar, "")
    assert accepts(grammar, "Let me check. " + call("get_time", json.dumps({"zone": "UTC"})))
    assert not accepts(grammar, "Let me check. " + call("get_time", '{"zone": "Mars"}'))


def test_auto_with_a_loose_tool_still_takes_any_object() -> None:
    grammar = tool_call_grammar("deepseek_v3", request({"type": "auto"}))
    assert accepts(grammar, call("note", '{"text": 5}'))  # auto keeps schemas of strict tools only


def test_no_constraint_when_nothing_is_forced_or_strict() -> None:
    loose = [{**tool, "strict": False} for tool in TOOLS]
    assert tool_call_grammar("deepseek_v3", request({"type": "auto"}, loose)) is None
    for output_format in ("deepseek_v3", "deepseek_v4", "plain"):
        assert tool_call_grammar(output_format, request({"type": "none"})) is None
        assert tool_call_grammar(output_format, request({"type": "required"}, [])) is None
    for output_format in ("deepseek_v4", "plain"):
        assert tool_call_grammar(output_format, request({"type": "auto"})) is None
        assert forced_call(output_format, "json", request({"type": "auto"})) is None


# --------------------------------------------------------------------------- DeepSeek-V4 (DSML)

V4_OPENED = "<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "a city", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
    },
    "required": ["city", "days"],
}
V4_TOOLS = [
    {"name": "get_weather", "parameters": WEATHER},  # not strict: forced calls follow it anyway
    {"name": "get_time", "parameters": ZONE, "strict": True},
    {"name": "anything", "parameters": {"type": "object"}},
]


def invoke(name: str, *params: tuple[str, bool, str], tag: str = "｜DSML｜") -> str:
    body = "".join(
        f'<{tag}parameter name="{p}" string="{"true" if raw else "false"}">{value}</{tag}parameter>\n'
        for p, raw, value in params
    )
    return f'<{tag}invoke name="{name}">\n{body}</{tag}invoke>'


def v4_calls(*invokes: str, tag: str = "｜DSML｜", block: str = "tool_calls") -> str:
    return "\n".join(invokes) + f"\n</{tag}{block}>"


def test_v4_required_spells_parameters_one_at_a_time_as_the_schema_says() -> None:
    grammar = tool_call_grammar("deepseek_v4", request({"type": "required"}, V4_TOOLS), prompt=V4_OPENED)
    StructuredOutput("lark", grammar).check()
    full = invoke(
        "get_weather",
        ("city", True, "Paris <b>"),
        ("unit", True, "celsius"),
        ("days", False, "3"),
        ("metric", False, "true"),
        ("tags", False, '["a", "b"]'),
        ("code", False, '"CDG"'),
    )
    assert accepts(grammar, v4_calls(full))
    assert accepts(grammar, v4_calls(invoke("get_weather", ("city", True, ""), ("days", False, "7"))))
    # Several calls, in the order the V4 encoding writes them.
    assert accepts(grammar, v4_calls(full, invoke("get_time", ("zone", True, "CET"))))
    # A schema without properties takes any parameters.
    assert accepts(grammar, v4_calls(invoke("anything", ("x", True, "1"), ("y", False, '{"z": null}'))))
    assert accepts(grammar, v4_calls(invoke("anything")))
    refused = [
        invoke("get_weather", ("city", True, "Paris")),  # days is required
        invoke("get_weather", ("days", False, "3"), ("city", True, "Paris")),  # the schema's order
        invoke("get_weather", ("city", True, "Paris"), ("days", False, "8")),  # maximum 7
        invoke("get_weather", ("city", True, "Paris"), ("days", False, "2.5")),
        invoke("get_weather", ("city", True, "Paris"), ("days", True, "3")),  # an integer is JSON
        invoke("get_weather", ("city", True, "A" * 13), ("days", False, "3")),  # maxLength 12
        invoke("get_weather", ("city", True, "Paris"), ("unit", True, "kelvin"), ("days", False, "3")),
        invoke("get_weather", ("city", True, "Paris"), ("days", False, "3"), ("code", False, '"cdg"')),
        invoke("get_weather", ("city", True, "Paris"), ("days", False, "3"), ("extra", True, "x")),
        invoke("get_time", ("zone", True, "PST")),
        invoke("unknown"),
    ]
    for text in refused:
        assert not accepts(grammar, v4_calls(text)), text
    assert not accepts(grammar, "The weather is fine.")
    assert not accepts(grammar, "<｜DSML｜tool_calls>\n" + v4_calls(full))  # the prompt opened the block


def test_v4_named_allows_one_call_of_that_tool() -> None:
    grammar = tool_call_grammar(
        "deepseek_v4", request({"type": "named", "name": "get_time"}, V4_TOOLS), prompt=V4_OPENED
    )
    one = invoke("get_time", ("zone", True, "UTC"))
    assert accepts(grammar, v4_calls(one))
    assert not accepts(grammar, v4_calls(one, one))
    assert not accepts(grammar, v4_calls(invoke("get_weather", ("city", True, "x"), ("days", False, "1"))))


def test_v41_spelling_and_a_block_the_prompt_did_not_open() -> None:
    tag = "｜DSML｜ "
    prompt = "<｜Assistant｜></think>\n\n<｜DSML｜ calls>\n"
    grammar = tool_call_grammar("deepseek_v4", request({"type": "required"}, V4_TOOLS), prompt=prompt)
    one = invoke("get_time", ("zone", True, "UTC"), tag=tag)
    assert accepts(grammar, v4_calls(one, tag=tag, block="calls"))
    assert not accepts(grammar, v4_calls(invoke("get_time", ("zone", True, "UTC")), block="tool_calls"))
    # V4.1 writes a blank line in an invoke without parameters.
    assert accepts(grammar, v4_calls(f'<{tag}invoke name="anything">\n\n</{tag}invoke>', tag=tag, block="calls"))
    # Not opened by the prompt (a V3.2 model rendered by its chat template): the grammar opens it.
    grammar = tool_call_grammar("deepseek_v4", request({"type": "required"}, V4_TOOLS), prompt="<｜Assistant｜>")
    text = "\n\n<｜DSML｜function_calls>\n" + v4_calls(
        invoke("get_time", ("zone", True, "UTC")), block="function_calls"
    )
    assert accepts(grammar, text)


# --------------------------------------------------------------------------- plain models

NOTE = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 8}}, "required": ["text"]}
PLAIN_TOOLS = [{"name": "get_time", "parameters": ZONE, "strict": True}, {"name": "note", "parameters": NOTE}]


def test_plain_required_is_vllms_json_list_with_each_schema() -> None:
    grammar = tool_call_grammar("plain", request({"type": "required"}, PLAIN_TOOLS))
    StructuredOutput("lark", grammar).check()
    assert forced_call("plain", "json", request({"type": "required"}, PLAIN_TOOLS)) == ("json_list", None)
    assert accepts(grammar, '[{"name": "get_time", "parameters": {"zone": "UTC"}}]')
    assert accepts(
        grammar, '[{"name": "note", "parameters": {"text": "hi"}}, {"name": "get_time", "parameters": {"zone": "CET"}}]'
    )
    for text in [
        "[]",
        "The time is noon.",
        '[{"name": "note", "parameters": {"text": 5}}]',  # not strict, still its schema
        '[{"name": "note", "parameters": {"text": "far too long"}}]',
        '[{"name": "note", "parameters": {}}]',
        '[{"name": "other", "parameters": {}}]',
        '[{"name": "get_time", "parameters": {"zone": "UTC"}}] and more',
    ]:
        assert not accepts(grammar, text), text


def test_plain_named_is_that_tools_arguments_alone() -> None:
    choice = {"type": "named", "name": "note"}
    grammar = tool_call_grammar("plain", request(choice, PLAIN_TOOLS))
    assert forced_call("plain", "json", request(choice, PLAIN_TOOLS)) == ("arguments", "note")
    assert accepts(grammar, '{"text": "hi"}')
    assert not accepts(grammar, '{"text": 1}')
    assert not accepts(grammar, '[{"name": "note", "parameters": {"text": "hi"}}]')


def test_plain_with_a_hermes_template_writes_tool_call_blocks() -> None:
    grammar = tool_call_grammar("plain", request({"type": "required"}, PLAIN_TOOLS), syntax="hermes")
    assert forced_call("plain", "hermes", request({"type": "required"}, PLAIN_TOOLS)) == ("hermes", None)
    block = '<tool_call>\n{"name": "note", "arguments": {"text": "hi"}}\n</tool_call>'
    assert accepts(grammar, block)
    assert accepts(grammar, block + "\n" + block)
    assert not accepts(grammar, '<tool_call>\n{"name": "note", "arguments": {"text": 1}}\n</tool_call>')
    assert not accepts(grammar, '[{"name": "note", "parameters": {"text": "hi"}}]')
    named = tool_call_grammar("plain", request({"type": "named", "name": "note"}, PLAIN_TOOLS), syntax="hermes")
    assert accepts(named, block) and not accepts(named, block + "\n" + block)


def test_required_without_parallel_calls_allows_exactly_one_call_in_every_syntax() -> None:
    """``single_tool_call`` (parallel_tool_calls false, disable_parallel_tool_use) under
    required: one call of any forced tool, never two; the same request with parallel
    calls takes two."""
    time = invoke("get_time", ("zone", True, "UTC"))
    note = '{"name": "note", "parameters": {"text": "hi"}}'
    block = '<tool_call>\n{"name": "note", "arguments": {"text": "hi"}}\n</tool_call>'
    cases = [
        ("deepseek_v4", "json", V4_TOOLS, V4_OPENED, v4_calls(time), v4_calls(time, time)),
        ("plain", "json", PLAIN_TOOLS, "", f"[{note}]", f"[{note}, {note}]"),
        ("plain", "hermes", PLAIN_TOOLS, "", block, block + "\n" + block),
    ]
    for output_format, syntax, tools, prompt, one, two in cases:
        single = request({"type": "required"}, tools, single_tool_call=True)
        grammar = tool_call_grammar(output_format, single, prompt=prompt, syntax=syntax)
        assert accepts(grammar, one) and not accepts(grammar, two), (output_format, syntax)
        parallel = tool_call_grammar(output_format, request({"type": "required"}, tools), prompt=prompt, syntax=syntax)
        assert accepts(parallel, two), (output_format, syntax)


# --------------------------------------------------------------------------- grammar -> parser

SMOLLM2_CONFIG = json.loads((FIXTURES / "smollm2" / "tokenizer_config.json").read_text())


def adapters() -> dict[str, RecipeAdapter]:
    from powertrain.testing.checkpoints import tiny_tokenizer

    smollm2 = TOKENIZER.read_text()
    hermes = {**SMOLLM2_CONFIG, "chat_template": (FIXTURES / "qwen_like_tools.jinja").read_text()}
    return {
        "plain": RecipeAdapter(smollm2, SMOLLM2_CONFIG, {"model_type": "llama"}),
        "hermes": RecipeAdapter(smollm2, hermes, {"model_type": "qwen2"}),
        "deepseek_v4": RecipeAdapter(tiny_tokenizer().to_str(), {}, {"model_type": "deepseek_v4"}),
    }


def test_the_tool_syntax_comes_from_the_template_the_prompt_is_rendered_with() -> None:
    hermes = (FIXTURES / "qwen_like_tools.jinja").read_text()
    smollm2 = TOKENIZER.read_text()
    assert adapters()["plain"].tool_syntax == "json"
    assert adapters()["hermes"].tool_syntax == "hermes"
    # A list of named templates: "default", else the first (as the encoder chooses).
    for templates, syntax in [
        ([{"name": "tool_use", "template": hermes}, {"name": "default", "template": "{{ messages }}"}], "json"),
        ([{"name": "tool_use", "template": hermes}, {"name": "rag", "template": "{{ messages }}"}], "hermes"),
    ]:
        assert RecipeAdapter(smollm2, {**SMOLLM2_CONFIG, "chat_template": templates}, {}).tool_syntax == syntax


def openai_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": tool} for tool in tools]


#: What a model may write for required / named (get_time), per adapter.
WRITTEN = {
    "plain": (
        '[{"name": "note", "parameters": {"text": "a}\\"b"}}, {"name": "get_time", "parameters": {"zone": "UTC"}}]',
        '{"zone": "CET"}',
    ),
    "hermes": (
        '<tool_call>\n{"name": "note", "arguments": {"text": "a}\\"b"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
    ),
    "deepseek_v4": (
        v4_calls(invoke("note", ("text", True, 'a}"b')), invoke("get_time", ("zone", True, "UTC"))),
        v4_calls(invoke("get_time", ("zone", True, "CET"))),
    ),
}


@pytest.mark.parametrize("kind", ["plain", "hermes", "deepseek_v4"])
def test_what_the_grammar_accepts_the_parser_reads_back_as_valid_calls(kind: str) -> None:
    adapter = adapters()[kind]
    schemas = {tool["name"]: tool["parameters"] for tool in PLAIN_TOOLS}
    for choice, text, names in [
        ("required", WRITTEN[kind][0], ["note", "get_time"]),
        ({"type": "function", "function": {"name": "get_time"}}, WRITTEN[kind][1], ["get_time"]),
    ]:
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "What time is it?"}],
            "tools": openai_tools(PLAIN_TOOLS),
            "tool_choice": choice,
            "thinking": {"type": "disabled"},  # a forced DSML call needs thinking off
        }
        parsed = adapter.parse_request("openai.chat", json.dumps(body).encode())
        grammar = adapter.tool_call_grammar(parsed)
        assert grammar is not None and accepts(grammar, text), (kind, choice)
        parser = adapter.stream_parser(parsed, id_prefix="call_x")
        events = [event for piece in text for event in parser.push(piece)] + parser.finish()
        calls: dict[int, dict[str, Any]] = {}
        for event in events:
            assert event["type"] != "text", event
            if event["type"] == "tool_call_start":
                calls[event["index"]] = {"name": event["name"], "arguments": ""}
            elif event["type"] == "tool_call_arguments":
                calls[event["index"]]["arguments"] += event["delta"]
        assert [c["name"] for c in calls.values()] == names
        for c in calls.values():
            jsonschema.validate(json.loads(c["arguments"]), schemas[c["name"]])
        assert adapter.finish_reason(events, "stop") == ("tool_calls", None)
