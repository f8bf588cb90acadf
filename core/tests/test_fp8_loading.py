"""FP8 block-scaled checkpoints: quantization round trip, the dequantizing stream, loading through load_checkpoint.

Error bound of a round trip, per element: a block's factor ``s = amax / 448`` maps it onto
float8_e4m3fn's range, and ``w / s`` is rounded to nearest. e4m3 has 3 mantissa bits, so for
normal values (``|w / s| >= 2^-6``) the rounding error is at most half an ulp, ``2^-4 * |w|``;
below that the subnormal spacing is ``2^-9``, an absolute error of at most ``2^-10 * s``. With
float32's own rounding of the division and product as slack:
``|dequantized - w| <= 2^-4 |w| + 2^-10 s + 2^-20 |w|``.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from powertrain.loader import CorruptCheckpointError, UnsupportedCheckpointError, load_checkpoint
from powertrain.loader.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_blocks,
    dequantize_stream,
    fp8_block_from_config,
    quantize_blocks,
)
from powertrain.testing import fresh_seed, quantize_checkpoint_fp8, write_tiny_deepseek
from powertrain.testing.checkpoints import (
    DEEPSEEK_V3_QUANTIZATION_CONFIG,
    fp8_quantized_in_deepseek_v3,
    tiny_tokenizer,
)

QUANTIZATION = dict(DEEPSEEK_V3_QUANTIZATION_CONFIG)


def generator() -> torch.Generator:
    return torch.Generator().manual_seed(fresh_seed())


def heavy_tailed(*shape: int, rng: torch.Generator) -> torch.Tensor:
    """Magnitudes spread over orders of magnitude, so blocks hold values in e4m3's subnormal range too."""
    return torch.randn(shape, generator=rng) * torch.exp(2 * torch.randn(shape, generator=rng))


def block_factors(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The oracle for scale_inv: each block's float64 absolute maximum / 448, block by block."""
    rows, cols = weight.shape[-2:]
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    factors = torch.empty(*weight.shape[:-2], *grid, dtype=torch.float64)
    for r, c in itertools.product(range(grid[0]), range(grid[1])):
        tile = weight[..., r * block[0] : (r + 1) * block[0], c * block[1] : (c + 1) * block[1]].double()
        factors[..., r, c] = tile.abs().amax(dim=(-2, -1)) / FP8_MAX
    return factors


def expand(factors: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = shape[-2:]
    return factors.repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)[..., :cols]


def assert_within_fp8_bound(dequantized: torch.Tensor, original: torch.Tensor, scale: torch.Tensor, name: str = ""):
    original = original.double()
    error = (dequantized.double() - original).abs()
    bound = 2**-4 * original.abs() + 2**-10 * scale.double() + 2**-20 * original.abs()
    worst = (error - bound).max()
    assert worst <= 0, f"{name}: an element is {worst.item():.3g} beyond the FP8 error bound"


@pytest.mark.parametrize(
    ("shape", "block"),
    [
        ((256, 256), (128, 128)),  # whole blocks
        ((80, 256), (128, 128)),  # one partial block row (kv_a_proj_with_mqa's shape)
        ((192, 96), (128, 128)),  # partial in both directions
        ((3, 200, 130), (128, 128)),  # stacked experts, partial blocks
        ((2, 2, 70, 300), (64, 32)),  # two leading dims, a non-square block
    ],
)
def test_quantize_dequantize_round_trip(shape: tuple[int, ...], block: tuple[int, int]) -> None:
    weight = heavy_tailed(*shape, rng=generator())
    fp8, scale_inv = quantize_blocks(weight, block)
    assert fp8.dtype == FP8_DTYPE and fp8.shape == weight.shape
    assert scale_inv.dtype == torch.float32
    expected_factors = block_factors(weight, block)
    assert scale_inv.shape == expected_factors.shape
    torch.testing.assert_close(scale_inv.double(), expected_factors, rtol=1e-6, atol=0)
    # Each block's largest element lands on the top of e4m3's range, none overflows.
    assert fp8.float().abs().max() == FP8_MAX and torch.isfinite(fp8.float()).all()

    dequantized = dequantize_blocks(fp8, scale_inv, block)
    assert dequantized.dtype == torch.float32
    scale = expand(scale_inv, weight.shape, block)
    assert_within_fp8_bound(dequantized, weight, scale)
    scaled = (weight / scale).abs()
    assert ((scaled > 0) & (scaled < 2**-6)).any(), "the subnormal range was not exercised"
    assert (dequantized != weight).any()  # the bound is not met trivially
    assert dequantize_blocks(fp8, scale_inv, block, torch.bfloat16).dtype == torch.bfloat16


def test_dequantize_refuses_a_scale_of_the_wrong_shape() -> None:
    fp8, scale_inv = quantize_blocks(torch.randn(200, 130, generator=generator()), (128, 128))
    with pytest.raises(ValueError, match=r"needs weight_scale_inv of shape \(2, 2\), got \(2, 1\)"):
        dequantize_blocks(fp8, scale_inv[:, :1], (128, 128))


# -- the stream adapter -----------------------------------------------------------------------------

BLOCK = (128, 128)


def fp8_pair(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_blocks(torch.randn(shape, generator=generator()), BLOCK)


def test_stream_pairs_weights_with_scales_in_either_order() -> None:
    a, a_scale = fp8_pair(256, 200)
    b, b_scale = fp8_pair(80, 256)
    experts, experts_scale = fp8_pair(4, 128, 256)  # fused experts: "<name>_scale_inv" without ".weight"
    norm = 1 + 0.1 * torch.randn(256, generator=generator())
    stream = [
        ("a.weight", a),
        ("norm.weight", norm),
        ("b.weight_scale_inv", b_scale),
        ("a.weight_scale_inv", a_scale),
        ("mlp.experts.gate_up_proj_scale_inv", experts_scale),
        ("b.weight", b),
        ("mlp.experts.gate_up_proj", experts),
    ]
    out = list(dequantize_stream(stream, BLOCK, torch.bfloat16))
    # A weight comes out where its pair completes; scales are gone; plain tensors pass untouched.
    assert [name for name, _ in out] == ["norm.weight", "a.weight", "b.weight", "mlp.experts.gate_up_proj"]
    tensors = dict(out)
    assert tensors["norm.weight"] is norm
    for name, weight, scale in [
        ("a.weight", a, a_scale),
        ("b.weight", b, b_scale),
        ("mlp.experts.gate_up_proj", experts, experts_scale),
    ]:
        assert tensors[name].dtype == torch.bfloat16
        assert torch.equal(tensors[name], dequantize_blocks(weight, scale, BLOCK, torch.bfloat16)), name


def test_stream_keeps_what_keep_names() -> None:
    a, a_scale = fp8_pair(130, 256)
    b, b_scale = fp8_pair(256, 128)
    stream = [("a.weight_scale_inv", a_scale), ("a.weight", a), ("b.weight", b), ("b.weight_scale_inv", b_scale)]
    out = list(dequantize_stream(stream, BLOCK, torch.float32, keep=lambda name: name == "a.weight"))
    assert [name for name, _ in out] == ["a.weight_scale_inv", "a.weight", "b.weight"]
    tensors = dict(out)
    assert tensors["a.weight"] is a and tensors["a.weight_scale_inv"] is a_scale
    assert torch.equal(tensors["b.weight"], dequantize_blocks(b, b_scale, BLOCK))


@pytest.mark.parametrize("kept", [False, True])
def test_stream_names_unpaired_tensors_at_the_end(kept: bool) -> None:
    a, _ = fp8_pair(128, 128)
    _, c_scale = fp8_pair(128, 128)
    d, d_scale = fp8_pair(128, 128)
    plain = torch.randn(128, 128, generator=generator()).to(torch.bfloat16)
    stream = [
        ("a.weight", a),
        ("c.weight_scale_inv", c_scale),
        ("plain.weight", plain),
        ("plain.weight_scale_inv", d_scale),
        ("d.weight", d),
        ("d.weight_scale_inv", d_scale),
    ]
    yielded = []
    with pytest.raises(CorruptCheckpointError) as error:
        for name, _ in dequantize_stream(stream, BLOCK, torch.float32, keep=lambda name: kept):
            yielded.append(name)
    # Everything loadable came out first; then one error names every unpaired tensor.
    assert "plain.weight" in yielded and "d.weight" in yielded
    message = str(error.value)
    assert "FP8 weight(s) without a _scale_inv tensor: a.weight" in message
    assert "scale(s) without an FP8 weight: c.weight_scale_inv, plain.weight_scale_inv" in message
    assert "plain.weight is torch.bfloat16" in message


def test_stream_names_a_scale_of_the_wrong_shape() -> None:
    a, a_scale = fp8_pair(256, 256)
    with pytest.raises(CorruptCheckpointError, match=r"layers\.0\.o_proj\.weight: .*shape \(2, 2\), got \(2, 1\)"):
        list(
            dequantize_stream(
                [("layers.0.o_proj.weight", a), ("layers.0.o_proj.weight_scale_inv", a_scale[:, :1])],
                BLOCK,
                torch.float32,
            )
        )


# -- quantization_config ----------------------------------------------------------------------------


def test_block_from_config() -> None:
    assert fp8_block_from_config({}) is None
    assert fp8_block_from_config({"quantization_config": QUANTIZATION}) == (128, 128)
    # transformers' FineGrainedFP8Config writes no fmt; DeepSeek's says e4m3.
    assert fp8_block_from_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 32]}}) == (
        64,
        32,
    )


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        ({"quant_method": "awq"}, "quant_method 'awq'"),
        ({"fmt": "e5m2"}, "fmt 'e5m2'"),
        ({"activation_scheme": "static"}, "activation_scheme 'static'"),
        ({"weight_block_size": None}, "weight_block_size None"),
        ({"weight_block_size": [128]}, r"weight_block_size \[128\]"),
        ({"weight_block_size": [128, 0]}, r"weight_block_size \[128, 0\]"),
    ],
)
def test_block_from_config_refuses_what_it_cannot_read(change: dict, complaint: str) -> None:
    with pytest.raises(UnsupportedCheckpointError, match=complaint) as error:
        fp8_block_from_config({"quantization_config": {**QUANTIZATION, **change}}, source="x/config.json")
    assert str(error.value).startswith("x/config.json: ") and "unquantized (BF16) checkpoint" in str(error.value)


# -- FP8 checkpoints through load_checkpoint --------------------------------------------------------


def write_fp8_folder(folder: Path, shards: dict[str, dict[str, torch.Tensor]], quantization: dict) -> Path:
    """A hand-made sharded checkpoint: ``shards`` maps file name -> tensors."""
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for file_name, tensors in shards.items():
        save_file(tensors, str(folder / file_name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file_name)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({"architectures": ["X"], "quantization_config": quantization}))
    tiny_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


def test_pairs_across_shards(tmp_path: Path) -> None:
    a, a_scale = fp8_pair(200, 256)
    b, b_scale = fp8_pair(256, 96)
    plain = torch.randn(256, generator=generator())
    folder = write_fp8_folder(
        tmp_path,
        {
            "model-00001-of-00002.safetensors": {"a.weight": a, "b.weight_scale_inv": b_scale, "norm.weight": plain},
            "model-00002-of-00002.safetensors": {"a.weight_scale_inv": a_scale, "b.weight": b},
        },
        QUANTIZATION,
    )
    checkpoint = load_checkpoint(folder)
    assert checkpoint.fp8_block == (128, 128)
    loaded = list(checkpoint.tensors())
    assert [name for name, _ in loaded] == list(checkpoint.tensor_names)
    assert set(checkpoint.tensor_names) == {"a.weight", "b.weight", "norm.weight"}
    tensors = dict(loaded)
    assert torch.equal(tensors["a.weight"], dequantize_blocks(a, a_scale, BLOCK))
    assert torch.equal(tensors["b.weight"], dequantize_blocks(b, b_scale, BLOCK))
    assert torch.equal(tensors["norm.weight"], plain)
    kept = dict(checkpoint.tensors(keep_fp8=lambda name: name == "b.weight"))
    assert kept["b.weight"].dtype == FP8_DTYPE and torch.equal(kept["b.weight_scale_inv"], b_scale)


def test_missing_scale_is_reported_by_tensors(tmp_path: Path) -> None:
    a, _ = fp8_pair(128, 256)
    folder = write_fp8_folder(tmp_path, {"model-00001-of-00001.safetensors": {"lone.weight": a}}, QUANTIZATION)
    with pytest.raises(CorruptCheckpointError, match=r"without a _scale_inv tensor: lone\.weight"):
        list(load_checkpoint(folder).tensors())


def test_unsupported_quantization_is_refused_on_open(tmp_path: Path) -> None:
    a, a_scale = fp8_pair(128, 256)
    folder = write_fp8_folder(
        tmp_path,
        {"model-00001-of-00001.safetensors": {"a.weight": a, "a.weight_scale_inv": a_scale}},
        {"quant_method": "gptq", "bits": 4},
    )
    with pytest.raises(UnsupportedCheckpointError, match="quant_method 'gptq'") as error:
        load_checkpoint(folder)
    assert str(folder / "config.json") in str(error.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_deepseek_fp8_checkpoint(tmp_path: Path, dtype: torch.dtype) -> None:
    source = write_tiny_deepseek(tmp_path / "float", seed=fresh_seed(), dtype=dtype)
    target = quantize_checkpoint_fp8(source, tmp_path / "fp8")

    config = json.loads((target / "config.json").read_text())
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    originals = {**load_file(source / "model-00001-of-00002.safetensors")}
    originals |= load_file(source / "model-00002-of-00002.safetensors")
    weight_map = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    stored = {}
    for shard in set(weight_map.values()):
        stored |= load_file(target / shard)
    assert set(weight_map) == set(stored)
    quantized = {name for name in originals if fp8_quantized_in_deepseek_v3(name)}
    assert set(stored) == set(originals) | {name + "_scale_inv" for name in quantized}
    for name in quantized:
        assert stored[name].dtype == FP8_DTYPE and stored[name + "_scale_inv"].dtype == torch.float32, name
        assert weight_map[name] == weight_map[name + "_scale_inv"], name  # a weight and its scale share a shard
    for name in set(originals) - quantized:
        assert torch.equal(stored[name], originals[name]), name
    # What DeepSeek-V3 quantizes, spelled out on this checkpoint's names.
    assert {name.split(".", 3)[-1] for name in quantized if name.startswith("model.layers.3.")} >= {
        "self_attn.q_a_proj.weight",
        "self_attn.q_b_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
        "self_attn.kv_b_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.shared_experts.gate_proj.weight",
        "mlp.experts.7.down_proj.weight",
    }
    assert "model.layers.0.mlp.gate_proj.weight" in quantized
    for kept in [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.kv_a_layernorm.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.3.eh_proj.weight",
        "model.layers.3.shared_head.head.weight",
        "model.layers.3.embed_tokens.weight",
        "model.layers.3.enorm.weight",
    ]:
        assert kept in originals and kept not in quantized, kept

    checkpoint = load_checkpoint(target)
    assert checkpoint.fp8_block == (128, 128)
    assert checkpoint.tensor_names == load_checkpoint(source).tensor_names
    assert checkpoint.tokenizer.vocab_size == config["vocab_size"]
    loaded = list(checkpoint.tensors())
    assert [name for name, _ in loaded] == list(checkpoint.tensor_names)
    for name, tensor in loaded:
        if name in quantized:
            assert tensor.dtype == torch.float32, name
            scale = expand(stored[name + "_scale_inv"], tensor.shape, BLOCK)
            assert_within_fp8_bound(tensor, originals[name], scale, name)
        else:
            assert torch.equal(tensor, originals[name]), name
    in_bfloat16 = dict(checkpoint.tensors(fp8_dtype=torch.bfloat16))
    assert in_bfloat16["model.layers.1.self_attn.o_proj.weight"].dtype == torch.bfloat16
    assert in_bfloat16["model.norm.weight"].dtype == dtype


def test_quantize_refuses_quantized_sources_and_full_targets(tmp_path: Path) -> None:
    source = write_tiny_deepseek(tmp_path / "float", seed=fresh_seed(), num_nextn_predict_layers=0)
    target = quantize_checkpoint_fp8(source, tmp_path / "fp8", block=(64, 64))
    assert load_checkpoint(target).fp8_block == (64, 64)
    assert not (target / "model.safetensors.index.json").exists()  # a single-file source stays single-file
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint_fp8(target, tmp_path / "again")
    with pytest.raises(FileExistsError, match="not empty"):
        quantize_checkpoint_fp8(source, target)
