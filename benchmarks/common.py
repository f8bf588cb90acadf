"""Shared by the benchmarks: what machine this is, and how results are printed."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import sys
from typing import Any

import torch

from powertrain.bench.report import cpu_model


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu_model() or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        # the widest vector ISA torch's CPU kernels use here (AVX2, AVX512, ...)
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
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


def quantised_tensors(model: torch.nn.Module) -> int:
    """How many integer-coded weights ``model`` holds (as parameters, buffers or plain
    attributes, including ``QuantizedWeight``): whether "keep" really kept anything."""
    from powertrain.interfaces.quantized import QuantizedWeight

    found = 0
    for module in model.modules():
        values = [*module.parameters(recurse=False), *module.buffers(recurse=False), *vars(module).values()]
        for value in values:
            coded = isinstance(value, torch.Tensor) and value.dtype in (torch.uint8, torch.int8)
            found += isinstance(value, QuantizedWeight) or coded
    return found


def llama_cpp_python(given: str | None) -> str | None:
    """The Python that runs the llama.cpp peer: ``given`` (``--llama-cpp-python``), else this
    one if it has llama-cpp-python, else None (a benchmark-only peer, never a dependency)."""
    if given:
        return given
    return sys.executable if importlib.util.find_spec("llama_cpp") is not None else None
