"""The DeepSpec golden fixtures (``fixtures/deepspec``, made by DeepSeek's DeepSpec code, see
their README) are whole: their provenance says where they came from, the tiny target and
drafters they were computed on are written again bit for bit from the recorded seeds, and
every tensor has the shape the README's scheme gives it."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from powertrain.testing import write_tiny_deepspec_drafter, write_tiny_qwen3

FIXTURES = Path(__file__).parent / "fixtures" / "deepspec"
VOCAB = 512


@pytest.fixture(scope="module")
def provenance() -> dict:
    return json.loads((FIXTURES / "provenance.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def golden() -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / "golden.safetensors")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_fixture_says_where_it_came_from(provenance: dict) -> None:
    """A fixture without its provenance cannot be regenerated or trusted: DeepSpec's commit and
    files, the versions, the seeds, each weight file's SHA-256, the schedule and the
    incremental-vs-scratch difference, and what the driver stubbed or shimmed."""
    reference = provenance["reference"]
    assert reference["repository"] == "deepseek-ai/DeepSpec"
    assert re.fullmatch(r"[0-9a-f]{40}", reference["commit"])
    for name in ("modeling/dspark/qwen3/modeling.py", "modeling/dspark/markov_head.py", "eval/dspark/draft_ops.py"):
        assert re.fullmatch(r"[0-9a-f]{64}", reference["files"][f"deepspec/{name}"]), name
    assert provenance["torch"] and provenance["transformers"] and provenance["dtype"] == "float32"
    assert isinstance(provenance["stubbed"], list) and isinstance(provenance["shims"], list)
    for key in ("prompt_seed", "forced_seed", "prompt_len", "new_tokens"):
        assert isinstance(provenance[key], int), key
    target = provenance["target"]
    assert isinstance(target["seed"], int) and re.fullmatch(r"[0-9a-f]{64}", target["model_sha256"])
    readme = (FIXTURES / "README.md").read_text(encoding="utf-8")
    assert provenance["scenarios"].keys() == {"main", "gated"}
    for name, scenario in provenance["scenarios"].items():
        assert isinstance(scenario["drafter"]["seed"], int), name
        assert re.fullmatch(r"[0-9a-f]{64}", scenario["model_sha256"]), name
        assert 0 <= scenario["incremental_vs_scratch"] <= provenance["tolerance"] <= 1e-5, name
        visited = sorted(anchor for visit in scenario["schedule"] for anchor in visit["anchors"])
        assert visited == list(range(scenario["first_anchor"], scenario["last_anchor"] + 1)), name
        assert f"`{name}`" in readme, f"the README does not describe scenario {name}"


@pytest.fixture(scope="module")
def target(provenance: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    record = provenance["target"]
    return write_tiny_qwen3(tmp_path_factory.mktemp("target"), seed=record["seed"], **record["overrides"])


def test_the_weights_the_fixtures_ran_on_are_written_again_bit_for_bit(
    provenance: dict, target: Path, tmp_path: Path
) -> None:
    record = provenance["target"]
    assert sha256(target / "model.safetensors") == record["model_sha256"], (
        "write_tiny_qwen3 no longer writes the target the fixtures ran on: regenerate them as their README says"
    )
    for name, scenario in provenance["scenarios"].items():
        drafter = write_tiny_deepspec_drafter(tmp_path / name, target, **scenario["drafter"])
        assert sha256(drafter / "model.safetensors") == scenario["model_sha256"], (
            f"write_tiny_deepspec_drafter no longer writes the drafter of scenario {name}: "
            "regenerate the fixtures as their README says"
        )


def test_the_drafter_writer_refuses_what_deepspec_refuses_and_reuses_a_folder(target: Path, tmp_path: Path) -> None:
    """DeepSpec's evaluator refuses a tap of the target's last layer (transformers returns it
    normalised); a confidence head with Markov features needs a Markov head."""
    with pytest.raises(ValueError, match="target_layer_ids"):
        write_tiny_deepspec_drafter(tmp_path / "last", target, target_layer_ids=(1, 3))
    with pytest.raises(ValueError, match="Markov head"):
        write_tiny_deepspec_drafter(tmp_path / "rank0", target, markov_rank=0)
    folder = write_tiny_deepspec_drafter(tmp_path / "again", target, markov_rank=0, confidence_head_with_markov=False)
    written = (folder / "model.safetensors").stat().st_mtime_ns
    assert write_tiny_deepspec_drafter(folder, target, markov_rank=0, confidence_head_with_markov=False) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == written
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    assert "markov_head_type" not in config and config["confidence_head_with_markov"] is False


def test_fixture_tensors_follow_the_readme_scheme(provenance: dict, golden: dict[str, torch.Tensor]) -> None:
    length = provenance["prompt_len"] + provenance["new_tokens"]
    taps = len(provenance["scenarios"]["main"]["drafter"]["target_layer_ids"])
    expected = {"target.tokens": ((length,), torch.int64), "target.taps": ((length, taps * 64), torch.float32)}
    for name, scenario in provenance["scenarios"].items():
        block = scenario["drafter"]["block_size"]
        anchors = list(range(provenance["prompt_len"] - 1, length - block + 1))
        assert [scenario["first_anchor"], scenario["last_anchor"]] == [anchors[0], anchors[-1]]
        full, forced = scenario["full_logit_anchors"], scenario["forced_anchors"]
        assert golden[f"{name}.anchors"].tolist() == anchors
        assert golden[f"{name}.full_logit_anchors"].tolist() == full
        assert golden[f"{name}.forced_anchors"].tolist() == forced
        assert len(forced) == 3 and set(forced) <= set(full) <= set(anchors)
        for key, listed in (("anchors", anchors), ("full_logit_anchors", full), ("forced_anchors", forced)):
            expected[f"{name}.{key}"] = ((len(listed),), torch.int64)
        for anchor in anchors:
            prefix = f"{name}.anchor_{anchor}."
            expected[prefix + "tokens"] = ((block,), torch.int64)
            expected[prefix + "confidence_logits"] = ((block,), torch.float32)
            expected[prefix + "chosen_logits"] = ((block,), torch.float32)
            if anchor in full:
                expected[prefix + "logits"] = ((block, VOCAB), torch.float32)
                expected[prefix + "base_logits"] = ((block, VOCAB), torch.float32)
            if anchor in forced:
                expected[prefix + "forced_tokens"] = ((block,), torch.int64)
                expected[prefix + "forced_logits"] = ((block, VOCAB), torch.float32)
                expected[prefix + "forced_confidence_logits"] = ((block,), torch.float32)
    assert golden.keys() == expected.keys(), golden.keys() ^ expected.keys()
    for key, (shape, dtype) in expected.items():
        assert (tuple(golden[key].shape), golden[key].dtype) == (shape, dtype), key


def test_fixture_values_are_consistent(golden: dict[str, torch.Tensor]) -> None:
    """What the scheme implies between tensors: the chosen logit is the greedy draft's corrected
    logit and the largest, and a forced path's first step has the greedy one's previous token."""
    for name in ("main", "gated"):
        for anchor in golden[f"{name}.full_logit_anchors"].tolist():
            prefix = f"{name}.anchor_{anchor}."
            logits, tokens = golden[prefix + "logits"], golden[prefix + "tokens"]
            assert torch.equal(logits.argmax(-1), tokens)
            assert torch.equal(logits.gather(-1, tokens[:, None])[:, 0], golden[prefix + "chosen_logits"])
        for anchor in golden[f"{name}.forced_anchors"].tolist():
            prefix = f"{name}.anchor_{anchor}."
            assert (golden[prefix + "forced_tokens"] != golden[prefix + "tokens"]).all()
            assert torch.equal(golden[prefix + "forced_logits"][0], golden[prefix + "logits"][0])
