"""The Python face of the recipe against real components: SmolLM2's tokenizer and chat
template (from the GGUF the workspace ships), transformers' apply_chat_template as the
oracle, and the engine's own output for responses."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx2 as httpx
import openai
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

TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


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
        assert request.prompt == text, protocol
        assert request.prompt_token_ids == ids, protocol


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
        injected = [i for i in request.prompt_token_ids if i in special_ids]
        expected = [i for i in template_ids.prompt_token_ids if i in special_ids]
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
            [output] = llm.generate([request.prompt_token_ids], SamplingParams(temperature=0, max_tokens=24))
            response = json.loads(adapter.render_response(protocol, request, output))
            text = output.outputs[0].text
            assert "Paris" in text
            if protocol == "openai.chat":
                assert response["choices"][0]["message"]["content"] == text
                assert response["usage"]["prompt_tokens"] == len(request.prompt_token_ids)
            elif protocol == "openai.responses":
                assert response["output"][-1]["content"][0]["text"] == text
            else:
                assert response["content"][0]["text"] == text and response["type"] == "message"


# --------------------------------------------------------------------------- official SDKs as oracles

FIXTURES = Path(__file__).parent / "fixtures" / "smollm2"
CALLS_BEGIN, CALLS_END = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL_BEGIN, CALL_END, SEP = (
    "<\uff5ctool\u2581call\u2581begin\uff5c>",
    "<\uff5ctool\u2581call\u2581end\uff5c>",
    "<\uff5ctool\u2581sep\uff5c>",
)
#: A DeepSeek-V3.1 style output: reasoning, text, one tool call.
DEEPSEEK_OUTPUT = (
    f'<think>The user wants weather.</think>Checking.{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{{"city": "Paris"}}'
    f"{CALL_END}{CALLS_END}"
)


def deepseek_adapter() -> RecipeAdapter:
    """SmolLM2's tokenizer and template with DeepSeek-V3 output markup (no checkpoint needed)."""
    config = json.loads((FIXTURES / "tokenizer_config.json").read_text())
    config["chat_template"] = (FIXTURES / "chat_template.jinja").read_text()
    return RecipeAdapter((FIXTURES / "tokenizer.json").read_text(), config, {"model_type": "deepseek_v3"})


def stream_frames(protocol: str, text: str, *, reasoning_summary: bool = False, **usage: int) -> list[str]:
    """SSE frames for ``text`` written in chunks of 5 characters, as a server streams them."""
    parser = StreamParser("deepseek_v3", id_prefix="call_r1")
    writer = ResponseWriter(
        protocol,
        {"chat_completions": "chatcmpl-r1", "responses": "resp_r1", "anthropic_messages": "msg_r1"}[protocol],
        "ds",
        1700000000,
        include_usage=True,
        prompt_tokens=usage.get("prompt_tokens", 0),
        cached_prompt_tokens=usage.get("cached_prompt_tokens", 0),
        reasoning_summary=reasoning_summary,
    )
    frames = writer.start()
    for i in range(0, len(text), 5):
        frames += writer.events(parser.push(text[i : i + 5]))
    frames += writer.events(parser.finish())
    return frames + writer.finish("tool_calls", 30, 12, cached_prompt_tokens=usage.get("cached_prompt_tokens", 0))


def mock_http(frames: list[str]) -> httpx.Client:
    """An HTTP client (the SDKs' own httpx2) that answers every request with these frames."""

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content="".join(frames).encode())

    return httpx.Client(transport=httpx.MockTransport(handler))


def test_anthropic_sdk_parses_our_stream_into_a_message() -> None:
    frames = stream_frames("anthropic_messages", DEEPSEEK_OUTPUT, prompt_tokens=30, cached_prompt_tokens=8)
    names = [f.split("\n", 1)[0] for f in frames]
    assert names[:2] == ["event: message_start", "event: ping"]
    client = anthropic.Anthropic(api_key="test", base_url="http://recipe.test", http_client=mock_http(frames))
    with client.messages.stream(
        model="ds", max_tokens=64, messages=[{"role": "user", "content": "Weather in Paris?"}]
    ) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert "signature" in kinds and kinds[-1] == "message_stop"
    # Every block well-formed by the SDK's own (strict) model.
    message = anthropic.types.Message.model_validate(message.model_dump())
    thinking, text, call = message.content
    assert (thinking.type, thinking.thinking, thinking.signature) == ("thinking", "The user wants weather.", "")
    assert (text.type, text.text) == ("text", "Checking.")
    assert (call.type, call.id, call.name, call.input) == ("tool_use", "call_r1_0", "get_weather", {"city": "Paris"})
    assert (message.stop_reason, message.stop_sequence) == ("tool_use", None)
    usage = message.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.output_tokens) == (22, 8, 12)


def test_openai_sdk_parses_our_chat_stream() -> None:
    frames = stream_frames("chat_completions", DEEPSEEK_OUTPUT, prompt_tokens=30, cached_prompt_tokens=8)
    client = openai.OpenAI(api_key="test", base_url="http://recipe.test/v1", http_client=mock_http(frames))
    with client.chat.completions.stream(
        model="ds", messages=[{"role": "user", "content": "Weather in Paris?"}]
    ) as stream:
        for _ in stream:
            pass
        completion = stream.get_final_completion()
    [choice] = completion.choices
    assert choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "call_r1_0",
        "get_weather",
        {"city": "Paris"},
    )
    assert choice.finish_reason == "tool_calls"
    assert completion.usage.prompt_tokens_details.cached_tokens == 8


@pytest.mark.parametrize("summary", [False, True])
def test_openai_sdk_parses_our_responses_stream(summary: bool) -> None:
    frames = stream_frames("responses", DEEPSEEK_OUTPUT, reasoning_summary=summary, prompt_tokens=30)
    client = openai.OpenAI(api_key="test", base_url="http://recipe.test/v1", http_client=mock_http(frames))
    reasoning = {"effort": "medium", "summary": "auto"} if summary else {"effort": "medium"}
    with client.responses.stream(model="ds", input="Weather in Paris?", reasoning=reasoning) as stream:
        kinds = [event.type for event in stream]
        response = stream.get_final_response()
    item, message, call = response.output
    assert item.type == "reasoning"
    if summary:
        assert "response.reasoning_summary_text.delta" in kinds and "response.reasoning_text.delta" not in kinds
        assert [(s.type, s.text) for s in item.summary] == [("summary_text", "The user wants weather.")]
        assert item.content is None
    else:
        assert "response.reasoning_text.delta" in kinds and "response.reasoning_summary_text.delta" not in kinds
        assert item.summary == []
        assert [(c.type, c.text) for c in item.content] == [("reasoning_text", "The user wants weather.")]
    assert response.output_text == "Checking."
    assert (call.type, call.call_id, call.name, json.loads(call.arguments)) == (
        "function_call",
        "call_r1_0",
        "get_weather",
        {"city": "Paris"},
    )
    assert response.status == "completed" and response.usage.input_tokens == 30


# --------------------------------------------------------------------------- request options end to end


def test_new_request_fields_reach_the_engine_request() -> None:
    adapter = deepseek_adapter()
    chat = adapter.parse_request(
        "openai.chat",
        chat_body(
            [{"role": "user", "content": "hi"}],
            prompt_cache_key="tenant-1",
            safety_identifier="u-hash",
            user="legacy",
        ),
    )
    assert (chat.native["prompt_cache_key"], chat.native["safety_identifier"], chat.native["user"]) == (
        "tenant-1",
        "u-hash",
        "legacy",
    )
    responses = adapter.parse_request(
        "openai.responses",
        json.dumps(
            {
                "model": "m",
                "input": "hi",
                "reasoning": {"summary": "detailed"},
                "top_logprobs": 4,
                "include": ["message.output_text.logprobs"],
            }
        ).encode(),
    )
    assert responses.native["reasoning_summary"] == "detailed"
    assert (responses.sampling.logprobs, responses.sampling.top_logprobs) == (True, 4)
    messages = adapter.parse_request(
        "anthropic.messages",
        json.dumps(
            {
                "model": "m",
                "max_tokens": 64,
                "thinking": {"type": "adaptive"},
                "messages": [
                    {"role": "user", "content": "go"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "text", "text": "Calling f."},
                            {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
                        ],
                    },
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "boom", "is_error": True}],
                    },
                ],
            }
        ).encode(),
    )
    assert messages.native["conversation"]["thinking"]["adaptive"] is True
    assert messages.native["conversation"]["messages"][2] == {
        "role": "tool",
        "content": [{"type": "text", "text": "boom"}],
        "tool_call_id": "t1",
        "name": "f",
        "is_error": True,
    }
    # The prompt still renders (the template ignores the flag), from the parsed request too.
    prompt, ids = adapter.encoder.render_request(json.dumps(dict(messages.native)))
    assert prompt == messages.prompt and ids == messages.prompt_token_ids
    # Streaming takes several choices and log-probabilities (one writer per choice).
    streamed = adapter.parse_request("openai.chat", chat_body([{"role": "user", "content": "hi"}], stream=True, n=2))
    assert streamed.stream and streamed.sampling.n == 2


def fake_output(*texts: str, prompt_len: int = 7) -> Any:
    completions = [
        SimpleNamespace(text=text, token_ids=list(range(3 + i)), finish_reason="stop") for i, text in enumerate(texts)
    ]
    return SimpleNamespace(
        request_id="r9", prompt_token_ids=list(range(prompt_len)), num_cached_tokens=2, outputs=completions
    )


def test_render_response_writes_every_choice_and_the_reasoning_summary() -> None:
    adapter = deepseek_adapter()
    request = adapter.parse_request("openai.chat", chat_body([{"role": "user", "content": "hi"}], n=2))
    body = json.loads(adapter.render_response("openai.chat", request, fake_output("<think>a</think>One", "Two")))
    assert [(c["index"], c["message"]["content"]) for c in body["choices"]] == [(0, "One"), (1, "Two")]
    assert body["choices"][0]["message"]["reasoning_content"] == "a"
    assert body["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 3 + 4,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 2},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    summary = adapter.parse_request(
        "openai.responses", json.dumps({"model": "m", "input": "hi", "reasoning": {"summary": "auto"}}).encode()
    )
    plain = adapter.parse_request("openai.responses", json.dumps({"model": "m", "input": "hi"}).encode())
    output = fake_output("<think>Thought.</think>Answer.")
    with_summary = json.loads(adapter.render_response("openai.responses", summary, output))["output"][0]
    without = json.loads(adapter.render_response("openai.responses", plain, output))["output"][0]
    assert with_summary["summary"] == [{"type": "summary_text", "text": "Thought."}] and "content" not in with_summary
    assert without["summary"] == [] and without["content"] == [{"type": "reasoning_text", "text": "Thought."}]


@pytest.mark.parametrize(
    ("fields", "skipped"),
    [
        ({}, True),  # vLLM's default
        ({"skip_special_tokens": False}, False),
        ({"tools": [TOOL]}, False),  # the parser must see tool-call markup whole
        ({"tools": [TOOL], "tool_choice": "none"}, True),  # no call can come
        ({"tools": [TOOL], "skip_special_tokens": True}, False),
    ],
)
def test_special_tokens_are_skipped_unless_asked_or_tool_calls_may_come(fields: dict, skipped: bool) -> None:
    request = deepseek_adapter().parse_request("openai.chat", chat_body([{"role": "user", "content": "hi"}], **fields))
    assert request.sampling.skip_special_tokens is skipped


@pytest.mark.parametrize("encoding", ["v4", "v41"])
def test_a_forced_tool_call_is_prefilled_and_parsed_from_inside_the_block(encoding: str) -> None:
    """tool_choice required (thinking off): the prompt opens the DSML block, as DeepSeek's
    adapter does, and the stream parser starts inside it, so the model's invoke comes
    back as a tool call in every protocol's shape (V4 and V4.1 spellings)."""
    from powertrain.testing.checkpoints import tiny_tokenizer

    config = {"model_type": "deepseek_v4"}
    if encoding == "v41":
        config["_name_or_path"] = "deepseek-ai/DeepSeek-V4.1-Flash"
    adapter = RecipeAdapter(tiny_tokenizer().to_str(), {}, config)
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    body = {
        "model": "ds",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [tool],
        "tool_choice": "required",
        "thinking": {"type": "disabled"},
    }
    request = adapter.parse_request("openai.chat", json.dumps(body).encode())
    opening = "<｜DSML｜ calls>" if encoding == "v41" else "<｜DSML｜tool_calls>"
    assert request.prompt.endswith(f"<｜Assistant｜></think>\n\n{opening}\n")
    tag = "｜DSML｜ " if encoding == "v41" else "｜DSML｜"
    generated = (
        f'<{tag}invoke name="get_weather">\n<{tag}parameter name="city" string="true">Paris</{tag}parameter>\n'
        f"</{tag}invoke>\n</{opening[1:]}"
    )
    parser = adapter.stream_parser(request)
    events = [e for ch in generated for e in parser.push(ch)] + parser.finish()
    assert [e["type"] for e in events if e["type"] != "tool_call_arguments"] == ["tool_call_start", "tool_call_end"]
    assert events[0]["name"] == "get_weather"
    assert json.loads("".join(e["delta"] for e in events if e["type"] == "tool_call_arguments")) == {"city": "Paris"}
    # With thinking on (the default) the block cannot be opened: a clear 400.
    body.pop("thinking")
    with pytest.raises(RecipeError) as refused:
        adapter.parse_request("openai.chat", json.dumps(body).encode())
    assert refused.value.status == 400 and "thinking" in str(refused.value)
