"""The MTP drafter: a DeepSeek checkpoint's multi-token-prediction layer drafts for DSpark.

Depth 0 of the MTP (``model.mtp``) maps the target's final hidden state h_i and the
token t_{i+1} to a hidden state g_i whose logits predict t_{i+2}. Its decoder block
attends over its own latent cache — one entry per position, in the target's blocks —
so the drafter keeps that cache in step with the target's.

Catch-up (``observe``, on the device thread after every forward). Each position i whose
next token is known gets its entry from (h_i, t_{i+1}): every row of a prompt chunk but
the last (its next token is the next chunk's first: that row waits, with its h, until
the chunk comes); for a sequence that sampled, its rows up to the last accepted draft,
the one after that being followed by the sampled token. Rejected drafts' rows are
skipped: those slots are written again when the positions are computed for real. The
output at a sampling sequence's last row is the *tail* its next drafts grow from.

Drafting reuses depth 0 recursively: draft 1 comes from the tail's logits, draft k+1
from g at position P+k, computed from (g at P+k-1, draft k). These entries are
provisional (catch-up rewrites them); positions in blocks the sequence does not own yet
go to private scratch blocks, so no other sequence's entries are touched. All sequences
draft together, one MTP forward per draft depth. Drafts are made at the end of
``observe`` for the sequences that speculated in the step (their sampling settings are
known); ``propose`` drafts the others (a sequence's first decode after its prompt) on
the spot, except under expert parallelism (see ``MTPDrafter._expert_round``). Greedy
requests draft the argmax; sampling requests draw from the MTP's distribution processed
like the target's (temperature, top-k/p, min-p) with the request's generator, and
verification gets that distribution as q.

Confidence of draft k: the confidence head's (``confidence_head.py``) over the hidden
state that produced draft k's distribution and the token before draft k, or without a
head the largest probability of that distribution. Both are functions of the prefix and
the drafts before k, never of draft k.

A prefix-cache hit shares a block's MTP entries along with the target's; the entry at
a block's last position was computed with the writer's next token, which the sharer
may not have. Its drafts can then be worse, never wrong: verification decides.

What h is: the target's final hidden state (DeepSeek-V3), or the hidden state the MTP
says it reads in its place (``mtp.reads``, a ``HiddenTap``: DeepSeek-V4's streams before
the hyper head), which the drafter then asks the target's forward for (``taps``) and finds
in each step's ``taps``. g is whatever the MTP's depth returns (V4: its output streams),
and the confidence head reads g through ``mtp.collapse`` where the MTP has one. The MTP
layer's cache may hold several retention classes (V4's sliding window and compressor
rows): each class has its own block tables, taken from the step's, and its own scratch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from powertrain.interfaces import AttentionMetadata, DraftSlot, ExecutedStep, HiddenTap, SamplingParams
from powertrain_dspark.confidence_head import ConfidenceHead, ConfidenceLog, acceptance_probability, head_features
from powertrain_dspark.drafter import DraftBatch, draw_drafts

#: Private blocks for draft positions past a sequence's own blocks (a sequence needs at
#: most two per step for up to 16 drafts at block size 16; more sequences than fit
#: draft in several groups), in each retention class.
SCRATCH_BLOCKS = 128
#: A sequence not seen in this many steps is forgotten (finished or aborted).
FORGET_AFTER_STEPS = 256

NO_MTP = (
    "[dspark] drafter = 'mtp' needs a checkpoint with MTP layers (num_nextn_predict_layers > 0); use drafter = 'ngram'"
)


#: A sequence's block list in each retention class of the MTP layer's cache (window -> blocks).
Blocks = dict[int | None, list[int]]


@attrs.define
class _Tail:
    """Where a sequence's drafts start: g at ``position``, whose entries up to it are
    written, followed by ``token``; ``blocks`` are the blocks the sequence owned then."""

    hidden: torch.Tensor
    position: int
    token: int
    blocks: Blocks

    @property
    def num_blocks(self) -> int:
        return len(next(iter(self.blocks.values())))

    def fits(self, token_ids: Sequence[int]) -> bool:
        return len(token_ids) == self.position + 2 and token_ids[-1] == self.token


@attrs.frozen
class _Drafts:
    tokens: list[int]
    confidences: list[float]
    probs: torch.Tensor | None  # [len, vocab] on the CPU, for sampled drafts
    features: torch.Tensor | None = None  # [len, 2H], only while logging

    def first(self, n: int) -> _Drafts:
        return _Drafts(
            self.tokens[:n],
            self.confidences[:n],
            None if self.probs is None else self.probs[:n],
            None if self.features is None else self.features[:n],
        )


@attrs.define
class _Sequence:
    seen: int  # the last step the sequence was in
    pending: tuple[torch.Tensor, int] | None = None  # a prompt chunk's last row: (h, position)
    tail: _Tail | None = None
    ready: _Drafts | None = None  # drafted from ``tail`` at the end of the step
    proposed: _Drafts | None = None  # what the last propose handed out (kept while logging)


@attrs.define
class _Rows:
    """One sequence's catch-up: the rows of h to read (the step's, or a waiting one's),
    each with the token after it, at positions ``first`` on."""

    index: int  # in the step's batch
    first: int
    sources: list[int] = attrs.field(factory=list)
    next_tokens: list[int] = attrs.field(factory=list)

    def add(self, source: int, next_token: int) -> None:
        self.sources.append(source)
        self.next_tokens.append(next_token)

    @property
    def end(self) -> int:
        return self.first + len(self.sources)


@attrs.frozen
class _Job:
    tail: _Tail
    params: SamplingParams
    generator: torch.Generator | None
    count: int


class MTPDrafter:
    def __init__(
        self,
        model: Any,
        kv_cache: Any,
        scratch_blocks: Mapping[int | None, Sequence[int]],
        *,
        block_size: int,
        device: torch.device,
        max_draft_tokens: int,
        head: ConfidenceHead | None = None,
        expert_round: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self.mtp = model.mtp
        self.embed = _embedding(model)
        reads: HiddenTap | None = getattr(self.mtp, "reads", None)
        #: The target's hidden states the drafter reads (``SpeculativePolicy.taps``): none
        #: when the MTP reads the final hidden state (``ExecutedStep.hidden``).
        self.taps: tuple[HiddenTap, ...] = () if reads is None else (reads,)
        #: Where the confidence head reads g: through the MTP's hyper head where it has one.
        self._head_state = getattr(self.mtp, "collapse", None)
        self.kv_cache = kv_cache
        #: Private block ids per retention class of the cache, as many in each, used index by index.
        self.scratch_blocks = {window: list(ids) for window, ids in scratch_blocks.items()}
        self.block_size = block_size
        self.device = device
        self.max_draft_tokens = max_draft_tokens
        self.head = head
        #: Set to collect the confidence head's training data (verified drafts only).
        self.log: ConfidenceLog | None = None
        self._sequences: dict[int, _Sequence] = {}
        self._slots: dict[int, DraftSlot] = {}  # this step's proposal's slots
        self._drafted: list[_Sequence] = []  # sequences drafted for at the end of the last step
        self._step = 0
        #: Under expert parallelism: opens a drafter round before each MTP forward (its MoE
        #: layer exchanges tokens with every rank), which happens in ``observe`` only: a
        #: sequence's first decode after its prompt then has no drafts (none are made on the
        #: spot in ``propose``, before the step's own round, where none can pair with the peers').
        self._expert_round = expert_round

    @classmethod
    def from_context(cls, context: Any, config: Any) -> MTPDrafter:
        """The drafter of ``context.model``; raises ValueError when it has no MTP layers."""
        mtp = getattr(context.model, "mtp", None)
        if mtp is None:
            raise ValueError(NO_MTP)
        expert_round = None
        if context.join_expert_rounds is not None:
            expert_round = context.join_expert_rounds(mtp.routed_expert_layers(0))
        # Only depth 0 drafts (recursively), so only its cache is kept.
        layer = mtp.attention_layers[0]
        (cache,) = context.allocate_kv_caches([layer], extra_blocks=SCRATCH_BLOCKS)
        for tensor in cache.values():
            tensor.zero_()  # an entry never written (see the module doc) must not be NaN
        # A class's extra blocks are its last ids. A sliding class's pool ends in a null
        # block of its own, which no block table names: it serves as scratch, while the id
        # the target's tables use for their null block (the first extra one) is left zero.
        scratch = {}
        for name, tensor in cache.items():
            total = tensor.shape[0]
            scratch[layer.window_of(name)] = range(total - SCRATCH_BLOCKS, total)
        head = None
        if config.confidence_head:
            hidden_size = _embedding(context.model).embedding_dim
            head = ConfidenceHead.load(config.confidence_head, hidden_size).to(context.device)
        return cls(
            context.model,
            cache,
            scratch,
            block_size=context.block_size,
            device=context.device,
            max_draft_tokens=config.max_draft_tokens,
            head=head,
            expert_round=expert_round,
        )

    # -- before the step's forward ----------------------------------------------------------

    @torch.inference_mode()
    def propose(self, slots: Sequence[DraftSlot]) -> DraftBatch:
        """Drafts, raw confidences and draft distributions per slot."""
        chosen: list[_Drafts | None] = [None] * len(slots)
        lazy: list[int] = []
        for i, slot in enumerate(slots):
            state = self._sequences.get(slot.seq_id)
            if state is None or state.tail is None or not state.tail.fits(slot.token_ids):
                continue  # nothing to draft from (cannot happen after a step that sampled it)
            if state.ready is not None:
                chosen[i] = state.ready
            elif self._expert_round is None:
                lazy.append(i)
        for state in self._drafted:  # drafts nobody asked for (finished or not scheduled)
            state.ready = None
        self._drafted = []
        jobs = [self._job(slots[i], self._sequences[slots[i].seq_id].tail) for i in lazy]  # type: ignore[arg-type]
        for i, drafts in zip(lazy, self._draft(jobs), strict=True):
            chosen[i] = drafts
        self._slots = {slot.seq_id: slot for slot in slots}
        tokens, confidences, probs = [], [], []
        for slot, drafts in zip(slots, chosen, strict=True):
            drafts = drafts.first(min(self.max_draft_tokens, slot.max_draft)) if drafts else _Drafts([], [], None)
            state = self._sequences.get(slot.seq_id)
            if self.log is not None and state is not None:
                state.proposed = drafts
            tokens.append(drafts.tokens)
            confidences.append(drafts.confidences)
            probs.append(drafts.probs)
        return DraftBatch(tokens=tokens, confidences=confidences, draft_probs=probs)

    def record(self, seq_id: int, verified: int, accepted: int) -> None:
        """Nothing to learn online: the MTP's confidences come from the model (and the
        head, trained offline)."""

    def _job(self, slot: DraftSlot, tail: _Tail, gained: int = 0) -> _Job:
        return _Job(tail, slot.params, slot.generator, min(self.max_draft_tokens, slot.max_draft - gained))

    # -- after the step's forward -----------------------------------------------------------

    @torch.inference_mode()
    def observe(self, step: ExecutedStep) -> None:
        self._step += 1
        if self.log is not None:
            self._log_verified(step)
        kept = dict(zip(step.seq_ids, step.accepted, strict=True))
        jobs, owners = [], []
        for seq_id, tail in self._catch_up(step).items():
            state = self._sequences[seq_id]
            state.tail, state.ready = tail, None
            slot = self._slots.get(seq_id)  # it speculated: it still may, with the same settings
            if slot is not None:
                job = self._job(slot, tail, gained=len(kept[seq_id]))
                if job.count > 0:
                    jobs.append(job)
                    owners.append(state)
        for state, drafts in zip(owners, self._draft(jobs), strict=True):
            state.ready = drafts
        self._drafted = owners
        self._slots = {}  # they were this step's
        stale = [s for s, state in self._sequences.items() if state.seen < self._step - FORGET_AFTER_STEPS]
        for seq_id in stale:
            del self._sequences[seq_id]

    def _catch_up(self, step: ExecutedStep) -> dict[int, _Tail]:
        """Write the MTP entries of the step's rows whose next token is known (module
        doc); returns the tail of every sequence that sampled."""
        metadata = step.metadata
        starts, contexts = metadata.query_start_loc_host, metadata.context_lens_host
        input_ids = step.input_ids.tolist()
        tables = {window: metadata.for_window(window).block_tables.tolist() for window in self.scratch_blocks}
        source = step.taps[0] if self.taps else step.hidden  # h of each of the step's rows
        deferred: list[torch.Tensor] = []  # waiting rows' h, indexed after the step's rows
        work: list[_Rows] = []
        for i, seq_id in enumerate(step.seq_ids):
            state = self._sequences.setdefault(seq_id, _Sequence(seen=self._step))
            state.seen = self._step
            if state.tail is not None and contexts[i] <= state.tail.position:
                # Recomputed (preempted): the tail's blocks were freed and may hold another
                # sequence's entries now; it drafts again from the tail this recomputation ends in.
                state.tail = state.ready = None
            start, end = starts[i], starts[i + 1]
            rows = _Rows(i, first=contexts[i])
            if state.pending is not None and state.pending[1] == rows.first - 1:
                rows.add(len(source) + len(deferred), input_ids[start])
                deferred.append(state.pending[0])
                rows.first -= 1
            state.pending = None
            kept = step.accepted[i]
            if kept:  # rows up to the last accepted draft; the sampled token follows it
                last = end - 1 - step.num_drafts[i] + len(kept) - 1
                for row in range(start, last + 1):
                    rows.add(row, input_ids[row + 1] if row < last else kept[-1])
            else:  # a prompt chunk: its last row waits for the next chunk's first token
                for row in range(start, end - 1):
                    rows.add(row, input_ids[row + 1])
                state.pending = (source[end - 1].clone(), contexts[i] + end - 1 - start)
            if rows.sources:
                work.append(rows)
        if not work:
            return {}
        work.sort(key=lambda rows: len(rows.sources) != 1)  # one-token sequences first (the metadata contract)
        catch_up = AttentionMetadata.build(
            query_lens=[len(rows.sources) for rows in work],
            seq_lens=[rows.end for rows in work],
            block_tables={
                window: [table[rows.index][: -(-rows.end // self.block_size)] for rows in work]
                for window, table in tables.items()
            },
            block_size=self.block_size,
            device=self.device,
        )
        hidden = torch.cat([source, torch.stack(deferred)]) if deferred else source
        sources = torch.tensor([r for rows in work for r in rows.sources], device=self.device)
        output = self._forward(
            torch.tensor([t for rows in work for t in rows.next_tokens], device=self.device),
            torch.tensor([p for rows in work for p in range(rows.first, rows.end)], device=self.device),
            hidden[sources],
            self.kv_cache,
            catch_up,
        )
        tails = {}
        for rows, last in zip(work, catch_up.query_start_loc_host[1:], strict=True):
            kept = step.accepted[rows.index]
            if kept:
                owned = -(-metadata.seq_lens_host[rows.index] // self.block_size)
                blocks = {window: table[rows.index][:owned] for window, table in tables.items()}
                tail = _Tail(output[last - 1].clone(), rows.end - 1, kept[-1], blocks)
                tails[step.seq_ids[rows.index]] = tail
        return tails

    def _draft(self, jobs: Sequence[_Job]) -> list[_Drafts]:
        """Draft for every job, in groups whose scratch blocks fit."""
        results: list[_Drafts] = []
        group: list[_Job] = []
        used = 0
        available = len(next(iter(self.scratch_blocks.values())))
        for job in jobs:
            needed = self._scratch_needed(job)
            if group and used + needed > available:
                results += self._draft_group(group)
                group, used = [], 0
            group.append(job)
            used += needed
        if group:
            results += self._draft_group(group)
        return results

    def _scratch_needed(self, job: _Job) -> int:
        blocks = (job.tail.position + job.count - 1) // self.block_size + 1  # through the last draft position
        return max(0, blocks - job.tail.num_blocks)

    def _draft_group(self, jobs: Sequence[_Job]) -> list[_Drafts]:
        scratch = iter(range(len(next(iter(self.scratch_blocks.values())))))  # an index into each class's
        tables: list[Blocks] = []
        for job in jobs:
            blocks = (job.tail.position + job.count - 1) // self.block_size + 1
            private = [next(scratch) for _ in range(self._scratch_needed(job))]
            tables.append(
                {
                    window: own[:blocks] + [self.scratch_blocks[window][i] for i in private]
                    for window, own in job.tail.blocks.items()
                }
            )
        tokens: list[list[int]] = [[] for _ in jobs]
        confidences: list[list[float]] = [[] for _ in jobs]
        probs: list[list[torch.Tensor]] = [[] for _ in jobs]
        features: list[list[torch.Tensor]] = [[] for _ in jobs]
        hidden = torch.stack([job.tail.hidden for job in jobs])  # produces each active job's next draft
        previous = torch.tensor([job.tail.token for job in jobs], device=self.device)  # the token before it
        active = list(range(len(jobs)))
        for depth in range(max(job.count for job in jobs)):
            logits = self.mtp.compute_logits(0, hidden).float()
            chosen, raw, q = self._choose(logits, [jobs[i] for i in active])
            feats = None
            if self.head is not None or self.log is not None:
                state = hidden if self._head_state is None else self._head_state(0, hidden)
                feats = head_features(state, self.embed(previous))
                if self.head is not None:
                    raw = self.head.confidence(feats).tolist()
            for row, i in enumerate(active):
                tokens[i].append(chosen[row])
                confidences[i].append(raw[row])
                if q[row] is not None:
                    probs[i].append(q[row])
                if self.log is not None:
                    features[i].append(feats[row].cpu())  # type: ignore[index]
            going = [row for row, i in enumerate(active) if len(tokens[i]) < jobs[i].count]
            if not going:
                break
            active = [active[row] for row in going]
            positions = [jobs[i].tail.position + depth + 1 for i in active]
            metadata = AttentionMetadata.build(
                query_lens=[1] * len(active),
                seq_lens=[p + 1 for p in positions],
                block_tables={window: [tables[i][window] for i in active] for window in self.scratch_blocks},
                block_size=self.block_size,
                device=self.device,
            )
            previous = torch.tensor([chosen[row] for row in going], device=self.device)
            index = torch.tensor(going, device=self.device)
            hidden = self._forward(
                previous, torch.tensor(positions, device=self.device), hidden[index], self.kv_cache, metadata
            )
        return [
            _Drafts(
                tokens[i],
                confidences[i],
                torch.stack(probs[i]) if probs[i] else None,
                torch.stack(features[i]) if self.log is not None else None,
            )
            for i in range(len(jobs))
        ]

    def _forward(self, *args: Any) -> torch.Tensor:
        """Depth 0 of the MTP, in a drafter round of its own under expert parallelism."""
        if self._expert_round is not None:
            self._expert_round()
        return self.mtp(0, *args)

    def _choose(
        self, logits: torch.Tensor, jobs: Sequence[_Job]
    ) -> tuple[list[int], list[float], list[torch.Tensor | None]]:
        """Each row's draft, the largest probability of the distribution it came from,
        and that distribution for sampled drafts (None for greedy ones)."""
        return draw_drafts(logits, [job.params for job in jobs], [job.generator for job in jobs])

    def _log_verified(self, step: ExecutedStep) -> None:
        """Log each verified draft's features with its acceptance probability, from the
        target's rows that verified it (they see the drafts before it)."""
        assert self.log is not None
        starts = step.metadata.query_start_loc_host
        for i, (seq_id, verified) in enumerate(zip(step.seq_ids, step.num_drafts, strict=True)):
            state = self._sequences.get(seq_id)
            if not verified or state is None or state.proposed is None or state.proposed.features is None:
                continue
            drafts = state.proposed.first(verified)
            state.proposed = None
            target = self.model.compute_logits(step.hidden[starts[i] : starts[i] + verified]).float().cpu()
            labels = acceptance_probability(target, drafts.tokens, drafts.probs, self._slots[seq_id].params)
            self.log.add(drafts.features, labels, drafts.confidences)  # type: ignore[arg-type]


def _embedding(model: Any) -> torch.nn.Embedding:
    """The target's token embedding: where its MTP says (``mtp.embed_tokens``, V4's), else
    where DeepSeek-V3 keeps it."""
    mtp = model.mtp
    return mtp.embed_tokens if hasattr(mtp, "embed_tokens") else model.model.embed_tokens
