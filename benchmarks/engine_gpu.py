"""The whole engine on a GPU against HF transformers' batched ``generate`` on the same device.

Two models, random weights or the embedded checkpoint, so nothing is downloaded:

* ``deepseek-v3``: DeepSeek-V3's shape (hidden 7168, 128 MLA heads with q/kv LoRA 1536/512,
  experts of 2048, 8 of them per token in 8 groups, one shared) with fewer layers
  (``--layers``, the first dense) and routed experts (``--experts``), written by
  ``powertrain.testing.checkpoints`` in bfloat16; the tiny tokenizer's 512-token vocabulary.
  ``--shape tiny`` writes the test suite's tiny model instead (a smoke run on a CPU).
* ``smollm2``: the embedded SmolLM2-135M GGUF, which both engines dequantise.
* ``smollm2-shape``: SmolLM2-135M's shape (30 layers, hidden 576, 9 query and 3 kv heads)
  with random weights and the tiny tokenizer's 512-token vocabulary, in bfloat16: the
  same model where the GGUF cannot travel (a GPU machine without the package).

Each engine serves ``c`` requests at once (``--concurrency``, default 1, 16 and 64) of
``--prompt-len`` random prompt tokens and ``--max-tokens`` greedy output tokens (EOS
ignored; equal prompt lengths, so HF needs no padding). Printed per row: output tokens/s
of each engine and powertrain's ratio to HF, after a warm-up run of each shape.
powertrain runs twice: eager (``cuda_graphs = "off"``) and with its decode steps
captured as CUDA graphs (``"on"``); the row says how many outputs of the two agree.

Where powertrain's step time goes, at the largest concurrency: the wall time of the run,
the device thread's share of it (``ModelRunner.execute``: inputs to the device, forward,
sampling, which ends in a host copy that waits for the GPU) and, on CUDA, the GPU's
kernel time from ``torch.profiler``. Wall time the device thread did not cover is host
work the engine did not overlap; device-thread time the kernels did not cover is Python
launching kernels and moving small inputs.

    uv run python benchmarks/engine_gpu.py                    # an NVIDIA GPU (sm_90+)
    uv run python benchmarks/engine_gpu.py --shape tiny --concurrency 1 4 --max-tokens 8   # smoke, CPU
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import report

from powertrain import LLM, SamplingParams
from powertrain.loader import resolve_model_path
from powertrain.log_setup import configure_logging
from powertrain.testing.checkpoints import write_tiny_deepseek


def deepseek_v3_shape(layers: int, experts: int) -> dict[str, Any]:
    """DeepSeek-V3's config values, but ``layers`` layers and ``experts`` routed experts."""
    return {
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": layers,
        "first_k_dense_replace": 1,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_routed_experts": experts,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "max_position_embeddings": 4096,
    }


def model_folder(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """(what ``LLM`` and HF load, HF ``from_pretrained`` keywords)."""
    if args.model == "smollm2":
        path = resolve_model_path("smollm2-135m").path
        return str(path), {"gguf_file": path.name}
    if args.model == "smollm2-shape":
        return str(smollm2_shaped(Path(tempfile.mkdtemp(prefix="powertrain-engine-gpu-")))), {}
    folder = Path(tempfile.mkdtemp(prefix="powertrain-engine-gpu-"))
    shape = deepseek_v3_shape(args.layers, args.experts) if args.shape == "v3" else {}
    started = time.perf_counter()
    write_tiny_deepseek(folder, num_nextn_predict_layers=0, dtype=torch.bfloat16, **shape)
    print(f"wrote {args.shape}-shaped DeepSeek-V3 in {time.perf_counter() - started:.1f} s: {folder}")
    return str(folder), {}


def smollm2_shaped(folder: Path) -> Path:
    """A random Llama of SmolLM2-135M's shape (its config.json values), vocabulary 512."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from powertrain.testing.checkpoints import TOKENIZER_VOCAB_SIZE, random_hf_model, save_with_tiny_tokenizer

    config = LlamaConfig(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        initializer_range=0.04,
        torch_dtype="bfloat16",
    )
    return save_with_tiny_tokenizer(random_hf_model(LlamaForCausalLM, config), folder)


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (count, length), generator=g).tolist()


def run_powertrain(path: str, args: argparse.Namespace, graphs: str) -> tuple[dict[str, Any], dict[int, list]]:
    """(results, each concurrency's outputs) with ``cuda_graphs = graphs``."""
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    results: dict[str, Any] = {}
    tokens: dict[int, list] = {}
    label = "eager" if graphs == "off" else "graphs"
    with LLM(path, dtype=args.dtype, prefix_caching=False, cuda_graphs=graphs) as llm:
        runner = llm.engine.runner
        execute, busy = runner.execute, [0.0]

        def timed(step: Any) -> Any:
            started = time.perf_counter()
            try:
                return execute(step)
            finally:
                busy[0] += time.perf_counter() - started

        runner.execute = timed  # the device thread looks it up per step
        for count in args.concurrency:
            batch = prompts(count, args.prompt_len)
            llm.generate(batch, params)  # warm-up: every shape this run meets (Triton compiles)
            busy[0] = 0.0
            started = time.perf_counter()
            outputs = llm.generate(batch, params)
            wall = time.perf_counter() - started
            assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outputs)
            tokens[count] = [list(o.outputs[0].token_ids) for o in outputs]
            results[f"c={count} powertrain {label} tok/s"] = count * args.max_tokens / wall
            if count in (min(args.concurrency), max(args.concurrency)):
                results[f"c={count} {label} wall s"] = wall
                results[f"c={count} {label} device thread share"] = busy[0] / wall
                if torch.cuda.is_available():
                    results[f"c={count} {label} GPU kernel share"] = kernel_seconds(llm, batch, params) / wall
        if llm.engine.runner.graphs is not None:
            results[f"{label} replayed steps"] = llm.engine.runner.graphs.replays
    return results, tokens


def kernel_seconds(llm: LLM, batch: list[list[int]], params: SamplingParams) -> float:
    """The GPU's kernel time over one more run of ``batch`` (torch.profiler, one stream)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(batch, params)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time_total for e in kernels) / 1e6


def run_hf(path: str, hf_kwargs: dict[str, Any], args: argparse.Namespace, device: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    folder = str(Path(path).parent) if hf_kwargs else path
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **hf_kwargs).to(device).eval()
    results: dict[str, Any] = {}
    for count in args.concurrency:
        ids = torch.tensor(prompts(count, args.prompt_len), device=device)
        for _ in range(2):  # the first is a warm-up
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=args.max_tokens,
                    min_new_tokens=args.max_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
            if device == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - started
        assert out.shape == (count, args.prompt_len + args.max_tokens)
        results[f"c={count} HF tok/s"] = count * args.max_tokens / wall
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("deepseek-v3", "smollm2", "smollm2-shape"), default="deepseek-v3")
    parser.add_argument("--shape", choices=("v3", "tiny"), default="v3")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    configure_logging("warning")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path, hf_kwargs = model_folder(args)
    shape = {"deepseek-v3": args.shape, "smollm2": "gguf", "smollm2-shape": "random weights"}[args.model]
    results = {"model": args.model, "shape": shape, "device": device}
    eager, eager_tokens = run_powertrain(path, args, "off")
    results |= eager
    if device == "cuda":
        graphs, graph_tokens = run_powertrain(path, args, "on")
        results |= graphs
        for count in args.concurrency:
            same = sum(a == b for a, b in zip(eager_tokens[count], graph_tokens[count], strict=True))
            results[f"c={count} graphs / eager"] = (
                results[f"c={count} powertrain graphs tok/s"] / results[f"c={count} powertrain eager tok/s"]
            )
            results[f"c={count} outputs equal to eager"] = f"{same}/{count}"
    results |= run_hf(path, hf_kwargs, args, device)
    best = "graphs" if device == "cuda" else "eager"
    for count in args.concurrency:
        results[f"c={count} powertrain ({best}) / HF"] = (
            results[f"c={count} powertrain {best} tok/s"] / results[f"c={count} HF tok/s"]
        )
    report(f"powertrain engine vs HF transformers batched generate ({device})", results)


if __name__ == "__main__":
    main()
