"""Batch-1 greedy decode speed against the memory-bandwidth roofline.

At batch 1 every decoded token streams the whole set of weights it multiplies through
the CPU once, so decode speed is bounded by memory bandwidth / bytes read per token.
This script measures the machine's read bandwidth (a torch sum over a 1 GiB array, best
of a few), then decodes ``--tokens`` new tokens (EOS ignored) after the same prompt on the
embedded SmolLM2-135M-Instruct Q4_1 GGUF with each engine, and prints each engine's decode
tok/s (prefill excluded: the first token is timed on its own), the roofline for the bytes
that engine reads per token (its weights, and its KV cache at the run's mean context: the
prompt and half the new tokens), and the share of it reached:

* ``powertrain-dequantize``: ``LLM(quantization="dequantize")``, float32; reads every
  linear weight and the (tied) embedding matrix as the lm_head, 4 bytes per weight.
* ``powertrain-keep``: ``LLM(quantization="keep")``; reads the same matrices as stored in
  the GGUF file (Q4_1 blocks, the embedding in Q8_0).
* ``powertrain-keep-layerwise``: the same, with its layers called one by one instead of as
  the attention pack's fused decoder stack (what ``fused-decoder`` gains).
* ``hf``: transformers' ``generate`` on the same GGUF file, dequantised to float32 (its
  parameter bytes).
* ``llama.cpp``: llama-cpp-python on the GGUF file (its tensor bytes), when an interpreter
  with it installed is found: this one, or ``--llama-cpp-python`` (a benchmark-only peer,
  never a dependency).

Each engine runs in a fresh process of its own (offline_throughput.py says why: OpenMP
pools), with as many threads as torch uses here. A powertrain row also prints its resident
memory (VmRSS) before and after building the LLM and compares the growth to the bound
"2x the GGUF file size plus the KV cache". A row that fails prints why and the rest go on.

    uv run python benchmarks/decode.py [--tokens 128] [--engines powertrain-keep hf ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import llama_cpp_python, quantised_tensors, report

from powertrain.loader import resolve_model_path
from powertrain.loader.gguf_reader import read_gguf

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
ENGINES = ("powertrain-dequantize", "powertrain-keep", "powertrain-keep-layerwise", "hf", "llama.cpp")
KV_CACHE_GIB = 0.25  # small: the memory row compares weights, not a quarter of RAM of cache

LLAMA_CPP = """
import json, sys, time
from llama_cpp import Llama
path, threads, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompt = json.loads(sys.argv[4])
model = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=len(prompt) + tokens + 16,
              verbose=False)
def decode(count):
    model.reset()  # no prompt reuse from the previous run
    started, stamps = time.perf_counter(), []
    for _ in model.generate(prompt, temp=0.0, top_k=1, reset=True):  # never stops on EOS by itself
        stamps.append(time.perf_counter())
        if len(stamps) == count:
            return started, stamps
decode(2)  # warm up
started, stamps = decode(tokens)
print(json.dumps({"prefill_s": stamps[0] - started, "decode_s": stamps[-1] - stamps[0], "tokens": len(stamps)}))
"""


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second a torch sum reads from a ``gib`` GiB float32 array, best of ``repeats``."""
    data = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    data.sum()  # fault the pages in and start the thread pool
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.nbytes / best


def bytes_per_token(gguf: Path) -> dict[str, int]:
    """Weight bytes each engine streams per decoded token, from the GGUF tensor index.

    The matrices a token multiplies are every 2-D tensor: the linear weights, and the
    embedding matrix, which this model ties to the lm_head (the embedding lookup itself
    reads one row). The 1-D norm weights are all the file adds."""
    tensors = read_gguf(gguf).tensors
    matrices = [t for t in tensors if len(t.shape) == 2]
    return {
        "powertrain-dequantize": sum(t.n_elements for t in matrices) * 4,
        "powertrain-keep": sum(t.n_bytes for t in matrices),
        "powertrain-keep-layerwise": sum(t.n_bytes for t in matrices),
        "llama.cpp": sum(t.n_bytes for t in tensors),
        # "hf" comes from the child: its float32 parameter bytes (tied weights counted once)
    }


#: Bytes per element of each engine's KV cache: float32 for powertrain and HF (the model's
#: dtype here), llama.cpp's default f16.
KV_ELEMENT_BYTES = {
    "powertrain-dequantize": 4,
    "powertrain-keep": 4,
    "powertrain-keep-layerwise": 4,
    "hf": 4,
    "llama.cpp": 2,
}


def kv_elements_per_position(gguf: Path) -> int:
    """Key and value elements one cached position holds, over all layers (GQA: the kv heads)."""
    meta = read_gguf(gguf).metadata
    heads, kv_heads = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    head_dim = meta.get("llama.attention.key_length", meta["llama.embedding_length"] // heads)
    return meta["llama.block_count"] * 2 * kv_heads * head_dim


def rss_bytes(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def run_powertrain(quantization: str, prompt: list[int], tokens: int, layerwise: bool = False) -> dict[str, Any]:
    from powertrain import LLM, SamplingParams

    before = rss_bytes()
    with LLM(quantization=quantization, dtype="float32", memory_gib=KV_CACHE_GIB) as llm:
        loaded = rss_bytes()
        kv_gib = llm.engine.kv_cache.get("gib")
        model = getattr(getattr(llm.engine, "runner", None), "model", None)
        if layerwise:
            model.use_fused_decoder(None)
        kept = quantised_tensors(model) if isinstance(model, torch.nn.Module) else None
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # warm up
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        [output] = llm.generate([prompt], params)
        finished = time.monotonic()
        after_decode = rss_bytes()
    first = output.metrics["arrival_time"] + output.metrics["time_to_first_token_s"]
    return {
        "prefill_s": output.metrics["time_to_first_token_s"],
        "decode_s": finished - first,
        "tokens": len(output.outputs[0].token_ids),
        "rss_before": before,
        "rss_loaded": loaded,
        "rss_after_decode": after_decode,
        "rss_peak": rss_bytes("VmHWM"),
        "kv_cache_bytes": None if kv_gib is None else int(kv_gib * 2**30),
        "quantised_tensors": kept,
    }


def run_hf(prompt: list[int], tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    class Stamps(StoppingCriteria):
        """Called once per generated token: when each one was ready."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    path = resolve_model_path("smollm2-135m").path
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    weights = {p.data_ptr(): p.nbytes for p in model.parameters()}  # a tied weight once

    def decode(count: int) -> tuple[float, list[float]]:
        stamps = Stamps()
        ids = torch.tensor([prompt])
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=count,
                min_new_tokens=count,
                do_sample=False,
                pad_token_id=2,
                stopping_criteria=StoppingCriteriaList([stamps]),
            )
        return started, stamps.times

    decode(2)  # warm up
    started, times = decode(tokens)
    return {
        "prefill_s": times[0] - started,
        "decode_s": times[-1] - times[0],
        "tokens": len(times),
        "bytes_per_token": sum(weights.values()),
    }


def run_child(engine: str, args: argparse.Namespace, prompt: list[int]) -> dict[str, Any]:
    """``engine`` measured in a fresh process; its result, or {"error": why}."""
    if engine == "llama.cpp":
        python = llama_cpp_python(args.llama_cpp_python)
        if python is None:
            return {"error": "not installed (pip install llama-cpp-python, or pass --llama-cpp-python PYTHON)"}
        gguf = str(resolve_model_path("smollm2-135m").path)
        command = [python, "-c", LLAMA_CPP, gguf, str(args.threads), str(args.tokens), json.dumps(prompt)]
    else:
        command = [sys.executable, *sys.argv, "--engine", engine, "--prompt-ids", json.dumps(prompt)]
    proc = subprocess.run(command, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        why = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}, no output"]
        return {"error": why[0]}
    return json.loads(lines[-1])


def mib(count: float) -> str:
    return f"{count / 2**20:.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per run (EOS ignored)")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--llama-cpp-python", help="a Python with llama-cpp-python installed (default: this one)")
    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)  # one engine, in this process
    parser.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    if args.engine:  # a child: one engine, one JSON line
        prompt = json.loads(args.prompt_ids)
        try:
            if args.engine == "hf":
                result = run_hf(prompt, args.tokens)
            else:
                mode, _, layerwise = args.engine.removeprefix("powertrain-").partition("-")
                result = run_powertrain(mode, prompt, args.tokens, layerwise=layerwise == "layerwise")
        except Exception as error:  # the parent prints it as this row's result
            result = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(result))
        return

    gguf = resolve_model_path("smollm2-135m").path
    from powertrain.loader.gguf_tokenizer import tokenizer_from_gguf

    prompt = tokenizer_from_gguf(read_gguf(gguf).metadata, source=gguf.name).encode(PROMPT)
    bandwidth = read_bandwidth()
    streamed = bytes_per_token(gguf)
    # Each decoded token also reads every cached key and value: on average over the run, a
    # context of the prompt and half the new tokens.
    kv_positions = len(prompt) + args.tokens / 2
    kv_elements = kv_elements_per_position(gguf)
    file_bytes = os.path.getsize(gguf)
    results: dict[str, Any] = {
        "gguf": f"{gguf.name} ({mib(file_bytes)})",
        "prompt tokens": len(prompt),
        "new tokens": args.tokens,
        "threads": args.threads,
        "read bandwidth GB/s": bandwidth / 1e9,
    }
    for engine in args.engines:
        print(f"running {engine} ...", file=sys.stderr, flush=True)
        row = run_child(engine, args, prompt)
        if "error" in row:
            results[engine] = f"failed: {row['error']}"
            continue
        rate = (row["tokens"] - 1) / row["decode_s"]
        weights = row.get("bytes_per_token", streamed.get(engine, 0))
        kv_bytes = kv_elements * KV_ELEMENT_BYTES[engine] * kv_positions
        roofline = bandwidth / (weights + kv_bytes)
        results[f"{engine} decode tok/s"] = rate
        results[f"{engine} prefill+first token s"] = row["prefill_s"]
        results[f"{engine} roofline tok/s"] = (
            f"{roofline:.1f} ({mib(weights)} weights + {kv_bytes / 2**20:.1f} MiB cache per token)"
        )
        results[f"{engine} % of roofline"] = 100 * rate / roofline
        if "rss_loaded" in row:
            bound = 2 * file_bytes + (row["kv_cache_bytes"] or 0)
            growth = row["rss_loaded"] - row["rss_before"]
            results[f"{engine} RSS before / loaded / peak"] = (
                f"{mib(row['rss_before'])} / {mib(row['rss_loaded'])} / {mib(row['rss_peak'])}"
            )
            results[f"{engine} RSS growth vs bound"] = (
                f"{mib(growth)} vs {mib(bound)} (2x file + {mib(row['kv_cache_bytes'] or 0)} KV): "
                + ("within" if growth <= bound else "OVER")
            )
            if engine.startswith("powertrain-keep") and row["quantised_tensors"] == 0:
                results[f"{engine} note"] = "the model holds no quantised weights: 'keep' was not in effect"
    report(f"batch-1 greedy decode, {args.tokens} new tokens, float32 unless kept quantised", results)


if __name__ == "__main__":
    from powertrain.log_setup import configure_logging

    configure_logging("warning")  # a script is the application: LLM leaves logging to it
    main()
