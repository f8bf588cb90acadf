"""``tool_choice`` required or named forces a parseable call, whatever the model.

Real servers, the official ``openai`` and ``anthropic`` SDKs, all three protocols:

- the embedded SmolLM2 (output format "plain"; its chat template has no tool syntax),
  held to vLLM's forms (a JSON list of calls for required, the arguments alone for a named
  tool), and the same model behind a Hermes-style chat template (``<tool_call>`` blocks);
- a tiny random DeepSeek-V4 checkpoint, held to DSML invokes inside the block its prompt
  opened.

Every forced call must validate against its tool's schema, the tool not marked strict
included; ``auto`` and ``none`` stay free text. Sampled requests use a fresh seed per run
(printed; ``POWERTRAIN_TEST_SEED`` replays it), the others are greedy. Under "required" the
grammar lets a model write more calls, as vLLM's does, and a random model may go on
repeating calls until max_tokens cuts the last one off; the random DeepSeek-V4 model is
therefore asked with parallel calls turned off (``parallel_tool_calls: false``,
``disable_parallel_tool_use``), which holds it to one call, so its answer ends by
construction (every schema here is bounded), whatever the checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from powertrain.assemble import build_engine
from powertrain.config import EngineConfig
from powertrain.engine.async_engine import AsyncEngine
from powertrain.llm import apply_overrides
from powertrain.plugins import PluginManager
from powertrain.serve.run import protocol_adapter
from powertrain.serve.settings import ServeSettings
from powertrain.testing.base import fresh_seed
from powertrain.testing.checkpoints import write_tiny_deepseek_v4
from powertrain.testing.server import running_server
from powertrain_recipe import RecipeAdapter

MODEL = "m"
HERMES_TEMPLATE = Path(__file__).parents[1] / "plugins/recipe_rust/tests/fixtures/qwen_like_tools.jinja"
#: Bounded strings and no extra keys, so a call ends within a few dozen tokens even when
#: a random model writes it.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
#: get_weather is not strict: a forced call follows its schema all the same.
TOOLS = [
    {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER},
    {"name": "get_time", "description": "Time in a zone", "parameters": TIME, "strict": True},
]
SCHEMAS = {tool["name"]: tool["parameters"] for tool in TOOLS}
QUESTION = "What is the weather in Paris?"
PROTOCOLS = ["chat", "responses", "anthropic"]


def serve(engine: AsyncEngine, adapter: Any) -> Any:
    return running_server(engine, adapter, ServeSettings(served_model_name=MODEL))


@pytest.fixture(scope="module")
def smollm2_engine() -> Iterator[AsyncEngine]:
    config = apply_overrides(EngineConfig(), {"dtype": "float32"})
    engine = AsyncEngine(build_engine(config, PluginManager.load(config.plugins)))
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def smollm2(smollm2_engine: AsyncEngine) -> Iterator[str]:
    """SmolLM2 behind its own chat template: output format "plain", vLLM's JSON forms."""
    inner = smollm2_engine.engine
    adapter = protocol_adapter(PluginManager.load(EngineConfig().plugins), inner.tokenizer, inner.model_config)
    assert isinstance(adapter, RecipeAdapter) and (adapter.output_format, adapter.tool_syntax) == ("plain", "json")
    with serve(smollm2_engine, adapter) as url:
        yield url


@pytest.fixture(scope="module")
def hermes(smollm2_engine: AsyncEngine) -> Iterator[str]:
    """The same model behind a Hermes-style chat template (Qwen2.5's tool section)."""
    tokenizer = smollm2_engine.engine.tokenizer
    config = {
        "chat_template": HERMES_TEMPLATE.read_text(),
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
    }
    adapter = RecipeAdapter(tokenizer.backend.to_str(), config, smollm2_engine.engine.model_config)
    assert (adapter.output_format, adapter.tool_syntax) == ("plain", "hermes")
    with serve(smollm2_engine, adapter) as url:
        yield url


@pytest.fixture(scope="module")
def deepseek_v4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # A context long enough for V4's tool-use system prompt (about 1000 tokens of the tiny tokenizer).
    path = write_tiny_deepseek_v4(tmp_path_factory.mktemp("v4-tools"), seed=7, max_position_embeddings=2048)
    config = apply_overrides(EngineConfig(), {"path": str(path), "dtype": "float32", "block_size": 8})
    plugins = PluginManager.load(config.plugins)
    engine = AsyncEngine(build_engine(config, plugins))
    try:
        adapter = protocol_adapter(plugins, engine.engine.tokenizer, engine.engine.model_config)
        assert isinstance(adapter, RecipeAdapter) and adapter.output_format == "deepseek_v4"
        with serve(engine, adapter) as url:
            yield url
    finally:
        engine.shutdown()


def sampled() -> dict[str, Any]:
    seed = fresh_seed()
    print(f"seed={seed}")
    return {"temperature": 0.8, "seed": seed}


def ask(
    url: str,
    protocol: str,
    choice: str,
    max_tokens: int,
    *,
    name: str | None = None,
    stream: bool = False,
    thinking: bool | None = None,
    temperature: float = 0.0,
    seed: int | None = None,
    single: bool = False,
) -> tuple[str, list[tuple[str, Any]], str]:
    """One request through the protocol's SDK: (stop reason, calls as (name, arguments),
    text). ``choice`` is required / named (``name``) / auto / none, spelled per protocol;
    ``single`` turns parallel calls off; the stop reason is the protocol's (Responses: the
    response's status)."""
    if protocol == "chat":
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        tool_choice: Any = {"type": "function", "function": {"name": name}} if choice == "named" else choice
        request: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": QUESTION}],
            "tools": [{"type": "function", "function": tool} for tool in TOOLS],
            "tool_choice": tool_choice,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "extra_body": {} if thinking is None else {"thinking": {"type": "enabled" if thinking else "disabled"}},
        }
        if single:
            request["parallel_tool_calls"] = False
        if seed is not None:
            request["seed"] = seed
        if not stream:
            reply = client.chat.completions.create(**request)
            message = reply.choices[0].message
            calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
            return reply.choices[0].finish_reason, calls, message.content or ""
        names: dict[int, str] = {}
        arguments: dict[int, str] = {}
        text, reason = "", ""
        for chunk in client.chat.completions.create(**request, stream=True):
            delta = chunk.choices[0].delta
            text += delta.content or ""
            for piece in delta.tool_calls or []:
                names[piece.index] = names.get(piece.index, "") + (piece.function.name or "")
                arguments[piece.index] = arguments.get(piece.index, "") + (piece.function.arguments or "")
            reason = chunk.choices[0].finish_reason or reason
        return reason, [(names[i], json.loads(arguments[i])) for i in sorted(names)], text
    if protocol == "responses":
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        response = client.responses.create(
            model=MODEL,
            input=QUESTION,
            tools=[{"type": "function", **tool} for tool in TOOLS],
            tool_choice={"type": "function", "name": name} if choice == "named" else choice,
            max_output_tokens=max_tokens,
            temperature=temperature,
            **({"parallel_tool_calls": False} if single else {}),
            **({} if thinking is None else {"reasoning": {"effort": "medium" if thinking else "none"}}),
        )
        calls = [(item.name, json.loads(item.arguments)) for item in response.output if item.type == "function_call"]
        return response.status, calls, response.output_text
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    kinds = {"required": {"type": "any"}, "named": {"type": "tool", "name": name}}
    request = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": [
            {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
            | ({"strict": True} if t.get("strict") else {})
            for t in TOOLS
        ],
        "tool_choice": kinds.get(choice, {"type": choice}) | ({"disable_parallel_tool_use": True} if single else {}),
        "extra_body": {"temperature": temperature},  # this SDK no longer sends temperature itself
    }
    if thinking is not None:
        request["thinking"] = {"type": "adaptive"} if thinking else {"type": "disabled"}
    if stream:
        with client.messages.stream(**request) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**request)
    calls = [(block.name, block.input) for block in message.content if block.type == "tool_use"]
    text = "".join(block.text for block in message.content if block.type == "text")
    return message.stop_reason, calls, text


FORCED_STOP = {"chat": "tool_calls", "responses": "completed", "anthropic": "tool_use"}


def check_forced(protocol: str, answer: tuple[str, list[tuple[str, Any]], str], names: set[str]) -> None:
    reason, calls, text = answer
    assert reason == FORCED_STOP[protocol] and calls and not text.strip(), answer
    for name, arguments in calls:
        assert name in names, answer
        jsonschema.validate(arguments, SCHEMAS[name])


def check_free(answer: tuple[str, list[tuple[str, Any]], str]) -> None:
    reason, calls, text = answer
    assert not calls and text.strip() and reason not in ("tool_calls", "tool_use"), answer


# --------------------------------------------------------------------------- SmolLM2, plain


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_plain_model_required_gives_valid_calls(smollm2: str, protocol: str) -> None:
    check_forced(protocol, ask(smollm2, protocol, "required", 128), set(SCHEMAS))


def test_plain_model_required_streamed(smollm2: str) -> None:
    check_forced("anthropic", ask(smollm2, "anthropic", "required", 128, stream=True), set(SCHEMAS))


@pytest.mark.parametrize(
    ("protocol", "name"), [("chat", "get_weather"), ("responses", "get_time"), ("anthropic", "get_weather")]
)
def test_plain_model_named_calls_that_tool(smollm2: str, protocol: str, name: str) -> None:
    check_forced(protocol, ask(smollm2, protocol, "named", 48, name=name), {name})


def test_plain_model_named_streams_the_same_call(smollm2: str) -> None:
    options = sampled()
    whole = ask(smollm2, "chat", "named", 48, name="get_weather", **options)
    check_forced("chat", whole, {"get_weather"})
    assert ask(smollm2, "chat", "named", 48, name="get_weather", stream=True, **options) == whole


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("choice", ["auto", "none"])
def test_plain_model_auto_and_none_are_free_text(smollm2: str, protocol: str, choice: str) -> None:
    check_free(ask(smollm2, protocol, choice, 8))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_undeclared_named_tool_is_a_400_naming_the_tools(smollm2: str, protocol: str) -> None:
    error = openai.BadRequestError if protocol != "anthropic" else anthropic.BadRequestError
    with pytest.raises(error) as refused:
        ask(smollm2, protocol, "named", 8, name="get_wether")
    message = str(refused.value)
    assert '"get_wether"' in message and '"get_weather", "get_time"' in message, message


def test_hermes_template_model_writes_tool_call_blocks(hermes: str) -> None:
    check_forced("responses", ask(hermes, "responses", "required", 128), set(SCHEMAS))
    check_forced("chat", ask(hermes, "chat", "named", 64, name="get_weather", **sampled()), {"get_weather"})
    check_free(ask(hermes, "anthropic", "auto", 8))


# --------------------------------------------------------------------------- DeepSeek-V4, DSML


def test_deepseek_v4_required_gives_one_valid_call_in_every_protocol(deepseek_v4: str) -> None:
    # One call of at most about 250 tokens here (bounded schemas), so 600 always suffices.
    # Sampled where the protocol takes a seed (Chat Completions), greedy elsewhere.
    for protocol in PROTOCOLS:
        options = sampled() if protocol == "chat" else {}
        answer = ask(deepseek_v4, protocol, "required", 600, thinking=False, single=True, **options)
        check_forced(protocol, answer, set(SCHEMAS))
        assert len(answer[1]) == 1, answer


def test_deepseek_v4_named_sampled_and_streamed(deepseek_v4: str) -> None:
    answer = ask(deepseek_v4, "chat", "named", 400, name="get_weather", thinking=False, **sampled())
    check_forced("chat", answer, {"get_weather"})
    streamed = ask(deepseek_v4, "anthropic", "named", 400, name="get_time", thinking=False, stream=True)
    check_forced("anthropic", streamed, {"get_time"})


@pytest.mark.parametrize(("protocol", "choice"), [("chat", "auto"), ("responses", "none"), ("anthropic", "auto")])
def test_deepseek_v4_auto_and_none_are_free_text(deepseek_v4: str, protocol: str, choice: str) -> None:
    check_free(ask(deepseek_v4, protocol, choice, 6, thinking=False))
