"""The engine loop: requests in, a step at a time, outputs out.

With async scheduling (the default) each ``step()`` schedules and prepares step N+1
on this thread while step N runs on the device thread, then collects N. Anything that
needs N's tokens is built around that one-step lag: N+1 feeds placeholders that the
device thread fills from N's result; a sequence that N finishes may already be in N+1,
whose token for it is then dropped; stop checks and detokenization run here, on N's
result, while N+1 computes. A constrained sequence's (structured output) matcher eats N's
token and computes N+1's mask on the grammar worker while N+1's forward runs; see
``structured.py``. With speculative decoding, N+1's drafts follow from the tokens N keeps:
the device thread drafts and prepares N+1 from snapshots once N has run (``ModelRunner.
execute_speculative``), and a sequence's placeholder here stands for all the tokens N
keeps (``interfaces/speculative.py``).
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

from powertrain.engine.admission import admit, tokenize_prompt
from powertrain.engine.block_manager import BlockManager
from powertrain.engine.device_thread import DeviceThread
from powertrain.engine.images import PromptImage, lay_out_images
from powertrain.engine.kv_transfer import BlockMover
from powertrain.engine.model_runner import ModelRunner, StepResult
from powertrain.engine.sequence import PLACEHOLDER, Request, SequenceSnapshot, ends_at
from powertrain.engine.sequence import Sequence as Seq
from powertrain.engine.speculative import can_speculate
from powertrain.interfaces.engine import EngineStats
from powertrain.interfaces.errors import EngineDeadError, InvalidRequestError
from powertrain.interfaces.images import ImageInput
from powertrain.interfaces.outputs import CompletionOutput, RequestOutput
from powertrain.interfaces.sampling import SamplingDefaults, SamplingParams
from powertrain.interfaces.scheduling import ScheduledBatch, Scheduler, SequenceStatus
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
    started: float
    #: The cache copies submitted before the step (tiers), if any.
    transfers: Future[None] | None = None


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
        sampling_defaults: SamplingDefaults | None = None,
        device_thread: DeviceThread | None = None,
        kv_cache: Mapping[str, Any] | None = None,
        block_mover: BlockMover | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.runner = runner
        self.max_model_len = max_model_len
        self.async_scheduling = async_scheduling
        self.model_name = model_name
        #: The checkpoint's config (config.json semantics): protocol adapters read the
        #: model family from it.
        self.model_config: Mapping[str, Any] = model_config or {}
        #: What a request leaves unset gets (the model's own sampling settings, or ours).
        self.sampling_defaults = sampling_defaults or SamplingDefaults()
        #: The KV cache's accounting: its groups' bytes per token, the total, what a dense
        #: uncompressed cache would take, the blocks per pool (``CacheLayout.report``).
        self.kv_cache: Mapping[str, Any] = kv_cache or {}
        #: Copies blocks to and from the tiers below the cache (None: no tiers).
        self.block_mover = block_mover
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
        #: Publications in flight (``publish_prefix``) and their prompts.
        self._publications: list[tuple[Future[int], list[int]]] = []
        #: Forwards launched so far (a step launches at most one).
        self.launched_steps = 0

    # ----------------------------------------------------------------------- requests

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        images: Sequence[ImageInput] | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Bad input raises
        InvalidRequestError and leaves the engine untouched. ``images``: one decoded image
        per image placeholder token of the prompt, in order (an engine that
        ``accepts_images``; ``interfaces.images``)."""
        self._check_alive()
        given: list[int] | None = None
        given_text: str | None = None
        placed: tuple[PromptImage, ...] = ()
        if images:
            encoder = self.runner.image_encoder
            if encoder is None:
                raise InvalidRequestError(
                    f"model {self.model_name!r} has no vision encoder and takes text only; send no images"
                )
            given_text, given = tokenize_prompt(self.tokenizer, prompt)
            prompt, placed = lay_out_images(given, images, encoder)
        admitted = admit(
            self.tokenizer,
            prompt,
            params or self.sampling_defaults.params(),
            request_id,
            in_use=self._requests,
            new_id=lambda: f"req-{next(self._request_ids)}",
            max_model_len=self.max_model_len,
            cache_tokens=self.cache_tokens,
            structured=lambda: self.runner.structured,
        )
        request_id, params, text, token_ids = admitted.request_id, admitted.params, admitted.text, admitted.token_ids
        text = given_text if placed else text
        grammars = admitted.grammars
        # A constraint ends its output with EOS once complete (llguidance allows nothing else then).
        eos = self.tokenizer.eos_token_ids if not params.ignore_eos or grammars else set()
        stop_ids = tuple(sorted(set(params.stop_token_ids) | eos))
        request = Request(
            request_id, text, token_ids, params, stop_token_ids=stop_ids, images=placed, given_token_ids=given
        )
        self._requests[request_id] = request
        for seq, grammar in zip(request.sequences, grammars or [None] * params.n, strict=True):
            seq.grammar = grammar
            self._detokenizers[seq.seq_id] = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=params.skip_special_tokens, prompt_ids=request.given_token_ids
            )
            self._texts[seq.seq_id] = ""
            self.scheduler.add(seq)
        return request_id

    @property
    def accepts_images(self) -> bool:
        """Whether ``add_request`` takes ``images`` (``interfaces.images.accepts_images``): the
        model has a vision encoder."""
        return self.runner.image_encoder is not None

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
            **self._tier_stats(),
            preemptions=self._num_preemptions,
            speculative_request_steps=self._speculative_counts[0],
            speculative_verified_tokens=self._speculative_counts[1],
            speculative_accepted_tokens=self._speculative_counts[2],
        )

    @property
    def tier_blocks(self) -> int:
        """Blocks of the primary pool's size this engine's own tiers keep beside its device
        cache (those no other engine sees: a shared store is everyone's); 0 without."""
        if self.block_mover is None:
            return 0
        size = self.block_mover.block_bytes[next(iter(self.block_manager.pools))]  # the primary pool's
        own = [store.capacity_bytes for _, store in self.block_mover.tiers.tiers if not store.shared]
        return sum(capacity // size for capacity in own if capacity is not None)

    def publish_prefix(self, token_ids: list[int]) -> Future[int]:
        """Write the cached blocks a prompt of ``token_ids`` could hit to the shared tiers
        (prefill/decode disaggregation: a prefill rank's hand-off); the future gets how
        many blocks were written, or the copy's or store's error, or that blocks the
        prompt's hit needs are no longer cached here and not in the store (a decode rank
        would miss them: the hand-off failed, not merely wrote nothing). Call it after the step
        that computed them was collected (``step`` returned their request finished)."""
        published: Future[int] = Future()
        mover = self.block_mover
        if mover is None or not mover.tiers.shared:
            published.set_exception(RuntimeError("no shared KV store to publish to: set [components] kv_store"))
            return published
        publication = self.block_manager.prefix_publication(token_ids)

        def copy_out() -> None:
            try:
                mover.publish(publication, published)
            except BaseException as error:  # the device copy failed: the hand-off did
                published.set_exception(error)

        self._device_thread.submit(copy_out)  # after the step in flight, before any later one
        self._publications.append((published, list(token_ids)))
        return published

    def _note_publications(self) -> None:
        """Mark what finished publications put in the shared tiers (here, on the engine
        thread, before a scheduling pass could evict it): no second copy at eviction."""
        pending = []
        for published, token_ids in self._publications:
            if not published.done():
                pending.append((published, token_ids))
            elif published.exception() is None:
                self.block_manager.mark_stored(token_ids)
        self._publications = pending

    def _tier_stats(self) -> dict[str, dict[str, float]]:
        if self.block_mover is None:
            return {}
        tiers = self.block_mover.tiers.stats
        return {
            "prefix_cache_tier_hit_tokens": dict(self.block_manager.stats.tier_hit_tokens),
            "kv_tier_bytes_written": {name: t.bytes_written for name, t in tiers.items()},
            "kv_tier_bytes_read": {name: t.bytes_read for name, t in tiers.items()},
            "kv_tier_seconds": {name: t.write_seconds + t.read_seconds for name, t in tiers.items()},
            "kv_tier_errors": {name: t.errors for name, t in tiers.items()},
        }

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
        if self._publications:
            self._note_publications()
        batch = self.scheduler.schedule()
        if not batch:
            return None
        if self.runner.speculative is None:
            transfers = self._submit_transfers()
            future = self._device_thread.submit(self.runner.execute, self.runner.prepare(batch))
        else:  # the device thread drafts and prepares once the step before has run
            snapshots = ScheduledBatch(
                seqs=[
                    SequenceSnapshot.of(seq, self._reserve(seq, count, samples))
                    for seq, count, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples, strict=True)
                ],
                num_new_tokens=list(batch.num_new_tokens),
                samples=list(batch.samples),
            )
            transfers = self._submit_transfers()  # after _reserve, which may evict too
            future = self._device_thread.submit(self.runner.execute_speculative, snapshots, self.max_model_len)
        for seq, samples in zip(batch.seqs, batch.samples, strict=True):
            if samples:  # this step will sample the sequence's next token(s)
                seq.token_ids.append(PLACEHOLDER)
        self.launched_steps += 1
        return _InFlight(batch=batch, future=future, started=time.perf_counter(), transfers=transfers)

    def _submit_transfers(self) -> Future[None] | None:
        """Queue the cache copies this pass asked for on the device thread, ahead of its step."""
        transfers = self.block_manager.take_transfers()
        if transfers is None or self.block_mover is None:
            return None
        return self._device_thread.submit(self.block_mover.run, transfers)

    def _reserve(self, seq: Seq, count: int, samples: bool) -> int:
        """Cache blocks for the drafts the device thread may give ``seq`` this step; returns
        how many tokens its blocks hold. With the step before still running, its accepted
        drafts (as many again at most) may come first. Reserves what fits, releasing nothing
        (the step's queries start before ``num_computed_tokens`` once drafts join). The
        device thread leaves room for the next step's input after the drafts, so the
        accepted drafts of a step always fit in what was held for it."""
        held = len(seq.block_table) * self.block_manager.block_size
        if not samples or count != 1 or not can_speculate(seq.params, seq.num_output_tokens):
            return held
        most = self.runner.speculative.max_draft_tokens  # type: ignore[union-attr]
        pending = seq.token_ids[-1] == PLACEHOLDER  # the step in flight samples its input
        # Drafts, then the next step's input; the device thread keeps within what is held.
        target = min(seq.num_computed_tokens + most * (2 if pending else 1) + 1, self.max_model_len)
        while target > held and not self.block_manager.can_grow(seq, target):
            target -= 1  # the cache is nearly full: reserve what fits
        if target > held:
            self.block_manager.grow(seq, target)
        return max(target, held)

    def _collect(self, flight: _InFlight) -> list[RequestOutput]:
        if flight.transfers is not None:
            flight.transfers.result()  # a failed copy is a broken cache: the step's error
        output = flight.future.result()
        touched: dict[str, Request] = {}
        sampled = {
            seq.seq_id: seq for seq, samples in zip(flight.batch.seqs, flight.batch.samples, strict=True) if samples
        }
        self._speculative_counts[0] += output.speculated
        self._speculative_counts[1] += output.verified
        for seq_id, kept, logprobs in zip(output.seq_ids, output.tokens, output.logprobs, strict=True):
            seq = sampled[seq_id]
            if seq.finished:  # finished (or aborted) while this step ran: its token is moot
                continue
            touched[seq.request.request_id] = seq.request
            # This step's placeholder is the first of those at the end (the next step's may follow).
            position = len(seq.token_ids)
            while position and seq.token_ids[position - 1] == PLACEHOLDER:
                position -= 1
            seq.token_ids[position : position + 1] = kept
            if seq.status is SequenceStatus.RUNNING:  # not preempted since: accepted drafts are cached
                seq.num_computed_tokens += len(kept) - 1
            self._speculative_counts[2] += len(kept) - 1
            for offset, token in enumerate(kept):
                self._append_output(seq, position + offset, token, logprobs if len(kept) == 1 else None)
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
        ending = ends_at(params, request.stop_token_ids, token, produced, position + 1, self.max_model_len)
        stop_token = ending == "stop"
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
        if reason is None and ending == "length":
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
        if seq.block_tables:  # cache what its last step computed (a one-step request's whole prompt)
            self.block_manager.register_computed(seq)
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
            prompt_token_ids=request.given_token_ids,
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
        if self.block_mover is not None:
            self._persist_cache()
        self._device_thread.shutdown()
        if self.block_mover is not None:
            self.block_mover.tiers.close()
        if self.runner.structured is not None:
            self.runner.structured.shutdown()
        if self._on_shutdown is not None:
            self._on_shutdown(self)

    def _persist_cache(self) -> None:
        """Hand every cached block to the tiers (best effort: a failed engine's cache may
        be what failed)."""
        transfers = self.block_manager.cached_transfers()
        if transfers is None or self._dead is not None:
            return
        try:
            self._device_thread.run(self.block_mover.run, transfers)  # type: ignore[union-attr]
        except Exception as error:
            log.warning("the cache was not handed to the tiers", error=f"{type(error).__name__}: {error}")


def _cut_at_stop(text: str, stops: Sequence[str], include: bool, start: int = 0) -> tuple[str, bool]:
    """Cut ``text`` at the earliest stop string at or after ``start`` (kept if ``include``)."""
    found = [(index, s) for s in stops if (index := text.find(s, start)) >= 0]
    if not found:
        return text, False
    index, stop = min(found)
    return text[: index + len(stop)] if include else text[:index], True
