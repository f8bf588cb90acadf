"""powertrain-cann-ascend's fused CANN operators on an Ascend NPU: checked, timed, and
put against what the device can do. This is the script an Ascend owner runs; the
same shape as ``kernels_gpu.py``.

Each operator runs through the pack's backends (the calls the engine makes), is
checked against the builtin torch implementation on the same inputs, and is timed
with NPU events (median of repeated runs after warm-up). Decode attention (dense and
DeepSeek-V3.2's sparse MLA) and the Lightning Indexer report
achieved bandwidth as a fraction of the measured copy bandwidth; prefill and MoE
report TFLOP/s as a fraction of the measured bf16 matmul peak; each row also gives
the torch peer's time.

    uv run python benchmarks/kernels_npu.py                   # on a machine with an Ascend NPU
    uv run python benchmarks/kernels_npu.py --smoke           # tiny shapes on the CPU with
                                                              # stand-in ops: checks only
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

import attrs
import torch
from common import report
from kernel_bench import (
    FULL,
    SMOKE,
    Bench,
    Row,
    Shapes,
    bench_gqa,
    bench_indexer,
    bench_mla,
    bench_moe,
    bench_sparse_mla,
    results_table,
)

from powertrain.components import Availability, PlatformInfo
from powertrain.interfaces import AttentionBackendContext, MoEBackendContext
from powertrain.interfaces.moe import RoutingConfig
from powertrain.layers.moe import route


def _npu_timer(fn: Callable[[], Any], warmup: int = 3, repeats: int = 20) -> float:
    """Median milliseconds of ``fn`` between NPU events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


#: DeepSeek-V3's routing (256 experts in 8 groups, keep 4, top-8), and a quarter of it for smoke runs.
V3_ROUTING = RoutingConfig(
    num_experts=256, top_k=8, scoring="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=4,
    norm_topk_prob=True, routed_scaling_factor=2.5,
)  # fmt: skip
SMOKE_ROUTING = attrs.evolve(V3_ROUTING, num_experts=64, top_k=4, n_group=4, topk_group=2)


def bench_routing(bench: Bench, shapes: Shapes, moe: Any) -> Row:
    """npu_moe_gating_top_k against the core's torch routing."""
    config = SMOKE_ROUTING if bench.smoke else V3_ROUTING
    support = moe.routing_support(config)
    shape = (
        f"{shapes.tokens} tokens, top-{config.top_k} of {config.num_experts}, "
        f"{config.n_group} groups keep {config.topk_group}, noaux_tc"
    )
    if not support.available:
        return Row("moe gating top-k (DeepSeek-V3)", shape, f"not served: {support.reason}")
    logits = bench.randn(shapes.tokens, config.num_experts, dtype=torch.float32)
    bias = bench.randn(config.num_experts, dtype=torch.float32, scale=0.1)
    ids, weights = moe.route(logits, config, bias)
    want_ids, want_weights = route(logits, config, bias)
    order, want_order = ids.long().sort(dim=1), want_ids.long().sort(dim=1)
    same = torch.equal(order.values.cpu(), want_order.values.cpu())
    err = float((weights.float().gather(1, order.indices) - want_weights.gather(1, want_order.indices)).abs().max())
    check = f"ok (same experts, weight err {err:.1e})" if same and err < 1e-3 else f"FAIL (same={same}, err {err:.1e})"
    ms = bench.time_ms(lambda: moe.route(logits, config, bias))
    peer_ms = bench.time_ms(lambda: route(logits, config, bias))
    return Row("moe gating top-k (DeepSeek-V3)", shape, check, ms, peer_ms=peer_ms)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU with the stand-in operators")
    args = parser.parse_args()
    from powertrain.builtin.bucketed_attention import BucketedAttention
    from powertrain.builtin.grouped_moe import TorchGroupedMoE
    from powertrain.builtin.reference_attention import TorchReferenceAttention
    from powertrain_cann_ascend.attention import AscendAttention
    from powertrain_cann_ascend.moe import AscendMoE

    if args.smoke:
        # No NPU here: the torch stand-ins of the operators (written from their documentation).
        from powertrain_cann_ascend.testing.standins import StandInOps

        ops, device, shapes, timer = StandInOps(), torch.device("cpu"), SMOKE, None
    else:
        from powertrain_cann_ascend.ops import npu_ops
        from powertrain_cann_ascend.support import detect_npu

        platform_info = detect_npu()
        if not platform_info.available:
            parser.error(f"no usable Ascend NPU: {platform_info.availability.reason} (or use --smoke)")
        ops, device, shapes, timer = npu_ops(), torch.device("npu"), FULL, _npu_timer
    # The operators' documented limits: paged blocks of 128, MLA latent 512 + rope 64, the
    # indexer's 64 heads of 128.
    shapes = attrs.evolve(shapes, block_size=128, kv_lora_rank=512, rope=64, index_heads=64, index_dim=128)
    platform = PlatformInfo(name="npu", device_type=device.type, availability=Availability.yes("benchmark"))
    dtype = torch.bfloat16
    attention = AscendAttention(
        AttentionBackendContext(platform=platform, device=device, dtype=dtype, block_size=shapes.block_size), ops
    )
    moe = AscendMoE(MoEBackendContext(platform=platform, device=device, dtype=dtype), ops)
    bucketed, reference, grouped = BucketedAttention(), TorchReferenceAttention(), TorchGroupedMoE(dtype)

    bench = Bench(device, args.smoke, timer)
    bandwidth = 1.0 if args.smoke else bench.copy_bandwidth()
    peak = 1.0 if args.smoke else bench.matmul_peak(fp8=False)
    rows = [
        bench_gqa(bench, shapes, attention, bucketed, True, bandwidth, peak),
        bench_gqa(bench, shapes, attention, bucketed, False, bandwidth, peak),
        bench_mla(bench, shapes, attention, reference, bandwidth),
        bench_sparse_mla(bench, shapes, attention, reference, bandwidth),
        bench_indexer(bench, shapes, attention, reference, bandwidth),
        bench_moe(bench, shapes, moe, grouped, False, peak),
        bench_routing(bench, shapes, moe),
    ]
    results: dict[str, Any] = {}
    if not args.smoke:
        results["device"] = platform_info.device_name
        results["measured copy bandwidth"] = f"{bandwidth / 1e9:.0f} GB/s"
        results["measured matmul peak"] = f"bf16 {peak / 1e12:.0f} TFLOP/s"
    results.update(results_table(rows))
    report(
        "powertrain-cann-ascend operators" + (" (smoke: stand-in ops on CPU, checks only)" if args.smoke else ""),
        results,
    )
    return 1 if any(row.check.startswith("FAIL") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
