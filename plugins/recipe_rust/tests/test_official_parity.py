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
