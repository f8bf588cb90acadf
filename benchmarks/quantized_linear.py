"""Weight-only quantised linear on the CPU: powertrain-cpu-kernels' native q4/q8 kernel
versus torch's float32 ``F.linear`` on the dense weight (and ``torch._weight_int8pack_mm``,
torch's own int8 weight-only kernel, for q8 where this torch has it), on SmolLM2-135M's
shapes.

Each row: microseconds per call (median) for each route of ``NativeQuantizedLinear``:
``widened`` (codes widened inside each dot, activations float32), ``int16`` (the same, but
one or two rows of activations rounded to 16 bits, ``src/q4_i16.rs``), ``panels`` (the weight dequantised a panel at a
time and multiplied, ``src/gemm.rs``), ``blocks`` (dequantised 4 MB at a time for torch's
``F.linear``) and ``route`` (what it picks by default: widened below ``GEMM_MIN_ROWS`` rows,
panels from there); then ``F.linear`` on the dense float32 weight, the ratio dense/route (> 1:
the default route is faster) and the weight bytes the route reads per second. Then the whole
model (30 q4 layers + the q8 head) per row count and route, and whether the kernels' threads
and torch's OpenMP threads slow each other down when calls alternate.

With ``--dtype bfloat16`` the activations are bfloat16 and the routes are those for them:
``widened`` (activations widened to float32 for the native kernel), ``bf16 blocks`` (the
weight dequantised straight to bfloat16 4 MB at a time for oneDNN's bfloat16 matmul),
``amx`` (``src/amx.rs``, up to 128 rows, where ``_native.amx()``) and ``route`` (the plugin's
``for_this_cpu`` choice); the peer is ``F.linear`` on the dense bfloat16 weight.

    uv run python benchmarks/quantized_linear.py [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from common import report

from powertrain.interfaces.quantized import QuantizedWeight
from powertrain_cpu_kernels import NativeQuantizedLinear, _native
from powertrain_cpu_kernels.tuning import BF16_AMX_MAX_ROWS

# SmolLM2-135M: hidden 576, intermediate 1536, 9 heads / 3 KV heads of 64, 30 layers, 49152 tokens.
LAYERS = 30
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)


def timed(fn: Callable[[], object], budget: float) -> float:
    """Median seconds per call over five samples of about ``budget / 5`` seconds each."""
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < budget / 20 or calls < 1:
        fn()
        calls += 1
    per_sample = max(1, calls * 4)
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(per_sample):
            fn()
        samples.append((time.perf_counter() - start) / per_sample)
    return statistics.median(samples)


def weight(fmt: str, n: int, k: int) -> QuantizedWeight:
    """q4 with offsets (as Q4_K loads), q8 group 32 without (as Q8_0 loads)."""
    group = 32
    if fmt == "q4":
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
        offsets = torch.randn(n, k // group) * 0.01
    else:
        codes = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        offsets = None
    scales = torch.rand(n, k // group) * 0.01
    return QuantizedWeight(codes=codes, scales=scales, offsets=offsets, format=fmt, group=group, source=fmt)


def int8pack(w: QuantizedWeight) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """torch's int8 weight-only matmul (per-row scales: the same bytes, a coarser scale)."""
    op = getattr(torch, "_weight_int8pack_mm", None)
    if op is None or w.format != "q8":
        return None
    codes, scales = w.codes.contiguous(), w.scales[:, 0].contiguous()
    try:
        op(torch.randn(1, w.shape[1]), codes, scales)
    except RuntimeError:
        return None
    return lambda x: op(x, codes, scales)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--budget", type=float, default=0.25, help="seconds of timing per measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (the kernels' pool follows)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the activations'")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    if dtype == torch.bfloat16:
        routes = {
            "widened": NativeQuantizedLinear(),
            "bf16 blocks": NativeQuantizedLinear(bf16_dense_min_rows=1),
            **({"amx": NativeQuantizedLinear(bf16_amx_min_rows=1)} if _native.amx() else {}),
            "route": NativeQuantizedLinear.for_this_cpu(),
        }
    else:
        routes = {
            "widened": NativeQuantizedLinear(gemv_max_rows=1 << 30, gemm_min_rows=1 << 30, activation_bits=32),
            "int16": NativeQuantizedLinear(gemv_max_rows=1 << 30, gemm_min_rows=1 << 30),
            "panels": NativeQuantizedLinear(gemv_max_rows=1 << 30, gemm_min_rows=1),
            "blocks": NativeQuantizedLinear(gemv_max_rows=0),
            "route": NativeQuantizedLinear(),
        }
    route = routes["route"]
    peer = f"F.linear {'bf16' if dtype == torch.bfloat16 else 'f32'}"
    results: dict[str, object] = {
        "activations": args.dtype,
        "kernel_path": _native.kernel_path(),
        "amx": _native.amx(),
        "gemm_min_rows": route.gemm_min_rows,
        "gemv_max_rows": route.gemv_max_rows,
    }
    model: dict[int, dict[str, float]] = {m: {} for m in args.rows}  # seconds per route, 30 q4 layers + q8 head
    bytes_per_token = 0
    cases = [(name, n, k, fmt) for name, (n, k) in SHAPES.items() for fmt in ("q4", "q8")]
    cases.append(("head", *HEAD, "q8"))
    with torch.inference_mode():
        for name, n, k, fmt in cases:
            w = weight(fmt, n, k)
            prepared = route.prepare(w)
            dense = w.dequantize().to(dtype)
            int8_mm = int8pack(w) if name != "head" and dtype == torch.float32 else None  # slow: it would dominate
            count = LAYERS if name != "head" else 1
            in_model = name == "head" or fmt == "q4"
            bytes_per_token += count * prepared.nbytes if in_model else 0
            for m in args.rows:
                x = torch.randn(m, k).to(dtype)
                times = {
                    label: timed(partial(kernel.linear, x, prepared, None), args.budget)
                    for label, kernel in routes.items()
                    if not (label == "amx" and m > BF16_AMX_MAX_ROWS)  # above it, another route would run
                }
                times[peer] = timed(partial(F.linear, x, dense), args.budget)
                row = "  ".join(f"{label} {t * 1e6:8.1f} us" for label, t in times.items())
                row += f"  dense/route {times[peer] / times['route']:5.2f}x"
                row += f"  {prepared.nbytes / times['route'] / 1e9:5.1f} GB/s"
                if int8_mm is not None:
                    t_int8 = timed(partial(int8_mm, x), args.budget)
                    row += f"  int8pack_mm {t_int8 * 1e6:8.1f} us ({t_int8 / times['route']:4.2f}x route)"
                results[f"{name} {n}x{k} {fmt} m={m}"] = row
                print(f"{name:8} {n:6}x{k:<5} {fmt} m={m:<3} {row}", flush=True)
                if in_model:
                    for label, t in times.items():
                        model[m][label] = model[m].get(label, 0.0) + count * t
        for m, times in model.items():
            row = ", ".join(f"{label} {t * 1e3:.2f} ms" for label, t in times.items())
            if m == 1:
                rate = bytes_per_token / times["route"] / 1e9
                row += f"; {bytes_per_token / 1e6:.1f} MB quantised, route {rate:.1f} GB/s"
            results[f"model (30 layers q4 + head q8), m={m}"] = row
        results.update(thread_interplay(args.budget))
    report(f"weight-only quantised linear on the CPU: native q4/q8 vs torch {peer} (SmolLM2-135M)", results)


def thread_interplay(budget: float) -> dict[str, str]:
    """One layer's four q4 linears at m=1, alone, and alternating with torch matmuls that
    start torch's OpenMP threads (whose workers spin a while after each parallel region)."""
    kernel = NativeQuantizedLinear(gemv_max_rows=1 << 30)
    layer = [kernel.prepare(weight("q4", n, k)) for n, k in SHAPES.values()]
    xs = [torch.randn(1, k) for _, k in SHAPES.values()]
    dense = torch.randn(256, 576)
    batch = torch.randn(64, 576)

    def ours() -> None:
        for x, w in zip(xs, layer, strict=True):
            kernel.linear(x, w, None)

    def theirs() -> None:
        for _ in layer:
            F.linear(batch, dense)

    def alternating() -> None:
        for x, w in zip(xs, layer, strict=True):
            kernel.linear(x, w, None)
            F.linear(batch, dense)

    results = {}
    threads = torch.get_num_threads()
    for pool in sorted({1, threads}):
        torch.set_num_threads(pool)  # the kernels' pool follows torch's count
        t_ours, t_theirs, t_both = timed(ours, budget), timed(theirs, budget), timed(alternating, budget)
        results[f"interplay, {pool} thread(s)"] = (
            f"q4 layer {t_ours * 1e6:.1f} us + torch {t_theirs * 1e6:.1f} us alone; alternating "
            f"{t_both * 1e6:.1f} us ({t_both / (t_ours + t_theirs):.2f}x the sum)"
        )
    torch.set_num_threads(threads)
    return results


if __name__ == "__main__":
    main()
