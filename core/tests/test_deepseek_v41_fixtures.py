"""The DeepSeek-V4.1 golden fixtures (``fixtures/deepseek_v41``, made by DeepSeek's official
code, see their README) and what powertrain already checks against them: the tiny checkpoint
they were computed on is written again bit for bit, and Engram's table rows (compressed
vocabulary, primes, hashes) equal the official code's for every position."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from powertrain.layers.engram import EngramLayout, NgramHasher, compressed_token_map, is_prime, ngram_windows
from powertrain.testing.checkpoints import tiny_tokenizer
from powertrain.testing.deepseek_v41 import (
    TINY_DEEPSEEK_V41_TEXT_CONFIG,
    checkpoint_digest,
    engram_layout,
    tensor_shapes,
    write_tiny_deepseek_v41,
)

FIXTURES = Path(__file__).parent / "fixtures" / "deepseek_v41"


@pytest.fixture(scope="module")
def provenance() -> dict:
    return json.loads((FIXTURES / "provenance.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def golden() -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / "golden.safetensors")


def test_every_fixture_says_where_it_came_from(provenance: dict, golden: dict[str, torch.Tensor]) -> None:
    """A fixture without its provenance cannot be regenerated or trusted: the reference's files
    (repository, folder, commit and SHA-256 each), torch, the seeds, the fixes applied on top of
    the reference, and per variant the checkpoint it ran on and the reference's own spread."""
    reference = provenance["reference"]
    assert reference["repository"] == "tenstorrent/tt-metal" and reference["folder"].endswith("deepseek_v41/")
    for name in ("model.py", "engram.py", "kernel_cpu.py"):
        record = reference["files"][name]
        assert len(record["commit"]) == 40 and len(record["sha256"]) == 64, name
    assert provenance["torch"] and provenance["default_dtype"] == "bfloat16"
    assert isinstance(provenance["seed"], int) and isinstance(provenance["prompt_seed"], int)
    assert len(provenance["driver_fixes"]) == 2
    readme = (FIXTURES / "README.md").read_text(encoding="utf-8")
    for variant, record in provenance["variants"].items():
        assert len(record["checkpoint_sha256"]) == 64, variant
        assert {"max", "median"} <= record["decode_vs_prefill_spread"].keys(), variant
        assert {"max", "median"} <= record["decode_vs_prefill_spread_replaying_choices"].keys(), variant
        assert f"`{variant}`" in readme, f"the README does not describe variant {variant}"
    unexplained = {name.split(".")[0] for name in golden} - set(provenance["variants"])
    assert not unexplained, f"fixtures of no recorded variant: {unexplained}"


def test_the_checkpoint_the_fixtures_ran_on_is_written_again_bit_for_bit(provenance: dict, tmp_path: Path) -> None:
    for variant, record in provenance["variants"].items():
        folder = write_tiny_deepseek_v41(tmp_path / variant, seed=provenance["seed"], **record["overrides"])
        assert checkpoint_digest(folder) == record["checkpoint_sha256"], (
            f"write_tiny_deepseek_v41 no longer writes the checkpoint of variant {variant}: regenerate the "
            "fixtures as their README says"
        )


def test_engram_rows_equal_the_official_codes_at_every_position(golden: dict[str, torch.Tensor]) -> None:
    """The compressed vocabulary of the tiny tokenizer, then the table rows of every position of
    both sequences (prompt and greedy continuation), exactly."""
    mapping, size = compressed_token_map(tiny_tokenizer())
    assert torch.equal(torch.tensor(mapping), golden["main.compressed_token_map"])
    text = {**TINY_DEEPSEEK_V41_TEXT_CONFIG}
    layout = engram_layout(text)
    hasher = NgramHasher(layout, size)
    compressed = torch.tensor(mapping)
    pad = mapping[text["engram_pad_id"]]
    for name in ("a", "b"):
        sequence = torch.cat([golden[f"main.{name}.prompt"], golden[f"main.{name}.tokens"][:-1]])
        ids = compressed[sequence]
        positions = torch.arange(len(sequence))
        rows = hasher.rows(ngram_windows(ids, positions, layout.max_ngram_size, pad))
        assert torch.equal(rows, golden[f"main.{name}.engram_rows"]), name
        # A decode step sees only its own position's window: the same rows.
        last = hasher.rows(ngram_windows(ids, positions[-1:], layout.max_ngram_size, pad))
        assert torch.equal(last, rows[-1:])


def test_engram_rows_stay_inside_their_own_range() -> None:
    layout = EngramLayout.build((3, 9), max_ngram_size=4, n_heads=3, head_dim=32, vocab_size=50)
    primes = [p for layer in layout.primes for size in layer for p in size]
    assert len(set(primes)) == len(primes) and all(is_prime(p) and p >= 50 for p in primes)
    grams = torch.randint(0, 500, (64, 4))
    rows = NgramHasher(layout, 500).rows(grams)
    start, size = layout.offsets(), layout.moduli()
    assert ((rows >= start) & (rows < start + size)).all()
    assert (rows < torch.tensor(layout.table_rows)[:, None]).all()


def test_is_prime_agrees_with_trial_division() -> None:
    def slow(n: int) -> bool:
        return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))

    assert [n for n in range(3000) if is_prime(n)] == [n for n in range(3000) if slow(n)]
    assert is_prime(2**61 - 1) and not is_prime((2**31 - 1) * (2**61 - 1))


def test_the_tiny_checkpoint_has_every_block_type_and_the_release_storage() -> None:
    """Layer roles as the issue's schedule wants them, and each tensor stored as the release does."""
    shapes = tensor_shapes({**TINY_DEEPSEEK_V41_TEXT_CONFIG, "vocab_size": 512, "engram_num_embeddings": [660, 864]})
    names = set(shapes)
    compressor = {i for i in range(6) if f"layers.{i}.attn.compressor.wkv.weight" in names}
    gated = {i for i in range(6) if f"layers.{i}.attn.compressor.wgate.weight" in names}
    indexer = {i for i in range(6) if f"layers.{i}.attn.indexer.wq_b.weight" in names}
    keys = {i for i in range(6) if f"layers.{i}.attn.indexer.wk.weight" in names}
    engram = {i for i in range(6) if f"layers.{i}.engram.embed.weight" in names}
    assert (compressor, gated, indexer, keys, engram) == ({1, 3}, {1}, {1, 3, 5}, {1, 3}, {0, 1})
    assert TINY_DEEPSEEK_V41_TEXT_CONFIG["index_n_heads"] >= 8
    assert not any(name.startswith("mtp.0.attn.compressor") for name in names)  # DSpark: window only
    kinds = {name: kind for name, (_, kind) in shapes.items()}
    assert kinds["layers.2.attn.wo_a.weight"] == kinds["layers.2.attn.wq_a.weight"] == "fp8"
    assert kinds["layers.2.ffn.experts.3.w2.weight"] == "fp4"
    assert kinds["layers.0.engram.embed.weight"] == "engram"
    assert kinds["layers.1.attn.compressor.wgate.weight"] == kinds["head.weight"] == "bf16"
    assert kinds["layers.4.hc_ffn_fn"] == kinds["layers.4.ffn.gate.bias"] == "f32"
