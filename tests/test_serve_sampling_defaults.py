"""The server fills what a request leaves unset with the model's own sampling settings:
a tiny random checkpoint whose generation_config.json says ``top_k: 1`` answers every
seeded request without top_k greedily, on Chat Completions, Messages and legacy Completions."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import openai
import pytest

from powertrain.serve.settings import ServeSettings
from powertrain.testing.checkpoints import write_tiny_deepseek
from powertrain.testing.server import serving

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = write_tiny_deepseek(tmp_path_factory.mktemp("tiny") / "model", num_nextn_predict_layers=0)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "do_sample": True, "top_k": 1}))
    with serving({"path": str(folder), "dtype": "float32"}, ServeSettings(served_model_name=MODEL)) as url:
        yield url


def test_requests_without_top_k_take_the_checkpoints(base_url: str) -> None:
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    chat = dict(model=MODEL, messages=MESSAGES, max_tokens=10)
    endless = {"ignore_eos": True}
    greedy = oai.chat.completions.create(**chat, temperature=0, extra_body=endless).choices[0].message.content
    assert greedy
    for seed in range(3):  # temperature 1 (unset too), but top_k 1 from generation_config.json
        answer = oai.chat.completions.create(**chat, seed=seed, extra_body=endless)
        assert answer.choices[0].message.content == greedy
    told = [oai.chat.completions.create(**chat, seed=s, extra_body={**endless, "top_k": 0}) for s in range(3)]
    assert any(c.choices[0].message.content != greedy for c in told)  # a request's own top_k wins

    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    texts = {
        claude.messages.create(model=MODEL, max_tokens=10, messages=MESSAGES, extra_body={"temperature": t})
        .content[0]
        .text
        for t in (0.0, 0.5, 1.0)
    }
    assert len(texts) == 1  # greedy whatever the temperature: top_k 1

    completion = dict(model=MODEL, prompt="the quick brown fox", max_tokens=10, extra_body={"ignore_eos": True})
    plain = oai.completions.create(**completion, temperature=0).choices[0].text
    assert {oai.completions.create(**completion, seed=s).choices[0].text for s in range(3)} == {plain}
