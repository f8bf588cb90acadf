"""Offline throughput: powertrain against HF transformers on the same requests.

64 requests with prompt lengths 32-512 and max_tokens 16-256 (fixed seed) run
through powertrain, through HF ``generate`` with static batches (left padding), and
through HF's continuous-batching manager when the installed transformers has one,
on the same model, dtype and threads. Each engine runs in a fresh process of its own:
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
from common import report

from powertrain import LLM, SamplingParams
from powertrain.loader import resolve_model_path
from powertrain.log_setup import configure_logging


def workload(count: int, seed: int, vocab: int, min_prompt: int, max_prompt: int, min_out: int, max_out: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(min_prompt, max_prompt))] for _ in range(count)]
    max_tokens = [rng.randint(min_out, max_out) for _ in range(count)]
    return prompts, max_tokens


def run_powertrain(model: str, prompts, max_tokens, dtype: str) -> float:
    with LLM(model, dtype=dtype) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))  # warm up
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == sum(max_tokens), (produced, sum(max_tokens))
    return produced / elapsed


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


def run_engine(engine: str, args: argparse.Namespace, prompts, max_tokens) -> float | None:
    if engine == "powertrain":
        return run_powertrain(args.model, prompts, max_tokens, args.dtype)
    hf = load_hf(getattr(torch, args.dtype))
    if engine == "hf-static":
        return run_hf_static(hf, prompts, max_tokens, args.hf_batch_size, pad_id=2)
    return run_hf_continuous(hf, prompts, max_tokens)


def in_subprocess(engine: str) -> float | None:
    """This script with the same arguments, measuring only ``engine``: its last stdout line."""
    proc = subprocess.run(
        [sys.executable, *sys.argv, "--engine", engine], stdout=subprocess.PIPE, text=True, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="HF baselines use the embedded model only")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--max-tokens", type=int, nargs=2, default=(16, 256))
    # The same concurrency as powertrain (max_num_seqs 64); smaller batches waste less per batch.
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--skip-hf", action="store_true")

    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)  # one engine, in this process
    args = parser.parse_args()

    prompts, max_tokens = workload(args.requests, args.seed, 49152, *args.prompt_len, *args.max_tokens)
    if args.engine:
        print(json.dumps(run_engine(args.engine, args, prompts, max_tokens)))
        return
    results: dict[str, float | str] = {
        "requests": args.requests,
        "prompt tokens": sum(map(len, prompts)),
        "requested output tokens": sum(max_tokens),
    }
    rates = {engine: in_subprocess(engine) for engine in ENGINES if engine == "powertrain" or not args.skip_hf}
    ours = rates["powertrain"]
    results["powertrain output tok/s"] = ours
    if not args.skip_hf:
        static = rates["hf-static"]
        results[f"hf static (batch {args.hf_batch_size}) output tok/s"] = static
        results["ratio powertrain / hf static"] = ours / static
        continuous = rates["hf-continuous"]
        if continuous is None:
            results["hf continuous batching"] = "not in this transformers"
        else:
            results["hf continuous output tok/s"] = continuous
            results["ratio powertrain / hf continuous"] = ours / continuous
    report(f"offline throughput, {args.model}, {args.dtype}", results)


if __name__ == "__main__":
    configure_logging("warning")  # a script is the application: LLM leaves logging to it
    main()
