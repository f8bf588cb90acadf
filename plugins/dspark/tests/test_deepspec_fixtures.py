"""The DeepSpec golden fixtures (``fixtures/deepspec``, made by DeepSeek's DeepSpec code, see
their README) are whole: their provenance says where they came from, the tiny target and
drafters they were computed on are written again bit for bit from the recorded seeds, and
every tensor has the shape the README's scheme gives it. Then powertrain's block drafter
against them: the engine's proposals, and the drafter model's logits and confidences along
greedy and forced paths."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import attrs
import pytest
import torch
from safetensors.torch import load_file

from powertrain.builtin.reference_attention import TorchReferenceAttention
from powertrain.config import EngineConfig
from powertrain.interfaces import AttentionMetadata, allocate_caches
from powertrain.llm import apply_overrides
from powertrain.models.dspark import load_block_drafter
from powertrain.testing import write_tiny_deepspec_drafter, write_tiny_qwen3
from powertrain.testing.drafters import anchor_tensor_scheme, check_anchor_heads, check_engine_proposals

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
        expected.update(anchor_tensor_scheme(name, anchors, full, forced, block, VOCAB))
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


# --------------------------------------------------------------------------- powertrain's drafter against them

#: DeepSpec's numbers are float32 like ours; the README's incremental-vs-scratch difference
#: (2e-6) is that arithmetic's own spread, and the acceptance bar is 1e-5.
EXACT = 1e-5


@pytest.fixture(scope="module")
def drafters(provenance: dict, target: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: write_tiny_deepspec_drafter(tmp_path_factory.mktemp(name), target, **scenario["drafter"])
        for name, scenario in provenance["scenarios"].items()
    }


@pytest.mark.parametrize("scenario", ["main", "gated"])
def test_engine_proposals_equal_deepspecs(
    scenario: str, provenance: dict, golden: dict[str, torch.Tensor], target: Path, drafters: dict[str, Path]
) -> None:
    """The target's greedy continuation through the engine with the block drafter: every
    block it drafts (at whatever anchors the run visits) has DeepSpec's draft tokens and
    confidences there. The engine's context entries come from the engine's own taps of the
    target, so this covers the taps, the cache writes and the drafting together."""
    tokens = golden["target.tokens"].tolist()
    dspark = {
        "drafter": "block",
        "draft_model": str(drafters[scenario]),
        "max_draft_tokens": provenance["scenarios"][scenario]["drafter"]["block_size"],
        "profile_sequences": [1],
    }
    base = {"path": str(target), "dtype": "float32", "speculative": "fixed-k", "block_size": 4}
    config = attrs.evolve(apply_overrides(EngineConfig(), base), sections={"dspark": dspark})
    check_engine_proposals(config, tokens, provenance["prompt_len"], golden, scenario, EXACT)


@pytest.mark.parametrize("scenario", ["main", "gated"])
def test_block_logits_equal_deepspecs_along_greedy_and_forced_paths(
    scenario: str, provenance: dict, golden: dict[str, torch.Tensor], target: Path, drafters: dict[str, Path]
) -> None:
    """The drafter model on DeepSpec's own taps, one anchor at a time over a paged cache:
    base logits, Markov-corrected logits along the greedy path and along a forced
    (non-greedy) previous-token path (what a sampled draft's q is processed from), and the
    confidences along both, within 1e-5 of DeepSpec's."""
    config = json.loads((target / "config.json").read_text())
    reference = TorchReferenceAttention()
    model = load_block_drafter(drafters[scenario], config, reference, torch.float32, torch.device("cpu"))
    tokens, taps = golden["target.tokens"], golden["target.taps"]
    width = config["hidden_size"]
    split = [taps[:, i * width : (i + 1) * width] for i in range(taps.shape[1] // width)]
    size = model.config.block_size
    block_size = 4
    blocks = -(-(len(tokens) + size) // block_size)
    caches = allocate_caches(
        model.attention_layers,
        [reference.kv_cache_spec(layer, block_size, torch.float32) for layer in model.attention_layers],
        {None: blocks},
        "cpu",
    )
    table = list(range(blocks))
    anchors = golden[f"{scenario}.anchors"].tolist()
    written = 0
    for anchor in anchors:
        if anchor > written:  # the context rows not yet in the cache
            meta = AttentionMetadata.build(
                query_lens=[anchor - written], seq_lens=[anchor], block_tables=[table], block_size=block_size
            )
            context = model.context([tap[written:anchor] for tap in split])
            model.write_context(context, torch.arange(written, anchor), caches, meta)
            written = anchor
        meta = AttentionMetadata.build(
            query_lens=[size], seq_lens=[anchor + size], block_tables=[table], block_size=block_size
        )
        ids = torch.tensor([int(tokens[anchor])] + [model.config.mask_token_id] * (size - 1))
        hidden = model.block(ids, torch.arange(anchor, anchor + size), caches, meta)
        key = f"{scenario}.anchor_{anchor}"
        check_anchor_heads(
            model, hidden, tokens[anchor : anchor + 1], golden, key, EXACT, f"{scenario}, anchor {anchor}"
        )
