"""powertrain-cuda-sm100's Triton kernels on an NVIDIA GPU: checked, timed, and put
against what the device can do.

Each kernel runs through the pack's backends (the same calls the engine makes), is
checked against the builtin torch implementation on the same inputs, and is timed
with ``triton.testing.do_bench`` (median). Memory-bound kernels (decode attention, MLA
decode, sparse MLA, indexer, its top-k and V4 attention decode, RMSNorm, rotary + cache
write) report achieved bandwidth as a fraction of the device's measured copy bandwidth;
compute-bound ones (prefill, MoE GEMMs) report TFLOP/s as a fraction of the measured bf16
(or FP8) matmul peak. Each row also gives the time of the builtin torch peer on the same
inputs.

    uv run python benchmarks/kernels_gpu.py                 # on a machine with an NVIDIA GPU
    TRITON_INTERPRET=1 uv run python benchmarks/kernels_gpu.py --smoke
                                                            # tiny shapes on the CPU: checks only
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from common import report
from kernel_bench import (
    FULL,
    SMOKE,
    Bench,
    Shapes,
    bench_gqa,
    bench_indexer,
    bench_mla,
    bench_moe,
    bench_rmsnorm,
    bench_rotary,
    bench_row_topk,
    bench_sparse_mla,
    bench_v4_attention,
    results_table,
)

from powertrain.components import Availability, PlatformInfo
from powertrain.interfaces import AttentionBackendContext, MoEBackendContext


def _do_bench(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, return_mode="median"))


def setup(description: str) -> tuple[bool, torch.device, Shapes, PlatformInfo]:
    """Parse ``--smoke`` and pick (smoke, device, shapes, platform): tiny shapes on the CPU
    under the interpreter with ``--smoke``, else the full ones on the visible NVIDIA GPU
    (the parser errors without one)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes under TRITON_INTERPRET=1 on the CPU")
    smoke = parser.parse_args().smoke
    if smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--smoke runs the kernels in the Triton interpreter: set TRITON_INTERPRET=1")
        device, shapes, capability = torch.device("cpu"), SMOKE, (10, 0)
    elif not torch.cuda.is_available():
        parser.error("no CUDA device is visible; this benchmark needs an NVIDIA GPU (or --smoke)")
    else:
        device, shapes, capability = torch.device("cuda"), FULL, torch.cuda.get_device_capability()
    platform = PlatformInfo(
        name="cuda", device_type=device.type, availability=Availability.yes("benchmark"), capability=capability
    )
    return smoke, device, shapes, platform


def triton_attention(platform: PlatformInfo, device: torch.device, shapes: Shapes) -> Any:
    """triton-sm100's attention backend in bfloat16 at the shapes' block size."""
    from powertrain_cuda_sm100.attention import TritonAttention

    return TritonAttention(
        AttentionBackendContext(platform=platform, device=device, dtype=torch.bfloat16, block_size=shapes.block_size)
    )


def main() -> int:
    smoke, device, shapes, platform = setup(__doc__.splitlines()[0])
    capability = platform.capability

    from powertrain.builtin.bucketed_attention import BucketedAttention
    from powertrain.builtin.grouped_moe import TorchGroupedMoE
    from powertrain.builtin.reference_attention import TorchReferenceAttention
    from powertrain_cuda_sm100.moe import TritonMoE

    attention = triton_attention(platform, device, shapes)
    moe = TritonMoE(MoEBackendContext(platform=platform, device=device, dtype=torch.bfloat16))
    bucketed, reference, grouped = BucketedAttention(), TorchReferenceAttention(), TorchGroupedMoE(torch.bfloat16)

    bench = Bench(device, smoke, _do_bench)
    bandwidth = 1.0 if smoke else bench.copy_bandwidth()
    peak_bf16 = 1.0 if smoke else bench.matmul_peak(fp8=False)
    peak_fp8 = 1.0 if smoke else bench.matmul_peak(fp8=True)
    rows = [
        bench_gqa(bench, shapes, attention, bucketed, True, bandwidth, peak_bf16),
        bench_gqa(bench, shapes, attention, bucketed, False, bandwidth, peak_bf16),
        bench_mla(bench, shapes, attention, reference, bandwidth),
        bench_sparse_mla(bench, shapes, attention, reference, bandwidth),
        bench_indexer(bench, shapes, attention, reference, bandwidth),
        bench_row_topk(bench, shapes, bandwidth),
        bench_v4_attention(bench, shapes, attention, reference, bandwidth, csa=True),
        bench_v4_attention(bench, shapes, attention, reference, bandwidth, csa=False),
        bench_rotary(bench, shapes, attention, bucketed, bandwidth),
        bench_rmsnorm(bench, shapes, attention, bandwidth),
        bench_moe(bench, shapes, moe, grouped, False, peak_bf16),
        bench_moe(bench, shapes, moe, grouped, True, peak_fp8),
        bench_moe(bench, shapes, moe, grouped, False, peak_bf16, fp4=True),
    ]
    results: dict[str, Any] = {}
    if not smoke:
        results["device"] = f"{torch.cuda.get_device_name()} (sm_{capability[0]}{capability[1]})"
        results["measured copy bandwidth"] = f"{bandwidth / 1e9:.0f} GB/s"
        results["measured matmul peak"] = f"bf16 {peak_bf16 / 1e12:.0f} TFLOP/s, fp8 {peak_fp8 / 1e12:.0f} TFLOP/s"
    results.update(results_table(rows))
    report("powertrain-cuda-sm100 Triton kernels" + (" (smoke: interpreter, checks only)" if smoke else ""), results)
    return 1 if any(row.check.startswith("FAIL") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
