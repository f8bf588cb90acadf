"""Shared by the benchmarks: what machine this is, and how results are printed."""

from __future__ import annotations

import json
import os
import platform
import sys
from typing import Any

import torch


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": _cpu_model() or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def report(title: str, results: dict[str, Any]) -> None:
    """Print the command, the machine and the results (also as one JSON line)."""
    print(f"# {title}")
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"machine: {json.dumps(machine())}")
    width = max(len(key) for key in results)
    for key, value in results.items():
        shown = f"{value:.3f}" if isinstance(value, float) else value
        print(f"  {key:<{width}}  {shown}")
    print("json: " + json.dumps({"title": title, "machine": machine(), "results": results}))


def _cpu_model() -> str | None:
    """The CPU's model name (Linux): matmul speed depends on the vendor's libraries."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), None)
    except OSError:
        return None
