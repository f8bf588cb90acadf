"""oneDNN-packed projections (layers/linear.py) against a float64 torch oracle.

Which dtypes are packed is the CPU platform's fact (``PlatformInfo.packed_linear_dtypes``,
from what torch says this CPU runs): each dtype is tested packed where the fact lists it,
and otherwise checked to stay plain (and torch to refuse packing it, so the fact is true).
The fallback is also forced (the bfloat16 probe patched off), so it runs on every machine.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch
from torch import nn

from powertrain import LLM, SamplingParams
from powertrain.builtin import platforms
from powertrain.builtin.platforms import detect_cpu, detect_cuda
from powertrain.layers import linear, linear_choice
from powertrain.layers.linear import Linear, pack_for_platform, pack_linears
from powertrain.testing import fresh_seed, write_tiny_deepseek

CPU = detect_cpu()

pytestmark = pytest.mark.skipif(torch.float32 not in CPU.packed_linear_dtypes, reason=CPU.linear_packing_note)

NOT_PACKED = "linear weights not packed: plain F.linear"
CHOSEN = "linear implementation chosen"


def packed_wins(shape: tuple[int, int], dtype: torch.dtype) -> linear_choice.Times:
    """A timer (linear_choice.ShapeTimer) by which packed is always faster."""
    return {linear_choice.PACKED: {"decode": 1.0}, linear_choice.PLAIN: {"decode": 2.0}}


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh linear-choice cache, so no choice cached on this machine decides what packs."""
    monkeypatch.setenv("POWERTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def info_logs() -> Iterator[list[dict]]:
    """structlog events at info and above, whatever an earlier test configured (LLM sets warning)."""
    configured, saved = structlog.is_configured(), structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        with structlog.testing.capture_logs() as logs:
            yield logs
    finally:
        if configured:
            structlog.configure(**saved)
        else:
            structlog.reset_defaults()


def random_linear(generator: torch.Generator, n_in: int, n_out: int, bias: bool, dtype: torch.dtype) -> Linear:
    """A Linear with weights ~ N(0, 1/n_in) (and bias) drawn from ``generator``."""
    layer = Linear(n_in, n_out, bias=bias, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n_out, n_in, generator=generator) / n_in**0.5)
        if bias:
            layer.bias.copy_(torch.randn(n_out, generator=generator))
    return layer


def float64_linear(layer: Linear, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.double() @ weight.double().T + (layer.bias.double() if layer.bias is not None else 0)


def tolerance(n_in: int, dtype: torch.dtype, oracle: torch.Tensor) -> float:
    """Each output sums ``n_in`` products: allow a few roundings of the output's magnitude."""
    return 4 * n_in**0.5 * torch.finfo(dtype).eps * oracle.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_packed_linear_matches_float64(dtype: torch.dtype, bias: bool, rows: int) -> None:
    seed = fresh_seed()
    torch.manual_seed(seed)
    layer = Linear(192, 320, bias=bias, dtype=dtype)
    x = torch.randn(rows, 192, dtype=dtype)
    oracle = x.double() @ layer.weight.double().T + (layer.bias.double() if bias else 0)
    limit = tolerance(192, dtype, oracle)
    plain = layer(x)
    assert (plain.double() - oracle).abs().max().item() < limit, f"seed={seed}"
    if dtype not in CPU.packed_linear_dtypes:
        # The platform says this CPU cannot pack the dtype; torch agrees: it refuses the reorder.
        with pytest.raises(RuntimeError):
            layer.pack()
        assert layer.packed is None and layer.weight is not None, CPU.linear_packing_note
        return
    layer.pack()
    packed = layer(x)
    assert layer.weight is None and packed.dtype == dtype and packed.shape == (rows, 320)
    assert (packed.double() - oracle).abs().max().item() < limit, f"seed={seed}"


def test_packed_linear_takes_leading_dims_and_strided_inputs() -> None:
    layer = Linear(64, 96)
    fused = torch.randn(3, 7, 200)
    x = fused[..., 10:74]  # a strided view, as a split of a fused projection gives
    expected = layer(x)
    layer.pack()
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_pack_linears_packs_only_powertrain_linears_and_keeps_shared_weights() -> None:
    embedding = nn.Embedding(50, 32)
    head = Linear(32, 50, bias=False)
    head.weight = embedding.weight  # tied, as a model with tie_word_embeddings does
    plain = nn.Linear(32, 32)  # read as a matrix elsewhere: must stay dense
    model = nn.ModuleDict({"embedding": embedding, "head": head, "plain": plain, "o": Linear(32, 32)})
    hidden = torch.randn(4, 32)
    expected = hidden @ embedding.weight.T

    assert pack_linears(model) == 2
    assert pack_linears(model) == 0  # already packed
    assert isinstance(embedding.weight, nn.Parameter) and plain.weight is not None
    torch.testing.assert_close(head(hidden), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(embedding(torch.tensor([3])), embedding.weight[3:4])


def test_the_cpu_packs_float32_and_bfloat16_where_it_runs_them_and_accelerators_pack_nothing() -> None:
    assert torch.float32 in CPU.packed_linear_dtypes
    assert CPU.packed_linear_dtypes <= {torch.float32, torch.bfloat16}  # never float16
    assert (torch.bfloat16 in CPU.packed_linear_dtypes) == platforms.onednn_bf16_supported()
    assert CPU.linear_packing_note
    cuda = detect_cuda()
    assert cuda.packed_linear_dtypes == frozenset() and cuda.linear_packing_note == ""


def test_a_torch_without_onednn_packing_packs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear, "onednn_packing_ops", lambda: False)
    cpu = detect_cpu()
    assert cpu.packed_linear_dtypes == frozenset() and "no oneDNN linear packing" in cpu.linear_packing_note


def test_without_bfloat16_kernels_bfloat16_linears_stay_plain_f_linear(
    monkeypatch: pytest.MonkeyPatch, info_logs: list[dict], cache_dir: Path
) -> None:
    """A CPU without oneDNN bfloat16 kernels (AVX2 only), forced: float32 is still packed
    (where timing says packed wins), bfloat16 runs plain F.linear, and one info line says why."""
    monkeypatch.setattr(platforms, "onednn_bf16_supported", lambda: False)
    cpu = detect_cpu()
    assert cpu.packed_linear_dtypes == {torch.float32}
    assert "avx512bw" in cpu.linear_packing_note and "avx_ne_convert" in cpu.linear_packing_note

    seed = fresh_seed()
    generator = torch.Generator().manual_seed(seed)
    shapes = {"qkv": (96, 160, True), "o": (160, 96, False)}
    model = nn.ModuleDict({name: random_linear(generator, *shape, torch.bfloat16) for name, shape in shapes.items()})
    weights = {name: layer.weight.detach().clone() for name, layer in model.items()}

    assert pack_for_platform(model, cpu, torch.bfloat16) == 0
    assert all(layer.packed is None and layer.weight is not None for layer in model.values())
    (line,) = [entry for entry in info_logs if entry["event"] == NOT_PACKED]
    assert len(info_logs) == 1 and line["log_level"] == "info"
    assert (line["platform"], line["dtype"], line["packed_dtypes"]) == ("cpu", "torch.bfloat16", ["torch.float32"])
    assert line["why"] == cpu.linear_packing_note

    for name, layer in model.items():
        x = torch.randn(7, layer.in_features, generator=generator).to(torch.bfloat16)
        oracle = float64_linear(layer, x, weights[name])
        out = layer(x)
        assert out.dtype == torch.bfloat16
        error = (out.double() - oracle).abs().max().item()
        assert error < tolerance(layer.in_features, torch.bfloat16, oracle), f"{name}: {error} (seed={seed})"

    float32 = nn.ModuleDict({"o": random_linear(generator, 64, 32, False, torch.float32)})
    assert pack_for_platform(float32, cpu, torch.float32, timer=packed_wins) == 1 and float32["o"].packed is not None
    assert [entry["event"] for entry in info_logs[1:]] == [CHOSEN]


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_deepseek(tmp_path_factory.mktemp("tiny-v3-bf16"))


@pytest.mark.parametrize("bf16_kernels", ["as-this-cpu-says", "forced-off"])
def test_a_bfloat16_engine_loads_and_generates(
    tiny_v3: Path, bf16_kernels: str, monkeypatch: pytest.MonkeyPatch, info_logs: list[dict], cache_dir: Path
) -> None:
    """LLM(dtype="bfloat16") crashed at load on CPUs without bfloat16 kernels; now it packs
    exactly what the platform lists (timing forced to favour packing) and runs the rest plain."""
    monkeypatch.setattr(linear_choice, "time_shape", packed_wins)
    if bf16_kernels == "forced-off":
        monkeypatch.setattr(platforms, "onednn_bf16_supported", lambda: False)
    packs = platforms.onednn_bf16_supported()
    seed = fresh_seed()
    torch.manual_seed(seed)
    prompts = [torch.randint(4, 200, (n,)).tolist() for n in (5, 12)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(tiny_v3), dtype="bfloat16", block_size=8, num_blocks=32) as llm:
        outputs = llm.generate(prompts, params)
        layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6, 6], f"seed={seed}"
    assert layers and all((layer.packed is not None) == packs for layer in layers)
    events = [entry["event"] for entry in info_logs]
    assert events.count(NOT_PACKED) == (0 if packs else 1)
    assert events.count(CHOSEN) == (1 if packs else 0)
