"""What the engine and a speculative-decoding policy exchange, and the engine's side of it.

A step with speculation: the scheduler forms the batch as usual; then every decoding
sequence that may speculate becomes a ``DraftSlot``, the policy ``propose``s draft
tokens with confidences, decides with ``verify_lengths`` how many of each to verify
(for the whole batch at once), and the engine appends those drafts to the sequences,
so the step computes ``1 + ℓ`` tokens for each. The model runner hands the target's
logits of those rows to ``verify``, which returns the tokens each sequence keeps
(accepted drafts plus one token sampled from the target). The engine then rewinds
what was rejected: the sequence's computed-token count falls back to the accepted
tokens, so the rejected drafts' cache slots are simply written again later.

Speculative steps run synchronously (no overlap of step N+1's preparation with step
N): the drafts of N+1 depend on the tokens N accepts. A policy may still plan its
verification budget from an earlier step's confidences (DSpark's lagged budget), which
is what an overlapped engine would need.

Which sequences may speculate: those whose next token comes from the plain sampling
distribution (temperature, top-k, top-p, min-p), because verification must compare
draft and target distributions exactly. Penalties, structured output, logprobs and
not-yet-reached ``min_tokens`` make the distribution depend on per-token state the
verifier does not replay, so such sequences decode one token at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from powertrain.engine.sampling_params import SamplingParams
from powertrain.interfaces import AttentionMetadata


@attrs.frozen(kw_only=True)
class DraftSlot:
    """One sequence the policy may draft for this step."""

    seq_id: int
    #: Prompt + generated tokens so far (the last one is this step's input; read only).
    token_ids: Sequence[int]
    num_prompt_tokens: int
    params: SamplingParams
    #: This sequence's own generator (seeded requests), or None for the shared one.
    generator: torch.Generator | None
    #: At most this many drafts can be used (max_tokens, model length).
    max_draft: int


@attrs.frozen(kw_only=True)
class Proposal:
    """Drafts for each slot (same order), with their confidences.

    ``confidences[i][k]`` is c(i, k+1): the predicted probability that draft k+1 is
    accepted given that the drafts before it were; it may depend on the drafts before
    position k+1 but never on draft k+1 itself (a stochastic drafter's token at k+1 is
    what verification tests). ``draft_probs[i]`` is ``[len(tokens[i]), vocab]``, the
    distribution each draft was sampled from, or None for a deterministic drafter
    (each draft is then a point mass).
    """

    slots: list[DraftSlot]
    tokens: list[list[int]]
    confidences: list[list[float]]
    draft_probs: list[torch.Tensor | None]

    def __attrs_post_init__(self) -> None:
        n = len(self.slots)
        if not (len(self.tokens) == len(self.confidences) == len(self.draft_probs) == n):
            raise ValueError("a Proposal needs tokens, confidences and draft_probs for every slot")
        for slot, tokens, confidences in zip(self.slots, self.tokens, self.confidences, strict=True):
            if len(tokens) != len(confidences) or len(tokens) > slot.max_draft:
                raise ValueError(
                    f"sequence {slot.seq_id}: {len(tokens)} drafts with {len(confidences)} confidences "
                    f"(at most {slot.max_draft} drafts)"
                )


@attrs.frozen(kw_only=True)
class VerifyBatch:
    """What ``verify_lengths`` may know of the step besides the drafts."""

    #: Tokens the step computes without any draft (each decoding sequence's one token
    #: plus prefill chunks).
    base_tokens: int
    #: Sequences that sample a token this step (each yields at least one).
    num_sampling: int
    #: Sequences in the step (0: take ``num_sampling``).
    num_seqs: int = 0


@attrs.frozen(kw_only=True)
class ExecutedStep:
    """A step's forward, for policies that keep state on the device (an MTP drafter
    catches up its own cache from the target's hidden states). Device thread only."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    hidden: torch.Tensor  # [num_tokens, hidden]: the target's final hidden states
    metadata: AttentionMetadata
    seq_ids: list[int]  # one per sequence in the batch, in batch order
    #: For each sequence in the batch: the tokens it kept this step (accepted drafts and
    #: the sampled token), or [] when it sampled nothing (a prompt chunk).
    accepted: list[list[int]]
    #: How many drafts each sequence carried into the step (0 for most).
    num_drafts: list[int]


@attrs.frozen(kw_only=True)
class SpeculativeContext:
    """What a speculative policy's factory is given."""

    #: The plugin's validated config section (an attrs instance), or None.
    config: Any
    model: Any  # the CausalLM (an MTP drafter reads ``model.mtp``)
    vocab_size: int
    device: torch.device
    block_size: int
    #: ``(sequence counts, tokens per sequence) -> {(n, q): target steps per second}``,
    #: measured now on this machine: one forward + logits of ``n`` sequences of ``q`` new
    #: tokens each (a token and its drafts), for every pair.
    measure_steps_per_second: Callable[..., dict[tuple[int, int], float]]
    #: ``allocate_kv_caches(layers, extra_blocks=0)``: a cache like the target's for extra
    #: attention layers (an MTP drafter's), filled through the same block tables. The
    #: ``extra_blocks`` blocks after the target's (the last ids) are in no block table: a
    #: drafter's private scratch for positions its sequences own no block for yet.
    allocate_kv_caches: Callable[..., list[Any]]
    #: Expert-parallel ranks the target's MoE layers exchange tokens with (1: none). A
    #: drafter that runs MoE layers outside the target's forward cannot run above 1.
    expert_parallel_size: int = 1


def can_speculate(params: SamplingParams, num_output_tokens: int, constrained: bool) -> bool:
    """Whether a sequence's next tokens come from the plain sampling distribution (see module doc)."""
    return not (
        constrained
        or params.logprobs is not None
        or params.repetition_penalty != 1
        or params.presence_penalty
        or params.frequency_penalty
        or num_output_tokens < params.min_tokens
    )


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from for ``params``, one row per position
    (float32 ``[rows, vocab]``); greedy (temperature 0) is a one-hot of the argmax."""
    from powertrain.engine.sampler import filtered_probs

    logits = logits.float()
    if params.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    return filtered_probs(logits / params.temperature, [params] * logits.shape[0])


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
        model: Any,
        kv_caches: Sequence[Any],
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
