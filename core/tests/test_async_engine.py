"""The asyncio front: streaming, concurrent requests, client disconnects, bad input."""

from __future__ import annotations

import asyncio

import pytest

from powertrain import AsyncEngine, SamplingParams
from powertrain.assemble import build_engine
from powertrain.config import EngineConfig, ModelConfig
from powertrain.interfaces.errors import InvalidRequestError


@pytest.fixture(scope="module")
def engine():
    front = AsyncEngine(build_engine(EngineConfig(model=ModelConfig(dtype="float32"))))
    yield front
    front.shutdown()


async def collect(front: AsyncEngine, prompt: str, params: SamplingParams) -> list:
    return [output async for output in front.generate(prompt, params)]


def test_streams_grow_token_by_token_and_finish(engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    async def main():
        return await asyncio.gather(collect(engine, "The sky is", params), collect(engine, "Rivers flow", params))

    first, second = asyncio.run(main())
    for stream in (first, second):
        lengths = [len(o.outputs[0].token_ids) for o in stream]
        assert lengths == sorted(lengths) and lengths[-1] == 10 and len(stream) >= 5
        assert stream[-1].finished and not any(o.finished for o in stream[:-1])
        assert stream[-1].outputs[0].text.startswith(stream[-2].outputs[0].text[:1])
    # Streaming two at once changes nothing about the tokens: each alone gives the same ones.
    alone = asyncio.run(collect(engine, "Rivers flow", params))
    assert alone[-1].outputs[0].token_ids == second[-1].outputs[0].token_ids


def test_a_consumer_that_leaves_aborts_its_request(engine: AsyncEngine) -> None:
    blocks = engine.engine.block_manager
    free_before = blocks.num_free_blocks

    async def main():
        async for output in engine.generate(
            "Write a long essay about", SamplingParams(max_tokens=500, ignore_eos=True)
        ):
            if len(output.outputs[0].token_ids) >= 3:
                break  # the client went away
        for _ in range(100):  # the loop thread frees the blocks right after
            if blocks.num_free_blocks == free_before:
                return True
            await asyncio.sleep(0.05)
        return False

    assert asyncio.run(main())


def test_bad_input_fails_only_its_own_request(engine: AsyncEngine) -> None:
    async def main():
        good = asyncio.create_task(collect(engine, "Hello there", SamplingParams(temperature=0, max_tokens=6)))
        with pytest.raises(InvalidRequestError, match="the prompt is empty"):
            await collect(engine, "", SamplingParams())
        return await good

    outputs = asyncio.run(main())
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) >= 1


def test_the_one_process_engine_is_the_front_ends_engine(engine: AsyncEngine) -> None:
    """``LLM``, ``AsyncEngine`` and the server see only ``interfaces.Engine``; the
    one-process engine implements it, as the parallel front end does
    (test_parallel_engine)."""
    from powertrain.engine.engine import LLMEngine
    from powertrain.interfaces.engine import Engine, EngineStats, EngineTokenizer

    assert isinstance(engine.engine, LLMEngine) and isinstance(engine.engine, Engine)
    assert isinstance(engine.engine.tokenizer, EngineTokenizer)
    assert isinstance(engine.stats, EngineStats)


def test_an_object_missing_part_of_the_contract_is_not_an_engine() -> None:
    from powertrain.interfaces.engine import Engine

    class NoStep:
        tokenizer = model_name = model_config = max_model_len = None

        def add_request(self, prompt, params=None, request_id=None): ...
        def abort_request(self, request_id): ...
        def has_unfinished_requests(self): ...
        def stats(self): ...
        def shutdown(self): ...

    assert not isinstance(NoStep(), Engine)
