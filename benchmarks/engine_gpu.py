"""The whole engine on an NVIDIA GPU: powertrain-cuda-sm100 against the builtin torch backends.

A tiny random DeepSeek-V3 (MLA + MoE, written here) serves 16 requests of 4-300 prompt
tokens, 24 greedy tokens each, four ways: float32 with the torch backends (the
reference), float32 with Triton attention, bfloat16 with the torch backends and
bfloat16 with Triton attention and MoE. Printed: the wall time of each (after a
warm-up that compiles the kernels) and how many outputs equal the reference, whole and
at the first token. bfloat16 runs diverge from float32 on a random model's near-ties;
the torch bfloat16 row says how much of that is rounding.

    uv run python benchmarks/engine_gpu.py        # on a machine with an NVIDIA GPU (sm_90+)
"""

from __future__ import annotations

import tempfile
import time

import torch
from common import report

from powertrain import LLM, SamplingParams
from powertrain.log_setup import configure_logging
from powertrain.testing.checkpoints import write_tiny_deepseek

RUNS = {
    "fp32 torch": {"dtype": "float32", "attention": "torch-reference", "moe": "torch-grouped"},
    "fp32 triton attention": {"dtype": "float32", "attention": "triton-sm100", "moe": "torch-grouped"},
    "bf16 torch": {"dtype": "bfloat16", "attention": "torch-reference", "moe": "torch-grouped"},
    "bf16 triton": {"dtype": "bfloat16", "attention": "triton-sm100", "moe": "triton-sm100"},
}


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs an NVIDIA GPU")
    path = str(write_tiny_deepseek(tempfile.mkdtemp(prefix="powertrain-engine-gpu-")))
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 300, (16,), generator=g).tolist()
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens: dict[str, list[list[int]]] = {}
    results: dict[str, object] = {}
    for name, settings in RUNS.items():
        with LLM(path, memory_gib=2.0, **settings) as llm:
            llm.generate(prompts, params)  # compiles the kernels for every shape the run meets
            torch.cuda.synchronize()
            started = time.perf_counter()
            outputs = llm.generate(prompts, params)
            results[f"{name} seconds"] = round(time.perf_counter() - started, 3)
        tokens[name] = [o.outputs[0].token_ids for o in outputs]
    reference = tokens["fp32 torch"]
    for name in list(RUNS)[1:]:
        same = sum(a == b for a, b in zip(tokens[name], reference, strict=True))
        first = sum(a[0] == b[0] for a, b in zip(tokens[name], reference, strict=True))
        results[f"{name} vs fp32 torch"] = f"{same}/16 outputs identical, {first}/16 first tokens"
    report("powertrain engine on a GPU, tiny DeepSeek-V3: triton-sm100 vs torch backends", results)


if __name__ == "__main__":
    configure_logging("warning")  # a script is the application: LLM leaves logging to it
    main()
