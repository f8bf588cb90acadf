"""benchmarks/kernels_gpu.py's checking path, on tiny shapes under the interpreter.

The script is meant for a machine with an NVIDIA GPU (there it also times every
kernel); ``--smoke`` runs the same calls and checks on the CPU, so a broken script is
found here rather than on a borrowed GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "kernels_gpu.py"
KERNELS = (
    "gqa decode",
    "gqa chunked prefill",
    "mla decode (absorbed)",
    "rotary + cache write + decode",
    "rmsnorm + residual",
    "moe grouped gemm (bf16)",
    "moe grouped gemm (fp8 e4m3 128-block)",
)


def test_smoke_run_checks_every_kernel() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke"],
        capture_output=True,
        text=True,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=SCRIPT.parent,
        timeout=600,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    lines = {line.strip().split("  ")[0]: line for line in done.stdout.splitlines() if line.startswith("  ")}
    for kernel in KERNELS:
        assert kernel in lines, f"no row for {kernel!r} in:\n{done.stdout}"
        assert ": ok (row err" in lines[kernel], lines[kernel]
