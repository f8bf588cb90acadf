"""Long-context decoding on DeepSeek-V3.2: sparse attention (Lightning Indexer + top-k) vs dense MLA.

A tiny random DeepSeek-V3.2 (``write_tiny_deepseek_v32``, V3's tiny shape plus the indexer,
``index_topk`` 2048 as in the real model, positions up to 32k) is loaded twice, in the same
process: as ``DeepseekV32ForCausalLM`` (each query's MLA reads only the ``index_topk`` tokens
the indexer picks) and as ``DeepseekV3ForCausalLM`` from a copy of the same checkpoint without
the ``*.indexer.*`` tensors (dense MLA over the whole context, the same weights otherwise).
Before timing, both must produce the same greedy tokens from a prompt shorter than
``index_topk``, where sparse attention reads every token.

For each context length both engines prefill one request of that many random prompt tokens,
then decode it greedily one token per engine step, the engines taking turns (``--rounds``
blocks each, so that a busy spell of a shared machine falls on both alike). Scheduling is
synchronous, so a step's wall time is the whole engine path: schedule, forward, sample,
detokenize. Printed per context: the median ms per decode step of each model, dense/sparse of
the medians and of the 10th percentiles (the steps a busy machine slowed least), and the
prefill seconds; with ``--repeats`` each cell is the median over repeats. Also the KV cache
bytes per token summed over layers, per cache group, as the engine accounted them when it
allocated the cache: MLA's latent and rope (the backend's group), the indexer's keys (the
model's ``indexer`` group) and their total.

Both engines use the same attention backend (``--attention``, default ``torch-reference``,
today the only one serving sparse MLA), so the ratio compares the two attention paths, not
two implementations. With a tiny model the fixed part of a step (MoE, lm_head, the engine
loop) is large next to attention, and the tiny indexer (16 heads x 32) is about as costly
per token as the tiny MLA it prunes (4 heads x 80): the ratio says how the reference code
scales with context, not what DeepSeek-V3.2 gains with its kernels. Prefill takes most of the
run: the reference sparse MLA gathers ``index_topk`` latents for every prompt token.

    uv run python benchmarks/long_context_v32.py                        # 4k, 8k, 16k on CPU
    uv run python benchmarks/long_context_v32.py --contexts 1024 2048   # a quick check
    uv run python benchmarks/long_context_v32.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from common import decode_in_turns, engine_of, prefill, report
from safetensors.torch import load_file, save_file

from powertrain import LLM, SamplingParams
from powertrain.layers.attention import MLAAttention
from powertrain.log_setup import configure_logging
from powertrain.testing.checkpoints import TINY_DEEPSEEK_V32_CONFIG, write_tiny_deepseek_v32

#: The real DeepSeek-V3.2's top-k: a quarter of 8k, an eighth of 16k.
INDEX_TOPK = 2048
#: Positions the tiny model accepts (prompt + decoded tokens); the default 512 is too short.
MAX_POSITIONS = 32768
BLOCK_SIZE = 16


def dense_copy(sparse: Path, folder: Path) -> Path:
    """``sparse``'s checkpoint as DeepSeek-V3: the same tensors but the indexer's, the same
    config with V3's architecture and V3.2's fixed routing spelled out (V3 reads it from the
    config; V3.2 hard-codes it)."""
    folder.mkdir(parents=True, exist_ok=True)
    for file in sparse.iterdir():
        if file.suffix == ".safetensors":
            tensors = {name: t for name, t in load_file(file).items() if ".indexer." not in name}
            save_file(tensors, folder / file.name, metadata={"format": "pt"})
        elif file.name == "model.safetensors.index.json":
            index = json.loads(file.read_text())
            index["weight_map"] = {k: v for k, v in index["weight_map"].items() if ".indexer." not in k}
            (folder / file.name).write_text(json.dumps(index, indent=2))
        elif file.name == "config.json":
            config = json.loads(file.read_text())
            config = {key: value for key, value in config.items() if not key.startswith("index_")}
            config |= {
                "architectures": ["DeepseekV3ForCausalLM"],
                "model_type": "deepseek_v3",
                "scoring_func": "sigmoid",
                "topk_method": "noaux_tc",
                "num_nextn_predict_layers": 0,
            }
            (folder / file.name).write_text(json.dumps(config, indent=2))
        elif file.is_file():
            (folder / file.name).write_bytes(file.read_bytes())
    return folder


def cache_bytes_per_token(llm: LLM) -> dict[str, float]:
    """Bytes one token takes in the KV cache, summed over layers, per cache group, as the
    engine accounted it when it allocated the cache (``LLMEngine.kv_cache``)."""
    return {group["name"]: group["bytes_per_token"] for group in engine_of(llm).kv_cache["groups"]}


def backend_name(llm: LLM) -> str:
    names = {m.backend.name for m in engine_of(llm).runner.model.modules() if isinstance(m, MLAAttention)}
    return ",".join(sorted(names))


def same_tokens(sparse: LLM, dense: LLM, index_topk: int) -> bool | str:
    """Whether both models' greedy tokens agree on a sequence (prompt and output) no longer than
    ``index_topk``: the indexer then selects every token, so both attend alike."""
    length = min(64, index_topk - 16)
    if length < 1:
        return "not checked (index_topk <= 16)"
    prompt = torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    [a], [b] = sparse.generate([prompt], params), dense.generate([prompt], params)
    return a.outputs[0].token_ids == b.outputs[0].token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384], help="prompt lengths")
    parser.add_argument("--rounds", type=int, default=8, help="turns of decode steps per engine and run")
    parser.add_argument("--steps", type=int, default=12, help="timed decode steps per turn")
    parser.add_argument("--warmup-steps", type=int, default=3, help="untimed decode steps opening each turn")
    parser.add_argument("--repeats", type=int, default=1, help="runs per cell, engines taking turns (median)")
    parser.add_argument("--index-topk", type=int, default=INDEX_TOPK)
    parser.add_argument("--device", default="auto", help="platform: auto, cpu, cuda")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attention", default="torch-reference", help="attention backend of both engines")
    parser.add_argument("--prefill-chunk", type=int, default=1024, help="max_num_batched_tokens (bounds memory)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="folder for the tiny checkpoints (temp)")
    args = parser.parse_args()
    decoded = args.rounds * (args.warmup_steps + args.steps)  # tokens each run decodes
    if max(args.contexts) + 1 + decoded > MAX_POSITIONS:
        raise SystemExit(f"with {decoded} decoded tokens, contexts up to {MAX_POSITIONS - 1 - decoded} tokens")

    root = args.checkpoint or Path(tempfile.mkdtemp(prefix="powertrain-long-context-v32-"))
    # YaRN's stretch stays the tiny model's (factor 4), now over MAX_POSITIONS positions.
    rope = {**TINY_DEEPSEEK_V32_CONFIG["rope_parameters"], "original_max_position_embeddings": MAX_POSITIONS // 4}
    sparse_path = write_tiny_deepseek_v32(
        root / "v32", max_position_embeddings=MAX_POSITIONS, rope_parameters=rope, index_topk=args.index_topk
    )
    config = json.loads((sparse_path / "config.json").read_text())
    dense_path = dense_copy(sparse_path, root / "v3-dense")
    settings: dict[str, Any] = {
        "platform": args.device,
        "dtype": args.dtype,
        "attention": args.attention,
        "async_scheduling": False,  # one step = one forward: its wall time is that step's
        "prefix_caching": False,  # every run prefills its whole prompt
        "max_num_seqs": 1,
        "max_num_batched_tokens": args.prefill_chunk,
        "num_blocks": -(-(max(args.contexts) + 1 + decoded) // BLOCK_SIZE),
        "cache__block_size": BLOCK_SIZE,
    }
    engines = {"sparse": LLM(str(sparse_path), **settings), "dense": LLM(str(dense_path), **settings)}
    try:
        agree = same_tokens(engines["sparse"], engines["dense"], args.index_topk)
        if agree is False:
            raise SystemExit("sparse and dense models disagree where the indexer keeps every token")
        names = list(engines)
        cells: dict[int, dict[str, list[dict[str, float]]]] = {}
        for context in args.contexts:
            prompt = torch.randint(3, 500, (context,), generator=torch.Generator().manual_seed(context)).tolist()
            cells[context] = {name: [] for name in engines}
            for repeat in range(args.repeats):
                order = {name: engines[name] for name in (names if repeat % 2 == 0 else names[::-1])}
                seconds = {name: prefill(llm, prompt, 1 + decoded) for name, llm in order.items()}
                runs = decode_in_turns(order, args.rounds, args.warmup_steps, args.steps)
                for name, run in runs.items():
                    run["prefill_s"] = seconds[name]
                    cells[context][name].append(run)
                    print(
                        f"context {context} {name}: {run['decode_ms']:.2f} ms/step "
                        f"(p10 {run['p10_ms']:.2f}, p90 {run['p90_ms']:.2f}), prefill {run['prefill_s']:.1f} s",
                        flush=True,
                    )
        sparse_bytes, dense_bytes = (cache_bytes_per_token(engines[name]) for name in ("sparse", "dense"))
        backends = {name: backend_name(llm) for name, llm in engines.items()}
    finally:
        for llm in engines.values():
            llm.shutdown()

    def median(context: int, name: str, key: str) -> float:
        return statistics.median(run[key] for run in cells[context][name])

    mla = sparse_bytes["attention"]  # the backend's latent + rope
    indexer = sparse_bytes.get("indexer", 0)
    columns = ["context", "sparse ms/step", "dense ms/step", "dense/sparse", "dense/sparse p10"]
    columns += ["prefill s sparse", "prefill s dense", "KV MiB sparse", "KV MiB dense"]
    print("  ".join(f"{c:>{max(8, len(c))}}" for c in columns))
    for context in args.contexts:
        sparse_ms, dense_ms = median(context, "sparse", "decode_ms"), median(context, "dense", "decode_ms")
        cells_shown = [str(context), f"{sparse_ms:.2f}", f"{dense_ms:.2f}", f"{dense_ms / sparse_ms:.2f}"]
        cells_shown += [f"{median(context, 'dense', 'p10_ms') / median(context, 'sparse', 'p10_ms'):.2f}"]
        cells_shown += [f"{median(context, name, 'prefill_s'):.1f}" for name in ("sparse", "dense")]
        cells_shown += [f"{context * total / 2**20:.1f}" for total in (mla + indexer, sum(dense_bytes.values()))]
        print("  ".join(f"{v:>{max(8, len(c))}}" for v, c in zip(cells_shown, columns, strict=True)))
    print(
        f"KV cache bytes/token (all {config['num_hidden_layers']} layers): MLA latent+rope {mla}, "
        f"indexer keys {indexer}, total {mla + indexer} (dense model: {sum(dense_bytes.values())})"
    )

    results: dict[str, Any] = {
        "model": (
            f"tiny DeepSeek-V3.2: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
            f"{config['num_attention_heads']} MLA heads (latent {config['kv_lora_rank']} + rope "
            f"{config['qk_rope_head_dim']}), indexer {config['index_n_heads']} heads x {config['index_head_dim']}, "
            f"index_topk {config['index_topk']}, {args.dtype}"
        ),
        "attention backend": f"sparse {backends['sparse']}, dense {backends['dense']}",
        "greedy tokens equal below index_topk": agree,
    }
    for context in args.contexts:
        sparse_ms, dense_ms = median(context, "sparse", "decode_ms"), median(context, "dense", "decode_ms")
        results[f"{context} sparse ms/step"] = sparse_ms
        results[f"{context} dense ms/step"] = dense_ms
        results[f"{context} dense/sparse"] = dense_ms / sparse_ms
        results[f"{context} p10 ms/step (sparse, dense)"] = (
            f"{median(context, 'sparse', 'p10_ms'):.2f}, {median(context, 'dense', 'p10_ms'):.2f}"
        )
        results[f"{context} prefill s (sparse, dense)"] = (
            f"{median(context, 'sparse', 'prefill_s'):.1f}, {median(context, 'dense', 'prefill_s'):.1f}"
        )
    results["kv bytes/token MLA latent+rope (all layers)"] = mla
    results["kv bytes/token indexer keys (all layers)"] = indexer
    results["kv bytes/token total, sparse model"] = mla + indexer
    results["kv bytes/token total, dense model"] = sum(dense_bytes.values())
    report(f"DeepSeek-V3.2 long-context decode: sparse vs dense MLA, contexts {args.contexts}", results)


if __name__ == "__main__":
    configure_logging("warning")  # a script is the application: LLM leaves logging to it
    main()
