"""How much does prefix caching save on multi-turn chat?

Replays 16 conversations of 6 turns, where each turn resends the whole history (as
chat APIs do), once with prefix caching on and once off, in the same process on the
same model. Reports the share of prompt tokens served from the cache and the mean
time to first token of each run, and their ratio.

    uv run python benchmarks/prefix_cache.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from common import report

from powertrain import LLM, SamplingParams
from powertrain.log_setup import configure_logging

TOPICS = [
    "volcanoes",
    "the history of tea",
    "prime numbers",
    "sailing",
    "bread baking",
    "black holes",
    "chess openings",
    "honey bees",
    "the Roman empire",
    "solar panels",
    "jazz",
    "glaciers",
    "octopuses",
    "origami",
    "the printing press",
    "rain forests",
    "bicycles",
    "coffee",
]
FOLLOW_UPS = [
    "Tell me more about that.",
    "Why is that?",
    "Can you give an example?",
    "What is a common misconception about it?",
    "Summarise that in one sentence.",
    "What should a beginner know?",
    "How did that change over time?",
]


def conversations(count: int, turns: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    return [
        [f"Let's talk about {rng.choice(TOPICS)}. What is it?"] + [rng.choice(FOLLOW_UPS) for _ in range(turns - 1)]
        for _ in range(count)
    ]


def replay(llm: LLM, user_turns: list[list[str]], max_tokens: int) -> dict[str, float]:
    """Every turn of every conversation, one request at a time; returns TTFT and cache stats."""
    histories: list[list[dict[str, str]]] = [[] for _ in user_turns]
    ttfts: list[float] = []
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    stats = llm.engine.block_manager.stats
    queried, hits = stats.queried_tokens, stats.hit_tokens
    prompt_tokens = 0
    started = time.perf_counter()
    for turn in range(len(user_turns[0])):
        for history, turns in zip(histories, user_turns, strict=True):
            history.append({"role": "user", "content": turns[turn]})
            [output] = llm.chat(history, params)
            history.append({"role": "assistant", "content": output.outputs[0].text})
            ttfts.append(output.metrics["time_to_first_token_s"])
            prompt_tokens += len(output.prompt_token_ids)
    return {
        "mean_ttft_s": statistics.mean(ttfts),
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": stats.hit_tokens - hits,
        "cache_hit_rate": (stats.hit_tokens - hits) / max(1, stats.queried_tokens - queried),
        "wall_s": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=48, help="assistant reply length per turn")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    user_turns = conversations(args.conversations, args.turns, args.seed)
    results: dict[str, float] = {}
    for caching in (True, False):
        with LLM(args.model, prefix_caching=caching) as llm:
            llm.generate("warm up", SamplingParams(max_tokens=2))
            run = replay(llm, user_turns, args.max_tokens)
        label = "on" if caching else "off"
        results.update({f"{key} (caching {label})": value for key, value in run.items()})
    results["ttft speed-up (off / on)"] = results["mean_ttft_s (caching off)"] / results["mean_ttft_s (caching on)"]
    report(f"prefix cache: {args.conversations} conversations x {args.turns} turns, {args.model}", results)


if __name__ == "__main__":
    configure_logging("warning")  # a script is the application: LLM leaves logging to it
    main()
