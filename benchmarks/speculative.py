"""Speculative decoding policies on SmolLM2 with the n-gram drafter (and, given
``--block-drafter <folder>``, DeepSeek's DSpark block drafter), at several concurrencies.

The workload is one where drafts are useful: each request asks the model to repeat a
paragraph of its prompt, so prompt lookup finds what the model writes next. For each
policy — no speculation, fixed-k (k = 1..5), DSpark, and DSpark with synchronous steps
(``dspark-sync``: ``speculative_overlap = "off"``, with the step-time profile the ``dspark``
engine measured, so that only the overlap differs; every other row overlaps the engine
thread's scheduling and output work with the step on the device) — one engine serves the same
requests at concurrency 1, 4, 16 and 64 (a closed loop: a new request starts when one
finishes; greedy, 64 output tokens each), after the same warm-up on other prompts. The
engines stay loaded and take turns; each cell is the median of ``--repeats`` runs.
DSpark's confidences are first calibrated (per-position temperature scaling, as
``powertrain-dspark calibrate`` does) on a verification log of other prompts.
With ``--block-drafter`` (a folder ``powertrain-dspark train-drafter`` wrote) the rows
``fixed-K-block`` (fixed-k, K = the drafter's block size unless named otherwise) and
``dspark-block`` draft with it; its confidences, its own confidence head's (trained against
acceptance on the drafter's training text), are calibrated the same way on a log of this
workload's other prompts.
Printed per policy and concurrency: output
tokens/s, draft tokens verified per request-step and tokens accepted per request-step
(a request-step is one decoding step of one request that could speculate).

    uv run python benchmarks/speculative.py
    uv run python benchmarks/speculative.py --block-drafter ~/.cache/powertrain/drafters/smollm2-block \
        --draft-quantization q8
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import attrs
from common import report

from powertrain import LLM, SamplingParams
from powertrain.config import EngineConfig
from powertrain.llm import apply_overrides
from powertrain.log_setup import configure_logging

SUBJECTS = "the river|the old mill|a small village|the northern road|the harbour|the library|a quiet garden".split("|")
VERBS = "runs past|stands beside|looks over|leads to|hides behind|opens onto|turns toward".split("|")
DETAILS = (
    "in the early morning light|after the long winter|where the children play|"
    "beyond the stone bridge|under a grey sky|near the market square|at the end of the valley"
).split("|")


def paragraph(rng: random.Random) -> str:
    sentences = [
        f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)} {rng.choice(SUBJECTS)} {rng.choice(DETAILS)}."
        for _ in range(rng.randint(3, 5))
    ]
    return " ".join(sentences)


def prompts(llm: LLM, count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    result = []
    for _ in range(count):
        text = paragraph(rng)
        messages = [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{text}"}]
        result.append(llm.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return result


def closed_loop(llm: LLM, requests: list[str], concurrency: int, max_tokens: int) -> dict[str, float]:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    before = engine.stats()
    pending = list(requests)
    active = 0
    produced = 0
    started = time.perf_counter()
    while pending or active:
        while pending and active < concurrency:
            engine.add_request(pending.pop(0), params)
            active += 1
        for output in engine.step():
            if output.finished:
                active -= 1
                produced += len(output.outputs[0].token_ids)
    elapsed = time.perf_counter() - started
    after = engine.stats()
    steps = after.speculative_request_steps - before.speculative_request_steps
    verified = after.speculative_verified_tokens - before.speculative_verified_tokens
    accepted = after.speculative_accepted_tokens - before.speculative_accepted_tokens
    return {
        "tok/s": produced / elapsed,
        "verified/req-step": verified / steps if steps else 0.0,
        "accepted/req-step": accepted / steps if steps else 0.0,
    }


def calibrate(args: argparse.Namespace, drafter: dict[str, object]) -> str:
    """DSpark's intended setup: per-position temperatures fitted (``powertrain-dspark
    calibrate``'s functions) on a verification log of other prompts, written by fixed-k
    verifying every drafted position so that no position goes unobserved. ``drafter``: the
    ``[dspark]`` keys naming the drafter (and its drafts per step)."""
    from powertrain_dspark.calibration import Calibration, fit, read_log, split, survival_ece

    folder = Path(tempfile.mkdtemp(prefix="powertrain-dspark-calibration-"))
    log = folder / "verifications.jsonl"
    overrides = {"speculative": "fixed-k", "dtype": args.dtype, "max_num_seqs": 16, "memory_gib": args.kv_gib}
    config = attrs.evolve(apply_overrides(EngineConfig(), overrides), sections={"dspark": {**drafter, "log": str(log)}})
    with LLM(config=config) as llm:
        closed_loop(llm, prompts(llm, 48, seed=args.seed + 2), 8, args.max_tokens)
    fitting, held = split(read_log(log), 0.3, args.seed)
    calibration = fit(fitting)
    before, after = survival_ece(held, Calibration()), survival_ece(held, calibration)
    named = drafter.get("drafter", "ngram")
    print(f"calibration ({named} drafter): temperatures {[round(t, 3) for t in calibration.temperatures]}")
    print(f"held-out survival ECE per position before {before} after {after}", flush=True)
    calibration.save(folder / "calibration.json")
    return str(folder / "calibration.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests-per-slot", type=int, default=2, help="requests = max(8, this × concurrency)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--policies",
        nargs="+",
        default=["none", "fixed-1", "fixed-2", "fixed-3", "fixed-4", "fixed-5", "dspark", "dspark-sync"],
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--warmup-requests", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell (the median is reported)")
    parser.add_argument("--kv-gib", type=float, default=1.0, help="KV cache per engine (all stay loaded)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-drafter", help="a DSpark block drafter folder: adds fixed-K-block and dspark-block")
    parser.add_argument(
        "--draft-quantization",
        choices=["none", "q8"],
        default="none",
        help="[dspark] draft_quantization of the block rows",
    )
    parser.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="DSpark on raw confidences instead of ones calibrated on held-out prompts first",
    )
    args = parser.parse_args()
    if args.block_drafter:
        block = json.loads((Path(args.block_drafter).expanduser() / "config.json").read_text())["block_size"]
        args.policies += [p for p in (f"fixed-{block}-block", "dspark-block") if p not in args.policies]
    elif any(p.endswith("-block") for p in args.policies):
        parser.error("the -block policies need --block-drafter")
    dspark_rows = {"dspark", "dspark-sync"} & set(args.policies)
    calibration = calibrate(args, {"max_draft_tokens": 5}) if args.calibrate and dspark_rows else ""
    block_calibration = ""
    drafter: dict[str, object] = {}
    if args.block_drafter:
        drafter = {
            "drafter": "block",
            "draft_model": str(Path(args.block_drafter).expanduser()),
            "draft_quantization": args.draft_quantization,
        }
    if args.calibrate and "dspark-block" in args.policies:
        block_calibration = calibrate(args, {**drafter, "max_draft_tokens": block})

    engines: dict[str, LLM] = {}
    for policy in args.policies:
        speculative, section = "none", {}
        if policy.startswith("fixed-"):
            speculative, section = "fixed-k", {"max_draft_tokens": int(policy.split("-")[1])}
        elif policy in ("dspark", "dspark-sync"):
            speculative, section = "dspark", {"calibration": calibration} if calibration else {}
        elif policy == "dspark-block":
            speculative, section = "dspark", {"calibration": block_calibration} if block_calibration else {}
        if policy.endswith("-block"):
            section |= drafter
            if policy == "dspark-block":
                section["max_draft_tokens"] = block
        overrides = {"speculative": speculative, "dtype": args.dtype, "max_num_seqs": max(args.concurrency)}
        overrides["speculative_overlap"] = "off" if policy == "dspark-sync" else "on"
        config = apply_overrides(EngineConfig(), {**overrides, "memory_gib": args.kv_gib})
        if policy == "dspark-sync" and "dspark" in engines:  # the same step-time profile: only the overlap differs
            measured = engines["dspark"].speculative_policy.sps.seconds  # type: ignore[union-attr]
            section["steps_per_second"] = [[n, q, 1.0 / seconds] for (n, q), seconds in measured.items()]
        if section:
            config = attrs.evolve(config, sections={"dspark": section})
        llm = engines[policy] = LLM(config=config)
        # Warm-up on other prompts: the engine has been serving a while (DSpark's n-gram
        # confidences are acceptance rates learned online; every policy gets the same).
        closed_loop(llm, prompts(llm, args.warmup_requests, seed=args.seed + 1), 4, args.max_tokens)

    # All engines stay loaded and take turns (in a rotating order), so slow drifts of a
    # shared machine hit every policy alike; each cell is the median of its repeats.
    results: dict[str, dict[int, dict[str, float]]] = {policy: {} for policy in engines}
    for concurrency in args.concurrency:
        runs: dict[str, list[dict[str, float]]] = {policy: [] for policy in engines}
        for repeat in range(args.repeats):
            order = list(engines)[repeat % len(engines) :] + list(engines)[: repeat % len(engines)]
            for policy in order:
                llm = engines[policy]
                requests = prompts(llm, max(8, args.requests_per_slot * concurrency), seed=args.seed)
                runs[policy].append(closed_loop(llm, requests, concurrency, args.max_tokens))
        for policy, measured in runs.items():
            measured.sort(key=lambda row: row["tok/s"])
            results[policy][concurrency] = measured[len(measured) // 2]
            print(policy, concurrency, [round(row["tok/s"], 1) for row in measured], flush=True)
    for llm in engines.values():
        llm.shutdown()

    flat: dict[str, object] = {}
    for concurrency in args.concurrency:
        others = [results[p][concurrency]["tok/s"] for p in results if not p.startswith("dspark")]
        for policy in results:
            row = results[policy][concurrency]
            flat[f"c={concurrency} {policy}"] = (
                f"{row['tok/s']:.1f} tok/s, verified {row['verified/req-step']:.2f}, "
                f"accepted {row['accepted/req-step']:.2f} per request-step"
            )
        if "dspark" in results and others:
            flat[f"c={concurrency} dspark / best other"] = results["dspark"][concurrency]["tok/s"] / max(others)
        if {"dspark", "dspark-sync"} <= set(results):
            overlapped, synchronous = (results[p][concurrency]["tok/s"] for p in ("dspark", "dspark-sync"))
            flat[f"c={concurrency} dspark overlapped / synchronous"] = overlapped / synchronous
        if "dspark-block" in results and others:
            flat[f"c={concurrency} dspark-block / best other"] = results["dspark-block"][concurrency]["tok/s"] / max(
                others
            )
    drafters = "n-gram and DSpark block drafters" if args.block_drafter else "n-gram drafter"
    report(f"speculative decoding policies, {drafters}, SmolLM2 (repeat-the-paragraph workload)", flat)


if __name__ == "__main__":
    configure_logging("warning")  # a script is the application: LLM leaves logging to it
    main()
