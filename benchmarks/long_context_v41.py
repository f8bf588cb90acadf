"""Long-context decoding of DeepSeek-V4.1 vs V4 vs V3 on CPU, and Engram's RSS at load.

**Part 1, long context.** Three tiny random checkpoints of the same hidden width (256) and depth
(6 layers), loaded side by side in one process:

- V4.1 (``write_tiny_deepseek_v41``): its tiny schedule (a window-only layer, a ratio-2 KV and
  index source and its reader, a ratio-1 KV, index and candidate source, a reader, an index
  source inside the candidates), with the release's ``sliding_window`` 128 and ``index_topk``
  512, and ``candidate_topk_blocks`` 256 of ``candidate_block_size`` 8 (the release's block
  size; its 2048 blocks would keep 16k entries, every entry of a 16k context). 2048 candidates
  over a ratio-1 group prune at 4k (to a half), 16k (an eighth) and 64k (a 32nd), and
  ``index_topk`` 512 then picks a quarter of them: both levels of the top-k cut at every
  default context. Engram as in the tiny model (layers 0 and 1, small tables).
- V4 (``write_tiny_deepseek_v4``): hidden 256 and the V4.1 model's head shapes (4 heads of 64
  with 16 rope dims, one KV head, q/o LoRA 64, 2 output groups, indexer 8 heads x 64, 4
  experts of 128, 2 per token), window 128, ``index_topk`` 512, the release's compression
  rates (CSA 4, HCA 128); layers: window-only, then CSA, HCA alternating.
- V3 (``write_tiny_deepseek``): dense MLA (4 heads, latent 64 + rope 16), hidden 256,
  6 layers (the first dense), no MTP layer.

All three take positions up to ``MAX_POSITIONS`` (131072) with the tiny models' YaRN stretch
(factor 4) over them: ``original_max_position_embeddings`` = 131072 / 4 = 32768 for every
model, the relation transformers checks for V4 and the one the V3.2 benchmark uses; the
release's V4.1 has factor 16 over 65536, a longer context than any run here reaches.

For each context every engine prefills one random prompt of that length (in chunks of
``--prefill-chunk`` tokens, which bounds the reference code's score matrices), then decodes
greedily one token per engine step, the engines taking turns (``common.decode_in_turns``), so
a busy spell of a shared machine falls on all three alike. Printed per context and model:
median ms per decode step (p10, p90), prefill seconds, KV cache bytes per token at that
context, and the ratios V3/V4.1 and V4/V4.1 of step time and of KV bytes per token. KV bytes
per token at context N come from the engine's own accounting (``LLMEngine.kv_cache``, the
startup "kv cache" event): (growing_bytes_per_token * N + sliding_bytes_per_sequence) / N,
where the sliding groups (windows, the ratio-2 compressor's open group, Engram's token ids)
hold a fixed amount per sequence; V3 keeps every token in every layer. V4.1's saving from
cross-layer sharing (``saved_by_sharing_bytes_per_token``: what the reader layers would hold
with their own copies) is printed too. The KV cache stores float32 here (``--dtype``), so
the bytes are four times the bf16 ones; the ratios do not change.

No greedy-token cross-check precedes the timing (the V3.2 benchmark compares sparse and dense
MLA below ``index_topk``): V4 and V4.1 have no dense twin with the same weights, and three
models with different weights share no answer to compare.

Time on this machine (2 AMD EPYC cores, AVX2, otherwise idle): the prefills dominate and grow
about quadratically with the context (the reference indexers score every entry, V3's MLA is
dense; V4's and V4.1's sparse layers gather each query's picks, so their attention grows with
``index_topk``). Measured prefill seconds, V4.1 / V4 / V3: 6.5 / 2.6 / 2.4 at 4k, 37 / 21 / 52
at 16k, 598 / 138 / 744 at 64k; the default run (4k and 16k, decode included) takes about 3
minutes, ``--contexts 4096 16384 65536`` 31 minutes (peak RSS unmeasured; a 512-token chunk's
indexer scores over 64k entries are ~1 GB per matrix, so lower ``--prefill-chunk`` if memory is
tight). Decode ms per step, same run: 29.0 / 29.5 / 14.1 at 4k, 55 / 44 / 30 at 16k, 140 / 64 /
143 at 64k; KV bytes per token (float32) 896 / 932 / 1920, 800 / 524 / 1920, 776 / 422 / 1920.
V4.1's decode step is spent in the reference indexer (every index source scores all its
entries with 8 heads and sorts them for a stable top-k); a backend's indexer kernel is where
it would shrink.

**Part 2, Engram RSS at load** (``--engram-gib``, 0 skips). A V4.1 of the tiny width whose one
Engram layer (layer 1) has a table of at least that many GiB: the tiny checkpoint is written
with a small Engram vocabulary, then a new ``model.safetensors`` is streamed to disk (header,
the small tensors, the scale, then the table in 64 MiB chunks of random e4m3 bytes without
the NaN codes, scale 1.0 everywhere), with ``engram_vocab_size`` set so the layout's table
rows cover the size and ``engram_num_embeddings`` set to them. The file is checked with
``safetensors.safe_open`` (every small tensor equal to the tiny one's, the table's shape and a
few of its rows). A fresh Python process then reads ``/proc/self/status`` (VmRSS, RssAnon,
RssFile) before ``LLM(path, dtype="float32")`` (a KV cache of 8 blocks, so that its
allocation stays out of the numbers), after it loaded, and after ``--engram-steps`` greedy decode
steps: growth at load as a fraction of the table's bytes (the target is under 10%: the table
is memory-mapped, never read), and growth after decoding against the distinct rows and 4 KiB
pages the steps read (recorded from the table's own gathers, and estimated as
(max_ngram - 1) * n_heads rows per token per Engram layer). The checkpoint goes under
``--workdir`` (a temporary folder under /tmp by default; free disk is checked first) and is
removed at the end unless ``--keep``. The table's pages are evicted from the page cache
after writing (a checkpoint read from disk): with the file still cached, ext4's large folios
let one row's fault map up to 2 MiB of the file into the process (``--warm-cache`` shows it).
Measured with 2 GiB: +47 MiB VmRSS at load (2.3% of the table; the table's map holds no
page), and 32 decode steps read 282 rows whose 562 table and scale pages (2.2 MiB) match the
2.2 MiB the map gained; with ``--warm-cache`` the same 282 rows mapped 534 MiB.

    uv run python benchmarks/long_context_v41.py                                 # 4k, 16k; 2 GiB Engram
    uv run python benchmarks/long_context_v41.py --contexts 4096 16384 65536     # 64k too (about 30 minutes)
    uv run python benchmarks/long_context_v41.py --contexts 1024 --engram-gib 0  # a quick check
    uv run python benchmarks/long_context_v41.py --contexts --engram-gib 4       # Engram only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import decode_in_turns, engine_of, prefill, report

from powertrain import LLM
from powertrain.layers.engram import EngramLayout
from powertrain.loader.mapped_rows import DTYPES as SAFETENSORS_DTYPES
from powertrain.log_setup import configure_logging
from powertrain.testing.checkpoints import TINY_DEEPSEEK_V4_CONFIG, write_tiny_deepseek, write_tiny_deepseek_v4
from powertrain.testing.deepseek_v41 import TINY_DEEPSEEK_V41_TEXT_CONFIG, write_tiny_deepseek_v41

#: Positions every model accepts (prompt + decoded tokens): above 64k.
MAX_POSITIONS = 131072
#: YaRN: the tiny models' factor over MAX_POSITIONS.
ROPE_FACTOR = 4.0
HIDDEN = 256
LAYERS = 6
#: The release's window and index top-k (V4 and V4.1 alike).
SLIDING_WINDOW = 128
INDEX_TOPK = 512
#: V4.1's candidate stage: 256 blocks of 8 ratio-1 entries (2048 candidates).
CANDIDATE_BLOCKS, CANDIDATE_BLOCK_SIZE = 256, 8
#: V4's compression rates, as released.
V4_CSA, V4_HCA = 4, 128
#: A multiple of every compression ratio (V4's HCA 128; V4.1's 1 and 2).
BLOCK_SIZE = 128
MODELS = ("V4.1", "V4", "V3")
MIB = 2**20
PAGE = 4096


# --------------------------------------------------------------------------- part 1


def write_checkpoints(root: Path) -> dict[str, Path]:
    yarn = {"beta_fast": 32.0, "beta_slow": 1.0, "factor": ROPE_FACTOR}
    original = int(MAX_POSITIONS / ROPE_FACTOR)
    v41 = write_tiny_deepseek_v41(
        root / "v41",
        max_position_embeddings=MAX_POSITIONS,
        rope_scaling={**TINY_DEEPSEEK_V41_TEXT_CONFIG["rope_scaling"], "original_max_position_embeddings": original},
        sliding_window=SLIDING_WINDOW,
        index_topk=INDEX_TOPK,
        candidate_topk_blocks=CANDIDATE_BLOCKS,
        candidate_block_size=CANDIDATE_BLOCK_SIZE,
    )
    text = TINY_DEEPSEEK_V41_TEXT_CONFIG
    v4 = write_tiny_deepseek_v4(
        root / "v4",
        seed=0,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        layer_types=["sliding_attention"]
        + ["compressed_sparse_attention", "heavily_compressed_attention"] * ((LAYERS - 1) // 2)
        + ["compressed_sparse_attention"] * ((LAYERS - 1) % 2),
        mlp_layer_types=["hash_moe"] * 2 + ["moe"] * (LAYERS - 2),
        compress_rates={"compressed_sparse_attention": V4_CSA, "heavily_compressed_attention": V4_HCA},
        head_dim=text["head_dim"],
        partial_rotary_factor=text["qk_rope_head_dim"] / text["head_dim"],
        q_lora_rank=text["q_lora_rank"],
        o_groups=text["o_groups"],
        o_lora_rank=text["o_lora_rank"],
        index_n_heads=text["index_n_heads"],
        index_head_dim=text["index_head_dim"],
        moe_intermediate_size=text["moe_intermediate_size"],
        n_routed_experts=text["n_routed_experts"],
        num_experts_per_tok=text["num_experts_per_tok"],
        sliding_window=SLIDING_WINDOW,
        index_topk=INDEX_TOPK,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={**TINY_DEEPSEEK_V4_CONFIG["rope_parameters"], "original_max_position_embeddings": original},
    )
    v3 = write_tiny_deepseek(
        root / "v3",
        seed=0,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_nextn_predict_layers=0,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": original,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            **yarn,
        },
    )
    return {"V4.1": v41, "V4": v4, "V3": v3}


def kv_bytes_per_token(cache: dict[str, Any], context: int) -> float:
    """Bytes per token of a ``context``-token sequence, from the engine's accounting: the
    full-history groups' bytes per token, plus the sliding groups' fixed amount spread over it."""
    if "growing_bytes_per_token" not in cache:  # every group keeps every token
        return float(cache["bytes_per_token"])
    return (cache["growing_bytes_per_token"] * context + cache["sliding_bytes_per_sequence"]) / context


def describe(name: str, path: Path) -> str:
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    shape = f"{text['num_hidden_layers']} layers, hidden {text['hidden_size']}, {text['num_attention_heads']} heads"
    if name == "V4.1":
        return (
            f"{shape} x {text['head_dim']}, compress_ratios {text['compress_ratios'][: text['num_hidden_layers']]}, "
            f"window {text['sliding_window']}, index_topk {text['index_topk']}, candidates "
            f"{text['candidate_topk_blocks']} blocks x {text['candidate_block_size']}, Engram layers "
            f"{text['engram_layer_ids']}"
        )
    if name == "V4":
        return (
            f"{shape} x {text['head_dim']}, {text['layer_types']}, compress_rates {text['compress_rates']}, "
            f"window {text['sliding_window']}, index_topk {text['index_topk']}"
        )
    return f"{shape}, dense MLA (latent {text['kv_lora_rank']} + rope {text['qk_rope_head_dim']})"


def long_context(args: argparse.Namespace, results: dict[str, Any]) -> None:
    decoded = args.rounds * (args.warmup_steps + args.steps)
    if max(args.contexts) + 1 + decoded > MAX_POSITIONS:
        raise SystemExit(f"with {decoded} decoded tokens, contexts up to {MAX_POSITIONS - 1 - decoded} tokens")
    root = args.checkpoint or Path(tempfile.mkdtemp(prefix="powertrain-long-context-v41-"))
    started = time.perf_counter()
    paths = write_checkpoints(root)
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
    engines = {name: LLM(str(paths[name]), **settings) for name in MODELS}
    print(f"checkpoints written and loaded in {time.perf_counter() - started:.0f} s", flush=True)
    cells: dict[int, dict[str, dict[str, float]]] = {}
    try:
        caches = {name: dict(engine_of(llm).kv_cache) for name, llm in engines.items()}
        for context in args.contexts:
            prompt = torch.randint(3, 500, (context,), generator=torch.Generator().manual_seed(context)).tolist()
            seconds = {}
            for name, llm in engines.items():
                seconds[name] = prefill(llm, prompt, 1 + decoded)
                print(f"context {context} {name}: prefill {seconds[name]:.1f} s", flush=True)
            runs = decode_in_turns(engines, args.rounds, args.warmup_steps, args.steps)
            for name, run in runs.items():
                run["prefill_s"] = seconds[name]
                run["kv_bytes_per_token"] = kv_bytes_per_token(caches[name], context)
                print(
                    f"context {context} {name}: {run['decode_ms']:.2f} ms/step "
                    f"(p10 {run['p10_ms']:.2f}, p90 {run['p90_ms']:.2f}), "
                    f"KV {run['kv_bytes_per_token']:.1f} B/token",
                    flush=True,
                )
            cells[context] = runs
    finally:
        for llm in engines.values():
            llm.shutdown()

    columns = ["context", "model", "ms/step", "p10", "p90", "prefill s", "KV B/token", "x V4.1 step", "x V4.1 KV"]
    widths = [max(9, len(c)) for c in columns]
    print("  ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)))
    for context, runs in cells.items():
        base = runs["V4.1"]
        for name, run in runs.items():
            shown = [str(context), name, f"{run['decode_ms']:.2f}", f"{run['p10_ms']:.2f}", f"{run['p90_ms']:.2f}"]
            shown += [f"{run['prefill_s']:.1f}", f"{run['kv_bytes_per_token']:.1f}"]
            shown += [f"{run['decode_ms'] / base['decode_ms']:.2f}"]
            shown += [f"{run['kv_bytes_per_token'] / base['kv_bytes_per_token']:.2f}"]
            print("  ".join(f"{v:>{w}}" for v, w in zip(shown, widths, strict=True)))

    for name in MODELS:
        results[f"model {name}"] = describe(name, paths[name])
    results["settings"] = (
        f"{args.dtype}, attention {args.attention}, block {BLOCK_SIZE}, prefill chunk {args.prefill_chunk}, "
        f"{args.rounds} rounds x ({args.warmup_steps} untimed + {args.steps} timed) decode steps"
    )
    for name in MODELS:
        cache = caches[name]
        groups = ", ".join(f"{g['name']} ({g['retention']}) {g['bytes_per_token']:g}" for g in cache["groups"])
        results[f"kv groups {name} (bytes/token, all layers)"] = groups
        if "growing_bytes_per_token" in cache:
            results[f"kv {name} growing B/token, sliding B/sequence"] = (
                f"{cache['growing_bytes_per_token']:g}, {cache['sliding_bytes_per_sequence']:g}"
            )
    v41 = caches["V4.1"]
    results["kv V4.1 saved by cross-layer sharing B/token"] = (
        f"{v41.get('saved_by_sharing_bytes_per_token', 0):g} "
        f"(unshared {v41.get('unshared_bytes_per_token', v41['bytes_per_token']):g}, "
        f"shared {v41['bytes_per_token']:g}, every group counted as keeping every token)"
    )
    for context, runs in cells.items():
        base = runs["V4.1"]
        for name, run in runs.items():
            results[f"{context} {name} ms/step (p10, p90)"] = (
                f"{run['decode_ms']:.2f} ({run['p10_ms']:.2f}, {run['p90_ms']:.2f})"
            )
        for name, run in runs.items():
            results[f"{context} {name} prefill s"] = run["prefill_s"]
        for name, run in runs.items():
            results[f"{context} {name} KV B/token"] = run["kv_bytes_per_token"]
        for name in ("V3", "V4"):
            results[f"{context} {name}/V4.1 step time (median, p10)"] = (
                f"{runs[name]['decode_ms'] / base['decode_ms']:.2f}, {runs[name]['p10_ms'] / base['p10_ms']:.2f}"
            )
            results[f"{context} {name}/V4.1 KV B/token"] = runs[name]["kv_bytes_per_token"] / base["kv_bytes_per_token"]
    results["long-context part s"] = time.perf_counter() - started


# --------------------------------------------------------------------------- part 2

#: The big table's layer, and its tensors' names.
ENGRAM_LAYER = 1
TABLE = f"layers.{ENGRAM_LAYER}.engram.embed"
CHUNK = 64 * MIB
#: safetensors' dtype names for the torch dtypes the tiny checkpoint holds.
ST_DTYPES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def engram_vocab_for(table_bytes: int, text: dict[str, Any]) -> tuple[int, int]:
    """The smallest-ish ``engram_vocab_size`` whose layout gives one layer a table of at least
    ``table_bytes`` (rows of ``engram_head_dim`` bytes), and those rows."""
    columns = (text["engram_max_ngram_size"] - 1) * text["engram_n_heads"]
    need = -(-table_bytes // text["engram_head_dim"])
    vocab = need // columns
    while True:
        layout = EngramLayout.build(
            [ENGRAM_LAYER], text["engram_max_ngram_size"], text["engram_n_heads"], text["engram_head_dim"], vocab
        )
        rows = layout.table_rows[0]
        if rows >= need:
            return vocab, rows
        vocab += -(-(need - rows) // columns)


def write_big_engram(folder: Path, gib: float) -> dict[str, Any]:
    """A tiny-width V4.1 with one Engram layer whose table takes ``gib`` GiB, streamed to disk."""
    from safetensors import safe_open

    small = write_tiny_deepseek_v41(folder / "small", engram_layer_ids=[ENGRAM_LAYER])
    config = json.loads((small / "config.json").read_text())
    text = config["text_config"]
    head_dim, groups = text["engram_head_dim"], text["engram_head_dim"] // 32
    vocab, rows = engram_vocab_for(int(gib * 2**30), text)
    text["engram_vocab_size"], text["engram_num_embeddings"] = vocab, [rows]
    big = folder / "big"
    big.mkdir(parents=True, exist_ok=True)
    for file in small.iterdir():
        if file.name not in ("config.json", "model.safetensors") and not file.name.startswith("powertrain_tiny"):
            shutil.copyfile(file, big / file.name)
    (big / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    with safe_open(small / "model.safetensors", "pt") as opened:
        tensors = {name: opened.get_tensor(name) for name in opened.keys() if not name.startswith(TABLE + ".")}  # noqa: SIM118
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": ST_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header[f"{TABLE}.scale"] = {
        "dtype": "F8_E8M0",
        "shape": [rows, groups],
        "data_offsets": [offset, offset + rows * groups],
    }
    offset += rows * groups
    table_bytes = rows * head_dim
    header[f"{TABLE}.weight"] = {
        "dtype": "F8_E4M3",
        "shape": [rows, head_dim],
        "data_offsets": [offset, offset + table_bytes],
    }
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    path = big / "model.safetensors"
    started = time.perf_counter()
    generator = np.random.default_rng(0)
    with open(path, "wb") as out:
        out.write(len(encoded).to_bytes(8, "little"))
        out.write(encoded)
        for tensor in tensors.values():
            out.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        scale = np.full(min(CHUNK, rows * groups), 127, dtype=np.uint8)  # e8m0 127 = 2**0
        for start in range(0, rows * groups, CHUNK):
            out.write(scale[: min(CHUNK, rows * groups - start)].tobytes())
        for start in range(0, table_bytes, CHUNK):
            chunk = np.frombuffer(generator.bytes(min(CHUNK, table_bytes - start)), dtype=np.uint8)
            out.write((chunk & 0xF7).tobytes())  # clears 0x7F/0xFF, e4m3fn's NaN codes
    seconds = time.perf_counter() - started

    with safe_open(path, "pt") as opened:
        for name, tensor in tensors.items():
            if not torch.equal(opened.get_tensor(name).view(torch.uint8), tensor.view(torch.uint8)):
                raise SystemExit(f"{path}: {name} does not read back as written")
        table = opened.get_slice(f"{TABLE}.weight")
        if table.get_shape() != [rows, head_dim] or table.get_dtype() != "F8_E4M3":
            raise SystemExit(f"{path}: the table reads back as {table.get_dtype()} {table.get_shape()}")
        tail = table[rows - 4 : rows].view(torch.uint8)
        if tail.shape != (4, head_dim) or bool(((tail & 0x7F) == 0x7F).any()):
            raise SystemExit(f"{path}: the table's last rows are not what was written")
        scales = opened.get_slice(f"{TABLE}.scale")[0:4].view(torch.uint8)
        if not bool((scales == 127).all()):
            raise SystemExit(f"{path}: the scales are not what was written")
    page_cache(path, warm=False)
    return {
        "path": big,
        "vocab": vocab,
        "rows": rows,
        "table_bytes": table_bytes,
        "file_bytes": path.stat().st_size,
        "write_s": seconds,
        "small_tensors": len(tensors),
    }


def page_cache(path: Path, *, warm: bool) -> None:
    """Drop ``path``'s pages from the page cache (written back first), as a checkpoint read
    from disk finds it, or with ``warm`` read it all into the cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if warm:
            while os.read(fd, CHUNK):
                pass
        else:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def rss(mapped: str | None = None) -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of this process (bytes), and with ``mapped`` (a file's path)
    the resident bytes of this process's maps of that file (``Mapped``, from /proc/self/smaps)."""
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            found[key] = int(value.split()[0]) * 1024
    if mapped is not None:
        found["Mapped"], inside = 0, False
        for line in Path("/proc/self/smaps").read_text().splitlines():
            fields = line.split()
            if fields and not fields[0].endswith(":"):  # a mapping's first line: range, perms, ..., path
                inside = len(fields) >= 6 and fields[5] == mapped
            elif inside and fields[0] == "Rss:":
                found["Mapped"] += int(fields[1]) * 1024
    return found


def rss_child(path: str, steps: int) -> None:
    """Run in a fresh process: RSS before the load, after it, and after ``steps`` greedy decode
    steps, with the table rows and pages those steps gathered. Prints one JSON line."""
    from powertrain import SamplingParams

    mapped = str((Path(path) / "model.safetensors").resolve())
    before = rss(mapped)
    started = time.perf_counter()
    llm = LLM(path, dtype="float32", max_num_seqs=1, num_blocks=8, cache__block_size=16)
    load_s = time.perf_counter() - started
    loaded = rss(mapped)
    model = engine_of(llm).runner.model
    table = model.layers[ENGRAM_LAYER].engram.table
    read: list[np.ndarray] = []
    gather = table.weight.rows

    def recording(ids: torch.Tensor) -> torch.Tensor:
        read.append(ids.detach().cpu().numpy().ravel().copy())
        return gather(ids)

    table.weight.rows = recording
    text = json.loads((Path(path) / "config.json").read_text())["text_config"]
    prompt = torch.randint(3, 500, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    [output] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    decoded = rss(mapped)
    tokens = len(prompt) + len(output.outputs[0].token_ids)
    ids = np.unique(np.concatenate(read)) if read else np.empty(0, dtype=np.int64)
    head_dim = text["engram_head_dim"]
    print(
        "rss-child "
        + json.dumps(
            {
                "before": before,
                "loaded": loaded,
                "decoded": decoded,
                "load_s": load_s,
                "tokens": tokens,
                "rows_estimate": tokens * (text["engram_max_ngram_size"] - 1) * text["engram_n_heads"],
                "rows_read": len(ids),
                "pages_read": len(np.unique(ids * head_dim // PAGE)),
                "scale_pages_read": len(np.unique(ids * (head_dim // 32) // PAGE)),
                "kv_cache_gib": engine_of(llm).kv_cache.get("gib"),
            }
        ),
        flush=True,
    )
    llm.shutdown()


def engram_rss(args: argparse.Namespace, results: dict[str, Any]) -> None:
    started = time.perf_counter()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="powertrain-engram-rss-"))
    workdir.mkdir(parents=True, exist_ok=True)
    need = int(args.engram_gib * 2**30 * 1.05) + 64 * MIB
    free = shutil.disk_usage(workdir).free
    if free < need:
        raise SystemExit(
            f"{workdir} has {free / 2**30:.1f} GiB free, the {args.engram_gib} GiB Engram checkpoint needs "
            f"{need / 2**30:.1f}; pass --workdir elsewhere or a smaller --engram-gib"
        )
    try:
        written = write_big_engram(workdir, args.engram_gib)
        print(
            f"Engram checkpoint: {written['rows']} rows ({written['table_bytes'] / 2**30:.2f} GiB table, "
            f"{written['file_bytes'] / 2**30:.2f} GiB file) written in {written['write_s']:.0f} s",
            flush=True,
        )
        if args.warm_cache:
            page_cache(written["path"] / "model.safetensors", warm=True)
        child = subprocess.run(
            [sys.executable, __file__, "--rss-child", str(written["path"]), "--engram-steps", str(args.engram_steps)],
            capture_output=True,
            text=True,
            check=False,
        )
        lines = [line for line in child.stdout.splitlines() if line.startswith("rss-child ")]
        if child.returncode != 0 or not lines:
            raise SystemExit(f"the RSS process failed ({child.returncode}):\n{child.stdout}\n{child.stderr}")
        got = json.loads(lines[-1].removeprefix("rss-child "))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    table = written["table_bytes"]
    before, loaded, decoded = got["before"], got["loaded"], got["decoded"]

    def growth(a: dict[str, int], b: dict[str, int]) -> str:
        keys = ("VmRSS", "RssAnon", "RssFile", "Mapped")
        return ", ".join(f"{key} {(b[key] - a[key]) / MIB:+.2f}" for key in keys)

    load_growth = loaded["VmRSS"] - before["VmRSS"]
    results["engram table"] = (
        f"layer {ENGRAM_LAYER}: {written['rows']} rows x {table // written['rows']} B = {table / 2**30:.3f} GiB "
        f"(engram_vocab_size {written['vocab']}), file {written['file_bytes'] / 2**30:.3f} GiB, written in "
        f"{written['write_s']:.0f} s; {written['small_tensors']} small tensors read back equal"
    )
    results["engram RSS before load MiB (VmRSS, RssAnon, RssFile)"] = ", ".join(
        f"{before[key] / MIB:.1f}" for key in ("VmRSS", "RssAnon", "RssFile")
    )
    results["engram page cache before the load"] = "warm (whole file read)" if args.warm_cache else "cold (evicted)"
    results["engram growth: Mapped = resident pages of the process's maps of model.safetensors"] = "smaps"
    results["engram RSS growth at load MiB"] = growth(before, loaded)
    results["engram RSS growth at load / table"] = f"{load_growth / table:.4f} (target < 0.10)"
    results["engram load s"] = got["load_s"]
    results["engram load under 10% of the table"] = load_growth < 0.1 * table
    results[f"engram RSS growth over {got['tokens']} tokens MiB"] = growth(loaded, decoded)
    results["engram rows read (distinct; estimate tokens x columns)"] = f"{got['rows_read']}; {got['rows_estimate']}"
    results["engram 4 KiB pages those rows span (table, scale)"] = (
        f"{got['pages_read']}, {got['scale_pages_read']} = "
        f"{(got['pages_read'] + got['scale_pages_read']) * PAGE / MIB:.2f} MiB"
    )
    pages = (got["pages_read"] + got["scale_pages_read"]) * PAGE
    results["engram checkpoint map resident after load, after decode MiB"] = (
        f"{loaded['Mapped'] / MIB:.2f}, {decoded['Mapped'] / MIB:.2f}"
    )
    results["engram checkpoint map growth while decoding / pages read"] = (
        f"{(decoded['Mapped'] - loaded['Mapped']) / max(1, pages):.2f}"
    )
    results["engram part s"] = time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="*", default=[4096, 16384], help="prompt lengths (none: skip)")
    parser.add_argument("--rounds", type=int, default=4, help="turns of decode steps per engine and context")
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps per turn")
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed decode steps opening each turn")
    parser.add_argument("--device", default="auto", help="platform: auto, cpu, cuda")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attention", default="torch-reference", help="attention backend of every engine")
    parser.add_argument("--prefill-chunk", type=int, default=512, help="max_num_batched_tokens (bounds memory)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="folder for the tiny checkpoints (temp)")
    parser.add_argument("--engram-gib", type=float, default=2.0, help="Engram table size for the RSS part (0 skips)")
    parser.add_argument("--engram-steps", type=int, default=32, help="greedy decode steps after the load")
    parser.add_argument("--workdir", type=Path, default=None, help="folder for the big Engram checkpoint (temp)")
    parser.add_argument(
        "--warm-cache", action="store_true", help="read the Engram checkpoint into the page cache before loading"
    )
    parser.add_argument("--keep", action="store_true", help="keep the big Engram checkpoint")
    parser.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_child:
        rss_child(args.rss_child, args.engram_steps)
        return
    results: dict[str, Any] = {}
    if args.contexts:
        long_context(args, results)
    if args.engram_gib > 0:
        engram_rss(args, results)
    if not results:
        raise SystemExit("nothing to run: give --contexts or --engram-gib")
    report(f"DeepSeek-V4.1 vs V4 vs V3 long-context decode, Engram RSS; contexts {args.contexts}", results)


if __name__ == "__main__":
    configure_logging("warning")  # a script is the application: LLM leaves logging to it
    main()
