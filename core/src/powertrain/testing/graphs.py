"""Check captured decode steps (``engine.cuda_graphs``) against eager ones, model level.

Two copies of a model's paged cache start alike; prompts are prefilled eagerly into one
and copied into the other (every block but the padding one); then each decode step runs
eagerly with the step's own metadata on one copy and through ``DecodeGraphs`` (padded to
a captured size, host lengths as bounds) on the other. The hidden states must agree
within the caller's tolerance (the padded batch may take other matmul and split paths),
and so must a drafter's hidden taps where the check asks for some (``taps``); with
``capture`` the replayed graph must equal, bit for bit, an eager forward of the very same
padded step. Caches start as NaN, so a read of a slot nobody wrote poisons the
output, and after every step both caches must hold the same outside the block reserved
for padding rows.

``check_captured_attention`` is the attention kit's ``cuda-graphs`` case: one backend,
one padded and bounded decode step, and its capture where the platform can.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from powertrain.engine.cuda_graphs import DecodeGraphs
from powertrain.engine.speculative import forward_with_taps
from powertrain.interfaces import AttentionMetadata, HiddenTap
from powertrain.testing.paged import nan_caches

__all__ = ["check_captured_attention", "check_decode_graphs"]

PAD_BLOCK = 0


def check_decode_graphs(
    model: Any,
    backend: Any,
    *,
    dtype: torch.dtype,
    device: torch.device,
    capture: bool,
    sizes: Sequence[int] = (1, 4, 8),
    batches: Sequence[int] = (1, 3, 8, 5),
    decode_steps: int = 3,
    block_size: int = 4,
    max_model_len: int = 64,
    vocab: int = 100,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    taps: Sequence[HiddenTap] = (),
) -> DecodeGraphs:
    """Run the check (see the module docstring); returns the graphs for further asserts."""
    num_blocks = sum(batches) * -(-max_model_len // block_size) + 1
    eager = nan_caches(model.attention_layers, backend, dtype, device, block_size, num_blocks)
    through_graphs = nan_caches(model.attention_layers, backend, dtype, device, block_size, num_blocks)
    graphs = _captured(model, through_graphs, sizes, block_size, max_model_len, device, capture, taps)
    free = (torch.randperm(num_blocks - 1) + 1).tolist()  # every block but the padding one
    for batch in batches:
        lengths = torch.randint(1, max_model_len - decode_steps - 8, (batch,)).tolist()
        blocks = [[free.pop() for _ in range(-(-max_model_len // block_size))] for _ in range(batch)]
        prompts = [torch.randint(0, vocab, (n,)).tolist() for n in lengths]
        order = sorted(range(batch), key=lambda i: lengths[i] != 1)  # one-token prompts are decodes: first
        prefill = _metadata([lengths[i] for i in order], [lengths[i] for i in order], [blocks[i] for i in order])
        ids = torch.tensor([t for i in order for t in prompts[i]], device=device)
        positions = torch.tensor([p for i in order for p in range(lengths[i])], device=device)
        with torch.inference_mode():  # prefilled once: the graph side's blocks are copies of the eager ones
            model.forward(ids, positions, eager, _on(prefill, block_size, device))
            _copy_blocks(eager, through_graphs)
        for step in range(decode_steps):
            seq_lens = [n + step + 1 for n in lengths]
            metadata = _on(_metadata([1] * batch, seq_lens, blocks), block_size, device)
            ids = torch.randint(0, vocab, (batch,), device=device)
            positions = torch.tensor([n - 1 for n in seq_lens], device=device)
            size = graphs.size_for(metadata)
            assert size == min(s for s in sizes if s >= batch), f"batch {batch} got graph size {size}"
            with torch.inference_mode():
                want, wanted_taps = forward_with_taps(model, taps, ids, positions, eager, metadata)
            got, got_taps = graphs.forward(ids, positions, metadata, size)
            compared = [("hidden", got, want), *zip(map(str, taps), got_taps, wanted_taps, strict=True)]
            for what, ours, theirs in compared:
                torch.testing.assert_close(
                    ours,
                    theirs,
                    atol=atol,
                    rtol=rtol,
                    msg=lambda m, b=batch, s=step, w=what: f"batch {b} step {s} {w}: {m}",
                )
            for layer, (ours, theirs) in enumerate(zip(through_graphs, eager, strict=True)):
                for name in ours:  # every block but the padding one holds what the eager steps wrote
                    torch.testing.assert_close(
                        ours[name][1:], theirs[name][1:], atol=atol, rtol=rtol, equal_nan=True,
                        msg=lambda m, b=batch, s=step, n=name, i=layer: f"batch {b} step {s}, layer {i} {n} cache: {m}",
                    )  # fmt: skip
            if capture:
                captured = graphs.captured[size]
                replayed = captured.hidden[:batch].clone()
                replayed_taps = [tap[:batch].clone() for tap in captured.taps]
                with torch.inference_mode():  # the same padded step again, eagerly: writes the same entries
                    again, again_taps = forward_with_taps(
                        model, taps, graphs.input_ids[:size], graphs.positions[:size], through_graphs, captured.metadata
                    )
                assert torch.equal(replayed, again[:batch]), f"batch {batch} step {step}: replay differs from eager"
                for tap, ours, theirs in zip(taps, replayed_taps, again_taps, strict=True):
                    assert torch.equal(ours, theirs[:batch]), f"batch {batch} step {step}: replayed {tap} differs"
        # A prefill step and a batch past the biggest size run eager.
        assert graphs.size_for(_on(prefill, block_size, device)) is None or all(n == 1 for n in lengths)
    too_many = _on(_metadata([1] * (sizes[-1] + 1), [1] * (sizes[-1] + 1), [[1]] * (sizes[-1] + 1)), block_size, device)
    assert graphs.size_for(too_many) is None
    return graphs


def _captured(
    model: Any,
    caches: list,
    sizes: Sequence[int],
    block_size: int,
    max_model_len: int,
    device: torch.device,
    capture: bool,
    taps: Sequence[HiddenTap] = (),
) -> DecodeGraphs:
    """``DecodeGraphs`` over ``caches`` with block ``PAD_BLOCK`` for padding, every size captured."""
    graphs = DecodeGraphs(
        model,
        caches,
        sizes=sizes,
        block_size=block_size,
        max_model_len=max_model_len,
        pad_blocks={None: PAD_BLOCK},
        device=device,
        capture=capture,
        taps=taps,
    )
    graphs.capture_all()
    return graphs


def _copy_blocks(source: list, target: list) -> None:
    """Every block but the padding one, from ``source``'s caches into ``target``'s, in place (the
    graphs hold ``target``'s tensors). Why: a prefill is an eager step on both sides, so running
    it twice would only cost time (under the Triton interpreter, most of the check's)."""
    for theirs, ours in zip(source, target, strict=True):
        for name, tensor in ours.items():
            tensor[PAD_BLOCK + 1 :].copy_(theirs[name][PAD_BLOCK + 1 :])


def _metadata(query_lens: list[int], seq_lens: list[int], tables: list[list[int]]) -> dict[str, Any]:
    return {"query_lens": query_lens, "seq_lens": seq_lens, "block_tables": tables}


def _on(spec: dict[str, Any], block_size: int, device: torch.device) -> AttentionMetadata:
    return AttentionMetadata.build(**spec, block_size=block_size, device=device)


def check_captured_attention(
    backend: Any,
    layer: Any,
    spec: Any,
    *,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    tolerance: tuple[float, float],
    capture: bool,
    what: str = "attention",
) -> None:
    """The attention kit's ``cuda-graphs`` case: a decode step shaped as a captured one
    (padded to a graph size with one-token sequences over a reserved block, host lengths
    at a bound, ``DecodeGraphs.load``) gives the real rows what the step's own metadata
    gives, within ``tolerance``, and writes the cache alike outside the reserved block.
    Then the padded step is captured in a CUDA graph, replayed after the buffers
    took another step, and must equal an eager run of that step bit for bit: with
    ``capture``, where the platform can (``PlatformInfo.cuda_graphs``)."""
    gen = torch.Generator().manual_seed(seed)
    bound = 8 * block_size
    size = 8
    num_blocks = 2 * size * (bound // block_size) + 1
    graphs = _captured(None, [], [size], block_size, bound, device, capture=False)  # load() needs no model
    cache = spec.allocate(num_blocks, device)
    for tensor in cache.values():
        tensor.copy_(torch.randn(tensor.shape, generator=gen).to(tensor.dtype))
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()

    def step(batch: int) -> tuple[AttentionMetadata, tuple[torch.Tensor, ...]]:
        seq_lens = torch.randint(1, bound + 1, (batch,), generator=gen).tolist()
        tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
        metadata = _on(_metadata([1] * batch, seq_lens, tables), block_size, device)
        return metadata, _inputs(layer, size, dtype, device, gen)

    def run(inputs: tuple[torch.Tensor, ...], metadata: AttentionMetadata, kv: dict) -> torch.Tensor:
        if layer.kind == "mla":
            return backend.forward_mla(layer, *inputs, kv, metadata)
        return backend.forward(layer, *inputs, kv, metadata)

    batch = int(torch.randint(1, size, (1,), generator=gen))  # at least one padding row
    metadata, inputs = step(batch)
    exact_cache, padded_cache = _clone(cache), _clone(cache)
    with torch.inference_mode():
        want = run(tuple(x[:batch] for x in inputs), metadata, exact_cache)
        captured = graphs.load(
            torch.zeros(batch, dtype=torch.int64, device=device), metadata.seq_lens.long(), metadata, size
        )
        got = run(inputs, captured.metadata, padded_cache)
    atol, rtol = tolerance
    torch.testing.assert_close(
        got[:batch].float(), want.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: padded step's real rows: {m}"
    )
    for name in cache:
        assert torch.equal(padded_cache[name][1:], exact_cache[name][1:]), (
            f"{what}: the padded step wrote {name!r} outside the block reserved for padding rows"
        )
    if not capture:
        return
    # Capture the padded step, then replay it with another step's inputs and metadata.
    static = tuple(x.clone() for x in inputs)
    graph_cache = _clone(cache)
    with torch.inference_mode():
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            run(static, captured.metadata, graph_cache)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(static, captured.metadata, graph_cache)
        metadata, inputs = step(int(torch.randint(1, size + 1, (1,), generator=gen)))
        graphs.load(
            torch.zeros(metadata.batch_size, dtype=torch.int64, device=device), metadata.seq_lens.long(), metadata, size
        )
        for buffer, value in zip(static, inputs, strict=True):
            buffer.copy_(value)
        for name in cache:
            graph_cache[name].copy_(cache[name])
        graph.replay()
        eager_cache = _clone(cache)
        eager = run(inputs, captured.metadata, eager_cache)
    assert torch.equal(out, eager), f"{what}: the replayed graph differs from the eager padded step"
    for name in cache:
        assert torch.equal(graph_cache[name], eager_cache[name]), f"{what}: the replay wrote {name!r} otherwise"


def _inputs(layer: Any, rows: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> tuple:
    """A decode step's new-token inputs for ``layer``: (query, key, value), or MLA's
    (q_latent, q_rope, latent, k_rope)."""
    if layer.kind == "mla":
        shapes = [
            (rows, layer.num_heads, layer.kv_lora_rank),
            (rows, layer.num_heads, layer.qk_rope_head_dim),
            (rows, layer.kv_lora_rank),
            (rows, layer.qk_rope_head_dim),
        ]
    else:
        shapes = [(rows, layer.num_heads, layer.head_size)] + [(rows, layer.num_kv_heads, layer.head_size)] * 2
    return tuple(torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for shape in shapes)


def _clone(cache: dict) -> dict:
    return {name: tensor.clone() for name, tensor in cache.items()}
