"""Offline throughput: powertrain against HF transformers on the same requests.

64 requests with prompt lengths 32-512 and max_tokens 16-256 (fixed seed) run
through powertrain, once with the GGUF weights dequantised to ``--dtype`` and once kept
quantised (``--quantization``; a row that fails prints why and the rest go on). HF
``generate`` with static batches (left padding) runs the same requests (``--hf-requests``:
all of them unless capped) on the same model, dtype and threads; HF's continuous-batching
manager, when the installed transformers has one, runs only the first
``--hf-continuous-requests`` (16): it is the slow one (about 45 tok/s on the 2-core Xeon;
with every HF run on all 64 the script once took over 25 minutes on the project's 2-core
dev box). Each powertrain row is also timed on each capped subset, and every ratio
compares like-for-like runs; the output says what was capped. The static baseline is not
capped because on 16 requests a quarter of every engine's decode steps carry a single
sequence (the longest request's tail): that measures batch-1 latency more than batching.
``--dtype all`` repeats everything in float32 and bfloat16. Each engine runs in a fresh process of its own:
torch's OpenMP thread pools belong to the thread that started them, and a second pool
in one process slows every later parallel op, so whichever engine ran second would be
handicapped. Output tokens/s counts only the tokens each request asked for (static
batches generate more for the shorter requests; those extra tokens are not counted).
EOS is ignored everywhere so every request runs its full length.

    uv run python benchmarks/offline_throughput.py
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time

import torch
from common import quantised_tensors, report

from powertrain import LLM, SamplingParams
from powertrain.loader import resolve_model_path
from powertrain.log_setup import configure_logging


def workload(count: int, seed: int, vocab: int, min_prompt: int, max_prompt: int, min_out: int, max_out: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(min_prompt, max_prompt))] for _ in range(count)]
    max_tokens = [rng.randint(min_out, max_out) for _ in range(count)]
    return prompts, max_tokens


def run_powertrain(model: str, prompts, max_tokens, dtype: str, quantization: str, subsets: list[int]) -> dict:
    """Output tok/s on all the requests, and on the first ``n`` of each of ``subsets`` (the
    HF engines' shares, keyed by ``n``)."""

    def rate(llm: LLM, count: int) -> float:
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens[:count]]
        started = time.perf_counter()
        outputs = llm.generate(prompts[:count], params)
        elapsed = time.perf_counter() - started
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        assert produced == sum(max_tokens[:count]), (produced, sum(max_tokens[:count]))
        return produced / elapsed

    # Prefix caching off: the subset run repeats prompts of the first run and would find
    # them cached (random prompts share no prefixes otherwise, so the first run loses nothing).
    with LLM(model, dtype=dtype, quantization=quantization, prefix_caching=False) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))  # warm up
        all_rate = rate(llm, len(prompts))
        subset_rates = {n: rate(llm, n) if n < len(prompts) else all_rate for n in sorted(set(subsets))}
        model_module = getattr(getattr(llm.engine, "runner", None), "model", None)
        kept = quantised_tensors(model_module) if isinstance(model_module, torch.nn.Module) else None
    return {"all": all_rate, "subsets": subset_rates, "quantised_tensors": kept}


def load_hf(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    path = resolve_model_path("smollm2-135m").path
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()


def run_hf_static(model, prompts, max_tokens, batch_size: int, pad_id: int) -> float:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # less padding: a favour to HF
    started = time.perf_counter()
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in batch)
        ids = torch.full((len(batch), width), pad_id)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(batch):
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        new = max(max_tokens[i] for i in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad_id,
            )
        assert out.shape[1] == width + new
    elapsed = time.perf_counter() - started
    return sum(max_tokens) / elapsed


def run_hf_continuous(model, prompts, max_tokens) -> float | None:
    if not hasattr(model, "init_continuous_batching"):
        return None
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(max_tokens), eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    started = time.perf_counter()
    for prompt, limit in zip(prompts, max_tokens, strict=True):
        manager.add_request(prompt, max_new_tokens=limit, eos_token_id=-1)
    produced = finished = 0
    while finished < len(prompts):  # results arrive in completion order, as in generate_batch
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("HF's continuous batching thread stopped before finishing")
            continue
        if result.is_finished():
            finished += 1
            produced += len(result.generated_tokens)
    elapsed = time.perf_counter() - started
    manager.stop(block=True)
    assert produced == sum(max_tokens), (produced, sum(max_tokens))
    return produced / elapsed


ENGINES = ("powertrain", "hf-static", "hf-continuous")
DTYPES = ("float32", "bfloat16")
QUANTIZATIONS = ("dequantize", "keep")


def hf_shares(args: argparse.Namespace) -> dict[str, int]:
    """How many of the requests each HF engine runs (the first ones)."""
    return {
        "hf-static": min(args.hf_requests, args.requests),
        "hf-continuous": min(args.hf_continuous_requests, args.requests),
    }


def run_engine(engine: str, args: argparse.Namespace, prompts, max_tokens) -> dict:
    shares = hf_shares(args)
    if engine == "powertrain":
        subsets = [] if args.skip_hf else list(shares.values())
        return run_powertrain(args.model, prompts, max_tokens, args.dtype, args.quantization, subsets)
    hf = load_hf(getattr(torch, args.dtype))
    prompts, max_tokens = prompts[: shares[engine]], max_tokens[: shares[engine]]
    if engine == "hf-static":
        return {"subset": run_hf_static(hf, prompts, max_tokens, args.hf_batch_size, pad_id=2)}
    return {"subset": run_hf_continuous(hf, prompts, max_tokens)}


def in_subprocess(engine: str, dtype: str, quantization: str = "dequantize") -> dict:
    """This script with the same arguments, measuring only ``engine`` (its last stdout line),
    with the seconds it took; ``{"error": why}`` when it failed."""
    command = [sys.executable, *sys.argv, "--engine", engine, "--dtype", dtype, "--quantization", quantization]
    print(f"running {engine} {dtype} {quantization if engine == 'powertrain' else ''}...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        why = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}, no output"]
        return {"error": why[0]}
    return {**json.loads(lines[-1]), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="HF baselines use the embedded model only")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--hf-requests", type=int, default=64, help="HF static batching runs the first N requests")
    parser.add_argument(
        "--hf-continuous-requests", type=int, default=16, help="HF continuous batching runs the first N (its time)"
    )
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--max-tokens", type=int, nargs=2, default=(16, 256))
    # The same concurrency as powertrain (max_num_seqs 64); smaller batches waste less per batch.
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=[*DTYPES, "all"])
    parser.add_argument(
        "--quantization", default="both", choices=[*QUANTIZATIONS, "both"], help="powertrain's GGUF weights"
    )
    parser.add_argument("--skip-hf", action="store_true")

    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)  # one engine, in this process
    args = parser.parse_args()

    prompts, max_tokens = workload(args.requests, args.seed, 49152, *args.prompt_len, *args.max_tokens)
    if args.engine:
        try:
            result = run_engine(args.engine, args, prompts, max_tokens)
        except Exception as error:  # the parent prints it as this row's result
            result = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(result))
        return
    shares = hf_shares(args)
    results: dict[str, float | str] = {
        "requests": args.requests,
        "prompt tokens": sum(map(len, prompts)),
        "requested output tokens": sum(max_tokens),
    }
    if not args.skip_hf:
        for engine, share in shares.items():
            if share < args.requests:
                results[f"capped {engine}"] = (
                    f"ran the first {share} requests ({sum(max_tokens[:share])} output tokens); "
                    f"its ratios compare powertrain on the same {share}"
                )
    dtypes = DTYPES if args.dtype == "all" else (args.dtype,)
    quantizations = QUANTIZATIONS if args.quantization == "both" else (args.quantization,)
    for dtype in dtypes:
        ours: dict[str, dict] = {}
        for quantization in quantizations:
            row = f"{dtype} powertrain ({quantization})"
            rate = in_subprocess("powertrain", dtype, quantization)
            if "error" in rate:
                results[row] = f"failed: {rate['error']}"
                continue
            ours[quantization] = rate
            results[f"{row} output tok/s"] = rate["all"]
            for share, subset_rate in rate["subsets"].items():  # keys: counts as JSON strings
                if int(share) < args.requests:
                    results[f"{row} output tok/s, first {share}"] = subset_rate
            results[f"{row} seconds"] = rate["seconds"]
            if quantization == "keep" and rate["quantised_tensors"] == 0:
                results[f"{row} note"] = "the model holds no quantised weights: 'keep' was not in effect"
        if args.skip_hf:
            continue
        for engine in ("hf-static", "hf-continuous"):
            row = f"{dtype} {engine}" + (f" (batch {args.hf_batch_size})" if engine == "hf-static" else "")
            theirs = in_subprocess(engine, dtype)
            if "error" in theirs:
                results[row] = f"failed: {theirs['error']}"
                continue
            if theirs["subset"] is None:
                results[row] = "not in this transformers"
                continue
            share = shares[engine]
            results[f"{row} output tok/s" + (f", first {share}" if share < args.requests else "")] = theirs["subset"]
            results[f"{row} seconds"] = theirs["seconds"]
            for quantization, rate in ours.items():
                ours_rate = rate["subsets"][str(share)]
                results[f"{dtype} ratio powertrain ({quantization}) / {engine}"] = ours_rate / theirs["subset"]
    report(f"offline throughput, {args.model}, {args.dtype}", results)


if __name__ == "__main__":
    configure_logging("warning")  # a script is the application: LLM leaves logging to it
    main()
