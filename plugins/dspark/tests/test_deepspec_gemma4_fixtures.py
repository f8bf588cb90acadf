"""The DeepSpec Gemma 4 golden fixtures (``fixtures/deepspec_gemma4``, made by DeepSeek's DeepSpec
code under the transformers it pins, see their README) are whole: their provenance says where
they came from, the tiny targets and drafters they were computed on are written again bit for
bit from the recorded seeds, and every tensor has the shape the README's scheme gives it. Then
powertrain's Gemma 4 block drafter (``models/dspark_gemma4.py``) against them: the engine's
proposals, and the drafter model's logits and confidences along greedy and forced paths, its
context written incrementally and from scratch. Last, what the loader and the writer refuse.
"""

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
from powertrain.models.dspark import Gemma4BlockDrafterModel, load_block_drafter, read_drafter_config
from powertrain.testing import write_tiny_deepspec_drafter, write_tiny_gemma4
from powertrain.testing.drafters import anchor_tensor_scheme, check_anchor_heads, check_engine_proposals

FIXTURES = Path(__file__).parent / "fixtures" / "deepspec_gemma4"
SCENARIOS = ("main", "gated")
VOCAB = 512
HIDDEN = 64
#: DeepSpec's numbers are float32 like ours; the acceptance bar, as for the Qwen3 fixtures.
EXACT = 1e-5


@pytest.fixture(scope="module")
def provenance() -> dict:
    return json.loads((FIXTURES / "provenance.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def golden() -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / "golden.safetensors")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_fixture_says_where_it_came_from(provenance: dict) -> None:
    """DeepSpec's commit and files, the versions (DeepSpec's pinned transformers ran its code),
    the seeds, each weight file's SHA-256, the schedule and the incremental-vs-scratch
    difference, and that nothing was stubbed or shimmed."""
    reference = provenance["reference"]
    assert reference["repository"] == "deepseek-ai/DeepSpec"
    assert re.fullmatch(r"[0-9a-f]{40}", reference["commit"])
    for name in (
        "deepspec/modeling/dspark/gemma4/modeling.py",
        "deepspec/modeling/dspark/gemma4/config.py",
        "deepspec/modeling/dspark/markov_head.py",
        "deepspec/eval/dspark/draft_ops.py",
        "requirements.txt",
    ):
        assert re.fullmatch(r"[0-9a-f]{64}", reference["files"][name]), name
    assert provenance["torch"] and provenance["transformers"] and provenance["dtype"] == "float32"
    assert provenance["stubbed"] == [] and provenance["shims"] == []
    for key in ("prompt_seed", "forced_seed", "prompt_len", "new_tokens", "full_every"):
        assert isinstance(provenance[key], int), key
    assert 0 <= provenance["target_taps_vs_writer_transformers"] <= 1e-5
    readme = (FIXTURES / "README.md").read_text(encoding="utf-8")
    assert provenance["scenarios"].keys() == set(SCENARIOS)
    for name, scenario in provenance["scenarios"].items():
        target = scenario["target"]
        assert target["writer"] == "write_tiny_gemma4" and isinstance(target["seed"], int), name
        assert re.fullmatch(r"[0-9a-f]{64}", target["model_sha256"]), name
        assert isinstance(scenario["drafter"]["seed"], int), name
        assert re.fullmatch(r"[0-9a-f]{64}", scenario["model_sha256"]), name
        assert 0 <= scenario["incremental_vs_scratch"] <= provenance["tolerance"] <= 1e-5, name
        assert set(scenario["config_keys_differing"]) <= {"transformers_version"}, name
        visited = sorted(anchor for visit in scenario["schedule"] for anchor in visit["anchors"])
        assert visited == list(range(scenario["first_anchor"], scenario["last_anchor"] + 1)), name
        assert f"`{name}`" in readme, f"the README does not describe scenario {name}"


@pytest.fixture(scope="module")
def targets(provenance: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: write_tiny_gemma4(
            tmp_path_factory.mktemp(f"{name}-target"),
            seed=scenario["target"]["seed"],
            **scenario["target"]["arguments"],
        )
        for name, scenario in provenance["scenarios"].items()
    }


@pytest.fixture(scope="module")
def drafters(provenance: dict, targets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: write_tiny_deepspec_drafter(tmp_path_factory.mktemp(name), targets[name], **scenario["drafter"])
        for name, scenario in provenance["scenarios"].items()
    }


def test_the_weights_the_fixtures_ran_on_are_written_again_bit_for_bit(
    provenance: dict, targets: dict[str, Path], drafters: dict[str, Path]
) -> None:
    for name, scenario in provenance["scenarios"].items():
        assert sha256(targets[name] / "model.safetensors") == scenario["target"]["model_sha256"], (
            f"write_tiny_gemma4 no longer writes the target of scenario {name}: regenerate the fixtures "
            "as their README says"
        )
        assert sha256(drafters[name] / "model.safetensors") == scenario["model_sha256"], (
            f"write_tiny_deepspec_drafter no longer writes the drafter of scenario {name}: "
            "regenerate the fixtures as their README says"
        )


def test_fixture_tensors_follow_the_readme_scheme(provenance: dict, golden: dict[str, torch.Tensor]) -> None:
    length = provenance["prompt_len"] + provenance["new_tokens"]
    expected = {}
    for name, scenario in provenance["scenarios"].items():
        block, taps = scenario["drafter"]["block_size"], len(scenario["drafter"]["target_layer_ids"])
        expected[f"{name}.target.tokens"] = ((length,), torch.int64)
        expected[f"{name}.target.taps"] = ((length, taps * HIDDEN), torch.float32)
        anchors = list(range(provenance["prompt_len"] - 1, length - block + 1))
        assert [scenario["first_anchor"], scenario["last_anchor"]] == [anchors[0], anchors[-1]]
        full, forced = scenario["full_logit_anchors"], scenario["forced_anchors"]
        every = provenance["full_every"]
        assert full == [a for a in anchors if (a - anchors[0]) % every == 0 or a == anchors[-1]]
        assert golden[f"{name}.anchors"].tolist() == anchors
        assert golden[f"{name}.full_logit_anchors"].tolist() == full
        assert golden[f"{name}.forced_anchors"].tolist() == forced
        assert len(forced) == 3 and set(forced) <= set(full) <= set(anchors)
        expected.update(anchor_tensor_scheme(name, anchors, full, forced, block, VOCAB))
    assert golden.keys() == expected.keys(), golden.keys() ^ expected.keys()
    for key, (shape, dtype) in expected.items():
        assert (tuple(golden[key].shape), golden[key].dtype) == (shape, dtype), key


def test_fixture_values_are_consistent(provenance: dict, golden: dict[str, torch.Tensor]) -> None:
    """The chosen logit is the greedy draft's corrected logit and the largest, a forced path's
    first step has the greedy one's previous token, and the base logits are soft-capped."""
    for name, scenario in provenance["scenarios"].items():
        cap = scenario["target"]["arguments"].get("final_logit_softcapping", 30.0)  # TINY_GEMMA4_CONFIG's
        for anchor in golden[f"{name}.full_logit_anchors"].tolist():
            prefix = f"{name}.anchor_{anchor}."
            logits, tokens = golden[prefix + "logits"], golden[prefix + "tokens"]
            assert torch.equal(logits.argmax(-1), tokens)
            assert torch.equal(logits.gather(-1, tokens[:, None])[:, 0], golden[prefix + "chosen_logits"])
            assert golden[prefix + "base_logits"].abs().max() < cap
        for anchor in golden[f"{name}.forced_anchors"].tolist():
            prefix = f"{name}.anchor_{anchor}."
            assert (golden[prefix + "forced_tokens"] != golden[prefix + "tokens"]).all()
            assert torch.equal(golden[prefix + "forced_logits"][0], golden[prefix + "logits"][0])


# --------------------------------------------------------------------------- powertrain's drafter against them


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_engine_proposals_equal_deepspecs(
    scenario: str,
    provenance: dict,
    golden: dict[str, torch.Tensor],
    targets: dict[str, Path],
    drafters: dict[str, Path],
) -> None:
    """The target's greedy continuation through the engine with the Gemma 4 block drafter:
    every block it drafts at a fixture anchor has DeepSpec's draft tokens and confidences
    there. The context entries come from the engine's own taps of its own Gemma 4 target."""
    tokens = golden[f"{scenario}.target.tokens"].tolist()
    dspark = {
        "drafter": "block",
        "draft_model": str(drafters[scenario]),
        "max_draft_tokens": provenance["scenarios"][scenario]["drafter"]["block_size"],
        "profile_sequences": [1],
    }
    # The drafter's cache gets as many blocks as the target's full-attention layers; with this
    # target's few full layers the default KV budget would make that several GiB.
    base = {
        "path": str(targets[scenario]),
        "dtype": "float32",
        "speculative": "fixed-k",
        "block_size": 4,
        "num_blocks": 64,
    }
    config = attrs.evolve(apply_overrides(EngineConfig(), base), sections={"dspark": dspark})
    check_engine_proposals(config, tokens, provenance["prompt_len"], golden, scenario, EXACT)


class PagedDrafter:
    """The drafter model over a paged cache of the reference backend, fed DeepSpec's taps."""

    BLOCK = 4

    def __init__(self, model: Gemma4BlockDrafterModel, taps: torch.Tensor, length: int) -> None:
        self.model, self.reference = model, TorchReferenceAttention()
        self.taps = [taps[:, i * HIDDEN : (i + 1) * HIDDEN] for i in range(taps.shape[1] // HIDDEN)]
        self.blocks = -(-(length + model.config.block_size) // self.BLOCK)
        self.table = list(range(self.blocks))
        self.fresh()

    def fresh(self) -> None:
        layers = self.model.attention_layers
        specs = [self.reference.kv_cache_spec(layer, self.BLOCK, torch.float32) for layer in layers]
        self.caches = allocate_caches(layers, specs, {None: self.blocks}, "cpu")
        self.written = 0

    def write(self, upto: int) -> None:
        """The context rows ``written .. upto - 1``, in one call."""
        meta = AttentionMetadata.build(
            query_lens=[upto - self.written], seq_lens=[upto], block_tables=[self.table], block_size=self.BLOCK
        )
        context = self.model.context([tap[self.written : upto] for tap in self.taps])
        self.model.write_context(context, torch.arange(self.written, upto), self.caches, meta)
        self.written = upto

    def block(self, anchor_token: int, anchor: int) -> torch.Tensor:
        size = self.model.config.block_size
        meta = AttentionMetadata.build(
            query_lens=[size], seq_lens=[anchor + size], block_tables=[self.table], block_size=self.BLOCK
        )
        ids = torch.tensor([anchor_token] + [self.model.config.mask_token_id] * (size - 1))
        return self.model.block(ids, torch.arange(anchor, anchor + size), self.caches, meta)


@pytest.mark.parametrize("written", ["incrementally", "from-scratch"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_block_logits_equal_deepspecs_along_greedy_and_forced_paths(
    scenario: str,
    written: str,
    golden: dict[str, torch.Tensor],
    targets: dict[str, Path],
    drafters: dict[str, Path],
) -> None:
    """The drafter model on DeepSpec's own taps over a paged cache, the context written one
    anchor's new rows at a time or all of it afresh for each anchor: base (soft-capped)
    logits, Markov-corrected logits along the greedy path and along a forced (non-greedy)
    previous-token path, and the confidences along both, within 1e-5 of DeepSpec's."""
    config = json.loads((targets[scenario] / "config.json").read_text())
    model = load_block_drafter(
        drafters[scenario], config, TorchReferenceAttention(), torch.float32, torch.device("cpu")
    )
    assert isinstance(model, Gemma4BlockDrafterModel)
    tokens, taps = golden[f"{scenario}.target.tokens"], golden[f"{scenario}.target.taps"]
    paged = PagedDrafter(model, taps, len(tokens))
    for anchor in golden[f"{scenario}.anchors"].tolist():
        if written == "from-scratch":
            paged.fresh()
        if anchor > paged.written:
            paged.write(anchor)
        hidden = paged.block(int(tokens[anchor]), anchor)
        key = f"{scenario}.anchor_{anchor}"
        check_anchor_heads(
            model, hidden, tokens[anchor : anchor + 1], golden, key, EXACT, f"{scenario} ({written}), anchor {anchor}"
        )


# --------------------------------------------------------------------------- refusals


def test_a_target_of_another_family_or_shape_is_refused_and_a_flat_one_served(
    provenance: dict, targets: dict[str, Path], drafters: dict[str, Path], tmp_path: Path
) -> None:
    """The target's config may nest its text config (Gemma4ForConditionalGeneration) or be a
    Gemma4ForCausalLM's (the writer, too, drafts for either); a Qwen3 target, or a Gemma 4 one
    of another width, is refused."""
    folder = drafters["main"]
    nested = json.loads((targets["main"] / "config.json").read_text())
    assert "text_config" in nested
    flat = write_tiny_gemma4(tmp_path / "flat", seed=0, global_head_keys=True, hidden_size_per_layer_input=0)
    flat_config = json.loads((flat / "config.json").read_text())
    reference, cpu = TorchReferenceAttention(), torch.device("cpu")
    for config in (nested, flat_config):
        load_block_drafter(folder, config, reference, torch.float32, cpu)
    for_flat = write_tiny_deepspec_drafter(tmp_path / "for-flat", flat, num_layers=1, target_layer_ids=(2,))
    written = json.loads((for_flat / "config.json").read_text())
    assert (written["target_model_type"], written["target_text_model_type"]) == ("gemma4_text", "gemma4_text")
    load_block_drafter(for_flat, flat_config, reference, torch.float32, cpu)
    qwen3 = {"model_type": "qwen3", "hidden_size": 64, "vocab_size": VOCAB, "num_hidden_layers": 6}
    with pytest.raises(ValueError, match=r"does not fit the target model: it is DeepSpec's Gemma 4 drafter .*'qwen3'"):
        load_block_drafter(folder, qwen3, reference, torch.float32, cpu)
    narrow = {**nested, "text_config": {**nested["text_config"], "hidden_size": 32, "num_hidden_layers": 4}}
    with pytest.raises(ValueError, match=r"its hidden_size is 64, the target's hidden_size is 32; its num_target_la"):
        load_block_drafter(folder, narrow, reference, torch.float32, cpu)


REFUSED = {
    "moe": ({"enable_moe_block": True}, r"enable_moe_block=True"),
    "per-layer inputs": ({"hidden_size_per_layer_input": 8}, r"hidden_size_per_layer_input=8 .* must be 0"),
    "per-layer inputs by default": ({"hidden_size_per_layer_input": None}, r"hidden_size_per_layer_input=256"),
    "head size by per_layer_config": (
        {"global_head_dim": None, "per_layer_config": {"0": {"head_dim": 32}}},
        r"lacks 'global_head_dim'",
    ),
    "k_eq_v without its heads": (
        {"attention_k_eq_v": True, "num_global_key_value_heads": None},
        r"attention_k_eq_v=True without 'num_global_key_value_heads'",
    ),
    "sliding layers": ({"layer_types": ["sliding_attention", "full_attention", "full_attention"]}, r"layer_types"),
    "soft cap": ({"final_logit_softcapping": 0.0}, r"final_logit_softcapping=0.0 must be positive"),
    "activation": ({"hidden_activation": "silu"}, r"hidden_activation='silu'"),
    "rnn Markov head": ({"markov_head_type": "rnn"}, r"markov_head_type='rnn'; supported: vanilla, gated"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_the_loader_refuses_what_it_cannot_serve_by_key(case: str, drafters: dict[str, Path], tmp_path: Path) -> None:
    """What DeepSpec refuses, or what a config could say that the drafter would compute
    otherwise, is refused by its key, naming the folder (None: the key left out)."""
    change, message = REFUSED[case]
    config = json.loads((drafters["main"] / "config.json").read_text())
    for key, value in change.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as refused:
        read_drafter_config(folder)
    assert str(folder) in str(refused.value)


def test_the_mlp_widths_follow_transformers_rule_for_the_drafters_own_depth(
    drafters: dict[str, Path], tmp_path: Path
) -> None:
    """main's three-layer drafter for a target with two KV-sharing layers and double-wide MLPs
    has layers 1 and 2 double-wide (layer i when i >= 3 - 2 > 0); a config that says otherwise
    meets the checkpoint's shapes at load, which name the tensor."""
    config = read_drafter_config(drafters["main"])
    assert [layer.intermediate_size for layer in config.layers.layers] == [96, 192, 192]  # type: ignore[attr-defined]
    narrow = tmp_path / "narrow"
    narrow.mkdir()
    stored = json.loads((drafters["main"] / "config.json").read_text())
    (narrow / "config.json").write_text(json.dumps({**stored, "use_double_wide_mlp": False}))
    (narrow / "model.safetensors").symlink_to(drafters["main"] / "model.safetensors")
    target = {"text_config": {"model_type": "gemma4_text", "hidden_size": 64, "vocab_size": VOCAB}}
    with pytest.raises(ValueError, match=r"'layers\.1\.mlp\.down_proj\.weight' has shape \(64, 192\)"):
        load_block_drafter(narrow, target, TorchReferenceAttention(), torch.float32, torch.device("cpu"))


def test_the_drafter_writer_refuses_gemma4_targets_deepspec_cannot_draft_for(tmp_path: Path) -> None:
    """Per-layer inputs (DeepSpec's drafter refuses them), and a config that spells the full
    layers' heads only as transformers 5.24's per_layer_config (DeepSpec reads global_head_dim)."""
    with_inputs = write_tiny_gemma4(tmp_path / "inputs", seed=0, conditional_generation=True, global_head_keys=True)
    with pytest.raises(ValueError, match=r"hidden_size_per_layer_input must be 0"):
        write_tiny_deepspec_drafter(tmp_path / "d1", with_inputs)
    per_layer = write_tiny_gemma4(
        tmp_path / "per-layer", seed=0, conditional_generation=True, hidden_size_per_layer_input=0
    )
    with pytest.raises(ValueError, match=r"global_head_keys=True"):
        write_tiny_deepspec_drafter(tmp_path / "d2", per_layer)
