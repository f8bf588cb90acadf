"""The Python face of the recipe against real components: SmolLM2's tokenizer and chat
template (from the GGUF the workspace ships), transformers' apply_chat_template as the
oracle, and the engine's own output for responses."""

from __future__ import annotations

import json
from typing import Any

import pytest

from powertrain.loader import load_checkpoint, resolve_model_path
from powertrain.testing import PluginContract
from powertrain_recipe import RecipeAdapter, RecipeError, ResponseWriter, StreamParser
from powertrain_recipe.adapter import output_format

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Count to three."},
    ],
    [{"role": "user", "content": "Ünïcödé — 日本語 and emoji 🙂, tabs\tand\nnew lines  "}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Good morning"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "Good night"},
    ],
]


class TestContract(PluginContract):
    plugin = "recipe"


@pytest.fixture(scope="module")
def smollm2() -> tuple[RecipeAdapter, Any]:
    checkpoint = load_checkpoint("smollm2-135m")
    from transformers import AutoTokenizer

    path = resolve_model_path("smollm2-135m").path
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return RecipeAdapter.for_tokenizer(checkpoint.tokenizer, checkpoint.config), hf


def chat_body(messages: list[dict[str, str]], **extra: Any) -> bytes:
    return json.dumps({"model": "smollm2", "messages": messages, **extra}).encode()


def anthropic_body(messages: list[dict[str, str]]) -> bytes:
    system = [m["content"] for m in messages if m["role"] == "system"]
    rest = [m for m in messages if m["role"] != "system"]
    body: dict[str, Any] = {"model": "smollm2", "max_tokens": 64, "messages": rest}
    if system:
        body["system"] = system[0]
    return json.dumps(body).encode()


def responses_body(messages: list[dict[str, str]]) -> bytes:
    system = [m["content"] for m in messages if m["role"] == "system"]
    items = [{"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "system"]
    body: dict[str, Any] = {"model": "smollm2", "input": items}
    if system:
        body["instructions"] = system[0]
    return json.dumps(body).encode()


def hf_ids(hf: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_prompts_and_ids_equal_transformers_from_every_protocol(smollm2: tuple[RecipeAdapter, Any], index: int) -> None:
    adapter, hf = smollm2
    messages = CONVERSATIONS[index]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = hf_ids(hf, messages)
    for protocol, body in (
        ("openai.chat", chat_body(messages)),
        ("openai.responses", responses_body(messages)),
        ("anthropic.messages", anthropic_body(messages)),
    ):
        request = adapter.parse_request(protocol, body)
        assert request["prompt"] == text, protocol
        assert request["prompt_token_ids"] == ids, protocol


def test_special_token_strings_in_user_and_tool_content_stay_plain_text(smollm2: tuple[RecipeAdapter, Any]) -> None:
    adapter, _ = smollm2
    specials = adapter.encoder.special_tokens()
    special_ids = set(adapter.encoder.special_token_ids())
    assert len(specials) >= 3 and len(special_ids) == len(specials)
    payload = " ".join(specials) + "".join(specials)
    for messages in (
        [{"role": "user", "content": payload}],
        [{"role": "system", "content": payload}, {"role": "user", "content": f"x{payload}y"}],
    ):
        request = adapter.parse_request("openai.chat", chat_body(messages))
        template_ids = adapter.parse_request("openai.chat", chat_body([{**m, "content": "z"} for m in messages]))
        # Only the template's own control tokens remain: the same count as with harmless content.
        injected = [i for i in request["prompt_token_ids"] if i in special_ids]
        expected = [i for i in template_ids["prompt_token_ids"] if i in special_ids]
        assert injected == expected


def test_bad_requests_are_typed_errors_with_protocol_bodies(smollm2: tuple[RecipeAdapter, Any]) -> None:
    adapter, _ = smollm2
    with pytest.raises(RecipeError) as chat_error:
        adapter.parse_request("openai.chat", chat_body([{"role": "user", "content": [{"type": "nope"}]}]))
    assert chat_error.value.status == 400
    assert chat_error.value.path == "messages[0].content[0].type"
    assert json.loads(chat_error.value.body)["error"]["param"] == "messages[0].content[0].type"
    with pytest.raises(RecipeError) as anthropic_error:
        adapter.parse_request("anthropic.messages", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}')
    body = json.loads(anthropic_error.value.body)
    assert body["type"] == "error" and "max_tokens" in body["error"]["message"]
    with pytest.raises(RecipeError) as json_error:
        adapter.parse_request("openai.responses", b"{not json")
    assert json_error.value.status == 400 and json_error.value.path == ""


def test_stream_parser_and_writer_round_trip_a_deepseek_tool_call() -> None:
    sep, begin, end = (
        "<\uff5ctool\u2581sep\uff5c>",
        "<\uff5ctool\u2581call\u2581begin\uff5c>",
        "<\uff5ctool\u2581call\u2581end\uff5c>",
    )
    calls_begin, calls_end = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
    output = f'<think>plan</think>Sure.{calls_begin}{begin}get_weather{sep}{{"city": "Paris"}}{end}{calls_end}'
    assert output_format({"model_type": "deepseek_v3"}) == "deepseek_v3"
    one_shot = StreamParser("deepseek_v3", id_prefix="call_r1")
    whole = one_shot.push(output) + one_shot.finish()
    chunked = StreamParser("deepseek_v3", id_prefix="call_r1")
    data = output.encode()
    pieces = [e for i in range(0, len(data), 3) for e in chunked.push_bytes(data[i : i + 3])] + chunked.finish()
    kinds = [e["type"] for e in whole]
    assert kinds[0] == "reasoning" and "tool_call_start" in kinds and kinds[-1] == "tool_call_end"

    def merged(events: list[dict[str, Any]]) -> tuple[str, str, str]:
        return (
            "".join(e["text"] for e in events if e["type"] == "reasoning"),
            "".join(e["text"] for e in events if e["type"] == "text"),
            "".join(e["delta"] for e in events if e["type"] == "tool_call_arguments"),
        )

    assert merged(pieces) == merged(whole) == ("plan", "Sure.", '{"city": "Paris"}')
    writer = ResponseWriter("chat_completions", "r1", "ds", 0, include_usage=True, prompt_tokens=10)
    frames = writer.start() + writer.events(whole) + writer.finish("tool_calls", 10, 20)
    assert frames[-1] == "data: [DONE]\n\n"
    body = json.loads(writer.response("tool_calls", 10, 20))
    call = body["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def test_engine_output_becomes_protocol_responses(smollm2: tuple[RecipeAdapter, Any]) -> None:
    """Request -> ids -> the real engine -> each protocol's JSON body."""
    from powertrain import LLM, SamplingParams

    adapter, _ = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with LLM(dtype="float32") as llm:
        for protocol, body in (
            ("openai.chat", chat_body(messages)),
            ("openai.responses", responses_body(messages)),
            ("anthropic.messages", anthropic_body(messages)),
        ):
            request = adapter.parse_request(protocol, body)
            [output] = llm.generate([request["prompt_token_ids"]], SamplingParams(temperature=0, max_tokens=24))
            response = json.loads(adapter.render_response(protocol, request, output))
            text = output.outputs[0].text
            assert "Paris" in text
            if protocol == "openai.chat":
                assert response["choices"][0]["message"]["content"] == text
                assert response["usage"]["prompt_tokens"] == len(request["prompt_token_ids"])
            elif protocol == "openai.responses":
                assert response["output"][-1]["content"][0]["text"] == text
            else:
                assert response["content"][0]["text"] == text and response["type"] == "message"
