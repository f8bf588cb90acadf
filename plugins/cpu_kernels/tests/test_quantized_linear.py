"""NativeQuantizedLinear against a float64 oracle: ``QuantizedWeight.dequantize(float64)``
times the activations in float64.

Tolerance: float32 results within ``1e-5 * (|x| @ |W|^T + |bias|)`` of the oracle, elementwise
(the scale of the terms summed, so cancellation cannot make a correct result look wrong);
bfloat16 results additionally within one bfloat16 rounding (``2**-8 * |oracle|``). Products
whose activations were rounded to 16 bits (``activation_bits=16``) additionally within that
rounding's bound, ``sum_g max|x_g| / 65534 * sum_j (|scale_g * code_gj| + |offset_g|)``
(``activation_rounding_bound``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import attrs
import pytest
import torch

from powertrain.engine.model_runner import torch_threads
from powertrain.interfaces.quantized import QuantizedLinearKernel, QuantizedWeight
from powertrain.testing.quantized_linear import activation_rounding_bound
from powertrain_cpu_kernels import NativeQuantizedLinear, PreparedWeight, _native
from powertrain_cpu_kernels.threads import openmp_team
from powertrain_cpu_kernels.torch_openmp import gomp_parallel_address

FORMATS = [("q4", 32), ("q8", 16), ("q8", 32)]
ROWS = (1, 3, 37, 257)
COLS = (32, 96, 544)
F32_TOL = 1e-5
BF16_TOL = 2.0**-8

NATIVE = NativeQuantizedLinear(gemv_max_rows=1 << 30)  # always the native kernel
# codes widened in the dot, activations float32
TILES = NativeQuantizedLinear(gemv_max_rows=1 << 30, gemm_min_rows=1 << 30, activation_bits=32)
# the same, but few rows of activations rounded to 16 bits on AVX2 (src/q4_i16.rs)
INT16 = NativeQuantizedLinear(gemv_max_rows=1 << 30, gemm_min_rows=1 << 30)
PANELS = NativeQuantizedLinear(gemv_max_rows=1 << 30, gemm_min_rows=1)  # dequantised panels (src/gemm.rs)
DENSE = NativeQuantizedLinear(gemv_max_rows=0)  # always native dequantise + F.linear
BLOCKED = NativeQuantizedLinear(gemv_max_rows=0, dense_block=544 * 16)  # the same, 16 rows of 544 a block
# bfloat16 activations times the weight dequantised to bfloat16 (F.linear in bfloat16), whole and blocked
BF16_DENSE = NativeQuantizedLinear(bf16_dense_min_rows=1)
BF16_BLOCKED = NativeQuantizedLinear(bf16_dense_min_rows=1, dense_block=544 * 16)
# bfloat16 activations on AMX tiles (src/amx.rs), where this CPU and OS provide them
AMX = NativeQuantizedLinear(bf16_amx_min_rows=1) if _native.amx() else None
needs_amx = pytest.mark.skipif(
    AMX is None, reason="this CPU or OS gives no AMX bfloat16 tiles (_native.amx() is False): the AMX kernel cannot run"
)


def random_weight(fmt: str, group: int, n: int, k: int, offsets: bool, half: bool = False) -> QuantizedWeight:
    """Codes over their full range, scales and offsets of both signs; with ``half``, scales
    and offsets that float16 holds exactly (as GGUF's Q4_0, Q4_1 and Q8_0 store them)."""
    if fmt == "q4":
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    else:
        codes = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    scales = torch.randn(n, k // group) * 0.05
    shifts = torch.randn(n, k // group) * 0.2 if offsets else None
    if half:
        scales = scales.half().float()
        shifts = None if shifts is None else shifts.half().float()
    else:  # one value float16 cannot hold (a lone random one sometimes fits: 1 in 8192)
        scales[0, 0] = 1 / 3
    return QuantizedWeight(codes=codes, scales=scales, offsets=shifts, format=fmt, group=group, source=f"test {fmt}")


@pytest.fixture(params=[False, True], ids=["float32-scales", "float16-scales"])
def half(request: pytest.FixtureRequest) -> bool:
    """Whether the weights' scales fit float16, which ``prepare`` then keeps them in."""
    return request.param


def oracle(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None,
    activation_bits: int = 32,
    weight_rounding: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 result, and the error each element may have (``weight_rounding``: the
    relative rounding of a weight the kernel multiplies in a narrower dtype)."""
    dense = weight.dequantize(torch.float64)
    x64 = x.to(torch.float64)
    want = x64 @ dense.T
    scale = x64.abs() @ dense.abs().T
    if bias is not None:
        want = want + bias.to(torch.float64)
        scale = scale + bias.to(torch.float64).abs()
    allowed = (F32_TOL + weight_rounding) * scale + 1e-30
    if activation_bits == 16:
        allowed = allowed + activation_rounding_bound(x64, weight, 16)
    if x.dtype == torch.bfloat16:
        allowed = allowed + BF16_TOL * want.abs()
    return want, allowed


def check(got: torch.Tensor, x: torch.Tensor, want: torch.Tensor, allowed: torch.Tensor, what: str) -> None:
    assert got.dtype == x.dtype and got.shape == want.shape, f"{what}: {got.dtype} {list(got.shape)}"
    if got.numel() == 0:
        return
    error = (got.to(torch.float64) - want).abs()
    worst = (error / allowed).max().item()
    assert worst <= 1.0, f"{what}: error {worst:.3g}x the tolerance (max abs error {error.max().item():.3g})"


@pytest.mark.parametrize("m", [1, 2, 5, 17, 64])
@pytest.mark.parametrize(("fmt", "group"), FORMATS)
def test_linear_matches_float64_oracle(fmt: str, group: int, m: int, kernel_path: str, half: bool, seed: int) -> None:
    case = 0
    for n in ROWS:
        for k in COLS:
            for offsets in (False, True):
                weight = random_weight(fmt, group, n, k, offsets, half)
                assert INT16.prepare(weight).half_scales == half
                # bias and dtype alternate so every pairing occurs across n
                with_bias = (case // 2) % 2 == 1
                dtype = torch.bfloat16 if case % 2 else torch.float32
                case += 1
                x = torch.randn(m, k).to(dtype)
                bias = torch.randn(n) if with_bias else None
                want, allowed = oracle(x, weight, bias)
                want16, allowed16 = oracle(x, weight, bias, activation_bits=16)
                got = INT16.linear(x, INT16.prepare(weight), bias)
                what = (
                    f"seed={seed} {fmt}/{group} {kernel_path} int16 m={m} n={n} k={k} offsets={offsets} "
                    f"half={half} {dtype}"
                )
                check(got, x, want16, allowed16, what)
                routes = (
                    (TILES, "native, widened"),
                    (PANELS, "native, panels"),
                    (DENSE, "dequantise+F.linear"),
                    (BLOCKED, "blocked dequantise"),
                )
                for kernel, route in routes:
                    got = kernel.linear(x, kernel.prepare(weight), bias)
                    what = (
                        f"seed={seed} {fmt}/{group} {kernel_path} {route} m={m} n={n} k={k} "
                        f"offsets={offsets} bias={with_bias} half={half} {dtype}"
                    )
                    check(got, x, want, allowed, what)
                if dtype == torch.bfloat16:
                    # Weights and bias rounded to bfloat16 (2**-9 relative), and the product may be
                    # rounded once more before the bias is added (another 2**-9 of the terms' scale).
                    want_b, allowed_b = oracle(x, weight, bias, weight_rounding=2.0**-8)
                    bf16_routes = [(BF16_DENSE, "bfloat16 dequantise"), (BF16_BLOCKED, "bfloat16 blocked")]
                    if AMX is not None and kernel_path != "scalar":
                        bf16_routes.append((AMX, "AMX tiles"))
                    for kernel, route in bf16_routes:
                        got = kernel.linear(x, kernel.prepare(weight), bias)
                        check(got, x, want_b, allowed_b, f"seed={seed} {fmt}/{group} {route} m={m} n={n} k={k}")


@pytest.mark.parametrize(("fmt", "group"), FORMATS)
def test_dequantize_is_bit_equal(fmt: str, group: int, kernel_path: str, half: bool, seed: int) -> None:
    for n, k in ((1, 32), (37, 544), (257, 96)):
        for offsets in (False, True):
            weight = random_weight(fmt, group, n, k, offsets, half)
            prepared = NATIVE.prepare(weight)
            got = NATIVE.dequantize(prepared)
            what = f"seed={seed} {fmt}/{group} {kernel_path} n={n} k={k} offsets={offsets} half={half}"
            assert torch.equal(got, weight.dequantize()), what
            # straight to bfloat16: torch's rounding of the float32 weight, bit for bit
            got = NATIVE.dequantize(prepared, torch.bfloat16)
            assert torch.equal(got, weight.dequantize().to(torch.bfloat16)), f"{what} bfloat16"


def test_scales_are_kept_in_float16_only_where_it_holds_them_exactly() -> None:
    """GGUF's own float16 scales stream in 2 bytes, not the loader's 4: a Q4_1 weight is 20
    bytes per group of 32 read, not 24. One value float16 cannot hold keeps the whole weight's
    scales and offsets in float32 (the kernels read them in one type)."""
    exact = random_weight("q4", 32, 8, 64, offsets=True, half=True)
    prepared = NATIVE.prepare(exact)
    assert prepared.half_scales and prepared.scales.dtype == prepared.offsets.dtype == torch.float16
    assert prepared.nbytes == 8 * 2 * (16 + 2 + 2)
    for tensor in ("scales", "offsets"):
        values = getattr(exact, tensor).clone()
        values[3, 1] = 1.0 + 2.0**-12  # between two float16 values
        inexact = NATIVE.prepare(attrs.evolve(exact, **{tensor: values}))
        assert not inexact.half_scales and inexact.scales.dtype == torch.float32, tensor
        assert inexact.nbytes == exact.nbytes
    x = torch.randn(1, 64)
    want, allowed = oracle(x, exact, None, activation_bits=16)
    check(INT16.linear(x, prepared, None), x, want, allowed, "float16 scales")


def test_default_kernel_batches_and_keeps_shape(kernel_path: str, seed: int) -> None:
    """The default crossovers (widened codes / panels, and the pool's row limit where it
    applies), leading dimensions, and inference mode."""
    kernel = NativeQuantizedLinear()
    weight = random_weight("q4", 32, 37, 96, offsets=True)
    prepared = kernel.prepare(weight)
    assert isinstance(kernel, QuantizedLinearKernel)
    crossovers = {kernel.gemm_min_rows - 1, kernel.gemm_min_rows, min(kernel.gemv_max_rows, 300) + 1}
    for shape in ((96,), (2, 3, 96), *((rows, 96) for rows in sorted(crossovers)), (0, 96)):
        x = torch.randn(shape)
        with torch.inference_mode():
            got = kernel.linear(x, prepared, None)
        assert got.shape == (*shape[:-1], 37)
        x2 = x.reshape(-1, 96)
        check(
            got.reshape(-1, 37),
            x2,
            *oracle(x2, weight, None, kernel.activation_bits),
            f"seed={seed} {kernel_path} x {list(shape)}",
        )
    strided = torch.randn(96, 5).T  # not contiguous
    check(
        kernel.linear(strided, prepared, None),
        strided,
        *oracle(strided, weight, None, kernel.activation_bits),
        f"seed={seed} strided x",
    )


def test_thread_count_does_not_change_results(seed: int) -> None:
    """Rows are split among threads; each output is computed the same way whatever the split."""
    weight = random_weight("q4", 32, 257, 544, offsets=True)
    x = torch.randn(5, 544)
    results = []
    with torch_threads(1):  # the package's pool: torch's team is not in use
        for threads in (1, 3, 2):
            kernel = NativeQuantizedLinear(threads=threads)
            results.append(kernel.linear(x, kernel.prepare(weight), None))
            assert _native.threads() == threads
    for threads in (2, 3):  # torch's OpenMP team, where this torch has one
        with torch_threads(threads):
            assert openmp_team() == (threads if gomp_parallel_address() else 0)
            kernel = NativeQuantizedLinear()
            results.append(kernel.linear(x, kernel.prepare(weight), None))
    assert all(torch.equal(results[0], result) for result in results[1:]), f"seed={seed}"


def test_environment_variable_forces_scalar() -> None:
    # The extension alone, without the package (whose import loads torch: seconds).
    code = (
        "import importlib.util, sys; "
        "spec = importlib.util.spec_from_file_location('_native', sys.argv[1]); "
        "native = importlib.util.module_from_spec(spec); spec.loader.exec_module(native); "
        "print(native.kernel_path(), native.best_kernel_path())"
    )
    env = {**os.environ, "POWERTRAIN_CPU_KERNELS_SCALAR": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, _native.__file__], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    path, best = proc.stdout.split()
    assert path == "scalar" and best == _native.best_kernel_path()


def test_errors_say_what_and_what_to_do() -> None:
    weight = random_weight("q8", 16, 4, 32, offsets=False)
    prepared = NATIVE.prepare(weight)
    with pytest.raises(ValueError, match=r"last dimension must be 32"):
        NATIVE.linear(torch.randn(2, 64), prepared, None)
    with pytest.raises(ValueError, match=r"floating-point CPU activations, got torch.int64"):
        NATIVE.linear(torch.ones(2, 32, dtype=torch.int64), prepared, None)
    with pytest.raises(ValueError, match=r"bias must be a CPU tensor of shape \[4\]"):
        NATIVE.linear(torch.randn(2, 32), prepared, torch.randn(5))
    with pytest.raises(TypeError, match=r"call kernel.prepare\(weight\) once"):
        NATIVE.linear(torch.randn(2, 32), weight, None)
    with pytest.raises(TypeError, match=r"takes a QuantizedWeight, got Tensor"):
        NATIVE.prepare(torch.randn(4, 32))
    assert isinstance(prepared, PreparedWeight) and prepared.nbytes == weight.nbytes
    with pytest.raises(ValueError, match=r"q8 group must be 16 or 32, got 8"):
        _native.q8_dequantize(0, 0, 0, False, 0, False, 0, 0, 8, 0)
    with pytest.raises(ValueError, match=r"the dense weight is float32 or bfloat16, got torch.float16"):
        NATIVE.dequantize(prepared, torch.float16)


@pytest.mark.skipif(
    sys.platform != "linux" or not torch.backends.openmp.is_available(), reason="torch here does not use libgomp"
)
def test_torch_openmp_runtime_is_found_where_torch_uses_libgomp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Linux wheels of torch parallelise with libgomp: asked to (``POWERTRAIN_CPU_OPENMP=1``),
    the kernels must find its team there; by default they keep to their own pool."""
    assert gomp_parallel_address() == 0  # the default: the pool (torch_openmp.SWITCH says why)
    monkeypatch.setenv("POWERTRAIN_CPU_OPENMP", "1")
    gomp_parallel_address.cache_clear()
    try:
        assert gomp_parallel_address() != 0
        with torch_threads(2):
            assert openmp_team() == 2
        assert _native.openmp_available()
    finally:
        monkeypatch.delenv("POWERTRAIN_CPU_OPENMP")
        gomp_parallel_address.cache_clear()


@pytest.fixture(params=["vnni", "avx2"])
def integer_dot(request: pytest.FixtureRequest) -> Iterator[str]:
    """The 16-bit products with AVX-512 VNNI's ``vpdpwssd`` (where this CPU has it) and with
    AVX2's ``vpmaddwd``."""
    if _native.best_kernel_path() != "avx2+fma":
        # Absent CPU features are detected, never assumed: elsewhere the products stay float32,
        # which the oracle test above covers on the scalar path.
        pytest.skip(f"16-bit activations run on AVX2 (the kernels detected {_native.best_kernel_path()})")
    _native.force_no_vnni(request.param == "avx2")
    if request.param == "vnni" and not _native.vnni():
        _native.force_no_vnni(False)
        # Detected, never assumed: without VNNI the AVX2 parameter runs the route this CPU takes.
        pytest.skip("this CPU has no AVX-512 VNNI")
    yield request.param
    _native.force_no_vnni(False)


#: The formats whose few-row products round activations to 16 bits on AVX2.
INT16_FORMATS = ["q4", "q8"]  # q8 with 32-column groups only (src/q8_i16.rs)


#: Rows up to which the integer products run: four with VNNI, two with ``vpmaddwd``
#: (``int16_max_rows`` in src/lib.rs).
INT16_MAX_ROWS = {"vnni": 4, "avx2": 2}


@pytest.mark.parametrize("fmt", INT16_FORMATS)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_int16_activations_stay_within_their_rounding_bound(
    fmt: str, m: int, integer_dot: str, half: bool, seed: int
) -> None:
    rounded = 0  # outputs that differ from the float32 kernel's: the integer path ran
    for n in (1, 3, 4, 5, 37, 257):
        for k in (32, 96, 544, 1536):
            for offsets in (False, True):
                weight = random_weight(fmt, 32, n, k, offsets, half)
                # activations of mixed magnitudes, as a model's are (outlier columns)
                x = torch.randn(m, k) * torch.exp(torch.randn(k) * 1.5)
                got = INT16.linear(x, INT16.prepare(weight), None)
                what = f"seed={seed} {fmt} {integer_dot} m={m} n={n} k={k} offsets={offsets} half={half}"
                check(got, x, *oracle(x, weight, None, activation_bits=16), what)
                rounded += int((got != TILES.linear(x, TILES.prepare(weight), None)).sum())
    if m <= INT16_MAX_ROWS[integer_dot]:
        assert rounded > 0, f"seed={seed} {fmt} {integer_dot} m={m}: no output moved, so no activation was rounded"
    else:  # the float32 kernel ran: the same bits
        assert rounded == 0, f"seed={seed} {fmt} {integer_dot} m={m}: rounded past {INT16_MAX_ROWS[integer_dot]} rows"


@pytest.mark.parametrize("fmt", INT16_FORMATS)
def test_int16_activations_that_need_no_rounding_give_float32_results(fmt: str, integer_dot: str, seed: int) -> None:
    """Each group holding a value of magnitude exactly 32767 steps, and every value a whole
    number of steps (a power of two), rounds without error: the result must then be as close
    to the oracle as a float32 product, so a wrong scale or rounding cannot hide in the bound."""
    for n, k in ((5, 32), (37, 544), (257, 1536)):
        for m in (1, 2):
            step = 2.0 ** torch.randint(-12, -4, (m, k // 32, 1)).double()
            q = torch.randint(-32767, 32768, (m, k // 32, 32)).double()
            q[:, :, torch.randint(0, 32, ())] = 32767.0 * torch.where(torch.rand(m, k // 32) < 0.5, -1.0, 1.0)
            x = (q * step).reshape(m, k).float()
            weight = random_weight(fmt, 32, n, k, offsets=True)
            got = INT16.linear(x, INT16.prepare(weight), None)
            check(got, x, *oracle(x, weight, None), f"seed={seed} {fmt} {integer_dot} m={m} n={n} k={k}")


@pytest.mark.parametrize("fmt", INT16_FORMATS)
def test_int16_activations_carry_nan_and_infinity_to_the_output(fmt: str, integer_dot: str) -> None:
    weight = random_weight(fmt, 32, 9, 96, offsets=True)
    prepared = INT16.prepare(weight)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, 96)
        x[0, 40] = bad
        got = INT16.linear(x, prepared, None)
        assert not got[0].isfinite().any(), f"{integer_dot} {bad}: {got[0]}"
        assert got[1].isfinite().all(), f"{integer_dot} {bad}: the other row"


def test_bfloat16_route_multiplies_the_weight_in_bfloat16(seed: int) -> None:
    """From ``bf16_dense_min_rows`` rows of bfloat16 activations on, the product is torch's
    bfloat16 matmul by the dequantised weight (bit for bit); below it, activations are widened
    for the float32 kernel, which gives other bits."""
    weight = random_weight("q4", 32, 300, 544, True)
    kernel = NativeQuantizedLinear(bf16_dense_min_rows=16, dense_block=544 * 128)  # 3 blocks
    prepared = kernel.prepare(weight)
    dense = weight.dequantize(torch.float32).to(torch.bfloat16)
    bias = torch.randn(300).to(torch.bfloat16)
    for m, taken in ((16, True), (40, True), (15, False)):
        x = torch.randn(2, m // 2 + m % 2, 544)[:, : m // 2 + m % 2].reshape(-1, 544)[:m].to(torch.bfloat16)
        got = kernel.linear(x, prepared, bias)
        blockwise = torch.cat(
            [torch.nn.functional.linear(x, part, b) for part, b in zip(dense.split(128), bias.split(128), strict=True)],
            dim=1,
        )
        assert torch.equal(got, blockwise) == taken, f"m={m} (seed {seed})"


def test_the_bfloat16_routes_are_chosen_from_the_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dequantised bfloat16 only where the CPU has bfloat16 dot products; with AMX tiles the
    kernels can use, the AMX kernel up to ``BF16_AMX_MAX_ROWS`` rows and the route above."""
    from powertrain_cpu_kernels.tuning import (
        BF16_AMX_MAX_ROWS,
        BF16_AMX_MIN_ROWS,
        BF16_DENSE_MIN_ROWS,
        BF16_DENSE_MIN_ROWS_AMX,
    )

    for flags, tiles, want in (
        ({"avx512_bf16", "avx2"}, True, (BF16_DENSE_MIN_ROWS, None)),
        ({"amx_bf16"}, False, (BF16_DENSE_MIN_ROWS_AMX, None)),
        ({"avx512_bf16", "amx_bf16"}, False, (BF16_DENSE_MIN_ROWS_AMX, None)),
        ({"avx512_bf16", "amx_bf16"}, True, (BF16_AMX_MAX_ROWS + 1, BF16_AMX_MIN_ROWS)),
        ({"avx2"}, True, (None, None)),
    ):
        monkeypatch.setattr("powertrain.builtin.platforms.cpu_flags", lambda flags=flags: frozenset(flags))
        monkeypatch.setattr(_native, "amx", lambda tiles=tiles: tiles)
        kernel = NativeQuantizedLinear.for_this_cpu()
        assert (kernel.bf16_dense_min_rows, kernel.bf16_amx_min_rows) == want, (flags, tiles)
        assert NativeQuantizedLinear.for_this_cpu(activation_bits=32).activation_bits == 32


def test_the_amx_kernel_is_refused_where_the_tiles_are_not_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "amx", lambda: False)
    with pytest.raises(ValueError, match=r"bf16_amx_min_rows needs AMX bfloat16 tiles.*leave it None"):
        NativeQuantizedLinear(bf16_amx_min_rows=4)


@needs_amx
@pytest.mark.parametrize(("fmt", "group"), FORMATS)
def test_amx_tiles_multiply_the_weight_rounded_to_bfloat16(fmt: str, group: int, half: bool, seed: int) -> None:
    """The AMX kernel's float32 product is that of the weight rounded to bfloat16 (torch's
    rounding of the dequantised weight), summed in float32: within float32's tolerance of
    the float64 product by that weight. A weight rounded any other way (truncated, or left
    in float32) is about 2**-9 off per element and fails this. Row counts across the 16-row
    tiles of x and of the weight, the last ones partial."""
    for n, k in ((1, 32), (37, 96), (300, 544)):
        for offsets in (False, True):
            weight = random_weight(fmt, group, n, k, offsets, half)
            prepared = AMX.prepare(weight)
            dense = weight.dequantize().to(torch.bfloat16).to(torch.float64)
            for m in (1, 5, 16, 17, 33, 64, 100):  # 100: two calls
                x = torch.randn(m, k).to(torch.bfloat16)
                got = AMX._amx_linear(x, prepared)
                x64 = x.to(torch.float64)
                error = (got.to(torch.float64) - x64 @ dense.T).abs()
                allowed = F32_TOL * (x64.abs() @ dense.abs().T) + 1e-30
                what = f"seed={seed} {fmt}/{group} m={m} n={n} k={k} offsets={offsets} half={half}"
                assert got.dtype == torch.float32 and (error <= allowed).all(), (
                    f"{what}: error {(error / allowed).max().item():.3g}x the tolerance"
                )


@needs_amx
def test_amx_rows_and_routes(seed: int) -> None:
    """``linear`` takes the AMX kernel from ``bf16_amx_min_rows`` to ``BF16_AMX_MAX_ROWS`` rows
    of bfloat16 activations (bias added in float32, one rounding to bfloat16), the dequantised
    route above, and widens below; a NaN scale makes its weight row's outputs NaN and no other."""
    from powertrain_cpu_kernels.tuning import AMX_MAX_ROWS, BF16_AMX_MAX_ROWS

    kernel = NativeQuantizedLinear(bf16_amx_min_rows=4, bf16_dense_min_rows=BF16_AMX_MAX_ROWS + 1)
    weight = random_weight("q4", 32, 70, 96, offsets=True, half=True)
    prepared = kernel.prepare(weight)
    bias = torch.randn(70).to(torch.bfloat16)
    calls = []
    amx_linear = kernel._amx_linear
    kernel._amx_linear = lambda x, prepared: calls.append(x.shape[0]) or amx_linear(x, prepared)
    taken = (4, AMX_MAX_ROWS, AMX_MAX_ROWS + 1, BF16_AMX_MAX_ROWS)
    for m in (3, *taken, BF16_AMX_MAX_ROWS + 1):
        x = torch.randn(m, 96).to(torch.bfloat16)
        got = kernel.linear(x.view(1, m, 96), prepared, bias)
        assert got.shape == (1, m, 70) and got.dtype == torch.bfloat16
        if m in taken:
            want = (amx_linear(x, prepared) + bias.to(torch.float32)).to(torch.bfloat16)
            assert torch.equal(got[0], want), f"m={m} (seed {seed})"
    assert calls == list(taken)
    # Past one call's rows, each 64-row slice is that slice's own product.
    x = torch.randn(AMX_MAX_ROWS + 9, 96).to(torch.bfloat16)
    whole = amx_linear(x, prepared)
    assert torch.equal(whole[AMX_MAX_ROWS:], amx_linear(x[AMX_MAX_ROWS:].contiguous(), prepared))
    scales = weight.scales.clone()
    scales[5, 2] = float("nan")
    poisoned = AMX.prepare(attrs.evolve(weight, scales=scales))
    got = AMX._amx_linear(torch.randn(20, 96).to(torch.bfloat16), poisoned)
    assert got[:, 5].isnan().all() and not got[:, torch.arange(70) != 5].isnan().any()
    x = torch.randn(65, 96).to(torch.bfloat16)
    out = torch.empty(65, 70)
    codes, scales, offsets = prepared.pointers
    with pytest.raises(ValueError, match=r"at most 64 rows and a multiple of 32 columns, got 65 x 96"):
        _native.q4_linear_amx(x.data_ptr(), codes, scales, offsets, prepared.half_scales, out.data_ptr(), 65, 70, 96, 0)


def test_activation_bits_are_16_or_32() -> None:
    with pytest.raises(ValueError, match=r"activation_bits must be 16 or 32, got 8"):
        NativeQuantizedLinear(activation_bits=8)
