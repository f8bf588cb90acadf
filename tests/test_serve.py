"""``powertrain serve`` end to end: a real server on a localhost port, the embedded
SmolLM2 model, and the official ``openai`` and ``anthropic`` client libraries."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
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
from powertrain.testing.schemas import JSON_SCHEMAS
from powertrain.testing.server import running_server

MODEL = "smollm2-135m"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def engine_and_adapter() -> Iterator[tuple[AsyncEngine, Any]]:
    config = apply_overrides(EngineConfig(), {"dtype": "float32"})
    plugins = PluginManager.load(config.plugins)
    engine = AsyncEngine(build_engine(config, plugins))
    try:
        yield engine, protocol_adapter(plugins, engine.engine.tokenizer, engine.engine.model_config)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def base_url(engine_and_adapter: tuple[AsyncEngine, Any]) -> Iterator[str]:
    with running_server(*engine_and_adapter) as url:
        yield url


@pytest.fixture
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)


def metric(base_url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{base_url}/metrics").text
    pattern = rf"^{re.escape(name)}{re.escape(labels)} (\S+)$" if labels else rf"^{re.escape(name)} (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def wait_until_idle(base_url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(base_url, "powertrain_kv_blocks_used") == 0 and metric(base_url, "powertrain_requests_running") == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"the engine is not idle after {timeout} s: {httpx.get(f'{base_url}/metrics').text}")


# --------------------------------------------------------------------------- generation endpoints


def test_models_and_health(oai: openai.OpenAI, base_url: str) -> None:
    assert [m.id for m in oai.models.list()] == [MODEL]
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}


def test_chat_completions_plain_and_streamed_agree(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    whole = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    answer = whole.choices[0].message.content
    assert "Paris" in answer
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 0 and 0 < whole.usage.completion_tokens <= 24

    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_stop_sequence_ends_the_answer(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    free = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    text = free.choices[0].message.content
    assert "4" in text, text
    stopped = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0, stop=["4"])
    assert stopped.choices[0].message.content == text[: text.index("4")]
    assert stopped.choices[0].finish_reason == "stop"


def test_responses_plain_and_streamed_agree(oai: openai.OpenAI) -> None:
    whole = oai.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0)
    assert "Paris" in whole.output_text
    assert whole.status in ("completed", "incomplete")
    events = list(oai.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text


def test_anthropic_messages_plain_and_streamed_agree(claude: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    whole = claude.messages.create(model=MODEL, max_tokens=24, messages=messages, extra_body={"temperature": 0})
    answer = "".join(block.text for block in whole.content if block.type == "text")
    assert "Paris" in answer
    assert whole.stop_reason in ("end_turn", "max_tokens")
    with claude.messages.stream(model=MODEL, max_tokens=24, messages=messages, extra_body={"temperature": 0}) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == answer
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_anthropic_system_and_stop_sequence(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model=MODEL,
        max_tokens=40,
        system="You answer in one short sentence.",
        messages=[{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
        extra_body={"temperature": 0},  # this SDK no longer sends temperature itself
        stop_sequences=["5"],
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "5"
    assert "5" not in message.content[0].text


def test_legacy_completions_plain_and_streamed_agree(oai: openai.OpenAI) -> None:
    whole = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in whole.choices[0].text
    assert whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"
    chunks = list(
        oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


# --------------------------------------------------------------------------- structured output


def test_json_schema_outputs_validate(base_url: str) -> None:
    assert len(JSON_SCHEMAS) >= 20

    async def one(client: openai.AsyncOpenAI, name: str, schema: dict, seed: int) -> tuple[str, str, dict]:
        reply = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Give me an example {name} as JSON."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema, "strict": True},
            },
            max_tokens=160,
            temperature=0.8,
            seed=seed,
        )
        return name, reply.choices[0].message.content, schema

    async def main() -> list[tuple[str, str, dict]]:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as client:
            jobs = [one(client, name, schema, i) for i, (name, schema) in enumerate(JSON_SCHEMAS.items())]
            return await asyncio.gather(*jobs)

    for name, text, schema in asyncio.run(main()):
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as error:
            raise AssertionError(f"{name}: {error}: {text!r}") from None


def test_json_object_regex_and_choice_constraints(oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format={"type": "json_object"},
        max_tokens=120,
    )
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    phone = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A phone number?"}],
        extra_body={"structured_outputs": {"regex": r"\+33 [1-9]( [0-9]{2}){4}"}},
        max_tokens=30,
    )
    assert re.fullmatch(r"\+33 [1-9]( [0-9]{2}){4}", phone.choices[0].message.content)
    pick = oai.responses.create(
        model=MODEL, input="Yes or no?", extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}}
    )
    assert pick.output_text in ("yes", "no", "maybe")
    schema = JSON_SCHEMAS["flat person"]
    message = claude.messages.create(
        model=MODEL,
        max_tokens=80,
        messages=[{"role": "user", "content": "A person as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    jsonschema.validate(json.loads(message.content[0].text), schema)
    with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_body={"structured_outputs": {"regex": "(unclosed"}},
        )


# --------------------------------------------------------------------------- refusals


def test_bad_requests_get_400_in_each_protocol_shape(
    oai: openai.OpenAI, claude: anthropic.Anthropic, base_url: str
) -> None:
    with pytest.raises(openai.BadRequestError, match="unknown model 'gpt-4o'"):
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as bad_role:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    assert "messages[0].role" in str(bad_role.value)
    with pytest.raises(anthropic.BadRequestError) as bad_anthropic:
        claude.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    body = bad_anthropic.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("max_tokens:")
    with pytest.raises(openai.BadRequestError, match="best_of"):
        oai.completions.create(model=MODEL, prompt="hi", n=2, best_of=3)

    malformed = httpx.post(f"{base_url}/v1/chat/completions", content=b"{not json")
    assert malformed.status_code == 400 and "error" in malformed.json()
    malformed = httpx.post(f"{base_url}/v1/messages", content=b"[1, 2")
    assert malformed.status_code == 400 and malformed.json()["type"] == "error"
    legacy = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": 3})
    assert legacy.status_code == 400 and legacy.json()["error"]["param"] == "logprobs"

    long_prompt = "word " * 9000  # past SmolLM2's 8192-token context
    with pytest.raises(openai.BadRequestError, match="context"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_prompt}])
    # Still serving.
    assert oai.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens == 2


def test_api_key_is_required_when_set(engine_and_adapter: tuple[AsyncEngine, Any]) -> None:
    with running_server(*engine_and_adapter, ServeSettings(api_key="s3cret")) as url:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )
        assert httpx.post(f"{url}/v1/chat/completions", json={}).status_code == 401
        assert [m.id for m in openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret").models.list()] == [MODEL]
        reply = anthropic.Anthropic(base_url=url, api_key="s3cret", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.usage.output_tokens == 2
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key


def test_the_access_log_has_each_request_its_status_and_a_streams_whole_duration(
    engine_and_adapter: tuple[AsyncEngine, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import structlog

    import powertrain.serve.app as app_module

    recorder = structlog.testing.CapturingLogger()
    monkeypatch.setattr(app_module, "access_log", recorder)
    with running_server(*engine_and_adapter, ServeSettings(api_key="s3cret")) as url:
        assert httpx.post(f"{url}/v1/chat/completions", json={}).status_code == 401
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        started = time.perf_counter()
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=12, stream=True
        )
        arrivals = [time.perf_counter() for _ in stream]
        elapsed_ms = 1000 * (time.perf_counter() - started)
    lines = [call.kwargs for call in recorder.calls if call.args == ("request",)]
    refused, streamed = (line for line in lines if line["path"] == "/v1/chat/completions")
    assert (refused["status"], refused["method"]) == (401, "POST")
    assert streamed["status"] == 200 and streamed["client"] == "127.0.0.1"
    # Logged when the stream ends, not when its headers went out: the duration spans the
    # chunks (half their span, for scheduling slack; the headers alone take a few ms).
    span_ms = 1000 * (arrivals[-1] - arrivals[0])
    assert len(arrivals) > 2 and span_ms / 2 <= streamed["duration_ms"] <= elapsed_ms, (span_ms, streamed)


def test_oversized_bodies_get_413(engine_and_adapter: tuple[AsyncEngine, Any]) -> None:
    with running_server(*engine_and_adapter, ServeSettings(max_body_bytes=2000)) as url:
        big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
        response = httpx.post(f"{url}/v1/chat/completions", json=big)
        assert response.status_code == 413 and "2000" in response.json()["error"]["message"]
        with pytest.raises(anthropic.APIStatusError) as refused:
            anthropic.Anthropic(base_url=url, api_key="x", max_retries=0).messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x" * 5000}]
            )
        assert refused.value.status_code == 413 and refused.value.body["error"]["type"] == "request_too_large"


# --------------------------------------------------------------------------- load, disconnects, metrics


def test_64_concurrent_streams_complete_well_formed(base_url: str) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Write a word that starts with the letter {chr(97 + i % 26)}."}],
            max_tokens=8,
            temperature=0.7,
            seed=i,
            stream=True,
        )
        text, reason = "", None
        async for chunk in stream:
            assert reason is None, "a chunk arrived after the finish reason"
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason
        return text, reason

    async def main() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert len(results) == 64
    assert all(reason in ("stop", "length") for _, reason in results)
    assert sum(bool(text) for text, _ in results) >= 60
    wait_until_idle(base_url)


def test_clients_killed_mid_stream_free_their_blocks(base_url: str) -> None:
    wait_until_idle(base_url)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a very long story about a dragon."}],
        "max_tokens": 2000,
        "stream": True,
    }

    async def killed_client() -> int:
        async with (
            httpx.AsyncClient(timeout=60) as client,
            client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response,
        ):
            received = 0
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    received += 1
                if received >= 3:
                    return received  # leaving the block closes the connection mid-stream
        return received

    async def main() -> list[int]:
        return await asyncio.gather(*(killed_client() for _ in range(8)))

    assert asyncio.run(main()) == [3] * 8
    wait_until_idle(base_url)  # all eight aborted long before 2,000 tokens
    assert metric(base_url, "powertrain_requests_total", '{protocol="openai.chat",status="499"}') >= 8


def test_clients_gone_before_a_whole_answer_abort_their_requests(base_url: str) -> None:
    """A non-streaming request whose client left stops generating: every endpoint, each
    request long enough (100,000 tokens, or a regex of 5,000 words) to fill the context
    for minutes if nothing aborted it."""
    wait_until_idle(base_url)
    story = [{"role": "user", "content": "Tell me a very long story about a dragon."}]
    forever = {"regex": "(la ){5000}"}  # Responses and Messages have no ignore_eos
    requests = {
        "openai.chat": ("/v1/chat/completions", {"messages": story, "max_tokens": 100_000, "ignore_eos": True}),
        "openai.completions": (
            "/v1/completions",
            {"prompt": "Once upon a time", "max_tokens": 100_000, "ignore_eos": True},
        ),
        "openai.responses": ("/v1/responses", {"input": story, "structured_outputs": forever}),
        "anthropic.messages": (
            "/v1/messages",
            {"messages": story, "max_tokens": 100_000, "structured_outputs": forever},
        ),
    }
    gone = '{{protocol="{}",status="499"}}'
    before = {protocol: metric(base_url, "powertrain_requests_total", gone.format(protocol)) for protocol in requests}

    async def main() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            posts = [
                asyncio.create_task(client.post(path, json={"model": MODEL, **body}))
                for path, body in requests.values()
            ]
            deadline = time.monotonic() + 60
            while metric(base_url, "powertrain_requests_running") < len(posts):  # all four are generating
                assert time.monotonic() < deadline and not any(post.done() for post in posts)
                await asyncio.sleep(0.05)
            for post in posts:  # the clients give up: their connections close
                post.cancel()
            await asyncio.gather(*posts, return_exceptions=True)

    asyncio.run(main())
    wait_until_idle(base_url, timeout=15)  # without the watch: minutes, until the context is full
    for protocol in requests:
        assert metric(base_url, "powertrain_requests_total", gone.format(protocol)) == before[protocol] + 1, protocol


def test_metrics_move_with_requests(oai: openai.OpenAI, base_url: str) -> None:
    before = {
        (name, labels): metric(base_url, name, labels)
        for name, labels in (
            ("powertrain_requests_total", '{protocol="openai.chat",status="200"}'),
            ("powertrain_generation_tokens_total", ""),
            ("powertrain_prompt_tokens_total", ""),
            ("powertrain_time_to_first_token_seconds_count", ""),
            ("powertrain_prefix_cache_queries_total", ""),
            ("powertrain_prefix_cache_hits_total", ""),
            ("powertrain_requests_total", '{protocol="openai.chat",status="400"}'),
        )
    }
    history = [{"role": "user", "content": "Name a color. " * 20}]  # > one block: a prefix-cache hit next time
    for _ in range(2):
        reply = oai.chat.completions.create(model=MODEL, messages=history, max_tokens=5, temperature=0)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="nope", messages=history)
    after = {key: metric(base_url, *key) for key in before}
    keys = list(before)
    assert after[keys[0]] - before[keys[0]] == 2
    assert after[keys[1]] - before[keys[1]] == 2 * reply.usage.completion_tokens
    assert after[keys[2]] - before[keys[2]] == 2 * reply.usage.prompt_tokens
    assert after[keys[3]] - before[keys[3]] == 2
    assert after[keys[4]] - before[keys[4]] == 2 * reply.usage.prompt_tokens
    assert after[keys[5]] - before[keys[5]] >= 16  # the second request reused the first's blocks
    assert after[keys[6]] - before[keys[6]] == 1
    text = httpx.get(f"{base_url}/metrics").text
    names = ("powertrain_kv_blocks_free", "powertrain_requests_waiting", "powertrain_preemptions_total")
    for name in (*names, "powertrain_prefill_handoffs_total", "powertrain_prefill_handoff_seconds_total"):
        assert re.search(rf"^{name} ", text, re.MULTILINE), name
    assert json.loads(httpx.get(f"{base_url}/health").text)["status"] == "ok"


def test_shutdown_ends_in_flight_streams_and_frees_their_blocks(engine_and_adapter: tuple[AsyncEngine, Any]) -> None:
    engine, _ = engine_and_adapter
    seen: list[str] = []
    first = threading.Event()

    def client(url: str) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 4000}
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
                for line in r.iter_lines():
                    seen.append(line)
                    first.set()
        except httpx.HTTPError as exc:  # the server may cut the connection: that is a clean end too
            seen.append(f"closed: {type(exc).__name__}")
        first.set()

    with running_server(*engine_and_adapter, ServeSettings(graceful_shutdown_s=0.5)) as url:
        thread = threading.Thread(target=client, args=(url,))
        thread.start()
        assert first.wait(60)
    thread.join(30)
    assert not thread.is_alive(), "the client still waits after the server stopped"
    assert any(line.startswith("data: ") for line in seen)
    deadline = time.monotonic() + 30
    while engine.stats.kv_blocks_free != engine.stats.kv_blocks_total and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.stats.kv_blocks_free == engine.stats.kv_blocks_total and engine.stats.running == 0
    assert engine.is_alive()


def test_bench_serve_measures_this_server(base_url: str, tmp_path: Path) -> None:
    """The serving benchmark as CI runs it, at a small size, against the real server; with
    --ignore-eos (vLLM's extension) every answer is exactly --output-len tokens."""
    output, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    command = [str(Path(sys.executable).parent / "powertrain"), "bench", "serve", "--base-url", base_url]
    command += ["--workload", "multi-turn", "--conversations", "2", "--turns", "3", "--concurrency", "1,2"]
    command += ["--input-len", "40", "--output-len", "6", "--ignore-eos", "--output", str(output), "--plot", str(plot)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report = json.loads(output.read_text())
    assert report["config"]["model"] == MODEL and report["config"]["ignore_eos"] is True
    assert len(report["levels"]) == 2
    for level in report["levels"]:
        assert level["requests"]["completed"] == 6 and level["errors"]["count"] == 0
        assert level["tokens"]["output"] == 6 * 6
        assert level["ttft_ms"]["p50"] <= level["ttft_ms"]["p99"]
        # Each turn resends the conversation so far: later turns hit the prefix cache.
        assert level["prefix_cache_hit_rate"] > 0.2
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failure_inside_one_request_is_a_500_and_the_server_keeps_serving(
    engine_and_adapter: tuple[AsyncEngine, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, adapter = engine_and_adapter
    real_render = adapter.render_response

    def render(protocol: str, request: Any, output: Any) -> bytes:
        if "explode" in request.prompt:
            raise RuntimeError("renderer exploded")
        return real_render(protocol, request, output)

    monkeypatch.setattr(adapter, "render_response", render)
    with running_server(engine, adapter) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError, match="renderer exploded"):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "explode"}], max_tokens=2)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.usage.completion_tokens == 2
        assert metric(url, "powertrain_requests_total", '{protocol="openai.chat",status="500"}') == 1
        wait_until_idle(url)


def test_chat_logprobs_come_back_for_every_token(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens == 6
    assert "".join(entry.token for entry in content) == choice.message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        ranked = [top.logprob for top in entry.top_logprobs]
        assert ranked == sorted(ranked, reverse=True) and all(lp <= 0 for lp in ranked)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely
        assert entry.logprob == pytest.approx(ranked[0])
        assert bytes(entry.bytes).decode() == entry.token


def test_responses_logprobs_come_back_on_the_output_text(oai: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "input": QUESTION, "max_output_tokens": 6, "temperature": 0}
    reply = oai.responses.create(**kwargs, include=["message.output_text.logprobs"], top_logprobs=3)
    [message] = reply.output
    [part] = message.content
    assert part.type == "output_text"
    assert len(part.logprobs) == reply.usage.output_tokens == 6
    assert "".join(entry.token for entry in part.logprobs) == part.text == reply.output_text
    for entry in part.logprobs:
        assert len(entry.top_logprobs) == 3
        ranked = [top.logprob for top in entry.top_logprobs]
        assert ranked == sorted(ranked, reverse=True) and all(lp <= 0 for lp in ranked)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely
        assert entry.logprob == pytest.approx(ranked[0])
        assert bytes(entry.bytes).decode() == entry.token
    # The same tokens as Chat Completions reports for the same prompt.
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    assert [(e.token, e.logprob) for e in part.logprobs] == [
        (e.token, pytest.approx(e.logprob, abs=1e-4)) for e in chat.choices[0].logprobs.content
    ]
    # Without the include, top_logprobs asks for nothing (as in OpenAI's API).
    plain = oai.responses.create(**kwargs, top_logprobs=3)
    assert plain.output[0].content[0].logprobs == []
    # Streamed: the deltas carry the same entries, and so does the completed response.
    streamed_entries = []
    completed = None
    with oai.responses.create(**kwargs, include=["message.output_text.logprobs"], top_logprobs=3, stream=True) as s:
        for event in s:
            if event.type == "response.output_text.delta":
                streamed_entries += [(e.token, e.logprob) for e in event.logprobs]
            elif event.type in ("response.completed", "response.incomplete"):
                completed = event.response
    expected = [(e.token, pytest.approx(e.logprob, abs=1e-4)) for e in part.logprobs]
    assert streamed_entries == expected
    assert completed is not None
    assert [(e.token, e.logprob) for e in completed.output[0].content[0].logprobs] == expected


def test_n_choices_plain_and_streamed_with_logprobs(oai: openai.OpenAI) -> None:
    """n = 3 sampled choices through the official SDK, with log-probabilities: the stream
    for the same seed gives the same three texts and, chunk by chunk, the same entries."""
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 1234,
        "n": 3,
        "logprobs": True,
        "top_logprobs": 2,
    }
    reply = oai.chat.completions.create(**kwargs)
    assert [choice.index for choice in reply.choices] == [0, 1, 2]
    texts = [choice.message.content for choice in reply.choices]
    assert len(set(texts)) > 1, texts  # sampled independently
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices)
    streamed_text = ["", "", ""]
    streamed_logprobs: list[list[tuple[str, float]]] = [[], [], []]
    finish = [None, None, None]
    usage = None
    for chunk in oai.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            streamed_text[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None:
                streamed_logprobs[choice.index] += [(e.token, e.logprob) for e in choice.logprobs.content]
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert streamed_text == texts
    for choice, streamed in zip(reply.choices, streamed_logprobs, strict=True):
        assert streamed == [(e.token, pytest.approx(e.logprob, abs=1e-4)) for e in choice.logprobs.content]
    assert finish == [choice.finish_reason for choice in reply.choices]
    assert usage is not None and usage.completion_tokens == reply.usage.completion_tokens
    # Legacy completions: n choices too, streamed per index.
    legacy = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, n=2, seed=5, temperature=1.0)
    assert sorted(choice.index for choice in legacy.choices) == [0, 1]
    parts = ["", ""]
    for chunk in oai.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, n=2, seed=5, temperature=1.0, stream=True
    ):
        for choice in chunk.choices:
            parts[choice.index] += choice.text
    assert parts == [choice.text for choice in sorted(legacy.choices, key=lambda c: c.index)]


# --------------------------------------------------------------------------- vLLM's sampling extensions

SHORT = [{"role": "user", "content": "Say hi."}]
COUNT = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]


def test_vllm_ignore_eos_and_min_tokens_set_the_length(oai: openai.OpenAI) -> None:
    free = oai.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=40, temperature=0)
    assert free.choices[0].finish_reason == "stop", free  # the model ends this answer itself ...
    ended = free.usage.completion_tokens
    exact = oai.chat.completions.create(
        model=MODEL, messages=SHORT, max_tokens=ended + 3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert exact.usage.completion_tokens == ended + 3 and exact.choices[0].finish_reason == "length"
    longer = oai.chat.completions.create(
        model=MODEL, messages=SHORT, max_tokens=40, temperature=0, extra_body={"min_tokens": ended + 2}
    )
    assert longer.usage.completion_tokens >= ended + 2
    legacy = oai.completions.create(
        model=MODEL, prompt="Hi", max_tokens=5, temperature=0, extra_body={"ignore_eos": True, "min_tokens": 5}
    )
    assert legacy.usage.completion_tokens == 5


def test_vllm_stop_token_ids_end_the_output(oai: openai.OpenAI, engine_and_adapter: tuple[AsyncEngine, Any]) -> None:
    tokenizer = engine_and_adapter[0].engine.tokenizer
    prompt = tokenizer.encode("The capital of France is")
    free = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    ids = tokenizer.encode(free.choices[0].text)
    stop = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    legacy = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body={"stop_token_ids": [ids[stop]]}
    )
    # The stop token counts as generated but its text is not in the output (as in vLLM).
    assert legacy.choices[0].finish_reason == "stop" and legacy.usage.completion_tokens == stop + 1
    assert legacy.choices[0].text == tokenizer.decode(ids[:stop])

    chat = oai.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=6, temperature=0)
    ids = tokenizer.encode(chat.choices[0].message.content)
    stopped = oai.chat.completions.create(
        model=MODEL, messages=SHORT, max_tokens=6, temperature=0, extra_body={"stop_token_ids": [ids[1]]}
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens <= 2


def test_vllm_include_stop_str_in_output_keeps_the_stop_string(oai: openai.OpenAI) -> None:
    kept = oai.chat.completions.create(
        model=MODEL, messages=COUNT, max_tokens=40, temperature=0, stop=["4"],
        extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    assert kept.choices[0].message.content.endswith("4") and kept.choices[0].finish_reason == "stop"
    legacy = oai.completions.create(
        model=MODEL, prompt="1, 2, 3,", max_tokens=8, temperature=0, stop=["5"],
        extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    assert legacy.choices[0].text.endswith("5") and legacy.choices[0].finish_reason == "stop"


def test_vllm_top_k_1_and_min_p_1_are_greedy(oai: openai.OpenAI) -> None:
    greedy = oai.chat.completions.create(model=MODEL, messages=COUNT, max_tokens=12, temperature=0)
    for extension in ({"top_k": 1}, {"min_p": 1.0}):
        sampled = oai.chat.completions.create(
            model=MODEL, messages=COUNT, max_tokens=12, temperature=1.5, seed=3, extra_body=extension
        )
        assert sampled.choices[0].message.content == greedy.choices[0].message.content, extension
    legacy_greedy = oai.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=8, temperature=0)
    legacy = oai.completions.create(
        model=MODEL, prompt="1, 2, 3,", max_tokens=8, temperature=1.5, seed=3, extra_body={"top_k": 1}
    )
    assert legacy.choices[0].text == legacy_greedy.choices[0].text


def test_vllm_repetition_penalty_changes_a_repetitive_answer(oai: openai.OpenAI) -> None:
    def count(**extra: Any) -> str:
        return (
            oai.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=8, temperature=0, extra_body=extra)
            .choices[0]
            .text
        )

    assert count(repetition_penalty=3.0) != count()
    reply = oai.chat.completions.create(
        model=MODEL, messages=COUNT, max_tokens=12, temperature=0, extra_body={"repetition_penalty": 3.0}
    )
    greedy = oai.chat.completions.create(model=MODEL, messages=COUNT, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content != greedy.choices[0].message.content


def test_vllm_skip_special_tokens_on_completions(
    oai: openai.OpenAI, engine_and_adapter: tuple[AsyncEngine, Any]
) -> None:
    tokenizer = engine_and_adapter[0].engine.tokenizer
    eos = min(tokenizer.eos_token_ids)
    body = {"ignore_eos": True, "min_tokens": 3}
    # A prompt that ends a document: the model's next token is EOS, then more text.
    prompt = tokenizer.encode("The end.") + [eos]
    kept = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, extra_body=body | {"skip_special_tokens": False}
    )
    skipped = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, extra_body=body)
    assert "<|" in kept.choices[0].text and "<|" not in skipped.choices[0].text


def test_vllm_skip_special_tokens_on_chat(oai: openai.OpenAI, engine_and_adapter: tuple[AsyncEngine, Any]) -> None:
    tokenizer = engine_and_adapter[0].engine.tokenizer
    specials = [t.content for t in tokenizer.backend.get_added_tokens_decoder().values() if t.special]
    free = oai.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=40, temperature=0)
    assert free.choices[0].finish_reason == "stop", free  # the model ends this answer itself ...
    answer, past_end = free.choices[0].message.content, free.usage.completion_tokens + 6
    body = {"ignore_eos": True, "min_tokens": past_end}  # ... and is made to go on past its end token

    def chat(stream: bool, **extra: Any) -> str:
        kwargs = {"model": MODEL, "messages": SHORT, "max_tokens": past_end, "temperature": 0}
        if not stream:
            reply = oai.chat.completions.create(**kwargs, extra_body=body | extra)
            assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == past_end
            return reply.choices[0].message.content
        chunks = oai.chat.completions.create(**kwargs, stream=True, extra_body=body | extra)
        return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)

    kept = chat(False, skip_special_tokens=False)
    assert kept.startswith(answer + tokenizer.eos_token), kept  # the end token's text, then more
    skipped = chat(False)  # vLLM's default: special tokens are left out
    assert not any(special in skipped for special in specials), skipped
    without_specials = kept
    for special in specials:
        without_specials = without_specials.replace(special, "")
    assert skipped == without_specials and len(skipped) > len(answer)
    assert chat(False, skip_special_tokens=True) == skipped
    assert chat(True) == skipped and chat(True, skip_special_tokens=False) == kept


def test_openai_logit_bias_bans_and_forces_tokens(
    oai: openai.OpenAI, engine_and_adapter: tuple[AsyncEngine, Any]
) -> None:
    tokenizer = engine_and_adapter[0].engine.tokenizer
    prompt = tokenizer.encode("The capital of France is")
    greedy = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0).choices[0].text
    first = tokenizer.encode(greedy)[0]
    banned = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body={"logit_bias": {str(first): -100}}
    )
    assert banned.choices[0].text != greedy
    forced = tokenizer.encode("Hello")[0]
    legacy = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=1, logit_bias={str(forced): 100}
    )
    assert legacy.choices[0].text == tokenizer.decode([forced, forced])
    chat = oai.chat.completions.create(
        model=MODEL, messages=SHORT, max_tokens=2, temperature=1, logit_bias={str(forced): 100}
    )
    assert chat.choices[0].message.content == tokenizer.decode([forced, forced])


@pytest.mark.parametrize(
    ("endpoint", "field", "value"),
    [
        ("chat", "top_k", "5"),
        ("chat", "min_p", 1.5),
        ("chat", "repetition_penalty", 0),
        ("chat", "ignore_eos", "yes"),
        ("chat", "stop_token_ids", [-1]),
        ("chat", "min_tokens", 50),
        ("chat", "logit_bias", {"abc": 1}),
        ("chat", "logit_bias", {"5": 101}),
        ("chat", "logit_bias", {"999999": 1}),
        ("chat", "skip_special_tokens", "no"),
        ("completions", "top_k", -3),
        ("completions", "min_p", 1.5),
        ("completions", "repetition_penalty", "high"),
        ("completions", "ignore_eos", 1),
        ("completions", "stop_token_ids", ["a"]),
        ("completions", "min_tokens", 50),
        ("completions", "skip_special_tokens", "no"),
        ("completions", "include_stop_str_in_output", None),
        ("completions", "logit_bias", [1]),
        ("completions", "logit_bias", {"5": "1"}),
        ("completions", "logit_bias", {"-5": 1}),
        ("completions", "logit_bias", {"999999": 1}),
    ],
)
def test_vllm_bad_values_get_400_naming_the_field(oai: openai.OpenAI, endpoint: str, field: str, value: Any) -> None:
    extra = {field: value}
    if value is None:  # null means absent: accepted
        reply = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=extra)
        assert reply.usage.completion_tokens == 2
        return
    with pytest.raises(openai.BadRequestError, match=field):
        if endpoint == "chat":
            oai.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=4, extra_body=extra)
        else:
            oai.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body=extra)
    reply = oai.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=2)  # still serving
    assert reply.usage.completion_tokens == 2


PNG_1X1 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


def test_images_are_checked_then_refused_naming_the_model(oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    """Image parts are accepted in all three protocols as inline data and checked; the
    served model has no vision encoder, so a valid image is a 400 naming it; a remote
    URL or broken data is a 400 naming the part. The server keeps serving."""
    data_url = f"data:image/png;base64,{PNG_1X1}"
    text = {"type": "text", "text": "What is this?"}
    with pytest.raises(openai.BadRequestError, match=f"model .{MODEL}. has no vision encoder"):
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [text, {"type": "image_url", "image_url": {"url": data_url}}]}],
        )
    with pytest.raises(openai.BadRequestError, match="no vision encoder"):
        oai.responses.create(
            model=MODEL,
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": data_url, "detail": "auto"}]}],
        )
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_1X1}}
    with pytest.raises(anthropic.BadRequestError, match="no vision encoder"):
        claude.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [text, image]}])
    with pytest.raises(openai.BadRequestError) as remote:
        oai.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}
            ],
        )
    assert "data URL" in str(remote.value) and "messages[0].content[0].image_url.url" in str(remote.value)
    broken = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "not base64!"}}
    with pytest.raises(anthropic.BadRequestError, match="base64"):
        claude.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [broken]}])
    assert oai.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens == 2
