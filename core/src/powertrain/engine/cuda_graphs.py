"""Decode steps as CUDA graphs: captured once per batch size, replayed with new inputs.

An eager decode step launches every kernel of every layer from Python; at small batches
the GPU waits on that. At startup the engine captures ``model.forward`` for each size
of a ladder (``[engine] cuda_graph_batch_sizes``). A step whose rows are all decodes, B
of them, then replays the smallest captured size G >= B: its inputs are copied into the
graph's buffers, and the G - B rows after them are padding. Other steps (prompt chunks,
draft verification, bigger batches) run eager.

What a captured step looks like to a backend (``interfaces.attention``, "CUDA graphs"):
its metadata's tensors are views of the buffers refilled here before each replay, and
its host values are fixed for size G: G one-token sequences, ``seq_lens_host`` and
``max_seq_len`` at the model's length (bounds, not the step's lengths). Padding rows
are one-token sequences at position 0 over the block each cache pool reserved for them
(``BlockManager.reserve_blocks``), so every backend computes them as ordinary rows and
their cache writes land where nobody reads.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from powertrain.engine.speculative import forward_with_taps
from powertrain.interfaces import AttentionMetadata, CausalLM, HiddenTap, LayerKVCache


@attrs.frozen
class Captured:
    """One batch size: its metadata (views of the buffers) and, once captured, the graph."""

    metadata: AttentionMetadata
    #: The graph and its output buffer ``[G, hidden]``; None: replayed eagerly (``capture=False``).
    graph: Any = None
    hidden: torch.Tensor | None = None
    #: The graph's buffers of the drafter's hidden taps, ``[G, width]`` each.
    taps: tuple[torch.Tensor, ...] = ()


class DecodeGraphs:
    """Captured decode steps of one model over one set of caches.

    ``pad_blocks``: per retention class (in the engine's order, the first the primary),
    the block reserved for padding rows. ``capture=False`` runs the same padded step
    eagerly instead of replaying a graph: the padding and the buffers are then checked
    where no GPU is (tests), and only the capture itself needs one. ``taps``: the hidden
    states a drafter reads (``HiddenTap``), captured with the step and handed out with it.
    """

    def __init__(
        self,
        model: CausalLM,
        kv_caches: Sequence[LayerKVCache],
        *,
        sizes: Sequence[int],
        block_size: int,
        max_model_len: int,
        pad_blocks: Mapping[int | None, int],
        device: torch.device,
        capture: bool = True,
        taps: Sequence[HiddenTap] = (),
    ) -> None:
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"graph batch sizes must be increasing and at least 1, got {list(sizes)}")
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = tuple(sizes)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.capture = capture
        self.taps = tuple(taps)
        self.pad_blocks = dict(pad_blocks)
        biggest = self.sizes[-1]
        #: Block-table columns: enough for a sequence of the model's length.
        self.width = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(biggest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(biggest, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(biggest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(biggest + 1, dtype=torch.int32, device=device)
        self.tables: dict[int | None, torch.Tensor] = {}
        self.slots: dict[int | None, torch.Tensor] = {}
        for window, block in self.pad_blocks.items():
            table = torch.zeros((biggest, self.width), dtype=torch.int32, device=device)
            table[:, 0] = block
            self.tables[window] = table
            self.slots[window] = torch.full((biggest,), block * block_size, dtype=torch.int64, device=device)
        self.captured: dict[int, Captured] = {}
        #: Rows of the buffers holding a real sequence since they were last reset to padding.
        self._filled = 0
        self._pool: Any = None
        #: Steps served by a captured size (tests and benchmarks count them).
        self.replays = 0

    # ----------------------------------------------------------------------- capture

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size, the biggest first (smaller graphs then reuse its memory pool)."""
        self._pad(0, self.sizes[-1])  # warm-ups and captures read the buffers, never write them
        for size in reversed(self.sizes):
            self.captured[size] = self._capture(size)

    def _capture(self, size: int) -> Captured:
        metadata = self._metadata(size)
        ids, positions = self.input_ids[:size], self.positions[:size]
        if not self.capture:
            return Captured(metadata)
        # Warm up off the capture: kernels compile and lazily built tables (rotary) grow
        # outside the graph; a side stream, as torch.cuda.graph wants.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(ids, positions, metadata)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden, taps = self._forward(ids, positions, metadata)
        self._pool = graph.pool()
        return Captured(metadata, graph, hidden, taps)

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        return forward_with_taps(self.model, self.taps, ids, positions, self.kv_caches, metadata)

    def _metadata(self, size: int) -> AttentionMetadata:
        """Size ``size``'s metadata: views of the buffers, host values fixed (bounds)."""
        tables = {w: (self.tables[w][:size], self.slots[w][:size]) for w in self.pad_blocks}
        first = next(iter(tables))
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=tables[first][0],
            slot_mapping=tables[first][1],
            query_start_loc_host=tuple(range(size + 1)),
            seq_lens_host=(self.max_model_len,) * size,
            num_decodes=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
            window=first,
            window_tables=tables if len(tables) > 1 else {},
        )

    # ----------------------------------------------------------------------- replay

    def size_for(self, metadata: AttentionMetadata) -> int | None:
        """The captured size that serves this step, or None: it runs eager (not all decodes,
        more sequences than the biggest size, or a block table wider than the buffers)."""
        batch = metadata.batch_size
        if not self.captured or metadata.num_decodes != batch or batch > self.sizes[-1] or batch == 0:
            return None
        tables = [metadata.for_window(w).block_tables for w in self.pad_blocks]
        if any(t.shape[1] > self.width for t in tables) or metadata.max_seq_len > self.max_model_len:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, batch)]

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, size: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The step's final hidden states ``[batch, hidden]`` and the drafter's taps
        (copies: the graph's output buffers are overwritten by the next replay)."""
        captured = self.load(input_ids, positions, metadata, size)
        self.replays += 1
        if captured.graph is None:
            hidden, taps = self._forward(self.input_ids[:size], self.positions[:size], captured.metadata)
        else:
            captured.graph.replay()
            hidden, taps = captured.hidden, captured.taps
        batch = metadata.batch_size
        return hidden[:batch].clone(), tuple(tap[:batch].clone() for tap in taps)

    def load(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, size: int
    ) -> Captured:
        """Copy a step of at most ``size`` decodes into the buffers, the rows after it
        padding; returns size ``size``'s capture, whose metadata now describes the step."""
        batch = metadata.batch_size
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.seq_lens[:batch].copy_(metadata.seq_lens)
        for window in self.pad_blocks:
            view = metadata.for_window(window)
            self.tables[window][:batch, : view.block_tables.shape[1]].copy_(view.block_tables)
            self.slots[window][:batch].copy_(view.slot_mapping)
        if self._filled > batch:
            self._pad(batch, self._filled)
        self._filled = batch
        captured = self.captured[size]
        if captured.metadata.refused.record is not None:  # a backend refuses sparse indices on the device
            captured.metadata.refused.record.zero_()
        return captured

    def _pad(self, start: int, end: int) -> None:
        """Make rows ``start:end`` padding: position 0 of a one-token sequence in the
        reserved blocks."""
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.seq_lens[start:end].fill_(1)
        for window, block in self.pad_blocks.items():
            self.tables[window][start:end, 0] = block
            self.slots[window][start:end] = block * self.block_size
