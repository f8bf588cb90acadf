"""Data-parallel attention + expert-parallel MoE against one process, on a tiny DeepSeek-V3.

Each layout (data_parallel, expert_parallel) serves the same greedy workload (``--prompts``
prompts of 16-48 tokens, ``--max-tokens`` output tokens each, all submitted at once)
after a warm-up; printed per layout: output tokens/s, its ratio to (1, 1) measured in the
same run, and per rank the time spent in expert all-to-alls per lockstep round (a round
is one step of that rank: a forward, or an empty MoE pass while a peer computes).

CPU numbers are for trend only: on a small machine the ranks share its cores (each
worker gets cores / world_size threads) and gloo moves tensors through loopback TCP, so
(2, 2) measures the protocol's overhead, not the speed-up DP attention + EP MoE give on
accelerators with fast interconnects.

    uv run python benchmarks/parallel.py
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from common import report

from powertrain import LLM, SamplingParams
from powertrain.log_setup import configure_logging
from powertrain.testing.checkpoints import write_tiny_deepseek


def workload(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(16, 48))] for _ in range(count)]


def run(path: str, dp: int, ep: int, args: argparse.Namespace) -> dict[str, float]:
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with LLM(path, data_parallel=dp, expert_parallel=ep, dtype="float32", memory_gib=0.25) as llm:
        llm.generate(workload(4, seed=1), params)  # warm-up
        before = llm.engine.counters() if dp * ep > 1 else {}
        started = time.perf_counter()
        outputs = llm.generate(workload(args.prompts, seed=0), params)
        seconds = time.perf_counter() - started
        after = llm.engine.counters() if dp * ep > 1 else {}
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {"tok/s": tokens / seconds}
    for rank, counters in after.items():
        rounds = counters["rounds"] - before[rank]["rounds"]
        exchange = counters["exchange_s"] - before[rank]["exchange_s"]
        result[f"rank {rank} all-to-all ms/round"] = 1000 * exchange / max(rounds, 1)
        result[f"rank {rank} rounds"] = rounds
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=["1,1", "2,2"], help="data_parallel,expert_parallel pairs")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    folder = write_tiny_deepseek(tempfile.mkdtemp(prefix="powertrain-bench-v3-"))
    results: dict[str, object] = {}
    baseline = None
    for layout in args.layouts:
        dp, ep = (int(x) for x in layout.split(","))
        measured = run(str(folder), dp, ep, args)
        rate = measured.pop("tok/s")
        baseline = baseline or rate
        results[f"({dp},{ep}) output tok/s"] = round(rate, 1)
        results[f"({dp},{ep}) / first layout"] = round(rate / baseline, 3)
        for key, value in measured.items():
            results[f"({dp},{ep}) {key}"] = round(value, 3) if isinstance(value, float) else value
    report("DP attention + EP MoE, tiny DeepSeek-V3 on CPU (gloo; trend only)", results)


if __name__ == "__main__":
    configure_logging("warning")  # a script is the application: LLM leaves logging to it
    main()
