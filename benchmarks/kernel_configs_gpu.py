"""Tile configs of triton-sm100's latent-width decode kernels, timed on an NVIDIA GPU.

MLA, sparse MLA (V3.2) and V4 attention decode keep a program's heads x 512 float32
accumulators in registers; how many heads a program takes (``block_h``), how many keys
a tile (``block_n``), warps and pipeline stages decide whether they spill and how many
programs fill the SMs. Each candidate runs through the pack's own backend on
``kernels_gpu.py``'s full shapes (the same rows, checked against the torch peer) with
the kernel module's config function replaced; the committed configs are chosen from
this table.

    uv run python benchmarks/kernel_configs_gpu.py       # on a machine with an NVIDIA GPU
    TRITON_INTERPRET=1 uv run python benchmarks/kernel_configs_gpu.py --smoke   # CPU: checks only
"""

from __future__ import annotations

import sys
from typing import Any

import attrs
import torch
from common import report
from kernel_bench import Bench, bench_mla, bench_sparse_mla, bench_v4_attention
from kernels_gpu import _do_bench, setup, triton_attention

#: (block_h, block_n, num_warps, num_stages) candidates.
CANDIDATES = (
    (16, 32, 4, 2),
    (16, 64, 4, 2),
    (16, 32, 4, 3),
    (32, 32, 4, 2),
    (32, 64, 8, 2),
    (64, 16, 8, 2),
)


def main() -> int:
    smoke, device, shapes, platform = setup(__doc__.splitlines()[0])
    capability = platform.capability
    from powertrain.builtin.reference_attention import TorchReferenceAttention
    from powertrain_cuda_sm100.kernels import mla, sparse_mla, v4_attention

    attention = triton_attention(platform, device, shapes)
    reference = TorchReferenceAttention()
    bench = Bench(device, smoke, _do_bench)
    bandwidth = 1.0 if smoke else bench.copy_bandwidth()
    kernels = {
        "mla decode": (mla, "mla_config", lambda: bench_mla(bench, shapes, attention, reference, bandwidth)),
        "sparse mla decode": (
            sparse_mla,
            "sparse_mla_config",
            lambda: bench_sparse_mla(bench, shapes, attention, reference, bandwidth),
        ),
        "v4 csa decode": (
            v4_attention,
            "v4_attention_config",
            lambda: bench_v4_attention(bench, shapes, attention, reference, bandwidth, csa=True),
        ),
        "v4 hca decode": (
            v4_attention,
            "v4_attention_config",
            lambda: bench_v4_attention(bench, shapes, attention, reference, bandwidth, csa=False),
        ),
    }
    results: dict[str, Any] = {
        "device": "interpreter" if smoke else f"{torch.cuda.get_device_name()} (sm_{capability[0]}{capability[1]})",
        "measured copy bandwidth": f"{bandwidth / 1e9:.0f} GB/s",
    }
    for kernel, (module, name, run) in kernels.items():
        committed = getattr(module, name)
        results[f"{kernel} committed"] = _row(run())
        for block_h, block_n, warps, stages in CANDIDATES:
            label = f"{kernel} h{block_h} n{block_n} w{warps} s{stages}"

            def config(
                *args: Any, _base: Any = committed, _fields: tuple = (block_h, block_n, warps, stages), **kw: Any
            ) -> Any:
                fields = dict(zip(("block_h", "block_n", "num_warps", "num_stages"), _fields, strict=True))
                base = _base(*args, **kw)
                return attrs.evolve(base, **fields, **({"block_q": 1} if hasattr(base, "block_q") else {}))

            setattr(module, name, config)
            try:
                results[label] = _row(run())
            except Exception as exc:  # noqa: BLE001 - a config the device cannot launch is a result too
                results[label] = f"{type(exc).__name__}: {str(exc)[:120]}"
            finally:
                setattr(module, name, committed)
    report("triton-sm100 latent decode tile configs", results)
    return 1 if any("FAIL" in str(v) for v in results.values()) else 0


def _row(row: Any) -> str:
    if row.ms is None:
        return row.check
    return f"{row.check}; {row.ms:.3f} ms, {row.achieved} = {row.fraction:.2f} of peak"


if __name__ == "__main__":
    sys.exit(main())
