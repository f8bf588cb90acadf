"""The HTTP server in front of a data/expert-parallel engine: one front end, two ranks.

A tiny random DeepSeek-V3 (made here) served with data_parallel = expert_parallel = 2
must answer exactly as the one-process engine does, over the OpenAI protocol, streamed
or not, with requests spread over both ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from powertrain.config import EngineConfig
from powertrain.deploy.launch import start_engine
from powertrain.engine.async_engine import AsyncEngine
from powertrain.llm import apply_overrides
from powertrain.plugins import PluginManager
from powertrain.serve.run import protocol_adapter
from powertrain.serve.settings import ServeSettings
from powertrain.testing.checkpoints import write_tiny_deepseek
from powertrain.testing.server import running_server

MODEL = "tiny-v3"
QUESTIONS = [f"question {i}: {'why ' * i}is the sky blue?" for i in range(6)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_deepseek(tmp_path_factory.mktemp("tiny-v3-serve-parallel") / "model")


def _serve(folder: Path, **parallel: int) -> Iterator[tuple[str, AsyncEngine]]:
    config = apply_overrides(EngineConfig(), {"path": str(folder), "dtype": "float32", "memory_gib": 0.05, **parallel})
    plugins = PluginManager.load(config.plugins)
    engine = AsyncEngine(start_engine(config, plugins))
    try:
        adapter = protocol_adapter(plugins, engine.engine.tokenizer, engine.engine.model_config)
        with running_server(engine, adapter, ServeSettings(served_model_name=MODEL)) as url:
            yield url, engine
    finally:
        engine.shutdown()


def _answers(url: str, stream: bool) -> list[str]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)

    def ask(question: str) -> str:
        kwargs = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 12}
        if not stream:
            return client.chat.completions.create(temperature=0, **kwargs).choices[0].message.content or ""
        chunks = client.chat.completions.create(temperature=0, stream=True, **kwargs)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:  # concurrent requests, as clients send them
        return list(pool.map(ask, QUESTIONS))


@pytest.fixture(scope="module")
def reference(folder: Path) -> list[str]:
    for url, _ in _serve(folder):
        return _answers(url, stream=False)
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def parallel(folder: Path) -> Iterator[tuple[str, AsyncEngine]]:
    yield from _serve(folder, data_parallel=2, expert_parallel=2)


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_server_answers_as_one_process(
    parallel: tuple[str, AsyncEngine], reference: list[str], stream: bool
) -> None:
    url, engine = parallel
    before = engine.engine.requests_per_rank()
    assert _answers(url, stream) == reference
    after = engine.engine.requests_per_rank()
    assert all(after[rank] > before[rank] for rank in after), (before, after)
