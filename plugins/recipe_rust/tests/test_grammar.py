"""Tool-call grammars (powertrain_recipe.grammar) run through llguidance's own matcher:
the texts a model may write are accepted, the malformed ones are not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from powertrain_recipe.grammar import tool_call_grammar

llguidance = pytest.importorskip("llguidance")

TOKENIZER = Path(__file__).parent / "fixtures" / "smollm2" / "tokenizer.json"
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


def accepts(grammar: str, text: str) -> bool:
    """Whether the grammar allows exactly ``text`` and then the end."""
    tokenizer = llguidance.LLTokenizer(TOKENIZER.read_text(), eos_token=0)
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.tokenize_str(text)
    return matcher.consume_tokens(ids) and matcher.is_accepting()


def request(choice: dict, tools: list[dict] = TOOLS) -> dict:
    return {"conversation": {"tools": tools, "tool_choice": choice}}


def test_a_required_call_must_be_well_formed_and_follow_a_strict_schema() -> None:
    grammar = tool_call_grammar("deepseek_v3", request({"type": "required"}))
    assert accepts(grammar, call("get_time", '{"zone": "UTC"}'))
    assert accepts(grammar, call("note", '{"text": "anything", "extra": 1}'))  # not strict: any object
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


def test_no_constraint_when_nothing_is_forced_or_strict_or_the_format_has_no_markup() -> None:
    loose = [{**tool, "strict": False} for tool in TOOLS]
    assert tool_call_grammar("deepseek_v3", request({"type": "auto"}, loose)) is None
    assert tool_call_grammar("deepseek_v3", request({"type": "none"})) is None
    assert tool_call_grammar("plain", request({"type": "required"})) is None
    assert tool_call_grammar("deepseek_v4", request({"type": "required"})) is None
    assert tool_call_grammar("deepseek_v3", request({"type": "required"}, [])) is None
