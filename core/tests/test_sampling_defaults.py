"""The model's own sampling settings as request defaults ([model] generation_config).

A checkpoint whose generation_config.json says ``top_k: 1`` makes every request that
leaves top_k unset greedy, whatever its seed: a check that holds by construction, where a
random tiny model at temperature 1 picks other tokens than its argmax almost surely.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from powertrain import LLM, SamplingParams
from powertrain.interfaces import InvalidRequestError, SamplingDefaults
from powertrain.loader import CorruptCheckpointError, LoadError, load_checkpoint, sampling_defaults
from powertrain.testing.checkpoints import write_tiny_deepseek

PROMPT = "the quick brown fox"


def test_generation_config_values_fill_only_what_a_request_leaves_unset() -> None:
    defaults = SamplingDefaults.from_generation_config(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 1}, "gen.json"
    )
    assert defaults.values == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert defaults.source == "gen.json"
    params = defaults.params(temperature=0.0, top_p=None, max_tokens=5)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.0, 0.95, 20, 5)
    assert SamplingDefaults().params() == SamplingParams()


def test_do_sample_false_is_greedy_and_a_bad_value_names_its_file() -> None:
    greedy = SamplingDefaults.from_generation_config({"do_sample": False, "temperature": 0.7}, "gen.json")
    assert greedy.params().greedy and "do_sample" in greedy.source
    nothing = SamplingDefaults.from_generation_config({"eos_token_id": 2}, "gen.json")
    assert nothing.values == {} and "gen.json sets none" in nothing.source
    with pytest.raises(InvalidRequestError, match=r"gen\.json: .*top_p must be in \(0, 1\]"):
        SamplingDefaults.from_generation_config({"top_p": 1.5}, "gen.json")


def test_the_embedded_model_brings_its_cards_settings() -> None:
    checkpoint = load_checkpoint("smollm2-135m")
    defaults = sampling_defaults("auto", checkpoint)
    assert defaults.values == {"temperature": 0.2, "top_p": 0.9}
    assert "model card" in defaults.source
    assert sampling_defaults("none", checkpoint).values == {}


@pytest.fixture(scope="module")
def greedy_by_default(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_tiny_deepseek(tmp_path_factory.mktemp("tiny") / "model", num_nextn_predict_layers=0)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "do_sample": True, "top_k": 1}))
    return folder


def test_a_checkpoints_top_k_1_makes_unset_requests_greedy(greedy_by_default: Path) -> None:
    seeds = range(4)
    with LLM(str(greedy_by_default), dtype="float32") as llm:
        assert llm.engine.sampling_defaults.values == {"top_k": 1}
        greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        seeded = llm.generate(
            [PROMPT] * len(seeds),
            [llm.default_sampling_params(seed=s, max_tokens=12, ignore_eos=True) for s in seeds],
        )
        unset = llm.generate(PROMPT)  # no params at all: the defaults, 16 tokens
        told = llm.generate(
            [PROMPT] * len(seeds), [SamplingParams(seed=s, top_k=0, max_tokens=12, ignore_eos=True) for s in seeds]
        )
    expected = greedy[0].outputs[0].token_ids
    assert [out.outputs[0].token_ids for out in seeded] == [expected] * len(seeds)
    assert unset[0].outputs[0].token_ids[: len(expected)] == expected[: len(unset[0].outputs[0].token_ids)]
    # A request that sets top_k itself is not overridden: temperature 1 on a random model.
    assert any(out.outputs[0].token_ids != expected for out in told)


def test_none_turns_them_off_and_a_path_replaces_them(greedy_by_default: Path, tmp_path: Path) -> None:
    checkpoint = load_checkpoint(greedy_by_default)
    assert sampling_defaults("auto", checkpoint).source == str(greedy_by_default / "generation_config.json")
    assert sampling_defaults("none", checkpoint).values == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "min_p": 0.1}))
    assert sampling_defaults(str(tmp_path), checkpoint).values == {"temperature": 0.3, "min_p": 0.1}
    with pytest.raises(LoadError, match=r"is not a file.*\"auto\".*\"none\""):
        sampling_defaults(str(tmp_path / "missing.json"), checkpoint)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(CorruptCheckpointError, match=r"temperature must be >= 0.*generation_config = \"none\""):
        sampling_defaults(str(tmp_path), checkpoint)
    with LLM(str(greedy_by_default), dtype="float32", generation_config="none") as llm:
        assert llm.engine.sampling_defaults.values == {}
        outs = llm.generate([PROMPT] * 4, [llm.default_sampling_params(seed=s, max_tokens=12) for s in range(4)])
        greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))
    assert any(out.outputs[0].token_ids != greedy[0].outputs[0].token_ids for out in outs)
