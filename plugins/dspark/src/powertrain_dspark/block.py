"""The block drafter: a DSpark drafter network (``interfaces.BlockDraftModel``) drafting for
the engine. Two networks implement it: DeepSpec's checkpoints for Qwen3 and Gemma 4 targets
(``powertrain.models.dspark``, ``[dspark] draft_model``), and the drafter a target's
checkpoint carries itself (DeepSeek-V4.1's ``mtp.*``, the target's ``model.dspark``), used
when no ``draft_model`` is named.

Context (``observe``, after every forward). The drafter keeps, in a paged cache laid
out like the target's and indexed by the same (full-history) block tables, each layer's
context entries of every position whose target hidden state is final: all rows of a
prompt chunk, and for a sequence that sampled its rows up to the last accepted draft.
They are computed from the step's taps (``HiddenTap``) and written in one forward. Rejected
drafts' rows are never written, so rejection needs no rollback; positions before the
first row a sequence computes (a prefix-cache hit) were written by the sequence that
computed them, and an entry depends only on the target's hidden state there, so the hit
is exact.

Drafting (``propose``). Each slot whose context is complete up to its last token (the
anchor) drafts one block: the anchor and mask tokens at the positions after it, attended
both ways and over the context (``AttentionLayerSpec.causal`` False), all slots in one
forward. The block's keys and values are written after the context, in the sequence's
own blocks or, past them, in private scratch blocks; the context entries written later
overwrite them, and nothing reads them before. The block's base logits come from the
drafter's head, or from the target's where they are the same weights (``shared_head``:
DeepSpec freezes a copy of the target's head in its drafters, and the target's is often a
quantised kernel, several times cheaper). Drafts are then drawn one after another, on demand
(``session``: the length rule draws only the drafts it verifies, ``lengths``' module
doc): each draft's logits are the block's plus the Markov bias of the draft before it
(the anchor for the first), greedy requests take the argmax, sampling requests draw from
that distribution processed as the target's (verification's q). The confidence of a
draft is the confidence head's, from its block output and the token before it, known
before the draft's logits are computed; without a head, its distribution's largest
probability.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import structlog
import torch

from powertrain.interfaces import AttentionMetadata, BlockDraftModel, DraftSlot, ExecutedStep
from powertrain.interfaces.quantized import keep_linears_as_q8
from powertrain_dspark.drafter import DraftBatch, draw_drafts

#: Private blocks for block positions past a sequence's own blocks (a block of up to 16
#: drafts needs at most two per sequence at block size 16; more sequences than fit draft
#: in several groups).
SCRATCH_BLOCKS = 128
#: A sequence not seen in this many steps is forgotten (finished or aborted).
FORGET_AFTER_STEPS = 256

#: A drafter head agrees with the target's on probe rows within this, relative to the largest
#: logit: the same weights (DeepSpec copies the target's head into the drafter and freezes it)
#: differ only by float32 summation order (K * 2**-24 for K = hidden <= 8,192 terms: 5e-4).
SAME_HEAD_TOLERANCE = 1e-3

log = structlog.get_logger(__name__)

NO_MODEL = (
    "[dspark] drafter = 'block' needs draft_model = <folder of a DeepSpec DSpark drafter>: the target's "
    "checkpoint carries no DSpark drafter of its own"
)


@attrs.define
class _Context:
    seen: int  # the last step the sequence ran in
    written: int  # the drafter's entries cover positions below this
    blocks: list[int]  # the sequence's blocks when it last ran


@attrs.frozen
class _Job:
    index: int  # the slot's, in the proposal
    slot: DraftSlot
    anchor: int  # the anchor's position
    count: int  # drafts wanted
    table: list[int]  # blocks covering the anchor's block


class BlockDrafter:
    def __init__(
        self,
        model: BlockDraftModel,
        caches: Sequence[Any],
        scratch_blocks: Sequence[int],
        *,
        block_size: int,
        device: torch.device,
        max_draft_tokens: int,
    ) -> None:
        self.model = model
        self.caches = list(caches)
        self.scratch_blocks = list(scratch_blocks)
        self.block_size = block_size  # the cache's
        self.device = device
        self.draft_block = model.block_size
        self.max_draft_tokens = min(max_draft_tokens, self.draft_block)
        self.mask_token_id = model.mask_token_id
        #: The target's hidden states the drafter reads, in the order its ``context`` takes them.
        self.taps = tuple(model.taps)
        #: Block outputs -> base logits: the drafter's own head, or the target's where they are
        #: the same weights (``shared_head``).
        self.base_logits: Callable[[torch.Tensor], torch.Tensor] = model.base_logits
        self._contexts: dict[int, _Context] = {}
        self._step = 0

    @classmethod
    def from_context(cls, context: Any, config: Any) -> BlockDrafter:
        """The drafter ``[dspark] draft_model`` names, for the target of ``context``; without
        one, the target's own (``model.dspark``)."""
        if config.draft_quantization == "q8" and not config.draft_model:
            raise ValueError(
                "[dspark] draft_quantization = 'q8' rounds a drafter loaded from draft_model; the target's own "
                "drafter shares the target's weights and keeps them as loaded"
            )
        if config.draft_quantization == "q8" and context.build_quantized_linear is None:
            raise ValueError(
                "[dspark] draft_quantization = 'q8': this platform has no quantised-linear kernel; "
                "use draft_quantization = 'none'"
            )
        model: BlockDraftModel
        if config.draft_model:
            if context.load_draft_model is None:
                raise ValueError("[dspark] drafter = 'block': this engine cannot load a drafter checkpoint")
            model = context.load_draft_model(config.draft_model)
        else:
            own = getattr(context.model, "dspark", None)
            if own is None:
                raise ValueError(NO_MODEL)
            if context.expert_parallel_size > 1:
                raise ValueError(
                    "[dspark] the target's own DSpark drafter runs MoE layers outside the target's forward, "
                    "which expert parallelism does not support yet; use parallel.expert_parallel = 1"
                )
            model = own
        caches = context.allocate_kv_caches(model.attention_layers, extra_blocks=SCRATCH_BLOCKS)
        for cache in caches:
            for tensor in cache.values():
                tensor.zero_()  # never-written slots past a sequence's end must not be NaN
        total = next(iter(caches[0].values())).shape[0]
        drafter = cls(
            model,
            caches,
            range(total - SCRATCH_BLOCKS, total),
            block_size=context.block_size,
            device=context.device,
            max_draft_tokens=config.max_draft_tokens,
        )
        shared = bool(config.draft_model) and shared_head(model, context.model, context.device)
        if shared:
            drafter.base_logits = context.model.compute_logits
            log.info("block drafter's head is the target's: its logits come from the target's head")
        if config.draft_quantization == "q8":
            rounded = keep_linears_as_q8(model, context.build_quantized_linear(), skip=("lm_head",) if shared else ())
            log.info("block drafter's linear weights kept as q8", linears=rounded)
        return drafter

    # -- after each forward -------------------------------------------------------------------

    @torch.inference_mode()
    def observe(self, step: ExecutedStep) -> None:
        self._step += 1
        metadata = step.metadata
        starts, contexts = metadata.query_start_loc_host, metadata.context_lens_host
        tables = metadata.for_window(None).block_tables.tolist()  # the drafter's cache keeps all history
        writes: list[tuple[int, int, int, list[int]]] = []  # (first row, rows, seq_len, blocks) per sequence
        for i, seq_id in enumerate(step.seq_ids):
            first = contexts[i]  # earlier positions: written before, or by a prefix's writer
            computed = starts[i + 1] - starts[i]
            kept = step.accepted[i]
            final = computed - step.num_drafts[i] + len(kept) - 1 if kept else computed
            blocks = tables[i][: -(-metadata.seq_lens_host[i] // self.block_size)]
            state = self._contexts.setdefault(seq_id, _Context(self._step, 0, blocks))
            state.seen, state.written, state.blocks = self._step, first + final, blocks
            if final:
                writes.append((starts[i], final, first + final, blocks))
        self._write(step, writes)
        stale = [s for s, state in self._contexts.items() if state.seen < self._step - FORGET_AFTER_STEPS]
        for seq_id in stale:
            del self._contexts[seq_id]

    def _write(self, step: ExecutedStep, writes: list[tuple[int, int, int, list[int]]]) -> None:
        """The context entries of the step's final rows, in one forward (one-row sequences
        first, as the metadata contract orders them)."""
        if not writes:
            return
        writes = sorted(writes, key=lambda write: write[1] != 1)
        metadata = AttentionMetadata.build(
            query_lens=[count for _, count, _, _ in writes],
            seq_lens=[seq_len for _, _, seq_len, _ in writes],
            block_tables=[blocks for _, _, _, blocks in writes],
            block_size=self.block_size,
            device=self.device,
        )
        rows = [row for first, count, _, _ in writes for row in range(first, first + count)]
        positions = [p for _, count, seq_len, _ in writes for p in range(seq_len - count, seq_len)]
        context = self.model.context([tap[torch.tensor(rows, device=self.device)] for tap in step.taps])
        self.model.write_context(context, torch.tensor(positions, device=self.device), self.caches, metadata)

    # -- before each forward ------------------------------------------------------------------

    def session(self, slots: Sequence[DraftSlot]) -> _BlockSession:
        """Every slot's block in one forward; its drafts drawn on demand (``DraftSession``)."""
        return self._open(slots)

    def propose(self, slots: Sequence[DraftSlot]) -> DraftBatch:
        """Every slot's whole block of drafts."""
        session = self._open(slots)
        session.draw_all()
        return session.drafts()

    @torch.inference_mode()
    def _open(self, slots: Sequence[DraftSlot]) -> _BlockSession:
        jobs: list[_Job] = []
        for i, slot in enumerate(slots):
            state = self._contexts.get(slot.seq_id)
            anchor = len(slot.token_ids) - 1
            count = min(self.max_draft_tokens, slot.max_draft)
            if state is None or state.written != anchor or count <= 0:
                continue  # no complete context to draft from (cannot happen after a step that sampled it)
            owned = -(-anchor // self.block_size)  # blocks holding the context
            jobs.append(_Job(i, slot, anchor, count, state.blocks[:owned]))
        hidden: dict[int, torch.Tensor] = {}
        for group in self._groups(jobs):
            for job, block in zip(group, self._block(group), strict=True):
                hidden[job.index] = block
        return _BlockSession(self, len(slots), jobs, hidden)

    def record(self, seq_id: int, verified: int, accepted: int) -> None:
        """Nothing to learn online: the confidences come from the drafter's trained head."""

    def _blocks_needed(self, job: _Job) -> int:
        """Blocks through the block's last position."""
        return -(-(job.anchor + self.draft_block) // self.block_size)

    def _groups(self, jobs: list[_Job]) -> list[list[_Job]]:
        """Jobs in groups whose scratch blocks fit."""
        groups: list[list[_Job]] = []
        used = len(self.scratch_blocks) + 1
        for job in jobs:
            needed = self._blocks_needed(job) - len(job.table)
            if used + needed > len(self.scratch_blocks):
                groups.append([])
                used = 0
            groups[-1].append(job)
            used += needed
        return groups

    def _block(self, jobs: Sequence[_Job]) -> torch.Tensor:
        """One block per job in one forward: the outputs ``[jobs, block, hidden]``."""
        size = self.draft_block
        scratch = iter(self.scratch_blocks)
        tables = [job.table + [next(scratch) for _ in range(self._blocks_needed(job) - len(job.table))] for job in jobs]
        metadata = AttentionMetadata.build(
            query_lens=[size] * len(jobs),
            seq_lens=[job.anchor + size for job in jobs],
            block_tables=tables,
            block_size=self.block_size,
            device=self.device,
        )
        ids = [tok for job in jobs for tok in (job.slot.token_ids[-1], *(self.mask_token_id,) * (size - 1))]
        positions = [p for job in jobs for p in range(job.anchor, job.anchor + size)]
        return self.model.block(
            torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device), self.caches, metadata
        ).view(len(jobs), size, -1)


class _BlockSession:
    """One step's blocks, their drafts drawn one position at a time on demand. A draft's
    logits (the base logits through the head and the Markov bias over the vocabulary, most
    of drafting's cost) are computed when it is drawn; its confidence, from the confidence
    head, before (it needs the block output and the draft before it only). Without a
    confidence head a draft's confidence is its distribution's largest probability, so its
    logits come first."""

    def __init__(self, drafter: BlockDrafter, slots: int, jobs: Sequence[_Job], hidden: dict[int, torch.Tensor]):
        self.drafter = drafter
        self.model = drafter.model
        self.device = drafter.device
        self.jobs = {job.index: job for job in jobs}
        self.hidden = hidden  # row -> its block's outputs [block, hidden]
        self.tokens: list[list[int]] = [[] for _ in range(slots)]
        self.raw: list[list[float]] = [[] for _ in range(slots)]
        self.probs: list[list[torch.Tensor]] = [[] for _ in range(slots)]
        self.upcoming: dict[int, float] = {}  # row -> the raw confidence of its next draft
        self.ready: dict[int, tuple[int, torch.Tensor | None]] = {}  # row -> its next draft (headless drafters)
        self._prepare(sorted(self.jobs))

    def confidence(self, row: int, position: int) -> float | None:
        drawn = self.raw[row]
        if position <= len(drawn):
            return drawn[position - 1]
        if position != len(drawn) + 1:
            raise ValueError(f"slot {row}: confidence of draft {position} asked before draft {position - 1} was drawn")
        return self.upcoming.get(row)

    @torch.inference_mode()
    def draw(self, wanted: Sequence[tuple[int, int]]) -> None:
        rows = []
        for row, position in wanted:
            if position <= len(self.tokens[row]):
                continue
            if position != len(self.tokens[row]) + 1 or row not in self.upcoming:
                raise ValueError(f"slot {row}: draft {position} cannot be drawn (it has {len(self.tokens[row])})")
            rows.append(row)
        computed = [row for row in rows if row not in self.ready]
        if computed:
            chosen, _, q = self._choose(computed)
            for row, token, dist in zip(computed, chosen, q, strict=True):
                self.ready[row] = (token, dist)
        for row in rows:
            token, dist = self.ready.pop(row)
            self.tokens[row].append(token)
            self.raw[row].append(self.upcoming.pop(row))
            if dist is not None:
                self.probs[row].append(dist)
        self._prepare(rows)

    def draw_all(self) -> None:
        """Every draft of every block, position by position."""
        while self.upcoming:
            self.draw([(row, len(self.tokens[row]) + 1) for row in sorted(self.upcoming)])

    def drafts(self) -> DraftBatch:
        probs = [torch.stack(p) if p else None for p in self.probs]
        return DraftBatch(tokens=self.tokens, confidences=self.raw, draft_probs=probs)

    def _previous(self, rows: Sequence[int]) -> torch.Tensor:
        """Each row's token before its next draft: its last draft, or the anchor."""
        previous = [self.tokens[row][-1] if self.tokens[row] else self.jobs[row].slot.token_ids[-1] for row in rows]
        return torch.tensor(previous, device=self.device)

    def _outputs(self, rows: Sequence[int]) -> torch.Tensor:
        """Each row's block output at its next draft."""
        return torch.stack([self.hidden[row][len(self.tokens[row])] for row in rows])

    def _choose(self, rows: Sequence[int]) -> tuple[list[int], list[float], list[torch.Tensor | None]]:
        """The next draft of each row: its logits, the token and (sampling) q."""
        out = self._outputs(rows)
        logits = self.model.corrected_logits(self.drafter.base_logits(out), self._previous(rows), out)
        jobs = [self.jobs[row] for row in rows]
        return draw_drafts(logits, [job.slot.params for job in jobs], [job.slot.generator for job in jobs])

    def _prepare(self, rows: Sequence[int]) -> None:
        """The confidence of each row's next draft, where it has one."""
        rows = [row for row in rows if len(self.tokens[row]) < self.jobs[row].count]
        if not rows:
            return
        head = self.model.confidence(self._outputs(rows), self._previous(rows))
        if head is not None:
            self.upcoming.update(zip(rows, head.tolist(), strict=True))
            return
        chosen, raw, q = self._choose(rows)
        for row, token, confidence, dist in zip(rows, chosen, raw, q, strict=True):
            self.ready[row] = (token, dist)
            self.upcoming[row] = confidence


@torch.inference_mode()
def shared_head(model: BlockDraftModel, target: Any, device: torch.device) -> bool:
    """Whether the drafter's head computes the target's logits (DeepSpec's drafters carry a
    frozen copy of the target's head): then the target's head, often a quantised kernel, is
    the cheaper of the two (SmolLM2's 49,152 x 576 head: 45 ms per 7-row block in float32
    on a 2-core CPU, against a few ms through the target's). Checked on random rows, so a
    target whose logits differ from its plain head (a soft cap, a scale) keeps the drafter's."""
    width = int(model.norm.weight.shape[-1])  # type: ignore[attr-defined]
    probe = torch.randn(4, width, generator=torch.Generator().manual_seed(0)).to(device)
    try:
        theirs = target.compute_logits(probe.to(_dtype(target))).float()
    except Exception:  # a target whose head takes other rows: keep the drafter's own
        return False
    ours = model.base_logits(probe.to(_dtype(model))).float()
    if ours.shape != theirs.shape:
        return False
    return bool(((ours - theirs).abs().amax() / ours.abs().amax().clamp_min(1e-30)) <= SAME_HEAD_TOLERANCE)


def _dtype(module: Any) -> torch.dtype:
    for parameter in module.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32
