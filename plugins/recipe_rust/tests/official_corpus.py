"""A seeded corpus of chat requests in all three protocols, for the parity test against
DeepSeek's own adapter (``deepseek-recipe``, ``test_official_parity.py``).

Each request is drawn from one ``random.Random(seed)``: system and developer
messages, multi-turn histories with reasoning, tools with calls and results, tool
choice, response formats, thinking on / off / unset and every effort level. Text
comes from a pool that mixes plain words, unicode, whitespace and control-token
spellings (``<｜User｜>``, ``<think>``, DSML markup), in every field a user controls.
The same conversation is written in each protocol's own shape, so a difference
between the adapters shows up per protocol.
"""

from __future__ import annotations

import json
import random
from typing import Any

PROTOCOLS = ("openai.chat", "openai.responses", "anthropic.messages")

_WORDS = (
    "weather",
    "Paris",
    "the",
    "answer",
    "is",
    "42",
    "naïve",
    "café",
    "東京",
    "天气怎么样",
    "😀",
    "👩‍💻",
    "Ωmega",
    "a\tb",
    "line\nbreak",
    "  spaced  ",
    '"quoted"',
    "back\\slash",
    "{json: true}",
    "</tool_result>",
    "<tool_result>",
)

# Text that spells the formats' control tokens: it must stay plain text.
_CONTROL_LOOKALIKES = (
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜System｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
    '<｜DSML｜invoke name="x">',
    "</｜DSML｜tool_calls>",
    "<｜DSML｜ calls>",
    "<｜latest_reminder｜>",
    "<｜image｜>",
)

# The V4 family's control tokens beyond the tiny test tokenizer's own: added to it so
# both adapters tokenize the same vocabulary.
V4_CONTROL_TOKENS = ("<think>", "</think>", "｜DSML｜", "<｜System｜>", "<｜latest_reminder｜>", "<｜image｜>")

#: A 1x1 PNG: the image part every protocol can carry inline.
PNG_1X1 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
PNG_DATA_URL = f"data:image/png;base64,{PNG_1X1}"

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def text(rng: random.Random, *, allow_empty: bool = False) -> str:
    """A short untrusted text: words, unicode, whitespace, control-token spellings."""
    if allow_empty and rng.random() < 0.05:
        return ""
    parts = []
    for _ in range(rng.randint(1, 6)):
        roll = rng.random()
        if roll < 0.15:
            parts.append(rng.choice(_CONTROL_LOOKALIKES))
        elif roll < 0.2:
            parts.append(rng.choice(("\n", "\n\n", " ", "\r\n")))
        else:
            parts.append(rng.choice(_WORDS))
    return " ".join(parts) if rng.random() < 0.8 else "".join(parts)


def _name(rng: random.Random) -> str:
    return rng.choice(("get_weather", "search", "lookup_city", "send_email", "calc", "x-y_2"))


def _schema(rng: random.Random) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    for key in rng.sample(("city", "query", "n", "flag", "items", "when", "ünïcode"), rng.randint(0, 3)):
        kind = rng.choice(("string", "integer", "boolean", "array", "number"))
        prop: dict[str, Any] = {"type": kind}
        if kind == "array":
            prop["items"] = {"type": "string"}
        if rng.random() < 0.4:
            prop["description"] = text(rng)
        properties[key] = prop
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if properties and rng.random() < 0.6:
        schema["required"] = sorted(properties)[:1]
    return schema


def _arguments(rng: random.Random, schema: dict[str, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, prop in schema["properties"].items():
        kind = prop["type"]
        values[key] = {
            "string": lambda: text(rng),
            "integer": lambda: rng.randint(-5, 1000),
            "boolean": lambda: rng.random() < 0.5,
            "array": lambda: [text(rng) for _ in range(rng.randint(0, 2))],
            "number": lambda: rng.choice((0.5, 1.25, -3.0, 1e-7, 12345.678)),
        }[kind]()
    return values


def conversation(rng: random.Random) -> dict[str, Any]:
    """A protocol-neutral conversation: what each protocol writer spells in its own shape."""
    tools = []
    for name in dict.fromkeys(_name(rng) for _ in range(rng.choice((0, 0, 1, 1, 2, 3)))):
        tool = {"name": name, "parameters": _schema(rng)}
        if rng.random() < 0.8:
            tool["description"] = text(rng)
        tools.append(tool)
    turns: list[dict[str, Any]] = []
    call_number = 0
    for _ in range(rng.randint(1, 4)):
        turns.append({"role": "user", "text": text(rng), "extra": _extra_parts(rng)})
        last = rng.random() < 0.35
        if last:
            break
        assistant: dict[str, Any] = {"role": "assistant", "text": text(rng, allow_empty=True), "calls": []}
        if rng.random() < 0.5:
            assistant["reasoning"] = text(rng)
        if tools and rng.random() < 0.6:
            for _ in range(rng.randint(1, 2)):
                tool = rng.choice(tools)
                call_number += 1
                assistant["calls"].append(
                    {
                        "id": f"call_{call_number}",
                        "name": tool["name"],
                        "arguments": _arguments(rng, tool["parameters"]),
                    }
                )
        turns.append(assistant)
        if assistant["calls"]:
            results = [{"id": c["id"], "text": text(rng)} for c in assistant["calls"]]
            if len(results) > 1 and rng.random() < 0.5:
                results.reverse()
            turns.append({"role": "tool", "results": results})
            if rng.random() < 0.5:
                continue  # the prompt may end on tool results
    if turns[-1]["role"] == "assistant":
        turns.append({"role": "user", "text": text(rng), "extra": _extra_parts(rng)})
    system = None
    if rng.random() < 0.6:
        system = text(rng)
    thinking = rng.choice((None, None, True, False))
    effort = rng.choice((None, None) + EFFORTS)
    if thinking is False and effort not in (None, "none"):
        effort = None  # a contradiction both adapters refuse; not what this corpus is about
    choice = None
    if tools and rng.random() < 0.5:
        choice = rng.choice(("auto", "none", "required", "named"))
    return {
        "system": system,
        "developer": text(rng) if rng.random() < 0.15 else None,
        "turns": turns,
        "tools": tools,
        "tool_choice": choice,
        "thinking": thinking,
        "effort": effort,
        "format": _response_format(rng),
        "list_content": rng.random() < 0.3,
    }


def _extra_parts(rng: random.Random) -> list[tuple[str, str]]:
    """More content parts after a user turn's text, now and then: text or an image."""
    if rng.random() < 0.8:
        return []
    return [("image", PNG_DATA_URL) if rng.random() < 0.4 else ("text", text(rng)) for _ in range(rng.randint(1, 2))]


def _response_format(rng: random.Random) -> dict[str, Any] | None:
    """None (text), JSON object, or a JSON schema with at least one property."""
    roll = rng.random()
    if roll < 0.85:
        return None
    if roll < 0.92:
        return {"type": "json_object"}
    schema = _schema(rng)
    if not schema["properties"]:
        schema["properties"] = {"answer": {"type": "string"}}
    return {"type": "json_schema", "name": rng.choice(("answer", "result_1")), "schema": schema}


def chat_body(c: dict[str, Any], model: str) -> dict[str, Any]:
    def content(value: str) -> Any:
        return [{"type": "text", "text": value}] if c["list_content"] else value

    messages: list[dict[str, Any]] = []
    if c["system"] is not None:
        messages.append({"role": "system", "content": content(c["system"])})
    if c["developer"] is not None:
        messages.append({"role": "developer", "content": content(c["developer"])})
    for turn in c["turns"]:
        if turn["role"] == "user" and turn["extra"]:
            parts = [{"type": "text", "text": turn["text"]}]
            for kind, value in turn["extra"]:
                image = {"type": "image_url", "image_url": {"url": value}}
                parts.append(image if kind == "image" else {"type": "text", "text": value})
            messages.append({"role": "user", "content": parts})
        elif turn["role"] == "user":
            messages.append({"role": "user", "content": content(turn["text"])})
        elif turn["role"] == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": turn["text"]}
            if "reasoning" in turn:
                message["reasoning_content"] = turn["reasoning"]
            if turn["calls"]:
                message["tool_calls"] = [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
                    }
                    for call in turn["calls"]
                ]
            messages.append(message)
        else:
            for result in turn["results"]:
                messages.append({"role": "tool", "tool_call_id": result["id"], "content": result["text"]})
    body: dict[str, Any] = {"model": model, "messages": messages}
    if c["tools"]:
        body["tools"] = [{"type": "function", "function": tool} for tool in c["tools"]]
    if c["tool_choice"] == "named":
        body["tool_choice"] = {"type": "function", "function": {"name": c["tools"][0]["name"]}}
    elif c["tool_choice"]:
        body["tool_choice"] = c["tool_choice"]
    if c["thinking"] is not None:
        body["thinking"] = {"type": "enabled" if c["thinking"] else "disabled"}
    if c["effort"] is not None:
        body["reasoning_effort"] = c["effort"]
    if c["format"] and c["format"]["type"] == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif c["format"]:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": c["format"]["name"], "schema": c["format"]["schema"]},
        }
    return body


def responses_body(c: dict[str, Any], model: str) -> dict[str, Any]:
    items: list[dict[str, Any]] = []
    if c["developer"] is not None:
        items.append({"role": "developer", "content": c["developer"]})
    for turn in c["turns"]:
        if turn["role"] == "user":
            if c["list_content"] or turn["extra"]:
                parts = [{"type": "input_text", "text": turn["text"]}]
                for kind, value in turn["extra"]:
                    image = {"type": "input_image", "image_url": value, "detail": "auto"}
                    parts.append(image if kind == "image" else {"type": "input_text", "text": value})
                items.append({"role": "user", "content": parts})
            else:
                items.append({"role": "user", "content": turn["text"]})
        elif turn["role"] == "assistant":
            if "reasoning" in turn:
                items.append(
                    {
                        "type": "reasoning",
                        "summary": [],
                        "content": [{"type": "reasoning_text", "text": turn["reasoning"]}],
                    }
                )
            if turn["text"]:
                items.append(
                    {
                        "type": "message",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": turn["text"], "annotations": []}],
                    }
                )
            for call in turn["calls"]:
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call["id"],
                        "name": call["name"],
                        "arguments": json.dumps(call["arguments"]),
                    }
                )
        else:
            for result in turn["results"]:
                items.append({"type": "function_call_output", "call_id": result["id"], "output": result["text"]})
    body: dict[str, Any] = {"model": model, "input": items}
    if c["system"] is not None:
        body["instructions"] = c["system"]
    if c["tools"]:
        body["tools"] = [{"type": "function", **tool} for tool in c["tools"]]
    if c["tool_choice"] == "named":
        body["tool_choice"] = {"type": "function", "name": c["tools"][0]["name"]}
    elif c["tool_choice"]:
        body["tool_choice"] = c["tool_choice"]
    if c["effort"] is not None or c["thinking"] is False:
        body["reasoning"] = {"effort": "none" if c["thinking"] is False else c["effort"]}
    if c["format"]:
        body["text"] = {"format": c["format"]}
    return body


_ANTHROPIC_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh", "max": "max"}


def messages_body(c: dict[str, Any], model: str) -> dict[str, Any]:
    def blocks(value: str) -> Any:
        return [{"type": "text", "text": value}] if c["list_content"] else value

    def extra_blocks(turn: dict[str, Any]) -> list[dict[str, Any]]:
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_1X1}}
        return [image if kind == "image" else {"type": "text", "text": value} for kind, value in turn["extra"]]

    messages: list[dict[str, Any]] = []
    for turn in c["turns"]:
        if turn["role"] == "user":
            if messages and messages[-1]["role"] == "user":
                content = messages[-1]["content"]
                content.append({"type": "text", "text": turn["text"]})
                content.extend(extra_blocks(turn))
            elif turn["extra"]:
                messages.append(
                    {"role": "user", "content": [{"type": "text", "text": turn["text"]}, *extra_blocks(turn)]}
                )
            else:
                messages.append({"role": "user", "content": blocks(turn["text"])})
        elif turn["role"] == "assistant":
            content = []
            if "reasoning" in turn:
                content.append({"type": "thinking", "thinking": turn["reasoning"], "signature": "sig"})
            if turn["text"]:
                content.append({"type": "text", "text": turn["text"]})
            for call in turn["calls"]:
                content.append({"type": "tool_use", "id": call["id"], "name": call["name"], "input": call["arguments"]})
            if not content:
                content.append({"type": "text", "text": " "})
            messages.append({"role": "assistant", "content": content})
        else:
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": result["id"], "content": result["text"]}
                        for result in turn["results"]
                    ],
                }
            )
    body: dict[str, Any] = {"model": model, "max_tokens": 4096, "messages": messages}
    system = "\n\n".join(s for s in (c["system"], c["developer"]) if s is not None)
    if c["system"] is not None or c["developer"] is not None:
        body["system"] = blocks(system)
    if c["tools"]:
        body["tools"] = []
        for tool in c["tools"]:
            spelled = {"name": tool["name"], "input_schema": tool["parameters"]}
            if "description" in tool:
                spelled["description"] = tool["description"]
            body["tools"].append(spelled)
    if c["tool_choice"] == "named":
        body["tool_choice"] = {"type": "tool", "name": c["tools"][0]["name"]}
    elif c["tool_choice"]:
        body["tool_choice"] = {"type": {"auto": "auto", "none": "none", "required": "any"}[c["tool_choice"]]}
    if c["thinking"] is not None or c["effort"] == "none":
        on = c["thinking"] is not False and c["effort"] != "none"
        body["thinking"] = {"type": "enabled", "budget_tokens": 2048} if on else {"type": "disabled"}
    output_config: dict[str, Any] = {}
    if c["effort"] in _ANTHROPIC_EFFORTS:
        output_config["effort"] = _ANTHROPIC_EFFORTS[c["effort"]]
    if c["format"] and c["format"]["type"] == "json_schema":
        output_config["format"] = {"type": "json_schema", "schema": c["format"]["schema"]}
    if output_config:
        body["output_config"] = output_config
    return body


WRITERS = {"openai.chat": chat_body, "openai.responses": responses_body, "anthropic.messages": messages_body}


def corpus(seed: int, count: int, model: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """``count`` (protocol, body, conversation) triples from ``seed``, the protocols in turn."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        protocol = PROTOCOLS[i % len(PROTOCOLS)]
        c = conversation(rng)
        out.append((protocol, WRITERS[protocol](c, model), c))
    return out
