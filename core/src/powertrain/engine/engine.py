"""The engine loop: requests in, a step at a time, outputs out.

With async scheduling (the default) each ``step()`` schedules and prepares step N+1
on this thread while step N runs on the device thread, then collects N. Anything that
needs N's tokens is built around that one-step lag: N+1 feeds placeholders that the
device thread fills from N's result; a sequence that N finishes may already be in N+1,
whose token for it is then dropped; stop checks and detokenization run here, on N's
result, while N+1 computes. A constrained sequence's (structured output) matcher eats N's
token and computes N+1's mask on the grammar worker while N+1's forward runs; see
``structured.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import attrs
import structlog

from powertrain.engine.admission import admit
from powertrain.engine.block_manager import BlockManager
from powertrain.engine.device_thread import DeviceThread
from powertrain.engine.model_runner import ModelRunner, Speculation, StepResult
from powertrain.engine.sequence import PLACEHOLDER, Request
from powertrain.engine.sequence import Sequence as Seq
from powertrain.engine.speculative import can_speculate, grammar_cut
from powertrain.interfaces.engine import EngineStats
from powertrain.interfaces.errors import EngineDeadError
from powertrain.interfaces.outputs import CompletionOutput, RequestOutput
from powertrain.interfaces.sampling import SamplingParams
from powertrain.interfaces.scheduling import ScheduledBatch, Scheduler, SequenceStatus
from powertrain.interfaces.speculative import DraftSlot, Proposal, VerifyBatch
from powertrain.tokenizer import IncrementalDetokenizer, Tokenizer

log = structlog.get_logger(__name__)


@attrs.define
class StepStats:
    """What one step did; handed to step observers."""

    step: int
    num_seqs: int
    num_tokens: int
    num_preempted: int
    duration_s: float


@attrs.define
class _InFlight:
    batch: ScheduledBatch[Seq]
    future: Future[StepResult]
    #: For each sampling sequence (in sample order): the index its token goes to.
    token_positions: list[int]
    started: float
    #: For each sampling sequence: how many drafts it verifies (empty without speculation).
    num_drafts: list[int] = attrs.field(factory=list)


class LLMEngine:
    """Built by ``powertrain.assemble.build_engine``; see that function for how."""

    def __init__(
        self,
        *,
        tokenizer: Tokenizer,
        scheduler: Scheduler[Seq],
        block_manager: BlockManager,
        runner: ModelRunner,
        max_model_len: int,
        async_scheduling: bool = True,
        on_step: Callable[[LLMEngine, StepStats], None] | None = None,
        on_shutdown: Callable[[LLMEngine], None] | None = None,
        model_name: str = "",
        model_config: Mapping[str, Any] | None = None,
        device_thread: DeviceThread | None = None,
        kv_cache: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.runner = runner
        self.max_model_len = max_model_len
        # Speculative steps run synchronously: a step's drafts follow from the tokens the
        # step before accepted (interfaces/speculative.py).
        self.async_scheduling = async_scheduling and runner.speculative is None
        self.model_name = model_name
        #: The checkpoint's config (config.json semantics): protocol adapters read the
        #: model family from it.
        self.model_config: Mapping[str, Any] = model_config or {}
        #: The KV cache's accounting: its groups' bytes per token, the total, what a dense
        #: uncompressed cache would take, the blocks per pool (``CacheLayout.report``).
        self.kv_cache: Mapping[str, Any] = kv_cache or {}
        self._on_step = on_step
        self._on_shutdown = on_shutdown
        self._requests: dict[str, Request] = {}
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}
        self._texts: dict[int, str] = {}
        self._in_flight: _InFlight | None = None
        self._device_thread = device_thread or DeviceThread()  # where steps execute
        self._step_counter = itertools.count()
        self._request_ids = itertools.count()
        self._dead: BaseException | None = None
        self._closed = False
        self._num_preemptions = 0
        self._speculative_counts = [0, 0, 0]  # request-steps, verified, accepted
        #: Forwards launched so far (a step launches at most one).
        self.launched_steps = 0

    # ----------------------------------------------------------------------- requests

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Bad input raises
        InvalidRequestError and leaves the engine untouched."""
        self._check_alive()
        admitted = admit(
            self.tokenizer,
            prompt,
            params,
            request_id,
            in_use=self._requests,
            new_id=lambda: f"req-{next(self._request_ids)}",
            max_model_len=self.max_model_len,
            cache_tokens=self.cache_tokens,
            structured=lambda: self.runner.structured,
        )
        request_id, params, text, token_ids = admitted.request_id, admitted.params, admitted.text, admitted.token_ids
        grammars = admitted.grammars
        # A constraint ends its output with EOS once complete (llguidance allows nothing else then).
        eos = self.tokenizer.eos_token_ids if not params.ignore_eos or grammars else set()
        stop_ids = tuple(sorted(set(params.stop_token_ids) | eos))
        request = Request(request_id, text, token_ids, params, stop_token_ids=stop_ids)
        self._requests[request_id] = request
        for seq, grammar in zip(request.sequences, grammars or [None] * params.n, strict=True):
            seq.grammar = grammar
            self._detokenizers[seq.seq_id] = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=params.skip_special_tokens, prompt_ids=token_ids
            )
            self._texts[seq.seq_id] = ""
            self.scheduler.add(seq)
        return request_id

    @property
    def cache_tokens(self) -> int:
        """Most tokens one sequence's cache can hold (unbounded, as max_model_len, when
        every cache group slides)."""
        held = self.block_manager.max_sequence_tokens
        return self.max_model_len if held is None else held

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks at once; returns its final output
        (finish reason "abort"), or None for an unknown or already finished id."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        for seq in request.sequences:
            if not seq.finished:
                self._finish(seq, "abort")
        return self._request_output(request)

    def stats(self) -> EngineStats:
        """Counts as of now; call on the thread that drives the engine."""
        seqs = [seq for request in self._requests.values() for seq in request.sequences]
        prefix = self.block_manager.stats
        return EngineStats(
            running=sum(seq.status is SequenceStatus.RUNNING for seq in seqs),
            waiting=sum(seq.status is SequenceStatus.WAITING for seq in seqs),
            kv_blocks_total=self.block_manager.num_blocks,
            kv_blocks_free=self.block_manager.num_free_blocks,
            prefix_cache_queried_tokens=prefix.queried_tokens,
            prefix_cache_hit_tokens=prefix.hit_tokens,
            preemptions=self._num_preemptions,
            speculative_request_steps=self._speculative_counts[0],
            speculative_verified_tokens=self._speculative_counts[1],
            speculative_accepted_tokens=self._speculative_counts[2],
        )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ----------------------------------------------------------------------- the loop

    def step(self) -> list[RequestOutput]:
        """Advance by one step; returns the requests that produced tokens (or finished)."""
        self._check_alive()
        try:
            if not self.async_scheduling:
                launched = self._launch()
                return self._collect(launched) if launched else []
            previous = self._in_flight
            self._in_flight = self._launch()
            return self._collect(previous) if previous else []
        except BaseException as exc:
            self._dead = exc
            log.error("engine step failed", error=f"{type(exc).__name__}: {exc}")
            raise

    def _launch(self) -> _InFlight | None:
        batch = self.scheduler.schedule()
        if not batch:
            return None
        speculation = self._speculate(batch) if self.runner.speculative is not None else None
        if speculation is not None:
            batch = speculation[0]
        prepared = self.runner.prepare(batch, speculation[1] if speculation else None)
        positions = []
        num_drafts = []
        drafts_of = dict(zip(speculation[1].seq_ids, speculation[1].num_drafts, strict=True)) if speculation else {}
        for seq, samples in zip(batch.seqs, batch.samples, strict=True):
            if samples:  # this step will sample the sequence's next token
                positions.append(len(seq.token_ids))
                seq.token_ids.append(PLACEHOLDER)
                num_drafts.append(drafts_of.get(seq.seq_id, 0))
        future = self._device_thread.submit(self.runner.execute, prepared)
        self.launched_steps += 1
        return _InFlight(
            batch=batch,
            future=future,
            token_positions=positions,
            started=time.perf_counter(),
            num_drafts=num_drafts if speculation else [],
        )

    def _speculate(self, batch: ScheduledBatch[Seq]) -> tuple[ScheduledBatch[Seq], Speculation]:
        """Ask the policy for drafts and lengths, and make each chosen sequence compute
        its drafts this step (see interfaces/speculative.py)."""
        policy = self.runner.speculative
        assert policy is not None
        slots: list[DraftSlot] = []
        members: list[int] = []
        for index, (seq, count, samples) in enumerate(
            zip(batch.seqs, batch.num_new_tokens, batch.samples, strict=True)
        ):
            produced = seq.num_output_tokens
            if not samples or count != 1 or not can_speculate(seq.params, produced):
                continue
            room = min(seq.params.max_tokens - produced, self.max_model_len - seq.num_tokens) - 1
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
            proposal = policy.propose(slots)
            step = VerifyBatch(base_tokens=batch.num_tokens, num_sampling=sum(batch.samples), num_seqs=len(batch.seqs))
            lengths = [int(n) for n in policy.verify_lengths(proposal, step)]
            if len(lengths) != len(slots) or any(
                not 0 <= n <= len(t) for n, t in zip(lengths, proposal.tokens, strict=True)
            ):
                drafted = [len(t) for t in proposal.tokens]
                raise RuntimeError(f"the speculative policy returned lengths {lengths} for drafts of {drafted}")
            allowed = self._grammar_allowed(batch, members, proposal, lengths)
            constrained: list[tuple[int, int]] = []  # (slot, drafts its verified rows are masked after)
            for slot_index, index in enumerate(members):
                seq = batch.seqs[index]
                length = lengths[slot_index]
                # Drafts join a step already scheduled: grow, releasing nothing (its queries
                # start before num_computed_tokens now).
                while length and not self.block_manager.can_grow(seq, seq.num_computed_tokens + length):
                    length -= 1  # the cache is nearly full: verify what fits
                lengths[slot_index] = length
                if length and seq.grammar is not None:
                    constrained.append((slot_index, min(length, allowed[slot_index])))
                if length:
                    self.block_manager.grow(seq, seq.num_computed_tokens + length)
                    seq.token_ids.extend(proposal.tokens[slot_index][:length])
                    seq.num_computed_tokens += length
                    counts[index] += length
            if constrained:  # computed on the grammar worker while the forward runs
                self.runner.structured.draft_masks(  # type: ignore[union-attr]
                    [batch.seqs[members[slot]].grammar for slot, _ in constrained],
                    [proposal.tokens[slot][:masked] for slot, masked in constrained],
                )
            self._speculative_counts[0] += len(slots)
            self._speculative_counts[1] += sum(lengths)
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
        self, batch: ScheduledBatch[Seq], members: list[int], proposal: Proposal, lengths: list[int]
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
            allowed[slot] = self.runner.structured.allowed_drafts(grammar, drafts)  # type: ignore[union-attr]
            lengths[slot] = grammar_cut(lengths[slot], allowed[slot], proposal.draft_probs[slot] is not None)
        return allowed

    def _collect(self, flight: _InFlight) -> list[RequestOutput]:
        output = flight.future.result()
        touched: dict[str, Request] = {}
        sampled = [seq for seq, samples in zip(flight.batch.seqs, flight.batch.samples, strict=True) if samples]
        num_drafts = flight.num_drafts or [0] * len(sampled)
        for seq, position, kept, logprobs, drafts in zip(
            sampled, flight.token_positions, output.tokens, output.logprobs, num_drafts, strict=True
        ):
            if seq.finished:  # finished (or aborted) while this step ran: its token is moot
                continue
            touched[seq.request.request_id] = seq.request
            if not drafts:
                seq.token_ids[position] = kept[0]
                self._append_output(seq, position, kept[0], logprobs)
                continue
            # Rewind past the drafts: the cache keeps the accepted ones, rejected slots are rewritten later.
            start = position - drafts
            del seq.token_ids[start:]
            seq.num_computed_tokens = start + len(kept) - 1
            self._speculative_counts[2] += len(kept) - 1
            for token in kept:
                seq.token_ids.append(token)
                self._append_output(seq, len(seq.token_ids) - 1, token, None)
                if seq.finished:
                    break
        for seq in flight.batch.seqs:
            if not seq.finished:
                self.block_manager.register_computed(seq)
        self._num_preemptions += len(flight.batch.preempted)
        stats = StepStats(
            step=next(self._step_counter),
            num_seqs=len(flight.batch.seqs),
            num_tokens=flight.batch.num_tokens,
            num_preempted=len(flight.batch.preempted),
            duration_s=time.perf_counter() - flight.started,
        )
        if self._on_step is not None:
            self._on_step(self, stats)
        return [self._request_output(request) for request in touched.values()]

    def _append_output(self, seq: Seq, position: int, token: int, logprobs: dict[int, float] | None) -> None:
        request = seq.request
        params = seq.params
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        produced = position + 1 - seq.num_prompt_tokens
        detokenizer = self._detokenizers[seq.seq_id]
        previous = self._texts[seq.seq_id]
        reason = None
        stop_token = produced >= params.min_tokens and token in request.stop_token_ids
        # A stop token (EOS) ends the text without appearing in it, even when special
        # tokens are kept (a protocol adapter that parses markup asks for them).
        text = previous if stop_token else previous + detokenizer.add(token)
        if produced >= params.min_tokens:
            if stop_token:
                reason = "stop"
            elif params.stop:
                # Earlier text held no stop string, so look only where new text could complete one.
                start = max(0, len(previous) - max(len(s) for s in params.stop) + 1)
                text, hit = _cut_at_stop(text, params.stop, params.include_stop_str_in_output, start)
                reason = "stop" if hit else None
        if reason is None and (produced >= params.max_tokens or position + 1 >= self.max_model_len):
            reason = "length"
            text += detokenizer.finish()  # a character still held back is all there will be
        self._texts[seq.seq_id] = text
        if reason is not None:
            del seq.token_ids[position + 1 :]  # drop the placeholder of a step already under way
            self._finish(seq, reason)

    def _finish(self, seq: Seq, reason: str) -> None:
        seq.finish_reason = reason
        if seq.token_ids and seq.token_ids[-1] == PLACEHOLDER:
            seq.token_ids.pop()
        self.scheduler.finish(seq)
        seq.status = SequenceStatus.FINISHED
        seq.grammar = None  # a step still in flight may hold it; nothing else will

    def _request_output(self, request: Request) -> RequestOutput:
        finished = request.finished
        outputs = [
            CompletionOutput(
                index=seq.index,
                text=self._texts[seq.seq_id],
                token_ids=[t for t in seq.output_token_ids if t != PLACEHOLDER],
                finish_reason=seq.finish_reason,
                logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            )
            for seq in request.sequences
        ]
        metrics: dict[str, float] = {"arrival_time": request.arrival_time}
        if request.first_token_time is not None:
            metrics["time_to_first_token_s"] = request.first_token_time - request.arrival_time
        result = RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=min(seq.num_cached_tokens for seq in request.sequences),
            metrics=metrics,
        )
        if finished:
            self._forget(request)
        return result

    def _forget(self, request: Request) -> None:
        self._requests.pop(request.request_id, None)
        for seq in request.sequences:
            self._detokenizers.pop(seq.seq_id, None)
            self._texts.pop(seq.seq_id, None)

    def run_on_device(self, fn: Callable[..., Any], /, *args: Any) -> Any:
        """Run ``fn`` on the device thread after the step in flight, and wait for it
        (expert-parallel idle rounds must stay in order with the forwards)."""
        self._check_alive()
        return self._device_thread.run(fn, *args)

    # ----------------------------------------------------------------------- lifecycle

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine has been shut down")
        if self._dead is not None:
            raise EngineDeadError(f"the engine failed and cannot serve: {type(self._dead).__name__}: {self._dead}")

    def shutdown(self) -> None:
        """Finish the step in flight, release the device thread, tell observers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._in_flight is not None:
            with contextlib.suppress(BaseException):  # a failed step has nothing more to release
                self._in_flight.future.result()
            self._in_flight = None
        self._device_thread.shutdown()
        if self.runner.structured is not None:
            self.runner.structured.shutdown()
        if self._on_shutdown is not None:
            self._on_shutdown(self)


def _cut_at_stop(text: str, stops: Sequence[str], include: bool, start: int = 0) -> tuple[str, bool]:
    """Cut ``text`` at the earliest stop string at or after ``start`` (kept if ``include``)."""
    found = [(index, s) for s in stops if (index := text.find(s, start)) >= 0]
    if not found:
        return text, False
    index, stop = min(found)
    return text[: index + len(stop)] if include else text[:index], True
