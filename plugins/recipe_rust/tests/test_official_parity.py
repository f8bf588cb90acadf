"""Our V4 / V4.1 prompts against DeepSeek's own adapter (``deepseek-recipe``, dev group).

A seeded corpus (``official_corpus``) of Chat Completions, Responses and Messages
requests is converted and rendered by the official adapter and by ours; prompt text and
token ids must be equal. The tokenizer is the tiny test tokenizer with the V4 family's
control tokens added, so both sides tokenize the same vocabulary.

Requests showing one of the deliberate differences (the recipe README's parity table)
are checked for exactly that difference instead (``deliberate``); requests both
adapters refuse are counted; everything else must match exactly.
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

deepseek_recipe = pytest.importorskip("deepseek_recipe")

from powertrain.testing.checkpoints import tiny_tokenizer  # noqa: E402
from powertrain_recipe import RecipeAdapter, RecipeError  # noqa: E402

# The corpus generator sits beside this file (pytest imports tests by path, not as a package).
_spec = importlib.util.spec_from_file_location("official_corpus", Path(__file__).with_name("official_corpus.py"))
assert _spec is not None and _spec.loader is not None
official_corpus = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(official_corpus)

REQUESTS_PER_ENCODING = 2800
SEED = 20261202

MODELS = {
    # The official adapter picks the encoding by model name; ours by the checkpoint.
    "v4": ("DeepSeek-V4-Pro", {}),
    "v41": ("DeepSeek-V4.1-Flash", {"_name_or_path": "deepseek-ai/DeepSeek-V4.1-Flash"}),
}

REQUEST_TYPES = {
    "openai.chat": deepseek_recipe.ChatCompletionRequest,
    "openai.responses": deepseek_recipe.ResponsesRequest,
    "anthropic.messages": deepseek_recipe.MessagesRequest,
}


def deliberate(protocol: str, conversation: dict[str, Any], official: Any, mine: Any, opened: str) -> str | None:
    """Which deliberate difference (the README's table) this request shows, if any
    (``opened``: how this encoding opens a tool-call block).

    Each is checked for exactly its stated shape: the official adapter refuses what
    we accept, or (Messages' output format) renders no instructions where we do. A
    request we refuse for another reason shows none of them."""
    if protocol == "anthropic.messages" and conversation["tool_choice"] == "required":
        # Anthropic's "any" forces a call (its API's meaning; refused with thinking, as
        # Anthropic refuses it); the official adapter reads it as "auto".
        assert not isinstance(official, str), official
        if isinstance(mine, str):
            assert "thinking mode" in mine, mine
        else:
            assert mine[0].endswith(opened) and not official[0].endswith(opened)
        return "Messages tool_choice any forces a call"
    if isinstance(mine, str):
        return None
    if protocol == "openai.chat" and conversation["developer"] is not None:
        assert isinstance(official, str) and "developer" in official, official
        return "Chat developer messages are accepted"
    if isinstance(official, str) and "must contain the word 'json'" in official:
        assert conversation["format"] == {"type": "json_object"}, conversation
        return "json_object needs no word 'json'"
    messages_schema = protocol == "anthropic.messages" and (conversation["format"] or {}).get("type") == "json_schema"
    if messages_schema:
        assert not isinstance(official, str), official
        assert "## Response Format:" in mine[0] and "## Response Format:" not in official[0]
        return "Messages output_config.format renders its instructions"
    return None


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens(list(official_corpus.V4_CONTROL_TOKENS))
    return tokenizer.to_str()


def official_prompt(encoding: Any, protocol: str, body: dict[str, Any]) -> tuple[str, list[int]] | str:
    """(text, ids), or the error text when the official adapter refuses the request."""
    try:
        conversation = REQUEST_TYPES[protocol](body).convert(deepseek_recipe.ConversionOptions()).conversation
    except (deepseek_recipe.ConversionError, ValueError) as error:
        return f"refused: {error}"
    return encoding.render_conversation(conversation).prompt, list(encoding.encode(conversation))


def first_difference(protocol: str, body: dict[str, Any], official: Any, mine: Any) -> str:
    """Where the two prompts part, with a little context (the whole prompts are long)."""
    if isinstance(official, str) or isinstance(mine, str):
        return f"{protocol} {json.dumps(body)[:400]}: official {str(official)[:200]!r}, ours {str(mine)[:200]!r}"
    a, b = official[0], mine[0]
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    where = "token ids" if a == b else f"text at {at}: official {a[at - 40 : at + 60]!r}, ours {b[at - 40 : at + 60]!r}"
    return f"{protocol} {json.dumps(body)[:400]}: {where}"


@pytest.mark.parametrize("version", sorted(MODELS))
def test_prompts_equal_the_official_adapters(version: str, tokenizer_json: str) -> None:
    model, config_extra = MODELS[version]
    encoding_type = deepseek_recipe.DeepseekV41Encoding if version == "v41" else deepseek_recipe.DeepseekV4Encoding
    encoding = encoding_type().with_tokenizer(deepseek_recipe.Tokenizer.from_str(tokenizer_json))
    config = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], **config_extra}
    ours = RecipeAdapter(tokenizer_json, {}, config)
    opened_tool_calls = "<｜DSML｜ calls>\n" if version == "v41" else "<｜DSML｜tool_calls>\n"

    outcomes: Counter[str] = Counter()
    mismatches = []
    for protocol, body, conversation in official_corpus.corpus(SEED, REQUESTS_PER_ENCODING, model):
        official = official_prompt(encoding, protocol, body)
        try:
            request = ours.parse_request(protocol, json.dumps(body).encode())
            mine: tuple[str, list[int]] | str = (request.prompt, list(request.prompt_token_ids))
        except RecipeError as error:
            mine = f"refused: {error}"
        if reason := deliberate(protocol, conversation, official, mine, opened_tool_calls):
            outcomes[reason] += 1
        elif isinstance(official, str) and isinstance(mine, str):
            outcomes["both refuse"] += 1
        elif official == mine:
            outcomes["equal"] += 1
        else:
            mismatches.append((protocol, body, official, mine))
    assert not mismatches, f"{len(mismatches)} prompts differ; first: {first_difference(*mismatches[0])}"
    # The corpus must exercise the comparison, not the exemptions.
    assert outcomes["equal"] >= 2000, outcomes
    assert len(outcomes) == 6, outcomes  # equal, both refuse, and each deliberate difference


# --------------------------------------------------------------------------- output side


def model_output(rng: Any, version: str) -> str:
    """What a V4-family model writes after ``<think>``: reasoning, the answer, and now
    and then DSML tool calls in this encoding's spelling (string and JSON parameters)."""
    tag, block = ("｜DSML｜ ", "calls") if version == "v41" else ("｜DSML｜", "tool_calls")
    words = ("Paris", "weather", "42", "naïve", "東京", "😀", "a\tb", "line\nbreak", '"q"', "{json}")
    say = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(0, 6)))  # noqa: E731
    out = f"{say()}</think>{say()}"
    calls = []
    for _ in range(rng.choice((0, 0, 1, 2))):
        params = []
        for key in rng.sample(("city", "n", "flag", "items"), rng.randint(0, 3)):
            value = rng.choice((say(), rng.randint(-9, 999), True, ["x", 2], {"k": None}))
            string = isinstance(value, str)
            shown = value if string else json.dumps(value)
            params.append(f'<{tag}parameter name="{key}" string="{str(string).lower()}">{shown}</{tag}parameter>')
        calls.append(
            f'<{tag}invoke name="get_weather">\n' + "\n".join(params) + ("\n" if params else "") + f"</{tag}invoke>"
        )
    if calls:
        out += f"\n\n<{tag}{block}>\n" + "\n".join(calls) + f"\n</{tag}{block}>"
    return out


ANSWER_TYPES = {
    "openai.chat": deepseek_recipe.ChatCompletionResponse,
    "openai.responses": deepseek_recipe.ResponsesResponse,
    "anthropic.messages": deepseek_recipe.MessagesResponse,
}

#: One request per protocol: a question, the weather tool, thinking left to the default.
ANSWER_REQUESTS: dict[str, dict[str, Any]] = {
    "openai.chat": {
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    },
    "openai.responses": {
        "input": "Weather?",
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
    },
    "anthropic.messages": {
        "max_tokens": 4096,
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
    },
}


def official_answer(protocol: str, model: str, body: dict[str, Any], chunks: list[str]) -> dict[str, Any]:
    """The official adapter's answer body for this generated text, streamed in ``chunks``."""
    request_type = REQUEST_TYPES[protocol]
    request = request_type({"model": model, **body}).convert(deepseek_recipe.ConversionOptions())
    generator = request_type.chunk_generator(request, "id", model)
    processor = deepseek_recipe.StreamProcessor(generator, request.parsing_options)
    inputs = [deepseek_recipe.InferenceChunk.ready()]
    inputs += [deepseek_recipe.InferenceChunk.text(chunk, 1) for chunk in chunks]
    inputs.append(deepseek_recipe.InferenceChunk.finish(deepseek_recipe.InferenceFinishReason.Stop))
    answer = ANSWER_TYPES[protocol]("id", model, 0, 1, 0)
    for item in inputs:
        for chunk in processor.push(item):
            answer.accumulate(chunk)
    for chunk in processor.finish():
        answer.accumulate(chunk)
    return json.loads(answer.to_json())


def essentials(protocol: str, answer: dict[str, Any]) -> tuple[Any, ...]:
    """What both adapters must agree on: answer text, reasoning, calls (arguments as
    JSON) and how the answer ended, read from the protocol's body."""
    if protocol == "openai.chat":
        choice = answer["choices"][0]
        message = choice["message"]
        calls = [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []
        ]
        return (message.get("content") or "", message.get("reasoning_content") or "", calls, choice["finish_reason"])
    if protocol == "openai.responses":
        items = answer["output"]
        text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
        reasoning = "".join(
            p["text"] for i in items if i["type"] == "reasoning" for p in (i.get("content") or i.get("summary") or [])
        )
        calls = [(i["name"], json.loads(i["arguments"])) for i in items if i["type"] == "function_call"]
        return (text, reasoning, calls, answer["status"])
    blocks = answer["content"]
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    reasoning = "".join(b["thinking"] for b in blocks if b["type"] == "thinking")
    calls = [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]
    return (text, reasoning, calls, answer["stop_reason"])


@pytest.mark.parametrize("protocol", sorted(ANSWER_REQUESTS))
@pytest.mark.parametrize("version", sorted(MODELS))
def test_generated_text_parses_as_the_official_adapter_parses_it(
    version: str, protocol: str, tokenizer_json: str
) -> None:
    """The output side: reasoning, answer and DSML tool calls (this encoding's spelling)
    from a seeded set of model outputs, fed to the official stream processor in random
    chunks and through our parser and writer, give the same answer in each protocol."""
    import random
    from types import SimpleNamespace

    model, config_extra = MODELS[version]
    ours = RecipeAdapter(tokenizer_json, {}, {"model_type": "deepseek_v4", **config_extra})
    body = ANSWER_REQUESTS[protocol]
    request = ours.parse_request(protocol, json.dumps({"model": model, **body}).encode())
    assert request.prompt.endswith("<think>")
    rng = random.Random(SEED)
    for _ in range(300):
        text = model_output(rng, version)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8)))) if len(text) > 1 else []
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        official = official_answer(protocol, model, body, chunks)
        output = SimpleNamespace(
            request_id="r",
            prompt_token_ids=request.prompt_token_ids,
            num_cached_tokens=0,
            outputs=[SimpleNamespace(text=text, token_ids=[0], finish_reason="stop", logprobs=None)],
        )
        mine = json.loads(ours.render_response(protocol, request, output))
        assert essentials(protocol, mine) == essentials(protocol, official), text
