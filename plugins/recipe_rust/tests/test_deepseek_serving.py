"""DeepSeek-V4 and V4.1 checkpoints served through all three protocols with the recipe's encodings.

The tiny random V4 (``write_tiny_deepseek_v4``) and V4.1 (``write_tiny_deepseek_v41``, its
own model: shared compressed attention, Engram) run behind the real server with the recipe
adapter, which picks V4's or V4.1's encoding from the checkpoint's config. The same
conversation sent as OpenAI Chat Completions, OpenAI Responses and Anthropic Messages must
become the same prompt (DeepSeek's encoder: no chat template), with thinking on and off and
with a tool (in the version's own tool-call spelling), and the engine must run exactly that
prompt (``usage`` counts its tokens) and answer in each protocol's own shape. What the
encodings themselves render is checked against DeepSeek's reference in the Rust tests
(``render.rs``) and ``test_official_parity.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from powertrain.assemble import build_engine
from powertrain.config import EngineConfig
from powertrain.engine.async_engine import AsyncEngine
from powertrain.llm import apply_overrides
from powertrain.plugins import PluginManager
from powertrain.serve.run import protocol_adapter
from powertrain.testing.checkpoints import write_tiny_deepseek_v4
from powertrain.testing.deepseek_v41 import write_tiny_deepseek_v41
from powertrain.testing.server import running_server
from powertrain_recipe import RecipeAdapter

QUESTION = "What is the weather in Paris today?"
#: Per version: how its tool-call block opens (DeepSeek's DSML, V4.1 spells it with a space).
TOOL_BLOCKS = {"v4": "<｜DSML｜tool_calls>", "v41": "<｜DSML｜ calls>"}
TOOL = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module", params=list(TOOL_BLOCKS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Any]]:
    """The version, the server's URL and its adapter, and the id the server answers to (its
    model path, from /v1/models)."""
    version = request.param
    folder = tmp_path_factory.mktemp(f"{version}-serve")
    # A context long enough for the tool-use system prompt (about 900 tokens of the tiny tokenizer).
    if version == "v4":
        path = write_tiny_deepseek_v4(folder, seed=7, max_position_embeddings=2048)
    else:
        path = write_tiny_deepseek_v41(folder, seed=7, max_position_embeddings=2048)
    config = apply_overrides(EngineConfig(), {"path": str(path), "dtype": "float32", "block_size": 8})
    plugins = PluginManager.load(config.plugins)
    engine = AsyncEngine(build_engine(config, plugins))
    try:
        adapter = protocol_adapter(plugins, engine.engine.tokenizer, engine.engine.model_config)
        assert isinstance(adapter, RecipeAdapter) and adapter.output_format == "deepseek_v4"
        with running_server(engine, adapter) as url:
            model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
            yield version, url, (adapter, model)
    finally:
        engine.shutdown()


def bodies(model: str, thinking: bool, tools: bool) -> dict[str, dict[str, Any]]:
    """One conversation in each protocol's spelling."""
    chat: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 6,
        "temperature": 0,
        "thinking": {"type": "enabled" if thinking else "disabled"},
    }
    responses: dict[str, Any] = {
        "model": model,
        "input": [{"role": "user", "content": QUESTION}],
        "max_output_tokens": 6,
        "temperature": 0,
        "reasoning": {"effort": "none"},
    }
    anthropic: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 6,
        "temperature": 0,
        # "adaptive": thinking on without a budget (an "enabled" one must be >= 1024 < max_tokens)
        "thinking": {"type": "adaptive" if thinking else "disabled"},
    }
    if tools:
        chat["tools"] = [{"type": "function", "function": TOOL}]
        responses["tools"] = [{"type": "function", **TOOL}]
        anthropic["tools"] = [
            {"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}
        ]
    if thinking:
        # The recipe's Responses parser reads reasoning.effort as an effort only, as Chat's
        # reasoning_effort: nothing in a Responses request turns DeepSeek's thinking mode on.
        return {"openai.chat": chat, "anthropic.messages": anthropic}
    return {"openai.chat": chat, "openai.responses": responses, "anthropic.messages": anthropic}


ROUTES = {
    "openai.chat": "/v1/chat/completions",
    "openai.responses": "/v1/responses",
    "anthropic.messages": "/v1/messages",
}


@pytest.mark.parametrize("tools", [False, True], ids=["no-tools", "tools"])
@pytest.mark.parametrize("thinking", [False, True], ids=["non-thinking", "thinking"])
def test_every_protocol_renders_the_same_prompt_and_is_answered(
    served: tuple[str, str, Any], thinking: bool, tools: bool
) -> None:
    version, url, (adapter, model) = served
    prompts = {}
    for protocol, body in bodies(model, thinking, tools).items():
        parsed = adapter.parse_request(protocol, json.dumps(body).encode())
        prompts[protocol] = (parsed.prompt, parsed.prompt_token_ids)
    (prompt, ids), *others = prompts.values()
    assert all(other == (prompt, ids) for other in others), {p: text for p, (text, _) in prompts.items()}
    assert prompt.startswith("<｜begin▁of▁sentence｜>") and QUESTION in prompt
    assert prompt.endswith("<｜Assistant｜><think>" if thinking else "<｜Assistant｜></think>")
    assert ("get_weather" in prompt) == tools and (TOOL_BLOCKS[version] in prompt) == tools

    for protocol, body in bodies(model, thinking, tools).items():
        response = httpx.post(url + ROUTES[protocol], json=body, timeout=120)
        assert response.status_code == 200, (protocol, response.text)
        answer = response.json()
        if protocol == "openai.chat":
            assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["role"] == "assistant"
            assert answer["usage"]["prompt_tokens"] == len(ids)
        elif protocol == "openai.responses":
            assert answer["object"] == "response" and answer["output"]
            assert answer["usage"]["input_tokens"] == len(ids)
        else:
            assert answer["type"] == "message" and answer["role"] == "assistant" and answer["content"] is not None
            usage = answer["usage"]  # Anthropic counts prefix-cache hits apart (earlier protocols sent the same prompt)
            assert usage["input_tokens"] + usage.get("cache_read_input_tokens", 0) == len(ids)


def test_a_malformed_request_is_refused_and_the_server_keeps_serving(served: tuple[str, str, Any]) -> None:
    _, url, (_, model) = served
    bad = httpx.post(url + ROUTES["openai.chat"], json={"model": model, "messages": "hello"}, timeout=60)
    assert bad.status_code == 400 and "messages" in bad.text
    good = httpx.post(url + ROUTES["openai.chat"], json=bodies(model, False, False)["openai.chat"], timeout=120)
    assert good.status_code == 200


def test_an_image_is_refused_naming_the_model(served: tuple[str, str, Any]) -> None:
    """V4 renders an image part as "[Unsupported Image]" and V4.1 as its image placeholder (like
    DeepSeek's adapter), but no model here has a vision encoder: the server refuses it before
    it runs."""
    version, url, (adapter, model) = served
    png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
    part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}
    body = {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": "Look."}, part]}]}
    parsed = adapter.parse_request("openai.chat", json.dumps(body).encode())
    placeholder = {"v4": "[Unsupported Image]", "v41": "<｜image｜>"}[version]
    assert parsed.image_count == 1 and f"Look.\n\n{placeholder}" in parsed.prompt
    # A 1x1 image is scaled up to 544x544 pixels: 13x13 tokens, a newline per row, two delimiters.
    assert parsed.image_tokens == 13 * 14 + 2
    refused = httpx.post(url + ROUTES["openai.chat"], json=body, timeout=60)
    assert refused.status_code == 400 and "has no vision encoder" in refused.text and model in refused.text
    assert "184 prompt tokens" in refused.text


def test_the_served_model_is_the_checkpoint(served: tuple[str, str, Any]) -> None:
    version, url, (_, model) = served
    models = httpx.get(url + "/v1/models", timeout=30).json()
    assert [entry["id"] for entry in models["data"]] == [model] and Path(model).name.startswith(f"{version}-serve")
