"""Grammars that make a model write a tool call in its own markup (for constrained decoding).

When a request requires a tool call (``tool_choice`` required, or a named tool) the engine
forces one, as vLLM does: decoding is constrained to the model's tool-call syntax with each
forced tool's JSON schema on its arguments (strict or not: a forced call must validate;
llguidance's ``lenient`` mode for tools not marked strict, so a keyword it cannot enforce is
skipped instead of refusing the request). Required allows one call or several (DeepSeek-V3
markup: one; exactly one when the request allows no parallel calls, ``single_tool_call``),
named exactly one call of that tool. ``auto`` forces nothing; only for DeepSeek-V3 markup and at
least one strict tool it keeps a call the model starts well formed (a strict tool's schema,
any JSON object for the others). ``none`` is never constrained. Written in llguidance's
Lark dialect (``%json`` embeds a schema; ``&`` and ``~`` intersect and negate a lexeme's
regex).

The syntax per output format:

- ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
  \\n```json\\nARGS\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>`` (one call).
- ``deepseek_v4`` (DSML): invokes in the block the V4 encoding opened at the end of the
  prompt (``\\n\\n<｜DSML｜tool_calls>\\n``, V4.1's ``<｜DSML｜ calls>``; the grammar starts
  inside it, as the stream parser does), or that the grammar opens in DeepSeek-V3.2's
  spelling when the prompt did not (only a V3.2 model rendered by its chat template
  gets here). Arguments are spelled one parameter at a time, in the schema's order,
  required ones always: a string-typed property as raw text (``string="true"``; an enum
  or const as its literal values, min/maxLength as the text's length), every other as
  JSON of the property's schema (``string="false"``), which is also the fallback for what
  raw text cannot express (a pattern, a format, several types). A schema without
  ``properties`` takes any parameters. Object-level keywords (``minProperties``,
  ``dependentRequired``, ``anyOf`` of whole objects...) are not enforced in this form.
- ``plain`` with a chat template that writes ``<tool_call>`` (Hermes, e.g. Qwen2.5):
  ``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`` blocks joined by a
  newline.
- ``plain`` otherwise (e.g. SmolLM2), vLLM's form: for required, a JSON array
  ``[{"name": NAME, "parameters": ARGS}, ...]``; for a named tool, its arguments object
  alone. The chat template gets the request's tools (``tools``, as transformers passes
  them); one that does not show them, like SmolLM2's, leaves them out of the prompt, as
  it would in vLLM: the grammar alone then spells the call's names and keys.

A plain model's output is read back as calls only when the stream parser is told the
form (``forced_call``); the DeepSeek formats parse their markup whatever the request.
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
_DSML = "<\uff5cDSML\uff5c"
_DSML_END = "</\uff5cDSML\uff5c"
#: The DSML spellings (the stream parser's ``DSML_V32``, ``DSML_V4``, ``DSML_V41``):
#: the block's name, and the separator before ``invoke`` / ``parameter``.
_DSML_SPELLINGS = {"v32": ("function_calls", ""), "v4": ("tool_calls", ""), "v41": (" calls", " ")}
_STRING_TRUE, _STRING_FALSE = ' string="true">', ' string="false">'
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_ANY_OBJECT = {"type": "object"}
#: llguidance's JSON layout options: compact JSON as json.dumps writes it. Free whitespace
#: would let a model pad the arguments with newlines until it runs out of tokens.
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: Keys a string property may have and still be written as raw DSML text.
_RAW_STRING_KEYS = {
    "type",
    "enum",
    "const",
    "minLength",
    "maxLength",
    "title",
    "description",
    "default",
    "examples",
    "deprecated",
    "readOnly",
    "writeOnly",
    "$comment",
}


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a Lark string literal uses JSON's escapes


def _regex(text: str) -> str:
    """``text`` matched literally inside a Lark ``/.../`` regex."""
    return re.escape(text).replace("/", "\\/")


def forced_tools(tools: Sequence[Mapping[str, Any]], tool_choice: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The tools a request forces a call to: none unless tool_choice requires one."""
    kind = tool_choice.get("type")
    if kind == "required":
        return list(tools)
    if kind == "named":
        return [tool for tool in tools if tool.get("name") == tool_choice.get("name")]
    return []


def tool_syntax(chat_template: str | None) -> str:
    """How a plain model writes tool calls, from its chat template: ``"hermes"`` when the
    template spells ``<tool_call>`` blocks, else ``"json"`` (vLLM's fallback forms)."""
    return "hermes" if chat_template and _HERMES_OPEN in chat_template else "json"


def forced_call(output_format: str, syntax: str, request: Mapping[str, Any]) -> tuple[str, str | None] | None:
    """The form a plain model's forced call is written in, as the stream parser takes it
    (``forced_call``, ``tool_name``): ``("hermes", None)``, ``("json_list", None)`` or
    ``("arguments", name)``; None when nothing is forced or the format has its own markup."""
    conversation = request.get("conversation") or {}
    choice = conversation.get("tool_choice") or {}
    if output_format != "plain" or not forced_tools(conversation.get("tools") or [], choice):
        return None
    if syntax == "hermes":
        return "hermes", None
    if choice.get("type") == "named":
        return "arguments", choice["name"]
    return "json_list", None


def tool_call_grammar(
    output_format: str, request: Mapping[str, Any], *, prompt: str = "", syntax: str = "json"
) -> str | None:
    """A Lark grammar for the request's tool calls in the model's syntax, or None.

    ``prompt`` is the rendered prompt (a DSML block it opened is where the grammar
    starts); ``syntax`` is a plain model's ``tool_syntax``.
    """
    conversation = request.get("conversation") or {}
    tools = conversation.get("tools") or []
    choice = conversation.get("tool_choice") or {}
    if not tools:
        return None
    forced = forced_tools(tools, choice)
    # One call: a named tool, or parallel calls turned off (protocols refuse that under auto).
    single = choice.get("type") == "named" or bool(conversation.get("single_tool_call"))
    if output_format == "deepseek_v3":
        return _v3_grammar(tools, forced, choice)
    if not forced:
        return None
    if output_format == "deepseek_v4":
        return _dsml_grammar(forced, single, prompt)
    if output_format != "plain":
        return None
    if syntax == "hermes":
        return _hermes_grammar(forced, single)
    if choice.get("type") == "named":
        return "start: args_0\n" + _arguments_rule(0, forced[0], forced=True)
    return _json_list_grammar(forced, single)


def _arguments_schema(tool: Mapping[str, Any], forced: bool) -> dict[str, Any]:
    """The JSON schema a call's arguments are held to: the tool's when the call is forced
    or the tool is strict (lenient unless strict), else any object."""
    parameters = tool.get("parameters")
    if not (forced or tool.get("strict")) or not isinstance(parameters, Mapping):
        return _ANY_OBJECT
    return dict(parameters)


def _json_rule(name: str, schema: Mapping[str, Any], strict: bool) -> str:
    """``name: %json {...}``: ``schema`` in the compact layout (lenient unless ``strict``)."""
    layout = _LAYOUT if strict else {**_LAYOUT, "lenient": True}
    return f"{name}: %json {json.dumps({**schema, 'x-guidance': layout}, ensure_ascii=False)}"


def _arguments_rule(i: int, tool: Mapping[str, Any], forced: bool) -> str:
    return _json_rule(f"args_{i}", _arguments_schema(tool, forced), bool(tool.get("strict"))) + "\n"


def _v3_grammar(
    tools: Sequence[Mapping[str, Any]], forced: Sequence[Mapping[str, Any]], choice: Mapping[str, Any]
) -> str | None:
    """DeepSeek-V3 markup: a forced call, or (``auto`` with a strict tool) text that may end
    with one well-formed call."""
    if forced:
        head, callable_tools = ["start: calls"], list(forced)
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
        header = f"{_V3_CALL_BEGIN}function{_V3_SEP}{tool['name']}\n```json\n"
        lines.append(f"call_{i}: {_literal(header)} args_{i} {_literal(chr(10) + '```' + _V3_CALL_END)}")
        lines.append(_arguments_rule(i, tool, forced=bool(forced)).rstrip("\n"))
    return "\n".join(lines) + "\n"


def _json_list_grammar(tools: Sequence[Mapping[str, Any]], single: bool) -> str:
    """vLLM's form for a required call: ``[{"name": N, "parameters": ARGS}, ...]`` (one
    element when ``single``)."""
    lines = [
        'start: "[" call "]"' if single else 'start: "[" call (", " call)* "]"',
        "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
    ]
    for i, tool in enumerate(tools):
        head = '{"name": ' + json.dumps(tool["name"]) + ', "parameters": '
        lines.append(f'call_{i}: {_literal(head)} args_{i} "}}"')
        lines.append(_arguments_rule(i, tool, forced=True).rstrip("\n"))
    return "\n".join(lines) + "\n"


def _hermes_grammar(tools: Sequence[Mapping[str, Any]], single: bool) -> str:
    """Hermes blocks: ``<tool_call>\\n{"name": N, "arguments": ARGS}\\n</tool_call>``."""
    lines = [
        "start: call" if single else 'start: call ("\\n" call)*',
        "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
    ]
    for i, tool in enumerate(tools):
        head = f'{_HERMES_OPEN}\n{{"name": {json.dumps(tool["name"])}, "arguments": '
        lines.append(f"call_{i}: {_literal(head)} args_{i} {_literal(chr(10).join(['}', _HERMES_CLOSE]))}")
        lines.append(_arguments_rule(i, tool, forced=True).rstrip("\n"))
    return "\n".join(lines) + "\n"


def _dsml_grammar(tools: Sequence[Mapping[str, Any]], single: bool, prompt: str) -> str:
    """DSML invokes for the forced tools (see the module doc)."""
    spelling = next(
        (key for key, (block, _) in _DSML_SPELLINGS.items() if prompt.endswith(f"{_DSML}{block}>\n")),
        None,
    )
    block, space = _DSML_SPELLINGS[spelling or "v32"]
    dsml = _Dsml(space, v41=spelling == "v41")
    # Each invoke's closing tag takes the newline after it, so what may follow (another
    # invoke, the block's end) starts with a tag: a lone "\n" lexeme beside "\n</..." would
    # be lexed greedily into the wrong one.
    invokes = "invoke" if single else "invoke invoke*"
    calls_end = _literal(f"{_DSML_END}{block}>")
    if spelling is None:
        lines = [f"start: {_literal(chr(10) * 2 + _DSML + block + '>' + chr(10))} {invokes} {calls_end}"]
    else:
        lines = [f"start: {invokes} {calls_end}"]
    lines.append("invoke: " + " | ".join(f"invoke_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        lines += dsml.invoke(i, tool)
    lines += dsml.lexemes()
    return "\n".join(lines) + "\n"


class _Dsml:
    """The rules of DSML invokes in one spelling; raw-text lexemes are shared."""

    def __init__(self, space: str, v41: bool) -> None:
        self.invoke_open = f"{_DSML}{space}invoke name="
        self.invoke_close = f"{_DSML_END}{space}invoke>"
        self.param_open = f"{_DSML}{space}parameter name="
        self.param_close = f"{_DSML_END}{space}parameter>"
        self.v41 = v41
        self.raw: dict[str, str] = {}  # lexeme name -> its definition

    def invoke(self, i: int, tool: Mapping[str, Any]) -> list[str]:
        schema = tool.get("parameters")
        schema = schema if isinstance(schema, Mapping) else {}
        strict = bool(tool.get("strict"))
        head = f"invoke_{i}: {_literal(self.invoke_open + json.dumps(tool['name']) + '>' + chr(10))}"
        close = _literal(self.invoke_close + "\n")
        newline = _literal("\n")
        properties = schema.get("properties")
        if not isinstance(properties, Mapping):
            # No properties declared: any parameters, each raw text or JSON.
            self.raw["PARAM_NAME"] = 'PARAM_NAME: /"[^"<>\\n]+"/'
            opening = f"{_literal(self.param_open)} PARAM_NAME"
            return [
                f"{head} (any_param_{i} {newline})* {newline + '?' if self.v41 else ''} {close}",
                f"any_param_{i}: {opening} {_literal(_STRING_TRUE)} {self._raw_value(None, None)}"
                f" | {opening} {_literal(_STRING_FALSE)} any_json_{i} {_literal(self.param_close)}",
                _json_rule(f"any_json_{i}", {}, strict),
            ]
        required = [name for name in schema.get("required") or () if isinstance(name, str)]
        extra = schema.get("additionalProperties")
        params = {name: sub for name, sub in properties.items() if sub is not False}
        for name in required:
            params.setdefault(name, extra if isinstance(extra, Mapping) else {})
        definitions = {key: schema[key] for key in ("$defs", "definitions") if key in schema}
        lines, items = [], []
        for k, (name, sub) in enumerate(params.items()):
            rule = f"param_{i}_{k}"
            lines.append(f"{rule}: {self._param(rule, name, sub, definitions, strict, lines)}")
            items.append(f"{rule} {newline}" if name in required else f"({rule} {newline})?")
        if self.v41 and not required:  # V4.1 writes a blank line when there is no parameter
            items.append(newline + ("?" if params else ""))
        return [f"{head} {' '.join(items)} {close}", *lines]

    def _param(
        self, rule: str, name: str, schema: Any, definitions: Mapping[str, Any], strict: bool, lines: list[str]
    ) -> str:
        """One parameter's rule body: raw text where the schema allows, else JSON (rules it
        needs are added to ``lines``)."""
        opening = _literal(self.param_open + json.dumps(name, ensure_ascii=False))
        if isinstance(schema, Mapping) and set(schema) <= _RAW_STRING_KEYS:
            values = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
            strings = values is None or (isinstance(values, list) and all(isinstance(v, str) for v in values))
            typed = schema.get("type", "string" if values is not None else None) == "string"
            if typed and strings:
                if values is not None:
                    choices = " | ".join(_literal(value) for value in values)
                    return f"{opening} {_literal(_STRING_TRUE)} ({choices}) {_literal(self.param_close)}"
                raw = self._raw_value(schema.get("minLength"), schema.get("maxLength"))
                return f"{opening} {_literal(_STRING_TRUE)} {raw}"
        sub = {**definitions, **schema} if isinstance(schema, Mapping) else {}
        lines.append(_json_rule(f"{rule}_json", sub, strict))
        return f"{opening} {_literal(_STRING_FALSE)} {rule}_json {_literal(self.param_close)}"

    def _raw_value(self, min_length: Any, max_length: Any) -> str:
        """The lexeme of a raw-text value with the closing tag after it: text (of the given
        length) up to the first closing tag. One lexeme, since a greedy text lexeme followed
        by a separate closing literal would swallow the literal's first characters."""
        low = min_length if isinstance(min_length, int) and min_length > 0 else 0
        high = max_length if isinstance(max_length, int) and max_length >= low else None
        name = f"RAW_{low}_{'' if high is None else high}".rstrip("_")
        length = "*" if low == 0 and high is None else f"{{{low},{'' if high is None else high}}}"
        close = _regex(self.param_close)
        self.raw[name] = f"{name}: /(?s:.{length}){close}/ & ~/(?s:.*{close}.+)/"
        return name

    def lexemes(self) -> list[str]:
        return list(self.raw.values())
