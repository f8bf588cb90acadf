"""FP4 experts (DeepSeek-V4's ``expert_dtype: fp4``): the dequantizer against transformers' own
unpacking and a float64 decoding of the e2m1 format, and a V4 FP4 checkpoint loading with its
experts dequantized under their weight names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from powertrain.loader.errors import CorruptCheckpointError, UnsupportedCheckpointError
from powertrain.loader.fp4 import (
    FP4_GROUP,
    dequantize_fp4,
    dequantize_fp4_stream,
    fp4_experts_from_config,
    unpack_fp4,
)
from powertrain.loader.hf import load_hf_folder
from powertrain.testing import fresh_seed
from powertrain.testing.base import generator
from powertrain.testing.checkpoints import quantize_fp4, write_tiny_deepseek_v4


@pytest.fixture(scope="module")
def seed() -> int:
    value = fresh_seed()
    print(f"seed={value}")
    return value


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory, seed: int) -> Path:
    return write_tiny_deepseek_v4(tmp_path_factory.mktemp(f"tiny-v4-seed{seed}"), seed=seed)


@pytest.fixture(scope="module")
def tiny_v4_fp4(tmp_path_factory: pytest.TempPathFactory, seed: int) -> Path:
    return write_tiny_deepseek_v4(tmp_path_factory.mktemp(f"tiny-v4-fp4-seed{seed}"), seed=seed, fp4_experts=True)


def _e2m1_float64(code: int) -> float:
    """The e2m1 format itself (1 sign, 2 exponent bits with bias 1, 1 mantissa bit; exponent 0 is
    subnormal), independent of any lookup table."""
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return -magnitude if sign else magnitude


def _reference(packed: torch.Tensor, exponent_bytes: torch.Tensor) -> torch.Tensor:
    """float64 dequantization of ``[rows, bytes]`` codes, one element at a time from the bit layout:
    column ``c`` is nibble ``c % 2`` (low first) of byte ``c // 2``, scaled by ``2**(e - 127)`` of group ``c // 32``."""
    codes, exps = packed.view(torch.uint8).tolist(), exponent_bytes.tolist()
    return torch.tensor(
        [
            [
                _e2m1_float64((row[c // 2] >> (4 * (c % 2))) & 0xF) * 2.0 ** (exps[r][c // FP4_GROUP] - 127)
                for c in range(2 * len(row))
            ]
            for r, row in enumerate(codes)
        ],
        dtype=torch.float64,
    )


def _random_weight(gen: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    """Groups of very different magnitude (2**-12 .. 2**6), so a scale on the wrong group shows."""
    magnitudes = torch.exp2(torch.randint(-12, 7, (rows, cols // FP4_GROUP), generator=gen).float())
    return torch.randn(rows, cols, generator=gen) * magnitudes.repeat_interleave(FP4_GROUP, dim=1)


def test_unpacking_matches_transformers_on_every_byte(seed: int) -> None:
    gen = generator(seed)
    packed = torch.randint(0, 256, (7, 256), generator=gen, dtype=torch.int32).to(torch.uint8)
    packed[0] = torch.arange(256, dtype=torch.uint8)  # every byte at least once
    want = Fp8Dequantize(None)._unpack_fp4(packed.view(torch.int8))
    assert torch.equal(unpack_fp4(packed.view(torch.int8)), want)
    assert unpack_fp4(packed)[0, :6].tolist() == [0.0, 0.0, 0.5, 0.0, 1.0, 0.0]  # low nibble first


@pytest.mark.parametrize("shape", [(5, 64), (3, 2, 96)], ids=["matrix", "stacked"])
def test_dequantize_matches_transformers_and_the_float64_format(seed: int, shape: tuple[int, ...]) -> None:
    """``dequantize_fp4(quantize_fp4(w))`` equals transformers' ``Fp8Dequantize`` and a float64 decoding of
    the bits, for each storage variant: int8 / uint8 / float4_e2m1fn_x2 codes, e8m0 / uint8 scales."""
    gen = generator(seed + len(shape))
    *lead, rows, cols = shape
    weight = _random_weight(gen, int(torch.tensor(lead).prod()) * rows, cols).reshape(shape)
    packed, scale = quantize_fp4(weight)
    assert packed.dtype == torch.int8 and scale.dtype == torch.float8_e8m0fnu

    got = dequantize_fp4(packed, scale)
    flat_packed, flat_scale = packed.reshape(-1, cols // 2), scale.reshape(-1, cols // FP4_GROUP)
    want64 = _reference(flat_packed, flat_scale.view(torch.uint8)).reshape(shape)
    assert torch.equal(got.double(), want64)
    transformers_dequantized = Fp8Dequantize(None)._dequantize_one(packed, scale, output_dtype=torch.float32)
    assert torch.equal(got, transformers_dequantized)
    assert float((got - weight).abs().max()) > 0  # the values did go through FP4
    assert torch.all((got - weight).abs() <= weight.abs().amax(-1, keepdim=True))  # ...and stayed near

    exponent_bytes = scale.view(torch.uint8)
    for label, codes, scales in (
        ("uint8 codes", packed.view(torch.uint8), scale),
        ("float4_e2m1fn_x2 codes", packed.view(torch.float4_e2m1fn_x2), scale),
        ("uint8 exponent scales", packed, exponent_bytes),
        ("uint8 codes and exponents", packed.view(torch.uint8), exponent_bytes),
    ):
        assert torch.equal(dequantize_fp4(codes, scales), got), label
    assert torch.equal(Fp8Dequantize(None)._dequantize_one(packed, exponent_bytes, torch.float32), got)
    assert torch.equal(dequantize_fp4(packed, scale, torch.bfloat16), got.to(torch.bfloat16))


def test_bad_shapes_and_dtypes_say_what_was_expected(seed: int) -> None:
    packed, scale = quantize_fp4(torch.randn(4, 64, generator=generator(seed)))
    with pytest.raises(ValueError, match=r"stored as \(4, 32\) bytes holds 64 columns.*\(4, 2\).*got \(4, 1\)"):
        dequantize_fp4(packed, scale[:, :1])
    with pytest.raises(ValueError, match=r"differ in rank"):
        dequantize_fp4(packed, scale[0])
    with pytest.raises(ValueError, match="ue8m0.*got torch.float32"):
        dequantize_fp4(packed, scale.float())
    with pytest.raises(ValueError, match="packed FP4 codes come as int8 or uint8 or float4_e2m1fn_x2, got torch.int16"):
        dequantize_fp4(packed.to(torch.int16), scale)


def test_stream_pairs_either_order_and_passes_other_scales_on(seed: int) -> None:
    gen = generator(seed)
    packed, scale = quantize_fp4(torch.randn(8, 64, generator=gen))
    fp8, fp8_scale = torch.randn(4, 4, generator=gen).to(torch.float8_e4m3fn), torch.rand(4, 4).to(torch.float8_e8m0fnu)
    plain = torch.randn(3, generator=gen)
    stream = [
        ("a.scale", scale),  # scale first, as safetensors sorts names
        ("a.weight", packed),
        ("b.weight", packed.view(torch.uint8)),  # weight first
        ("c.weight", fp8),  # not FP4: its scale is not consumed
        ("c.scale", fp8_scale),
        ("norm.weight", plain),
        ("b.scale", scale.view(torch.uint8)),
    ]
    got = dict(dequantize_fp4_stream(stream, torch.bfloat16))
    assert list(got) == ["a.weight", "c.weight", "c.scale", "norm.weight", "b.weight"]
    want = dequantize_fp4(packed, scale, torch.bfloat16)
    assert torch.equal(got["a.weight"], want) and torch.equal(got["b.weight"], want)
    assert got["c.scale"] is fp8_scale and got["c.weight"] is fp8 and got["norm.weight"] is plain

    with pytest.raises(CorruptCheckpointError, match=r"FP4 expert weight\(s\) without their .scale tensor: x.weight"):
        list(dequantize_fp4_stream([("x.weight", packed)], torch.float32))
    with pytest.raises(CorruptCheckpointError, match=r"^y.weight: .*needs a scale of shape \(8, 2\).*got \(8, 1\)"):
        list(dequantize_fp4_stream([("y.weight", packed), ("y.scale", scale[:, :1])], torch.float32))


def test_config_declares_fp4_experts() -> None:
    quantized = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    assert fp4_experts_from_config({"quantization_config": {**quantized, "expert_dtype": "fp4"}})
    assert fp4_experts_from_config({"quantization_config": quantized, "expert_dtype": "fp4"})
    assert not fp4_experts_from_config({"quantization_config": quantized})
    assert not fp4_experts_from_config({})
    with pytest.raises(UnsupportedCheckpointError, match=r"config.json: expert_dtype is 'int4'"):
        fp4_experts_from_config({"quantization_config": {**quantized, "expert_dtype": "int4"}}, source="config.json")


# --------------------------------------------------------------------------- a V4 checkpoint


def _expert_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [name for name in tensors if ".ffn.experts." in name and name.endswith(".weight")]


def test_v4_checkpoint_loads_its_experts_dequantized(tiny_v4: Path, tiny_v4_fp4: Path) -> None:
    """The experts arrive as ``dequantize_fp4`` of what is stored, in the requested dtype, under
    their weight names; the scales are gone and every other tensor is the float checkpoint's."""
    checkpoint = load_hf_folder(tiny_v4_fp4)
    assert checkpoint.fp4_experts
    stored = load_file(tiny_v4_fp4 / "model.safetensors")
    loaded = dict(checkpoint.tensors(fp8_dtype=torch.bfloat16))
    assert list(loaded) == list(checkpoint.tensor_names)
    float_tensors = load_file(tiny_v4 / "model.safetensors")
    assert loaded.keys() == float_tensors.keys()
    experts = _expert_names(loaded)
    assert experts and len(experts) == len([name for name in stored if name.endswith(".scale")])
    for name, tensor in loaded.items():
        if name in experts:
            packed, scale = stored[name], stored[name.removesuffix("weight") + "scale"]
            assert packed.dtype == torch.int8, name
            assert tensor.dtype == torch.bfloat16 and tensor.shape == float_tensors[name].shape, name
            assert torch.equal(tensor, dequantize_fp4(packed, scale).to(torch.bfloat16)), name
        else:
            assert torch.equal(tensor, float_tensors[name]), name
    # FP4 is lossy: the experts are near the float ones, not equal to them.
    name = experts[0]
    error = (loaded[name].float() - float_tensors[name].float()).norm() / float_tensors[name].float().norm()
    assert 0 < float(error) < 0.2


@pytest.mark.parametrize(
    "variant",
    ["uint8-exponent-scales", "float4-codes", "uint8-codes"],
)
def test_every_storage_variant_loads_the_same(tiny_v4_fp4: Path, tmp_path: Path, variant: str) -> None:
    """DeepSeek's reference types the codes float4_e2m1fn_x2 (safetensors F4), and ue8m0 scales may be
    stored as exponent bytes: the same bytes, so the same weights."""
    folder = tmp_path / variant
    folder.mkdir()
    for file in tiny_v4_fp4.iterdir():
        if file.is_file() and file.name != "model.safetensors":
            (folder / file.name).write_bytes(file.read_bytes())
    tensors = load_file(tiny_v4_fp4 / "model.safetensors")
    for name in list(tensors):
        if variant == "uint8-exponent-scales" and name.endswith(".scale"):
            tensors[name] = tensors[name].view(torch.uint8)
        elif variant != "uint8-exponent-scales" and tensors[name].dtype == torch.int8:
            tensors[name] = tensors[name].view(torch.float4_e2m1fn_x2 if variant == "float4-codes" else torch.uint8)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    want = dict(load_hf_folder(tiny_v4_fp4).tensors())
    got = dict(load_hf_folder(folder).tensors())
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_inconsistent_scale_names_the_tensor_and_both_shapes(tiny_v4_fp4: Path, tmp_path: Path) -> None:
    folder = tmp_path / "bad"
    folder.mkdir()
    for file in tiny_v4_fp4.iterdir():
        if file.is_file() and file.name != "model.safetensors":
            (folder / file.name).write_bytes(file.read_bytes())
    tensors = load_file(tiny_v4_fp4 / "model.safetensors")
    victim = sorted(name for name in tensors if name.endswith(".scale"))[0]
    tensors[victim] = tensors[victim][:, :-1].contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    weight = victim.removesuffix("scale") + "weight"
    rows, packed_cols = tensors[weight].shape
    want = (rows, 2 * packed_cols // FP4_GROUP)
    with pytest.raises(CorruptCheckpointError, match=rf"^{weight}: .*shape \({want[0]}, {want[1]}\).*got"):
        list(load_hf_folder(folder).tensors())


def test_without_the_declaration_packed_experts_are_not_dequantized(tiny_v4_fp4: Path, tmp_path: Path) -> None:
    """FP4 is read only where config.json declares it, never guessed from names."""
    folder = tmp_path / "undeclared"
    folder.mkdir()
    for file in tiny_v4_fp4.iterdir():
        if file.is_file():
            (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]["expert_dtype"]
    (folder / "config.json").write_text(json.dumps(config))
    checkpoint = load_hf_folder(folder)
    assert not checkpoint.fp4_experts
    loaded = dict(checkpoint.tensors())
    assert any(name.endswith(".scale") for name in loaded)
    assert all(loaded[name].dtype == torch.int8 for name in _expert_names(loaded))
