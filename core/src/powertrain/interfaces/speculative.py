"""What the engine and a speculative-decoding policy exchange.

A step with speculation: the scheduler forms the batch as usual; then every decoding
sequence that may speculate becomes a ``DraftSlot``, the policy ``propose``s draft
tokens with confidences and how many of each to verify (for the whole batch at once;
one decision, so a drafter need not draft past what is verified), and those drafts
join the step's inputs, so it computes ``1 + ℓ`` tokens for each sequence. The model
runner hands the target's logits of those rows to ``verify``, which returns the tokens
each sequence keeps (accepted drafts plus one token sampled from the target). The
sequence's computed-token count then moves on by the accepted drafts only, so the
rejected drafts' cache slots are simply written again later.

Overlap (async scheduling). The engine thread schedules step N+1 and reserves cache
blocks for its drafts while step N runs; it cannot draft, because N+1's drafts follow
from the tokens N keeps. So it hands the device thread a snapshot of each sequence, and
the device thread, once N has run, puts N's kept tokens in (a sequence that accepted
drafts moves on by as many positions; one whose kept tokens end it, by a stop token or
its length, leaves the step), asks the policy to ``propose``, prepares the step and
runs it. Meanwhile the engine thread turns N's
tokens into outputs (detokenization, stop strings). What the policy sees, and so what
it decides, is what it would see with synchronous steps; a policy may also plan its
verification budget from an earlier step (DSpark's lagged budget).

Which sequences may speculate: those whose next token comes from the plain sampling
distribution (temperature, top-k, top-p, min-p: ``sampling.target_probs``), because
verification must compare draft and target distributions exactly. Penalties, logprobs
and not-yet-reached ``min_tokens`` make the distribution depend on per-token state the
verifier does not replay, so such sequences decode one token at a time.

A constrained sequence (structured output) does speculate: the engine checks its drafts
against the grammar before the step, and verifies none the grammar forbids (a stochastic
drafter's first forbidden draft excepted, see ``engine.speculative.grammar_cut``); the
target's logits handed to ``verify`` are masked at each verified row as the sampler
masks them, so the kept tokens follow the grammar and are the tokens non-speculative
constrained decoding gives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from powertrain.interfaces.attention import AttentionLayerSpec, AttentionMetadata, LayerKVCache
from powertrain.interfaces.model import CausalLM
from powertrain.interfaces.quantized import QuantizedLinearKernel
from powertrain.interfaces.sampling import SamplingParams


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
    """Drafts for each slot (same order), with their confidences, and how many of each
    slot's drafts the step verifies (``lengths``: at most its drafts).

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
    lengths: list[int]

    def __attrs_post_init__(self) -> None:
        n = len(self.slots)
        if not (len(self.tokens) == len(self.confidences) == len(self.draft_probs) == len(self.lengths) == n):
            raise ValueError("a Proposal needs tokens, confidences, draft_probs and lengths for every slot")
        if any(not 0 <= length <= len(tokens) for length, tokens in zip(self.lengths, self.tokens, strict=True)):
            drafted = [len(t) for t in self.tokens]
            raise ValueError(f"a Proposal verifies {self.lengths} drafts of slots that drafted {drafted}")
        for slot, tokens, confidences in zip(self.slots, self.tokens, self.confidences, strict=True):
            if len(tokens) != len(confidences) or len(tokens) > slot.max_draft:
                raise ValueError(
                    f"sequence {slot.seq_id}: {len(tokens)} drafts with {len(confidences)} confidences "
                    f"(at most {slot.max_draft} drafts)"
                )


@attrs.frozen(kw_only=True)
class VerifyBatch:
    """What ``propose`` may know of the step besides the drafts (to choose their lengths)."""

    #: Tokens the step computes without any draft (each decoding sequence's one token
    #: plus prefill chunks).
    base_tokens: int
    #: Sequences that sample a token this step (each yields at least one).
    num_sampling: int
    #: Sequences in the step (0: take ``num_sampling``).
    num_seqs: int = 0


#: What a drafter may read of the target's forward (``HiddenTap.form``):
#: ``layer_output``: a layer's output hidden state (Qwen3's and Gemma's DSpark drafters);
#: ``streams_mean_in``: the mean of the mHC streams entering a layer (DeepSeek-V4.1's drafter);
#: ``head_streams``: the mHC streams before the hyper head collapses them, flattened
#: (DeepSeek-V4's MTP layer; ``layer`` is the number of layers).
TAP_FORMS = ("layer_output", "streams_mean_in", "head_streams")


@attrs.frozen
class HiddenTap:
    """One hidden state a drafter reads from the target's forward, for every row of a step."""

    layer: int
    form: str

    def __attrs_post_init__(self) -> None:
        if self.form not in TAP_FORMS:
            raise ValueError(f"hidden tap form {self.form!r}; one of {', '.join(TAP_FORMS)}")


class TapRecorder:
    """The taps a drafter asked for, filled by the target's forward: a model that supports
    taps (``CausalLM.tap_forms``) calls ``record`` where each form arises, and only for what
    was asked (``wants``), so a step copies nothing when no drafter asks."""

    def __init__(self, taps: Sequence[HiddenTap]) -> None:
        self.taps = tuple(taps)
        self._wanted = {(tap.layer, tap.form) for tap in self.taps}
        self.values: list[torch.Tensor | None] = [None] * len(self.taps)

    def wants(self, layer: int, form: str) -> bool:
        return (layer, form) in self._wanted

    def record(self, layer: int, form: str, value: torch.Tensor) -> None:
        """``value`` ``[num_tokens, width]`` for every tap ``(layer, form)`` (a copy: the forward
        may reuse its buffer)."""
        for index, tap in enumerate(self.taps):
            if (tap.layer, tap.form) == (layer, form):
                self.values[index] = value.clone()

    def taken(self) -> tuple[torch.Tensor, ...]:
        """The recorded values in ``taps`` order; a tap the forward did not record is an error
        of the model (it declared the form), raised naming the tap."""
        missing = [tap for tap, value in zip(self.taps, self.values, strict=True) if value is None]
        if missing:
            raise RuntimeError(f"the target's forward recorded no value for hidden taps {missing}")
        return tuple(value for value in self.values if value is not None)


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
    #: The policy's ``taps`` (``HiddenTap``), in its order, each ``[num_tokens, width]`` with
    #: the rows of ``hidden``; empty when it asks for none.
    taps: tuple[torch.Tensor, ...] = ()


@runtime_checkable
class BlockDraftModel(Protocol):
    """A block drafter's model (DeepSeek's DSpark drafter): DeepSpec's drafters for Qwen3 and
    Gemma 4 targets (``SpeculativeContext.load_draft_model``), or the drafter a checkpoint carries
    itself (DeepSeek-V4.1's ``mtp.*``, exposed by the target as ``model.dspark``).

    It reads the target's hidden states at ``taps``, keeps per-layer context keys/values
    of every position whose target hidden state is final in a paged cache like the
    target's (``attention_layers``, allocated through ``SpeculativeContext`` and indexed by
    the target's full-history block tables), and drafts a whole block per forward: the
    anchor token and ``block_size - 1`` copies of ``mask_token_id`` after it, attending both
    ways among themselves and to the context."""

    taps: tuple[HiddenTap, ...]
    block_size: int
    mask_token_id: int
    attention_layers: tuple[AttentionLayerSpec, ...]

    def context(self, taps: Sequence[torch.Tensor]) -> torch.Tensor:
        """The taps of some rows (each ``[rows, width]``, in ``taps`` order) -> their context vectors."""
        ...

    def write_context(
        self,
        context: torch.Tensor,
        positions: torch.Tensor,
        caches: Sequence[LayerKVCache],
        metadata: AttentionMetadata,
    ) -> None:
        """Each layer's keys/values of ``context`` rows, written at their positions."""
        ...

    def block(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: Sequence[LayerKVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The blocks' outputs ``[rows, hidden]``, one row per block position."""
        ...

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of block outputs, before the Markov bias."""
        ...

    def corrected_logits(self, base: torch.Tensor, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``base`` plus the Markov bias of the ``previous`` tokens (the token before each draft)."""
        ...

    def confidence(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor | None:
        """Predicted acceptance probability of each draft, or None without a confidence head."""
        ...


class StepsPerSecondProbe(Protocol):
    """``(sequence counts, tokens per sequence) -> {(n, q): target steps per second}``,
    measured now on this machine: one forward + logits of ``n`` sequences of ``q`` new
    tokens each (a token and its drafts), for every pair."""

    def __call__(self, seq_counts: Sequence[int], tokens_per_seq: Sequence[int]) -> dict[tuple[int, int], float]: ...


class ExpertRounds(Protocol):
    """``(MoE layers) -> (the call to make before each forward that runs them)``."""

    def __call__(self, layers: Sequence[Any]) -> Callable[[], None]: ...


class DraftModelLoader(Protocol):
    """``(folder) -> the block drafter checkpoint there``, built for this target: refused
    (ValueError, with the reason) when its architecture is unknown or it does not fit."""

    def __call__(self, folder: str) -> BlockDraftModel: ...


class KVCacheAllocator(Protocol):
    """A cache like the target's for extra attention layers (an MTP drafter's), one per
    layer, filled through the same block tables. The ``extra_blocks`` blocks after the
    target's (the last ids) are in no block table: a drafter's private scratch for
    positions its sequences own no block for yet."""

    def __call__(self, layers: Sequence[AttentionLayerSpec], extra_blocks: int = 0) -> list[LayerKVCache]: ...


@attrs.frozen(kw_only=True)
class SpeculativeContext:
    """What a speculative policy's factory is given."""

    #: The plugin's validated config section: an instance of the attrs class its
    #: ConfigSectionRecord names (the core knows no more of it), or None.
    config: Any
    #: The target model (an MTP drafter reads the architecture's own ``model.mtp``).
    model: CausalLM
    vocab_size: int
    #: The target checkpoint's config.json (a drafter trained for a target checks it fits).
    model_config: Mapping[str, Any] = attrs.field(factory=dict)
    device: torch.device
    block_size: int
    measure_steps_per_second: StepsPerSecondProbe
    allocate_kv_caches: KVCacheAllocator
    #: Loads a block drafter's checkpoint for this target, its layers on the target's
    #: attention backend (which has what the record's ``requirements`` asked for) and dtype
    #: (None: no loader here).
    load_draft_model: DraftModelLoader | None = None
    #: Builds the platform's quantised-linear kernel, for a drafter whose weights are kept
    #: quantised (``[dspark] draft_quantization``); None: the platform has none.
    build_quantized_linear: Callable[[], QuantizedLinearKernel] | None = None
    #: Expert-parallel ranks the target's MoE layers exchange tokens with (1: none).
    expert_parallel_size: int = 1
    #: Under expert parallelism (None: one process): a policy that runs MoE layers outside
    #: the target's forward (an MTP drafter) passes them here, in the order its forward runs
    #: them, and calls the function it gets back before each such forward, on the device
    #: thread (``observe``) only. Peers then run those layers with no tokens meanwhile, so
    #: the token exchanges pair up (``powertrain.parallel.lockstep``).
    join_expert_rounds: ExpertRounds | None = None


@runtime_checkable
class SpeculativePolicy(Protocol):
    """Drafts tokens, decides how many to verify, and verifies them losslessly.

    Built by its record's factory from a ``SpeculativeContext``. Everything runs on the
    device thread: ``propose`` before the step's forward (the step before has run by then,
    so every token so far is known), ``verify`` and ``observe`` after it.
    """

    #: The most drafts ``propose`` gives one sequence in a step: the engine reserves cache
    #: blocks for that many before the step.
    max_draft_tokens: int
    #: Optional, found by name: the target's hidden states the drafter reads
    #: (``HiddenTap``, handed over in ``ExecutedStep.taps``); assembly refuses a model that
    #: does not produce them.
    #: taps: tuple[HiddenTap, ...]

    def propose(self, slots: Sequence[DraftSlot], batch: VerifyBatch) -> Proposal:
        """Draft tokens and confidences per slot, and how many of each to verify this step
        (one decision: a drafter that drafts position by position need not draft past
        what is verified)."""
        ...

    def verify(
        self, proposal: Proposal, lengths: Sequence[int], target_logits: Sequence[torch.Tensor]
    ) -> list[list[int]]:
        """Per slot with a length > 0: the target's logits ``[1 + length, vocab]`` at
        the slot's verified rows -> the tokens it keeps (accepted drafts, then one token
        sampled from the target: the correction or the bonus). Lossless rejection
        sampling with the slots' own generators (``sampling.target_probs`` is the
        target's distribution); greedy slots accept on argmax match."""
        ...

    def observe(self, step: ExecutedStep) -> None:
        """Every executed step, for drafters that keep state."""
        ...
