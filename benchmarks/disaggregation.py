"""Prefill/decode disaggregation against colocated serving, under a mixed load.

Two data-parallel ranks serve the same open-loop load twice in one run: colocated (each
rank prefills and decodes its own requests) and disaggregated (``prefill_ranks = 1``:
rank 0 computes every prompt of at least ``prefill_rank_min_tokens`` (256) and publishes
its blocks to a directory store; rank 1 loads them and decodes everything, and computes
the shorter prompts itself). The load mixes long
prompts with short answers and short prompts with long answers, arriving at a fixed
interval. Reported per request class: mean and 90th-percentile time to first token
(TTFT, from submission) and inter-token latency (ITL, the gaps after the first token),
with the disaggregated/colocated ratio, and whether both runs produced the same tokens.

CPU numbers show a trend only: both ranks share this machine's cores (a thread each),
so a prefill on one rank still slows the other's decode through memory bandwidth, and
the hand-off goes through a local directory, not a fast interconnect.

    uv run python benchmarks/disaggregation.py
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from typing import Any

from common import report

from powertrain import LLM, AsyncEngine, SamplingParams
from powertrain.log_setup import configure_logging


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Requests in arrival order: every ``--long-every``-th has a long prompt."""
    rng = random.Random(args.seed)
    requests = []
    for index in range(args.requests):
        long = index % args.long_every == 0
        length = args.long_prompt if long else args.short_prompt
        prompt = [rng.randrange(100, vocab) for _ in range(length)]
        tokens = args.long_answer if not long else args.short_answer
        requests.append(("long" if long else "short", prompt, SamplingParams(temperature=0, max_tokens=tokens)))
    return requests


async def replay(engine: AsyncEngine, requests: list, interval_s: float) -> list[dict[str, Any]]:
    async def one(delay: float, kind: str, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
        await asyncio.sleep(delay)
        sent = time.perf_counter()
        times, final = [], None
        async for output in engine.generate(prompt, params):
            count = len(output.outputs[0].token_ids)
            times.extend([time.perf_counter()] * (count - len(times)))
            final = output
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        return {"kind": kind, "ttft": times[0] - sent, "gaps": gaps, "tokens": final.outputs[0].token_ids}

    tasks = [one(i * interval_s, *request) for i, request in enumerate(requests)]
    return await asyncio.gather(*tasks)


def serve(args: argparse.Namespace, settings: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    """Each request's timings, and the ranks' counts added up after the run."""
    with LLM(args.model, data_parallel=2, **settings) as llm:
        requests = workload(args, llm.tokenizer.vocab_size)
        engine = AsyncEngine(llm.engine)
        try:
            asyncio.run(replay(engine, requests[:4], 0.0))  # warm-up
            runs = asyncio.run(replay(engine, requests, args.interval))
            time.sleep(1.5)  # every rank reports its counts at least once a second; a last
            asyncio.run(replay(engine, requests[1:2], 0.0))  # short request reads those reports
            time.sleep(1.0)  # and the engine loop's next turn copies them
            return runs, engine.stats
        finally:
            engine.shutdown()


def summary(runs: list[dict[str, Any]], kind: str) -> dict[str, float]:
    mine = [run for run in runs if run["kind"] == kind]
    ttft = sorted(run["ttft"] for run in mine)
    gaps = sorted(gap for run in mine for gap in run["gaps"])
    return {
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
        "itl_mean_ms": 1000 * statistics.fmean(gaps),
        "itl_p90_ms": 1000 * gaps[int(0.9 * (len(gaps) - 1))],
        "itl_max_ms": 1000 * gaps[-1],  # the longest stall: a decode step held up by a prefill
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a checkpoint path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--long-every", type=int, default=3, help="every n-th request has a long prompt")
    parser.add_argument("--long-prompt", type=int, default=768, help="tokens")
    parser.add_argument("--short-prompt", type=int, default=24, help="tokens")
    parser.add_argument("--long-answer", type=int, default=48, help="tokens a short prompt asks for")
    parser.add_argument("--short-answer", type=int, default=8, help="tokens a long prompt asks for")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between arrivals")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="powertrain-pd-") as store:
        colocated, _ = serve(args, {})
        settings = {"prefill_ranks": 1, "kv_store": "directory", "store_path": store}
        disaggregated, stats = serve(args, settings)
    for kind in ("long", "short"):
        before, after = summary(colocated, kind), summary(disaggregated, kind)
        for key in before:
            results[f"{kind} prompts: {key} colocated"] = before[key]
            results[f"{kind} prompts: {key} disaggregated"] = after[key]
            results[f"{kind} prompts: {key} ratio (disaggregated/colocated)"] = after[key] / before[key]
    # The hand-off: what the prefill rank wrote to the store and the decode rank read back
    # (warm-up included), and the seconds both spent in the store's calls.
    results["hand-off MiB written"] = stats.kv_tier_bytes_written["directory"] / 2**20
    results["hand-off MiB read"] = stats.kv_tier_bytes_read["directory"] / 2**20
    results["hand-off store seconds (both ranks)"] = stats.kv_tier_seconds["directory"]
    results["prompt tokens loaded from the store"] = stats.prefix_cache_tier_hit_tokens["directory"]
    same = [a["tokens"] for a in colocated] == [b["tokens"] for b in disaggregated]
    results["same tokens in both runs"] = same
    title = (
        f"prefill/decode disaggregation vs colocated, 2 ranks, {args.requests} requests every {args.interval} s "
        f"(1 in {args.long_every}: {args.long_prompt}-token prompt, {args.short_answer} tokens out; others: "
        f"{args.short_prompt}-token prompt, {args.long_answer} tokens out), {args.model or 'SmolLM2-135M'}; "
        "CPU: trend only"
    )
    report(title, results)


if __name__ == "__main__":
    configure_logging("warning")  # a script is the application: LLM leaves logging to it
    main()
