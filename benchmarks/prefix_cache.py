"""How much does prefix caching save on multi-turn chat?

Replays 16 conversations of 6 turns, where each turn resends the whole history (as
chat APIs do), once with prefix caching on and once off, in the same process on the
same model. Reports the share of prompt tokens served from the cache and the mean
time to first token of each run, and their ratio.

    uv run python benchmarks/prefix_cache.py

``--tiers``: the conversations' histories outgrow the device cache (``--device-blocks``,
about a quarter of them by default), and the conversations take turns, so device-only
caching has evicted a conversation's history by its next turn. Replayed with device
caching only, then with a host-memory tier and a directory tier below it, then once
more after a restart (a new engine on the same directory, each conversation's last
prompt): hit rates (per tier) and mean time to first token. A device cache that holds
everything gives the ceiling: the hit rate no tiering can beat on this workload.

    uv run python benchmarks/prefix_cache.py --tiers
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
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


def replay(
    llm: LLM, user_turns: list[list[str]], max_tokens: int, histories: list[list[dict[str, str]]] | None = None
) -> tuple[dict[str, float], list[list[dict[str, str]]]]:
    """Every turn of every conversation, one request at a time (each conversation's
    turn t after every conversation's turn t - 1); returns TTFT and cache stats, and the
    conversations. With ``histories`` (whole conversations), only each one's last
    prompt, once."""
    ttfts: list[float] = []
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    stats = llm.engine.block_manager.stats
    queried, hits, tiers = stats.queried_tokens, stats.hit_tokens, dict(stats.tier_hit_tokens)
    prompt_tokens = 0
    started = time.perf_counter()

    def ask(history: list[dict[str, str]]) -> str:
        nonlocal prompt_tokens
        [output] = llm.chat(history, params)
        ttfts.append(output.metrics["time_to_first_token_s"])
        prompt_tokens += len(output.prompt_token_ids)
        return output.outputs[0].text

    if histories is not None:
        for history in histories:
            ask(history[:-1])  # the last user turn, with everything before it
    else:
        histories = [[] for _ in user_turns]
        for turn in range(len(user_turns[0])):
            for history, turns in zip(histories, user_turns, strict=True):
                history.append({"role": "user", "content": turns[turn]})
                history.append({"role": "assistant", "content": ask(history)})
    queried_now = max(1, stats.queried_tokens - queried)
    result = {
        "mean_ttft_s": statistics.mean(ttfts),
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": stats.hit_tokens - hits,
        "cache_hit_rate": (stats.hit_tokens - hits) / queried_now,
        "wall_s": time.perf_counter() - started,
    }
    for tier, tokens in stats.tier_hit_tokens.items():
        result[f"hit rate from {tier}"] = (tokens - tiers.get(tier, 0)) / queried_now
    return result, histories


def tiered(args: argparse.Namespace, user_turns: list[list[str]]) -> None:
    """Device-only caching against host + directory tiers, then a restart (``--tiers``)."""
    results: dict[str, float] = {}
    device = {"num_blocks": args.device_blocks}
    with tempfile.TemporaryDirectory(prefix="powertrain-kv-") as directory:
        tiers = {**device, "host_memory_gib": args.host_gib, "kv_store": "directory", "store_path": directory}
        ceiling = {"num_blocks": args.device_blocks * 16}
        for label, settings in (("device only", device), ("host + directory", tiers), ("ceiling", ceiling)):
            with LLM(args.model, **settings) as llm:
                llm.generate("warm up", SamplingParams(max_tokens=2))
                run, histories = replay(llm, user_turns, args.max_tokens)
                block_size = llm.config.cache.block_size
            results.update({f"{key} ({label})": value for key, value in run.items()})
        with LLM(args.model, **{**tiers, "host_memory_gib": 0.0}) as llm:
            llm.generate("warm up", SamplingParams(max_tokens=2))
            run, _ = replay(llm, user_turns, args.max_tokens, histories)
        results.update({f"{key} (after a restart)": value for key, value in run.items()})
    history_tokens = results["prompt_tokens (after a restart)"]
    results["history / device cache (tokens)"] = history_tokens / (args.device_blocks * block_size)
    results["ttft speed-up (device only / tiers)"] = (
        results["mean_ttft_s (device only)"] / results["mean_ttft_s (host + directory)"]
    )
    title = f"prefix cache tiers: {len(user_turns)} conversations x {len(user_turns[0])} turns, {args.model}"
    report(title, results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=48, help="assistant reply length per turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiers", action="store_true", help="histories beyond the device cache, tiers below it")
    parser.add_argument("--device-blocks", type=int, default=40, help="--tiers: device cache blocks")
    parser.add_argument("--host-gib", type=float, default=0.05, help="--tiers: host-memory tier")
    args = parser.parse_args()

    user_turns = conversations(args.conversations, args.turns, args.seed)
    if args.tiers:
        tiered(args, user_turns)
        return
    results: dict[str, float] = {}
    for caching in (True, False):
        with LLM(args.model, prefix_caching=caching) as llm:
            llm.generate("warm up", SamplingParams(max_tokens=2))
            run, _ = replay(llm, user_turns, args.max_tokens)
        label = "on" if caching else "off"
        results.update({f"{key} (caching {label})": value for key, value in run.items()})
    results["ttft speed-up (off / on)"] = results["mean_ttft_s (caching off)"] / results["mean_ttft_s (caching on)"]
    report(f"prefix cache: {args.conversations} conversations x {args.turns} turns, {args.model}", results)


if __name__ == "__main__":
    configure_logging("warning")  # a script is the application: LLM leaves logging to it
    main()
