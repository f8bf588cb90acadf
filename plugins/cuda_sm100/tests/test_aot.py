"""Every kernel compiles ahead of time for sm_100a and sm_90a with the configs its
launcher uses, and the GEMMs use the tensor-core MMA of each (tcgen05 / wgmma).

Runs in a subprocess: this test session interprets kernels (TRITON_INTERPRET=1,
conftest.py), and interpreted kernels cannot be compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from powertrain_cuda_sm100.aot import MMA_INSTRUCTIONS


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "powertrain_cuda_sm100.aot", "100", "90"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert rows, f"the AOT compiler printed nothing (exit {done.returncode}):\n{done.stderr[-4000:]}"
    return rows


def test_every_kernel_compiles_for_both_targets(compiled: list[dict]) -> None:
    failures = [f"sm_{r['capability']} {r['kernel']}: {r['error']}" for r in compiled if not r["ok"]]
    assert not failures, "\n".join(failures)
    for capability in (100, 90):
        kernels = {r["kernel"] for r in compiled if r["capability"] == capability}
        assert {"rotary_cache_write", "rms_norm_residual_7168"} <= kernels, kernels
    # The two targets compile the same set of kernels.
    assert {r["kernel"] for r in compiled if r["capability"] == 100} == {
        r["kernel"] for r in compiled if r["capability"] == 90
    }


@pytest.mark.parametrize("capability", [100, 90])
def test_gemms_use_the_targets_tensor_core_mma(compiled: list[dict], capability: int) -> None:
    gemms = [r for r in compiled if r["capability"] == capability and r.get("mma_required")]
    # The MoE grouped GEMMs, bf16 and FP8, decode- and prefill-sized, must all be among them.
    moe = {f"{gemm}_{dtype}_{size}" for gemm in ("gate_up_silu", "down") for dtype in ("bf16", "fp8")
           for size in ("small", "large")}  # fmt: skip
    assert moe <= {r["kernel"] for r in gemms}, f"MoE GEMMs not marked mma=True for sm_{capability}"
    wanted = "tcgen05_mma" if capability == 100 else "wgmma"
    assert MMA_INSTRUCTIONS[capability // 10].replace(".", "_") == wanted
    missing = [r["kernel"] for r in gemms if not r[wanted]]
    assert not missing, f"PTX for sm_{capability} lacks {MMA_INSTRUCTIONS[capability // 10]} in {missing}"


#: Shared memory one thread block may use on these targets (227 KiB on Hopper and
#: Blackwell data-center parts); a kernel needing more fails to launch (OutOfResources).
SHARED_MEMORY_LIMIT = 232448


def test_every_kernel_fits_the_sms_shared_memory(compiled: list[dict]) -> None:
    """bf16 and float32 variants alike: an H200 refused float32 MLA and prefill tiles
    sized for bf16 (490 and 256 KiB) before their configs took the element size."""
    too_big = [
        f"sm_{r['capability']} {r['kernel']}: {r['shared_bytes']} bytes"
        for r in compiled
        if r["ok"] and r["shared_bytes"] > SHARED_MEMORY_LIMIT
    ]
    assert not too_big, f"more shared memory than an SM has ({SHARED_MEMORY_LIMIT} bytes):\n" + "\n".join(too_big)
    assert any(r["kernel"].endswith("_fp32") for r in compiled), "no float32 variant was compiled"
