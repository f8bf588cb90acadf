"""The server on a DSpark engine: the official OpenAI SDK gets plain decoding's answer,
streamed and not, and /metrics shows the drafts that were verified and accepted."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence

import attrs
import httpx
import openai
import pytest

from powertrain import LLM, SamplingParams
from powertrain.assemble import build_engine
from powertrain.config import EngineConfig
from powertrain.engine.async_engine import AsyncEngine
from powertrain.llm import apply_overrides
from powertrain.plugins import PluginManager
from powertrain.serve.run import protocol_adapter
from powertrain.testing.server import running_server

MESSAGES = [
    {
        "role": "user",
        "content": "Repeat exactly: The harbour lights shine over the water while the boats come home.",
    }
]


def metric(base_url: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{base_url}/metrics").text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.fixture(scope="module")
def base_url(steady_steps_per_second: Callable[[Sequence[int], int], list]) -> Iterator[str]:
    config = apply_overrides(EngineConfig(), {"dtype": "float32", "speculative": "dspark"})
    # The step times are given, not measured (a loaded machine can make DSpark rightly verify
    # nothing): conftest's steady cost model, as [dspark] steps_per_second (5 drafts at most).
    profile = steady_steps_per_second([1, 4], 5)
    config = attrs.evolve(config, sections={"dspark": {"steps_per_second": profile}})
    plugins = PluginManager.load(config.plugins)
    engine = AsyncEngine(build_engine(config, plugins))
    try:
        with running_server(
            engine, protocol_adapter(plugins, engine.engine.tokenizer, engine.engine.model_config)
        ) as url:
            yield url
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def plain_answer() -> str:
    with LLM(dtype="float32") as llm:
        tokenizer = llm.engine.tokenizer
        prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
        output = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0]
        return output.outputs[0].text


def test_answers_equal_plain_decoding_and_metrics_count_drafts(base_url: str, plain_answer: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    verified = metric(base_url, "powertrain_speculative_verified_tokens_total")
    reply = client.chat.completions.create(model="smollm2-135m", messages=MESSAGES, max_tokens=40, temperature=0)
    assert reply.choices[0].message.content == plain_answer
    stream = client.chat.completions.create(
        model="smollm2-135m", messages=MESSAGES, max_tokens=40, temperature=0, stream=True
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == plain_answer
    assert metric(base_url, "powertrain_speculative_verified_tokens_total") > verified
    assert metric(base_url, "powertrain_speculative_accepted_tokens_total") > 0
