"""Grammars that make a model write a tool call in its own markup (for constrained decoding).

When a request requires a tool call (``tool_choice`` required, or a named tool) the
engine can force one; with ``auto`` and strict tools the model may still answer in text,
but a call it starts must be well formed. The grammar spells the model's tool-call
markers and embeds each tool's JSON schema for its arguments when the tool is strict
(any JSON object otherwise). Written in llguidance's Lark dialect (``%json`` embeds a
schema; ``&`` and ``~`` intersect and negate a lexeme's regex).

Only the DeepSeek-V3 markup is covered; other output formats return None (no
constraint), since a plain model has no tool-call markup to force and DeepSeek-V4's DSML
spells arguments one parameter at a time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

_V3_CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
_V3_CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
_V3_CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
_V3_CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
_V3_SEP = "<\uff5ctool\u2581sep\uff5c>"
_ANY_OBJECT = {"type": "object"}
#: llguidance's JSON layout options: compact JSON as json.dumps writes it. Free whitespace
#: would let a model pad the arguments with newlines until it runs out of tokens.
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a Lark string literal uses JSON's escapes


def forced_tools(tools: Sequence[Mapping[str, Any]], tool_choice: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The tools a request forces a call to: none unless tool_choice requires one."""
    kind = tool_choice.get("type")
    if kind == "required":
        return list(tools)
    if kind == "named":
        return [tool for tool in tools if tool.get("name") == tool_choice.get("name")]
    return []


def tool_call_grammar(output_format: str, request: Mapping[str, Any]) -> str | None:
    """A Lark grammar for the request's tool calls in the model's markup, or None.

    A required or named ``tool_choice`` forces exactly one call. With ``auto`` and at
    least one strict tool, the model may answer in text or end with one call, whose
    arguments then follow the tool's schema (any JSON object for a non-strict tool).
    """
    conversation = request.get("conversation") or {}
    tools = conversation.get("tools") or []
    choice = conversation.get("tool_choice") or {}
    if output_format != "deepseek_v3" or not tools:
        return None
    forced = forced_tools(tools, choice)
    if forced:
        head, callable_tools = ["start: calls"], forced
    elif choice.get("type", "auto") == "auto" and any(tool.get("strict") for tool in tools):
        # Text without the calls marker, or text that ends at its first marker and goes on
        # with the calls. (One lexeme up to the marker: a greedy text lexeme followed by a
        # separate marker literal would swallow the marker's first characters.)
        marker = re.escape(_V3_CALLS_BEGIN)
        head = [
            "start: TEXT | OPENING call_list",
            f"TEXT: /(?s:.*)/ & ~/(?s:.*{marker}.*)/",
            f"OPENING: /(?s:.*){marker}/ & ~/(?s:.*{marker}.+)/",
        ]
        callable_tools = list(tools)
    else:
        return None
    lines = [
        *head,
        f"calls: {_literal(_V3_CALLS_BEGIN)} call_list",
        f"call_list: call {_literal(_V3_CALLS_END)}",
        "call: " + " | ".join(f"call_{i}" for i in range(len(callable_tools))),
    ]
    for i, tool in enumerate(callable_tools):
        schema = tool.get("parameters") if tool.get("strict") and tool.get("parameters") else _ANY_OBJECT
        header = f"{_V3_CALL_BEGIN}function{_V3_SEP}{tool['name']}\n```json\n"
        lines.append(f"call_{i}: {_literal(header)} args_{i} {_literal(chr(10) + '```' + _V3_CALL_END)}")
        lines.append(f"args_{i}: %json {json.dumps({**schema, 'x-guidance': _LAYOUT})}")
    return "\n".join(lines) + "\n"
