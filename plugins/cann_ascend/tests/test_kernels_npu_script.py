"""benchmarks/kernels_npu.py's checking path, on tiny shapes with the stand-in operators.

On an Ascend machine the script also times each operator; ``--smoke`` runs the same
calls and checks on the CPU (NPU and torch_npu mocked by the stand-ins), so a broken
script is found here rather than by an Ascend owner.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "kernels_npu.py"
ROWS = (
    "gqa decode",
    "gqa chunked prefill",
    "mla decode (absorbed)",
    "sparse mla decode (V3.2)",
    "moe grouped gemm (bf16)",
)


def test_smoke_run_checks_every_operator_path() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, cwd=SCRIPT.parent, timeout=600
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    lines = {line.strip().split("  ")[0]: line for line in done.stdout.splitlines() if line.startswith("  ")}
    for row in ROWS:
        assert row in lines, f"no row for {row!r} in:\n{done.stdout}"
        assert ": ok (row err" in lines[row], lines[row]
    assert ": ok (1.0000 of picks agree;" in lines["lightning indexer decode (V3.2)"]
    assert "moe gating top-k (DeepSeek-V3)" in lines and ": ok (same experts" in lines["moe gating top-k (DeepSeek-V3)"]
