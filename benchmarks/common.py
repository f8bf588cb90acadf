"""Shared by the benchmarks: what machine this is, how results are printed, and driving one
in-process engine step by step (prefill a request, then decode with several engines taking turns)."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

import torch

from powertrain.bench.report import cpu_model

if TYPE_CHECKING:
    from powertrain import LLM
    from powertrain.engine.engine import LLMEngine


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


def engine_of(llm: LLM) -> LLMEngine:
    from powertrain.engine.engine import LLMEngine

    if not isinstance(llm.engine, LLMEngine):
        raise SystemExit("this benchmark times an in-process engine (no data/expert parallelism)")
    return llm.engine


def prefill(llm: LLM, prompt: list[int], max_tokens: int, images: list[Any] | None = None) -> float:
    """Queue ``prompt`` (with ``images``, one per image placeholder) and step until its first
    token is sampled; the seconds that took."""
    from powertrain import SamplingParams

    engine = engine_of(llm)
    extra = {"images": images} if images else {}
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), **extra)
    started = time.perf_counter()
    while not any(output.outputs[0].token_ids for output in engine.step()):
        if not engine.has_unfinished_requests():
            raise SystemExit("the request finished without a token")
    return time.perf_counter() - started


def decode_in_turns(llms: dict[str, LLM], rounds: int, warmup: int, steps: int) -> dict[str, dict[str, float]]:
    """Decode the prefilled request of every engine ``rounds * (warmup + steps)`` tokens, one
    engine step per token, the engines taking turns by blocks of ``warmup + steps`` steps (the
    first engine of a round alternates), so that a busy spell of a shared machine falls on all
    alike. Only the last ``steps`` steps of each block are timed: a block's first steps pay for
    the handover (each engine has its own device thread, and on CPU torch's OpenMP workers of the
    other one may still be spinning). Per engine: median, p10 and p90 of the timed steps (ms)."""
    names = list(llms)
    durations: dict[str, list[float]] = {name: [] for name in names}
    for turn in range(rounds):
        for name in names if turn % 2 == 0 else names[::-1]:
            engine = engine_of(llms[name])
            for step in range(warmup + steps):
                before = time.perf_counter()
                outputs = engine.step()
                elapsed = time.perf_counter() - before  # its token is on the host: the device is done
                if len(outputs) != 1:
                    raise SystemExit(f"{name}: a decode step produced {len(outputs)} outputs, not 1")
                if step >= warmup:
                    durations[name].append(elapsed)
    for name in names:
        if engine_of(llms[name]).has_unfinished_requests():
            raise SystemExit(f"{name}: the request outlived its {rounds * (warmup + steps)} decode steps")
    result = {}
    for name, measured in durations.items():
        timed = sorted(measured)
        result[name] = {
            "decode_ms": 1e3 * statistics.median(timed),
            "p10_ms": 1e3 * timed[len(timed) // 10],
            "p90_ms": 1e3 * timed[-1 - len(timed) // 10],
        }
    return result
