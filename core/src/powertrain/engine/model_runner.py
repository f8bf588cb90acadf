"""One step on the device: flat batch in, sampled tokens out.

``prepare`` runs on the CPU thread that schedules (it only reads the scheduled
batch); ``execute`` runs on the device thread. Under async scheduling step N+1 is
prepared while step N executes, so N+1 does not yet know the tokens N samples:
those inputs are placeholders, filled in by ``execute`` from N's result, which the
device thread holds because steps execute in order.

Structured output follows the same order: a constrained row's mask for step N+1 is
computed on the grammar worker from N's token while N+1's forward runs, and N+1's
sampler waits for it (see ``structured.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch

from powertrain.engine.cuda_graphs import DecodeGraphs
from powertrain.engine.images import EncodedImages, ImagePiece, image_pieces, model_image_encoder
from powertrain.engine.sampler import Sampler, SamplingInputs
from powertrain.engine.sequence import PLACEHOLDER, SequenceSnapshot, ends_at
from powertrain.engine.sequence import Sequence as Seq
from powertrain.engine.speculative import can_speculate, forward_with_taps, grammar_cut
from powertrain.engine.structured import GrammarState, StructuredOutputs, TokenMasks
from powertrain.interfaces import AttentionMetadata, CausalLM, LayerKVCache, SpeculativePolicy
from powertrain.interfaces.scheduling import ScheduledBatch
from powertrain.interfaces.speculative import DraftSlot, ExecutedStep, HiddenTap, Proposal, VerifyBatch


@attrs.frozen(kw_only=True)
class PreparedStep:
    input_ids: torch.Tensor  # int64 [num_tokens], PLACEHOLDER where step N's token goes
    positions: torch.Tensor  # int64 [num_tokens]
    metadata: AttentionMetadata
    sample_rows: torch.Tensor  # int64 [num_samples]: flat index of each sampling sequence's last token
    sampling: SamplingInputs
    #: Sequence ids in sample order, so the next step can find this step's tokens.
    sampled_seq_ids: list[int]
    #: (flat input row, sequence id) pairs whose token comes from the previous step.
    input_patches: list[tuple[int, int]]
    #: (sample row, sequence id) pairs whose penalty history ends in that token.
    history_patches: list[tuple[int, int]]
    #: Sample rows of constrained sequences (structured output), and their matchers.
    grammar_rows: list[int] = attrs.field(factory=list)
    grammars: list[GrammarState] = attrs.field(factory=list)
    #: The step's drafts and how to verify them (None without speculative decoding).
    speculation: Speculation | None = None
    #: The image span rows the step's tokens cover (``engine.images``); empty for text.
    images: list[ImagePiece] = attrs.field(factory=list)


@attrs.frozen(kw_only=True)
class Speculation:
    """A step's drafts: the policy's proposal and what the runner needs to verify it."""

    proposal: Proposal | None  # None when no sequence could speculate
    lengths: list[int]  # per proposal slot
    #: Per sampling sequence (sample order): its proposal slot, or -1.
    slot_of: list[int]
    #: Per sequence in the batch: its id and how many drafts it carries.
    seq_ids: list[int]
    num_drafts: list[int]


@attrs.frozen(kw_only=True)
class StepResult:
    #: Per sampling sequence (sample order): the tokens it keeps; one, unless it
    #: verified drafts (then the accepted drafts and a sampled token).
    tokens: list[list[int]]
    #: Per sampling sequence: {token id: logprob} of its token and top-k, or None.
    logprobs: list[dict[int, float] | None]
    #: Sequences that were offered drafts, and drafts verified, this step.
    speculated: int = 0
    verified: int = 0
    #: The sampling sequences' ids, in sample order (the device thread may reorder a
    #: speculative step: sequences with drafts go after the one-token ones).
    seq_ids: list[int] = attrs.field(factory=list)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: Sequence[LayerKVCache],
        block_size: int,
        device: torch.device,
        sampler: Sampler,
        structured: StructuredOutputs | None = None,
        speculative: SpeculativePolicy | None = None,
        windows: Sequence[int | None] = (None,),
        serial_torch_tokens: int = 0,
    ) -> None:
        self.model = model
        #: Steps of at most this many tokens run torch's ops on one thread (the quantised
        #: linears bring their own pool; ``QuantizedLinearRecord.own_pool_max_rows``).
        self.serial_torch_tokens = serial_torch_tokens
        #: The block manager's retention classes, in its order (the first is the primary).
        self.windows = tuple(windows)
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        #: Compiles constraints and computes token masks; None: this engine has no structured output.
        self.structured = structured
        #: Verifies drafts (and sees every step); None: no speculative decoding.
        self.speculative = speculative
        #: Expert parallelism: opens a round before every forward so that ranks without
        #: work join this forward's MoE collectives (parallel.lockstep); None: one process.
        self.lockstep: Any = None
        #: Per sequence the last executed step sampled for: the tokens it kept (device thread only).
        self._previous_kept: dict[int, list[int]] = {}
        #: Speculative steps launched before the step ahead of them had run (async scheduling).
        self.overlapped_steps = 0
        #: Sequences left out of an overlapped step because the step before ended them.
        self.ended_rows_left_out = 0
        #: Captured decode steps (``engine.cuda_graphs``); None: every step runs eager.
        self.graphs: DecodeGraphs | None = None
        #: The model's vision encoder (``CausalLM.image_encoder``); None: text only.
        self.image_encoder = model_image_encoder(model)
        #: Its recent outputs, by image (device thread); None: text only.
        self.encoded_images = None if self.image_encoder is None else EncodedImages(self.image_encoder)

    def prepare(
        self, batch: ScheduledBatch[Seq] | ScheduledBatch[SequenceSnapshot], speculation: Speculation | None = None
    ) -> PreparedStep:
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sampled_seq_ids: list[int] = []
        input_patches: list[tuple[int, int]] = []
        history_patches: list[tuple[int, int]] = []
        params, generators, history, num_output, banned = [], [], [], [], []
        grammar_rows: list[int] = []
        grammars: list[GrammarState] = []
        images: list[ImagePiece] = []
        for seq, count, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples, strict=True):
            end = seq.num_computed_tokens  # the scheduler already counted this step's tokens
            start = end - count
            if seq.images:
                images.extend(image_pieces(seq.images, start, end, len(input_ids)))
            for offset, token in enumerate(seq.token_ids[start:end]):
                if token == PLACEHOLDER:
                    input_patches.append((len(input_ids) + offset, seq.seq_id))
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            if not samples:
                continue
            sample_rows.append(len(input_ids) - 1)
            sampled_seq_ids.append(seq.seq_id)
            p = seq.params
            params.append(p)
            generators.append(seq.generator)
            tokens = seq.token_ids[:end]
            if tokens and tokens[-1] == PLACEHOLDER:
                history_patches.append((len(params) - 1, seq.seq_id))
            history.append(
                list(tokens) if (p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty) else []
            )
            produced = end - seq.num_prompt_tokens
            num_output.append(produced if history[-1] else 0)
            banned.append(_banned(seq.stop_token_ids, produced, p.min_tokens))
            if seq.grammar is not None:
                grammar_rows.append(len(params) - 1)
                grammars.append(seq.grammar)
        metadata = AttentionMetadata.build(
            query_lens=batch.num_new_tokens,
            seq_lens=[seq.num_computed_tokens for seq in batch.seqs],
            block_tables={w: [seq.block_tables[w] for seq in batch.seqs] for w in self.windows},
            block_size=self.block_size,
            device=self.device,
        )
        return PreparedStep(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            metadata=metadata,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=self.device),
            sampling=SamplingInputs(
                params=params, generators=generators, history=history, num_output=num_output, banned=banned
            ),
            sampled_seq_ids=sampled_seq_ids,
            input_patches=input_patches,
            history_patches=history_patches,
            grammar_rows=grammar_rows,
            grammars=grammars,
            speculation=speculation,
            images=images,
        )

    def execute_speculative(self, batch: ScheduledBatch[SequenceSnapshot], max_model_len: int) -> StepResult:
        """A step with speculation, from the engine thread's snapshots: the previous step's
        tokens go in, the policy drafts and chooses how many to verify (it sees every
        token so far), then the step is prepared and runs. Device thread."""
        batch = self._resolve(batch, max_model_len)
        if not batch.seqs:  # the step before ended every sequence of this one
            return StepResult(tokens=[], logprobs=[])
        batch, speculation = self._speculate(batch, max_model_len)
        return self.execute(self.prepare(batch, speculation))

    def _resolve(self, batch: ScheduledBatch[SequenceSnapshot], max_model_len: int) -> ScheduledBatch[SequenceSnapshot]:
        """Put the tokens the previous step kept where its placeholder is, in every snapshot
        whose last input it is (with async scheduling the engine thread launched this step
        before it knew them). A sequence that kept accepted drafts has their entries in the
        cache already, so its position moves on by as many; its input is its last token.

        A sequence those tokens end (a stop token, its length: ``sequence.ends_at``, as the
        engine thread will find) leaves the step: its rows would be computed for nothing,
        and its drafts, verified past its end, would teach the policy that good drafts fail
        (overlapped DSpark verified 3.92 drafts per request-step to the synchronous 4.30).
        Not under expert parallelism, whose ranks keep every launched step (lockstep)."""
        counts = list(batch.num_new_tokens)
        ended: set[int] = set()
        resolved = False
        for index, seq in enumerate(batch.seqs):
            end = seq.num_computed_tokens
            if not 0 < end <= len(seq.token_ids) or seq.token_ids[end - 1] != PLACEHOLDER:
                continue
            resolved = True
            kept = self._previous_kept[seq.seq_id]
            seq.token_ids[end - 1 : end] = kept
            seq.num_computed_tokens += len(kept) - 1
            if counts[index] > 1:  # a chunk recomputing the sequence recomputes those too
                counts[index] += len(kept) - 1
            if self.lockstep is None and any(
                ends_at(seq.params, seq.stop_token_ids, token, end + i - seq.num_prompt_tokens, end + i, max_model_len)
                for i, token in enumerate(kept)
            ):
                ended.add(index)
        self.overlapped_steps += resolved
        self.ended_rows_left_out += len(ended)
        keep = [index for index in range(len(batch.seqs)) if index not in ended]
        return ScheduledBatch(
            seqs=[batch.seqs[i] for i in keep],
            num_new_tokens=[counts[i] for i in keep],
            samples=[batch.samples[i] for i in keep],
            preempted=batch.preempted,
        )

    def _speculate(
        self, batch: ScheduledBatch[SequenceSnapshot], max_model_len: int
    ) -> tuple[ScheduledBatch[SequenceSnapshot], Speculation]:
        """Ask the policy for drafts and lengths, and make each chosen sequence compute
        its drafts this step (see interfaces/speculative.py)."""
        policy = self.speculative
        assert policy is not None
        slots: list[DraftSlot] = []
        members: list[int] = []
        for index, (seq, count, samples) in enumerate(
            zip(batch.seqs, batch.num_new_tokens, batch.samples, strict=True)
        ):
            produced = seq.num_output_tokens
            if not samples or count != 1 or not can_speculate(seq.params, produced):
                continue
            room = min(seq.params.max_tokens - produced, max_model_len - seq.num_tokens) - 1
            if room <= 0:
                continue
            slots.append(
                DraftSlot(
                    seq_id=seq.seq_id,
                    token_ids=seq.token_ids,
                    num_prompt_tokens=seq.num_prompt_tokens,
                    params=seq.params,
                    generator=seq.generator,
                    max_draft=room,
                )
            )
            members.append(index)
        counts = list(batch.num_new_tokens)
        lengths: list[int] = []
        proposal = None
        if slots:
            step = VerifyBatch(base_tokens=batch.num_tokens, num_sampling=sum(batch.samples), num_seqs=len(batch.seqs))
            proposal = policy.propose(slots, step)
            if len(proposal.slots) != len(slots):
                raise RuntimeError(f"the speculative policy proposed for {len(proposal.slots)} of {len(slots)} slots")
            lengths = [int(n) for n in proposal.lengths]
            allowed = self._grammar_allowed(batch, members, proposal, lengths)
            constrained: list[tuple[int, int]] = []  # (slot, drafts its verified rows are masked after)
            for slot_index, index in enumerate(members):
                seq = batch.seqs[index]
                # Within the blocks held, with room for the next step's input after the last draft.
                length = min(lengths[slot_index], max(0, seq.capacity - seq.num_computed_tokens - 1))
                lengths[slot_index] = length
                if length and seq.grammar is not None:
                    constrained.append((slot_index, min(length, allowed[slot_index])))
                if length:
                    seq.token_ids.extend(proposal.tokens[slot_index][:length])
                    seq.num_computed_tokens += length
                    counts[index] += length
            if constrained:  # computed on the grammar worker while the forward runs
                self.structured.draft_masks(  # type: ignore[union-attr]
                    [batch.seqs[members[slot]].grammar for slot, _ in constrained],
                    [proposal.tokens[slot][:masked] for slot, masked in constrained],
                )
        slot_by_seq = {batch.seqs[index].seq_id: slot for slot, index in enumerate(members)}
        order = sorted(range(len(batch.seqs)), key=lambda i: counts[i] != 1)  # one-token sequences first
        seqs = [batch.seqs[i] for i in order]
        batch = ScheduledBatch(
            seqs=seqs,
            num_new_tokens=[counts[i] for i in order],
            samples=[batch.samples[i] for i in order],
            preempted=batch.preempted,
        )
        slot_of = [slot_by_seq.get(seq.seq_id, -1) for seq, samples in zip(seqs, batch.samples, strict=True) if samples]
        num_drafts = [lengths[slot_by_seq[seq.seq_id]] if seq.seq_id in slot_by_seq else 0 for seq in seqs]
        return batch, Speculation(
            proposal=proposal,
            lengths=lengths,
            slot_of=slot_of,
            seq_ids=[seq.seq_id for seq in seqs],
            num_drafts=num_drafts,
        )

    def _grammar_allowed(
        self, batch: ScheduledBatch[SequenceSnapshot], members: list[int], proposal: Proposal, lengths: list[int]
    ) -> list[int]:
        """Cut each constrained slot's length where its grammar first forbids a draft (in
        place, ``grammar_cut``); returns, per slot, how many of its chosen drafts the
        grammar allows."""
        allowed = list(lengths)
        for slot, index in enumerate(members):
            grammar = batch.seqs[index].grammar
            if grammar is None or not lengths[slot]:
                continue
            drafts = proposal.tokens[slot][: lengths[slot]]
            allowed[slot] = self.structured.allowed_drafts(grammar, drafts)  # type: ignore[union-attr]
            lengths[slot] = grammar_cut(lengths[slot], allowed[slot], proposal.draft_probs[slot] is not None)
        return allowed

    def execute(self, step: PreparedStep) -> StepResult:
        if step.input_ids.numel() > self.serial_torch_tokens:
            return self._execute(step)
        with torch_threads(1):
            return self._execute(step)

    @torch.inference_mode()
    def _execute(self, step: PreparedStep) -> StepResult:
        input_ids = step.input_ids
        for row, seq_id in step.input_patches:
            input_ids[row] = self._previous_kept[seq_id][-1]
        for row, seq_id in step.history_patches:
            if step.sampling.history[row]:
                step.sampling.history[row][-1] = self._previous_kept[seq_id][-1]
        input_ids = input_ids.to(self.device)
        if self.lockstep is not None:
            self.lockstep.busy()
        rows = self.encoded_images.image_rows(step.images) if step.images else None  # type: ignore[union-attr]
        # A captured graph replays text embeddings: a step with image rows runs eager.
        size = None if self.graphs is None or rows is not None else self.graphs.size_for(step.metadata)
        if size is None:
            hidden, taps = forward_with_taps(
                self.model, self.taps, input_ids, step.positions, self.kv_caches, step.metadata, image_rows=rows
            )
            ran = step.metadata
        else:
            hidden, taps = self.graphs.forward(input_ids, step.positions, step.metadata, size)  # type: ignore[union-attr]
            ran = self.graphs.captured[size].metadata  # type: ignore[union-attr]
        if step.speculation is not None:
            result = self._verify(step, hidden)
        else:
            result = self._sample(step, self.model.compute_logits(hidden[step.sample_rows]).cpu())
        ran.raise_refused()  # sparse indices a backend refused on the device: the step fails
        if self.speculative is not None:
            self._observe(step, input_ids, hidden, taps, result)
        if self.lockstep is not None:  # peers may still run a drafter's MoE layers
            self.lockstep.finish_drafts()
        return result

    def _sample(self, step: PreparedStep, logits: torch.Tensor) -> StepResult:
        tokens, logprobs = self._sample_rows(step, logits, list(range(len(step.sampled_seq_ids))))
        self._previous_kept = {seq_id: [token] for seq_id, token in zip(step.sampled_seq_ids, tokens, strict=True)}
        return StepResult(tokens=[[t] for t in tokens], logprobs=logprobs, seq_ids=step.sampled_seq_ids)

    def _sample_rows(
        self, step: PreparedStep, logits: torch.Tensor, rows: list[int]
    ) -> tuple[list[int], list[dict[int, float] | None]]:
        """Sample the sampling sequences ``rows`` (sample order; ``logits`` has one row each)."""
        inputs = step.sampling
        if len(rows) != inputs.num_rows:
            inputs = SamplingInputs(
                params=[inputs.params[i] for i in rows],
                generators=[inputs.generators[i] for i in rows],
                history=[inputs.history[i] for i in rows],
                num_output=[inputs.num_output[i] for i in rows],
                banned=[inputs.banned[i] for i in rows],
            )
        masks = None
        # The constrained ones among ``rows`` (a constrained row that verified drafts is not).
        constrained = [
            (rows.index(g), state) for g, state in zip(step.grammar_rows, step.grammars, strict=True) if g in rows
        ]
        grammar_rows = [row for row, _ in constrained]
        grammars = [state for _, state in constrained]
        if grammars:  # the worker computed these while this step's forward ran
            masks = TokenMasks(rows=grammar_rows, disallowed=self.structured.masks(grammars))  # type: ignore[union-attr]
        output = self.sampler(logits, inputs, masks)
        tokens = output.tokens.tolist()
        if grammars:  # and now the next masks, while the next step's forward runs
            self.structured.advance(grammars, [[tokens[row]] for row in grammar_rows])  # type: ignore[union-attr]
        return tokens, output.logprobs

    def _verify(self, step: PreparedStep, hidden: torch.Tensor) -> StepResult:
        """Sampling rows without drafts go through the sampler; each slot with drafts
        hands its ``1 + ℓ`` rows' logits to the policy's verifier."""
        spec = step.speculation
        assert spec is not None and self.speculative is not None
        rows = step.sample_rows.tolist()
        drafts = [spec.lengths[slot] if slot >= 0 else 0 for slot in spec.slot_of]
        plain = [i for i, n in enumerate(drafts) if n == 0]
        verified = [i for i, n in enumerate(drafts) if n > 0]
        gather = [row for i in verified for row in range(rows[i] - drafts[i], rows[i] + 1)]
        logits = self.model.compute_logits(hidden[[rows[i] for i in plain] + gather]).cpu()
        tokens: list[list[int]] = [[] for _ in rows]
        logprobs: list[dict[int, float] | None] = [None] * len(rows)
        if plain:
            sampled, sampled_logprobs = self._sample_rows(step, logits[: len(plain)], plain)
            for i, token, lp in zip(plain, sampled, sampled_logprobs, strict=True):
                tokens[i], logprobs[i] = [token], lp
        if verified:
            assert spec.proposal is not None  # a slot verifies drafts only if it was proposed some
            chunks = logits[len(plain) :].split([drafts[i] + 1 for i in verified])
            grammar_of = dict(zip(step.grammar_rows, step.grammars, strict=True))
            constrained = [(i, grammar_of[i]) for i in verified if i in grammar_of]
            for i, state in constrained:  # the masks before each draft and after the last
                _mask_verified_rows(chunks[verified.index(i)], self.structured.masks([state]))  # type: ignore[union-attr]
            kept = self.speculative.verify(spec.proposal, spec.lengths, list(chunks))
            for i, accepted in zip(verified, kept, strict=True):
                tokens[i] = accepted
            if constrained:
                states = [state for _, state in constrained]
                self.structured.advance(states, [tokens[i] for i, _ in constrained])  # type: ignore[union-attr]
        self._previous_kept = dict(zip(step.sampled_seq_ids, tokens, strict=True))
        return StepResult(
            tokens=tokens,
            logprobs=logprobs,
            speculated=sum(slot >= 0 for slot in spec.slot_of),
            verified=sum(drafts),
            seq_ids=step.sampled_seq_ids,
        )

    @property
    def taps(self) -> tuple[HiddenTap, ...]:
        """The target's hidden states the speculative policy reads (``SpeculativePolicy.taps``)."""
        return tuple(getattr(self.speculative, "taps", ())) if self.speculative is not None else ()

    def _observe(
        self,
        step: PreparedStep,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        taps: tuple[torch.Tensor, ...],
        result: StepResult,
    ) -> None:
        spec = step.speculation
        kept = dict(zip(step.sampled_seq_ids, result.tokens, strict=True))
        seq_ids = spec.seq_ids if spec is not None else []
        self.speculative.observe(  # type: ignore[union-attr]
            ExecutedStep(
                input_ids=input_ids,
                positions=step.positions,
                hidden=hidden,
                metadata=step.metadata,
                seq_ids=seq_ids,
                accepted=[kept.get(seq_id, []) for seq_id in seq_ids],
                num_drafts=spec.num_drafts if spec is not None else [],
                taps=taps,
            )
        )


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads on this thread set to ``count`` for the block, then restored."""
    before = torch.get_num_threads()
    if before == count:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _mask_verified_rows(logits: torch.Tensor, disallowed: torch.Tensor) -> None:
    """Mask a constrained slot's verified rows in place. After a stochastic draft the
    grammar forbids (verified as the last, ``engine.speculative.grammar_cut``) comes a row
    that is never sampled, and it has no mask."""
    rows = disallowed.shape[0]
    TokenMasks(rows=list(range(rows)), disallowed=disallowed).apply(logits[:rows])


def _banned(stop_ids: tuple[int, ...], produced: int, min_tokens: int) -> tuple[int, ...]:
    """EOS and stop ids are not allowed before ``min_tokens`` tokens were produced."""
    return stop_ids if produced < min_tokens else ()
