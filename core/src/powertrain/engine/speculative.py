"""The engine's side of speculative decoding: which sequences may speculate, and the
startup profile a policy weighs drafts against. What the engine and a policy exchange,
and how a speculative step runs, is ``interfaces.speculative``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from powertrain.interfaces.attention import AttentionMetadata, LayerKVCache
from powertrain.interfaces.images import ImageRows
from powertrain.interfaces.model import CausalLM
from powertrain.interfaces.sampling import SamplingParams
from powertrain.interfaces.speculative import HiddenTap, TapRecorder


def can_speculate(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a sequence's next tokens come from the plain sampling distribution, masked
    by its grammar if it has one (``interfaces.speculative``: the verifier does not replay
    other per-token state)."""
    return not (
        params.logprobs is not None
        or params.repetition_penalty != 1
        or params.presence_penalty
        or params.frequency_penalty
        or params.logit_bias
        or num_output_tokens < params.min_tokens
    )


def grammar_cut(length: int, allowed: int, stochastic: bool) -> int:
    """How many of a constrained slot's ``length`` chosen drafts to verify, when its grammar
    allows the first ``allowed`` of them.

    Cutting before the first forbidden draft depends on that draft itself. That is exact
    for a deterministic drafter: the target's masked draw there can never be the draft,
    so verification would have rejected it and drawn from the target all the same. A
    stochastic draft's rejection draws from the residual max(p - q, 0) instead, which
    losslessness needs, so its first forbidden draft is verified as the last one: it is
    rejected for certain (p is 0 there).
    """
    if allowed >= length:
        return length
    return allowed + 1 if stochastic else allowed


#: The profile computes logits this many rows at a time: the time is the same, and a
#: [256, vocab] float32 block (50 MB for a 49k vocabulary) would leave the allocator in a
#: state that measurably slows the decoding that follows on CPU.
LOGIT_ROWS = 32


class StepsPerSecondProfiler:
    """Times target forwards over a grid of batch shapes, once at startup.

    Each probe is a decode-like batch: ``n`` sequences of ``q`` new tokens each, over a
    context of ``context`` tokens, using scratch cache blocks (the cache holds nothing
    yet). Logits are computed for every token, as verification does. The sequence count
    is part of the shape because a step's cost is not a function of its token count
    alone: on a 2-core CPU, 64 one-token sequences took 193 ms where 11 six-token
    sequences (the same 64 tokens) took 83 ms (attention and per-sequence work).
    """

    def __init__(
        self,
        model: CausalLM,
        kv_caches: Sequence[LayerKVCache],
        block_size: int,
        num_blocks: int,
        device: torch.device,
        context: int = 128,
        repeats: int = 2,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.context = context
        self.repeats = repeats

    @torch.inference_mode()
    def __call__(self, seq_counts: Sequence[int], tokens_per_seq: Sequence[int]) -> dict[tuple[int, int], float]:
        return {
            (n, q): 1.0 / self._seconds([q] * n) for n in sorted(set(seq_counts)) for q in sorted(set(tokens_per_seq))
        }

    def _seconds(self, query_lens: list[int]) -> float:
        """Median time of a forward + logits over sequences of ``query_lens`` new tokens."""
        blocks_per_seq = -(-(self.context + max(query_lens)) // self.block_size)
        if blocks_per_seq > self.num_blocks:
            raise ValueError("the KV cache is too small to profile a single sequence; raise [cache] memory_gib")
        tables = [
            [(i * blocks_per_seq + b) % self.num_blocks for b in range(blocks_per_seq)] for i in range(len(query_lens))
        ]
        seq_lens = [self.context + q for q in query_lens]
        metadata = AttentionMetadata.build(
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=tables,
            block_size=self.block_size,
            device=self.device,
        )
        input_ids = torch.randint(0, 100, (sum(query_lens),), device=self.device)
        positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)])
        positions = positions.to(self.device)
        timings = []
        for _ in range(self.repeats + 1):  # the first is a warm-up
            started = time.perf_counter()
            hidden = self.model.forward(input_ids, positions, self.kv_caches, metadata)
            for rows in hidden.split(LOGIT_ROWS):
                self.model.compute_logits(rows).cpu()
            timings.append(time.perf_counter() - started)
        return sorted(timings[1:])[len(timings[1:]) // 2]


def tap_problems(model: CausalLM, taps: Sequence[HiddenTap]) -> list[str]:
    """Why ``model`` cannot hand a drafter ``taps`` (empty: it can): a form its forward does
    not record (``tap_forms``), or a layer it does not have."""
    forms = frozenset(getattr(model, "tap_forms", ()))
    layers = len(model.attention_layers)
    problems = []
    for tap in taps:
        name = type(model).__name__
        if tap.form not in forms:
            offered = ", ".join(sorted(forms)) or "none"
            problems.append(f"the drafter reads {tap.form!r} at layer {tap.layer}; {name} records {offered}")
        elif tap.form == "head_streams" and tap.layer != layers:
            problems.append(f"'head_streams' are read after the last layer: layer {layers}, not {tap.layer}")
        elif tap.form != "head_streams" and not 0 <= tap.layer < layers:
            problems.append(f"the drafter reads {tap.form!r} at layer {tap.layer}; {name} has layers 0..{layers - 1}")
    return problems


def forward_with_taps(
    model: CausalLM,
    taps: Sequence[HiddenTap],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: Sequence[LayerKVCache],
    metadata: AttentionMetadata,
    image_rows: ImageRows | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The model's forward, and the drafter's ``taps`` it recorded (a ``TapRecorder`` set as
    the model's ``taps`` for this forward only); nothing is recorded when none is asked.
    ``image_rows`` go to the forward only where the step has some (text models take none)."""
    extra = {} if image_rows is None else {"image_rows": image_rows}
    if not taps:
        return model.forward(input_ids, positions, kv_caches, metadata, **extra), ()
    recorder = TapRecorder(taps)
    model.taps = recorder  # type: ignore[attr-defined]
    try:
        hidden = model.forward(input_ids, positions, kv_caches, metadata, **extra)
    finally:
        model.taps = None  # type: ignore[attr-defined]
    return hidden, recorder.taken()
