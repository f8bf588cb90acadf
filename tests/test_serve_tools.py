"""Tool calls end to end: a server on a tiny random DeepSeek-V3 checkpoint (made here),
requests that require a call to a strict tool, and the official SDKs parsing the call.

A random model writes no tool call by itself: the server forces the model's DeepSeek-V3
markup with the tool's schema on the arguments (llguidance), the protocol adapter parses
that markup back, and the SDKs must see a well-formed call whose arguments validate.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from powertrain.serve.settings import ServeSettings
from powertrain.testing.checkpoints import write_tiny_deepseek
from powertrain.testing.server import serving

MODEL = "tiny-v3"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,  # OpenAI's strict mode asks for it
}
OPENAI_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME, "strict": True}},
]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = write_tiny_deepseek(tmp_path_factory.mktemp("tiny-v3") / "model")
    with serving({"path": str(folder), "dtype": "float32"}, ServeSettings(served_model_name=MODEL)) as url:
        yield url


@pytest.fixture
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)


def check_call(name: str, arguments: Any) -> None:
    arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(arguments, WEATHER if name == "get_weather" else TIME)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_tool_call_comes_back_as_an_sdk_tool_call(oai: openai.OpenAI, seed: int) -> None:
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris for three days?"}],
        tools=OPENAI_TOOLS,
        tool_choice="required",
        max_tokens=300,
        temperature=1.0,
        seed=seed,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name in ("get_weather", "get_time")
    check_call(call.function.name, call.function.arguments)


def test_named_tool_call_streams_into_the_same_call(oai: openai.OpenAI) -> None:
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What time is it?"}],
        "tools": OPENAI_TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 300,
        "temperature": 0,
    }
    whole = oai.chat.completions.create(**request)
    [call] = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    check_call("get_weather", call.function.arguments)

    name, arguments, reasons = "", "", []
    for chunk in oai.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        for piece in delta.tool_calls or []:
            name += piece.function.name or ""
            arguments += piece.function.arguments or ""
        reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    assert (name, json.loads(arguments)) == ("get_weather", json.loads(call.function.arguments))
    assert reasons == ["tool_calls"]


def test_anthropic_tool_use_block(base_url: str) -> None:
    client = anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0)
    message = client.messages.create(
        model=MODEL,
        max_tokens=300,
        messages=[{"role": "user", "content": "Time in Paris?"}],
        tools=[{"name": "get_time", "input_schema": TIME, "strict": True}],
        tool_choice={"type": "tool", "name": "get_time"},
    )
    assert message.stop_reason == "tool_use"
    [block] = [b for b in message.content if b.type == "tool_use"]
    assert block.name == "get_time"
    check_call("get_time", block.input)


def test_constraints_that_conflict_or_do_not_compile_are_400(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="both constrain"):
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            tools=OPENAI_TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
        )
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"structured_outputs": {"grammar": "start: (((("}},
        )
    # Still serving.
    assert (
        oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        ).usage.completion_tokens
        == 3
    )


def test_tool_choice_auto_is_not_forced(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=OPENAI_TOOLS, max_tokens=5, temperature=0
    )
    assert reply.choices[0].message.tool_calls is None  # free text from a random model: nothing forced
