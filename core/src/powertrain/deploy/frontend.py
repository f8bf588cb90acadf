"""The front end of a multi-process engine: one engine-shaped object over every rank.

``ParallelEngine`` has what ``LLM``, ``AsyncEngine`` and the HTTP server use of an
``LLMEngine`` (``add_request``, ``step``, ``abort_request``, ``has_unfinished_requests``,
``stats``, ``shutdown``, the tokenizer and model facts), so they serve a
data/expert-parallel deployment unchanged. It checks every request itself
(``engine.admission``: a worker is no place to refuse one), picks its data-parallel
rank (``balance``), sends it there and gathers every rank's outputs.

Prefill/decode disaggregation (``[parallel] prefill_ranks``): a new request whose prompt
fills a cache block goes first to a prefill rank, which computes its prompt and
publishes the blocks to the shared KV store (``("prefill", ...)``, answered by
``("prefilled", ...)``); then to a decode rank, whose prefix lookup loads them from the
store and which samples every token with the request's settings, exactly as a
colocated rank would after a prefix-cache hit. A block the store lost is recomputed
there, so the hand-off can cost time but never change a token. Prompts shorter than
``[parallel] prefill_rank_min_tokens`` (or than a block and a token) go straight to a
decode rank.

Failure: a worker whose process exits, whose connection drops, who reports an
exception, or who stays silent for ``silence_timeout_s`` (workers report at least every
second) is lost. With expert parallelism that is a dead engine: the front end stops
every other worker (their process group cannot continue without the lost rank), and
every later call raises ``EngineDeadError`` naming the rank, its host and pid, and what
happened. Without it the ranks step alone: the lost rank's requests end with that error
(``RequestOutput.error``) and the others serve on; the engine is dead only once no rank
is left to decode. With no prefill rank left, decode ranks compute prompts themselves.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, Listener, wait
from typing import Any

import attrs
import structlog

from powertrain.assemble import model_length
from powertrain.deploy.balance import PrefixBalancer
from powertrain.deploy.worker import HEARTBEAT_S, WorkerInfo
from powertrain.engine.admission import admit
from powertrain.interfaces.engine import EngineStats
from powertrain.interfaces.errors import EngineDeadError
from powertrain.interfaces.outputs import CompletionOutput, RequestOutput
from powertrain.interfaces.sampling import SamplingParams
from powertrain.loader import sampling_defaults
from powertrain.parallel.layout import ParallelLayout

log = structlog.get_logger(__name__)

#: How long ``step`` waits for outputs before returning empty-handed.
STEP_WAIT_S = 0.05
#: How long ``shutdown`` lets workers finish before killing them.
SHUTDOWN_S = 30.0


@attrs.define
class _Request:
    """A request in flight, as the front end tracks it."""

    rank: int  # where it runs now
    text: str | None  # its prompt text, None for token ids
    token_ids: list[int]
    params: SamplingParams
    arrival: float = attrs.field(factory=time.monotonic)
    prefilling: bool = False  # on a prefill rank, not yet handed to a decode rank
    sent: float = 0.0  # when it was sent to its rank
    first_token: float | None = None
    last: RequestOutput | None = None  # its latest output (a failure keeps its text)


@attrs.define
class _Rank:
    rank: int
    conn: Connection | None = None
    info: WorkerInfo | None = None
    pid: int | None = None
    host: str = "this machine"
    process: Any = None  # a multiprocessing.Process the front end started, if any
    stats: EngineStats | None = None
    counters: dict[str, float] = attrs.field(factory=dict)
    requests: int = 0  # requests sent here so far
    last_heard: float = attrs.field(factory=time.monotonic)
    stopped: bool = False
    #: Why the front end gave up on it (its requests failed; the others serve on).
    lost: str | None = None

    def describe(self) -> str:
        pid = self.pid or (self.process.pid if self.process is not None else None)
        return f"rank {self.rank} (pid {pid or '?'} on {self.host})"


class ParallelEngine:
    def __init__(
        self,
        config: Any,
        checkpoint: Any,
        layout: ParallelLayout,
        listener: Listener,
        *,
        processes: dict[int, Any] | None = None,
        silence_timeout_s: float = 60.0,
    ) -> None:
        """``processes``: the workers this front end started (by rank), watched for exits."""
        self.config = config
        self.layout = layout
        self.tokenizer = checkpoint.tokenizer
        self.model_config = checkpoint.config
        self.model_name = config.model.path
        self.sampling_defaults = sampling_defaults(config.model.generation_config, checkpoint)
        self.max_model_len = model_length(config, checkpoint.config)
        self.silence_timeout_s = silence_timeout_s
        self._listener = listener
        self._ranks = {rank: _Rank(rank, process=(processes or {}).get(rank)) for rank in range(layout.world_size)}
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._balancer: PrefixBalancer | None = None  # over the decode ranks
        self._prefill_balancer: PrefixBalancer | None = None  # over the prefill ranks, if any
        #: Outputs the front end made itself (aborted prefills, failed requests), for ``step``.
        self._made: list[RequestOutput] = []
        #: Hand-offs from prefill to decode ranks: done, failed, seconds (``EngineStats``).
        self._handoffs: dict[str, float] = {"handoffs": 0, "handoff_failures": 0, "handoff_seconds": 0.0}
        self._structured: Any = None
        self._dead: EngineDeadError | None = None
        self._closed = False
        self._cache_tokens = 0
        #: A worker running in this process (rank 0 under torchrun), joined at shutdown so
        #: that its threads end before the interpreter does.
        self.own_worker: threading.Thread | None = None

    # ----------------------------------------------------------------------- startup

    def wait_ready(self, timeout_s: float) -> None:
        """Accept every worker's connection and wait until each has built its engine."""
        arrivals: queue.Queue[Any] = queue.Queue()

        def accept() -> None:
            for _ in range(self.layout.world_size):
                try:
                    conn = self._listener.accept()
                    arrivals.put(conn)
                except Exception as exc:  # the listener closed (shutdown) or a bad handshake
                    arrivals.put(exc)
                    return

        threading.Thread(target=accept, name="powertrain-accept", daemon=True).start()
        deadline = time.monotonic() + timeout_s
        pending: list[Connection] = []
        while any(r.info is None for r in self._ranks.values()):
            self._check_processes()
            if time.monotonic() > deadline:
                waiting = [r.describe() for r in self._ranks.values() if r.info is None]
                self._fail(f"workers not ready after {timeout_s:.0f} s: {', '.join(waiting)}")
            try:
                item = arrivals.get_nowait()
                if isinstance(item, Exception):
                    self._fail(f"accepting worker connections failed: {type(item).__name__}: {item}")
                pending.append(item)
            except queue.Empty:
                pass
            if not pending:
                time.sleep(0.05)
                continue
            for conn in wait(list(pending), timeout=0.1):
                self._handshake(conn, pending)
        attention = [self._ranks[r].info for r in self.layout.attention_ranks]
        self._block_size = attention[0].block_size
        # A prompt with no full block has nothing to hand over.
        self._prefill_min_tokens = max(self.config.parallel.prefill_rank_min_tokens, self._block_size + 1)
        # What a rank serves without recomputing: its device cache and its own tiers below it.
        blocks = min(info.num_blocks + info.tier_blocks for info in attention)
        self._cache_tokens = min(info.cache_tokens for info in attention)
        slack = self.config.scheduler.max_num_seqs
        self._balancer = PrefixBalancer(self.layout.decode_ranks, self._block_size, blocks, slack=slack)
        if self.layout.prefill_ranks:
            self._prefill_balancer = PrefixBalancer(self.layout.prefill_only_ranks, self._block_size, blocks, slack)
        log.info(
            "parallel engine ready",
            data_parallel=self.layout.data_parallel,
            expert_parallel=self.layout.expert_parallel,
            workers=[f"{r.rank}:{r.host}:{r.pid}" for r in self._ranks.values()],
        )

    def _handshake(self, conn: Connection, pending: list[Connection]) -> None:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            pending.remove(conn)
            return
        kind = message[0]
        if kind == "hello":
            _, rank, pid, host = message
            if rank not in self._ranks or self._ranks[rank].conn is not None:
                self._fail(
                    f"a worker announced itself as rank {rank}, which is not free in a world of {len(self._ranks)}"
                )
            entry = self._ranks[rank]
            entry.conn, entry.pid, entry.host, entry.last_heard = conn, pid, host, time.monotonic()
        elif kind == "ready":
            info: WorkerInfo = message[1]
            self._ranks[info.rank].info = info
            pending.remove(conn)
        elif kind == "failed":
            self._worker_failed(self._ranks[message[1]], message[2], while_starting=True)

    # ----------------------------------------------------------------------- requests

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Check the request here, then send it to its rank; bad input raises InvalidRequestError."""
        self._check_alive()
        admitted = admit(  # a grammar is compiled here to refuse a bad one; the rank compiles its own
            self.tokenizer,
            prompt,
            params or self.sampling_defaults.params(),
            request_id,
            in_use=self._requests,
            new_id=lambda: f"req-{next(self._ids)}",
            max_model_len=self.max_model_len,
            cache_tokens=self._cache_tokens,
            structured=self._grammar_checker,
        )
        request = _Request(-1, admitted.text, admitted.token_ids, admitted.params)
        self._requests[admitted.request_id] = request
        prefill = self._prefill_balancer
        if prefill is not None and prefill.ranks and len(request.token_ids) >= self._prefill_min_tokens:
            request.prefilling = True
            self._dispatch(admitted.request_id, request, prefill, ("prefill", admitted.request_id, request.token_ids))
        else:  # colocated, or a prompt too short to be worth handing over
            self._decode(admitted.request_id, request)
        return admitted.request_id

    def _decode(self, request_id: str, request: _Request) -> None:
        assert self._balancer is not None
        request.prefilling = False
        self._dispatch(request_id, request, self._balancer, ("add", request_id, request.token_ids, request.params))

    def _dispatch(self, request_id: str, request: _Request, balancer: PrefixBalancer, message: tuple) -> None:
        """Send ``message`` to ``balancer``'s choice (the request fails if it is lost on the way)."""
        rank = balancer.choose(request.token_ids)
        balancer.assign(rank, request.token_ids)
        request.rank, request.sent = rank, time.monotonic()
        self._ranks[rank].requests += 1
        self._send(rank, message)

    def _balancer_of(self, request: _Request) -> PrefixBalancer:
        balancer = self._prefill_balancer if request.prefilling else self._balancer
        assert balancer is not None
        return balancer

    def _grammar_checker(self) -> Any:
        if self._structured is None:
            from powertrain.engine.structured import StructuredOutputs

            self._structured = StructuredOutputs(self.tokenizer, threads=1)
        return self._structured

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Ask the request's rank to stop it; its final output comes from ``step``."""
        request = self._requests.get(request_id)
        if request is None or self._dead is not None:
            return None
        if request.prefilling:  # it has no output to end with yet: end it here
            self._made.append(self._deliver(request_id, self._ended(request_id, "abort")))
        self._send(request.rank, ("abort", request_id))
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests or self._made)

    def rank_of(self, request_id: str) -> int | None:
        """The data-parallel rank serving a request in flight."""
        request = self._requests.get(request_id)
        return None if request is None else request.rank

    @property
    def workers(self) -> list[WorkerInfo]:
        """What each rank reported when it was ready, in rank order."""
        return [entry.info for entry in self._ranks.values() if entry.info is not None]

    def requests_per_rank(self) -> dict[int, int]:
        """Requests sent to each data-parallel rank so far."""
        return {rank: self._ranks[rank].requests for rank in self.layout.attention_ranks}

    def counters(self) -> dict[int, dict[str, float]]:
        """Per rank, as of its last report: lockstep rounds (busy and in all) and seconds
        spent in expert all-to-alls (empty without expert parallelism)."""
        return {rank: dict(entry.counters) for rank, entry in self._ranks.items()}

    def stats(self) -> EngineStats:
        """Every rank's counts added up, as of its last report (a lost rank's counters, not
        its load or its cache)."""
        reports = [
            r.stats
            if r.lost is None
            else attrs.evolve(r.stats, running=0, waiting=0, kv_blocks_total=0, kv_blocks_free=0)
            for r in self._ranks.values()
            if r.stats is not None
        ]
        return attrs.evolve(EngineStats.total(reports), **self._handoffs)

    # ----------------------------------------------------------------------- the loop

    def step(self) -> list[RequestOutput]:
        """Outputs that arrived from any rank (waiting up to ``STEP_WAIT_S`` for some)."""
        self._check_alive()
        conns = {r.conn: r for r in self._ranks.values() if r.conn is not None and not r.stopped}
        sentinels = {r.process.sentinel: r for r in self._ranks.values() if r.process is not None and not r.stopped}
        outputs, self._made = self._made, []
        for ready in wait([*conns, *sentinels], timeout=0 if outputs else STEP_WAIT_S):
            if ready in sentinels:
                continue  # a process that exited is reported below, after its last words
            outputs.extend(self._drain(conns[ready]))
        self._check_processes()
        self._check_silence()
        return outputs

    def _check_silence(self) -> None:
        """Fail when a rank has been silent for ``silence_timeout_s``, naming every silent
        rank, the longest silent first. With expert parallelism the ranks run in lockstep,
        so the longest silent need not be the stuck one: a rank waiting in a collective for
        a slow peer goes quiet first, and that peer may have reported a moment before it
        froze. So there every rank is named, with how long it has been quiet."""
        now = time.monotonic()
        live = sorted((r for r in self._ranks.values() if not r.stopped), key=lambda r: r.last_heard)
        silent = [r for r in live if now - r.last_heard > 2 * HEARTBEAT_S]
        if silent and now - silent[0].last_heard > self.silence_timeout_s:
            named = live if self.layout.expert_parallel_enabled else silent
            ages = ", ".join(f"{r.describe()} {now - r.last_heard:.0f} s" for r in named)
            self._lose(
                silent[0],
                f"no word for over {self.silence_timeout_s:.0f} s from {silent[0].describe()} (quiet: {ages})",
            )

    def _drain(self, entry: _Rank) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        if entry.conn is None:  # lost while this step read another rank
            return outputs
        try:
            while entry.conn is not None and entry.conn.poll(0):  # a "failed" message loses the rank
                message = entry.conn.recv()
                entry.last_heard = time.monotonic()
                outputs.extend(self._handle(entry, message))
        except (EOFError, OSError):
            self._lose(entry, f"lost the connection to {entry.describe()}{self._exit_note(entry)}")
        return outputs

    def _handle(self, entry: _Rank, message: tuple[Any, ...]) -> list[RequestOutput]:
        kind = message[0]
        if kind == "outputs":
            _, outputs, stats, counters = message
            entry.stats, entry.counters = stats, counters
            known = [output for output in outputs if output.request_id in self._requests]
            return [self._deliver(output.request_id, output) for output in known]
        if kind == "prefilled":
            _, request_id, error = message
            request = self._requests.get(request_id)
            if request is None or not request.prefilling or request.rank != entry.rank:
                return []  # aborted (or failed) meanwhile, or its id reused for a prefill elsewhere
            self._balancer_of(request).finished(request.rank)
            if error is not None:
                log.warning("a prefill's blocks did not reach the store; the decode rank computes them", error=error)
            self._handoffs["handoffs"] += 1
            self._handoffs["handoff_failures"] += error is not None
            self._handoffs["handoff_seconds"] += time.monotonic() - request.sent
            self._decode(request_id, request)
            return []
        if kind == "refused":
            _, request_id, why = message
            log.error("a rank refused a request the front end accepted", rank=entry.rank, why=why)
            if request_id not in self._requests:
                return []
            return [self._deliver(request_id, self._ended(request_id, "abort"))]
        if kind == "failed":
            self._worker_failed(entry, message[2])
            return []
        if kind == "stopped":
            entry.stopped = True
        return []

    def _deliver(self, request_id: str, output: RequestOutput) -> RequestOutput:
        """``output`` as the caller sees it: its prompt text, and the time to its first
        token from its arrival here (a disaggregated request's includes its prefill)."""
        request = self._requests[request_id]
        if request.first_token is None and any(c.token_ids for c in output.outputs):
            request.first_token = time.monotonic()
        metrics = {"arrival_time": request.arrival}
        if request.first_token is not None:
            metrics["time_to_first_token_s"] = request.first_token - request.arrival
        output = attrs.evolve(output, metrics=metrics)
        if request.text is not None:
            output = attrs.evolve(output, prompt=request.text)
        request.last = output
        if output.finished:
            del self._requests[request_id]
            self._balancer_of(request).finished(request.rank)
        return output

    def _ended(self, request_id: str, reason: str, error: str | None = None) -> RequestOutput:
        """A request's final output, made here: what it produced so far, its unfinished
        completions ending with ``reason``."""
        request = self._requests[request_id]
        last = request.last
        completions = (
            [CompletionOutput(index=i, text="", token_ids=[]) for i in range(request.params.n)]
            if last is None
            else last.outputs
        )
        return RequestOutput(
            request_id=request_id,
            prompt=request.text,
            prompt_token_ids=list(request.token_ids),
            outputs=[c if c.finish_reason else attrs.evolve(c, finish_reason=reason) for c in completions],
            finished=True,
            num_cached_tokens=last.num_cached_tokens if last is not None else 0,
            error=error,
        )

    # ----------------------------------------------------------------------- failure

    def _exit_note(self, entry: _Rank) -> str:
        process = entry.process
        if process is None:
            return ""
        process.join(timeout=2.0)
        return "" if process.exitcode is None else f", whose process exited with code {process.exitcode}"

    def _worker_failed(self, entry: _Rank, text: str, *, while_starting: bool = False) -> None:
        """A rank raised. If a peer's process has died, that is the cause (a collective
        with a dead peer fails on the survivors), and the error says so."""
        log.error("worker traceback", rank=entry.rank, traceback=text)
        last = text.strip().splitlines()[-1] if text.strip() else "no traceback"
        when = " while starting" if while_starting else ""
        if not self.layout.expert_parallel_enabled and not while_starting:
            self._lose(entry, f"{entry.describe()} failed: {last}")
            return
        culprit = next(
            (
                r
                for r in self._ranks.values()
                if r is not entry and r.process is not None and r.process.exitcode not in (None, 0)
            ),
            None,
        )
        if culprit is None:
            time.sleep(0.2)  # a killed peer's exit may trail the survivor's error by a moment
            culprit = next(
                (
                    r
                    for r in self._ranks.values()
                    if r is not entry and r.process is not None and not r.process.is_alive()
                ),
                None,
            )
        if culprit is not None:
            self._fail(
                f"{culprit.describe()} exited with code {culprit.process.exitcode}; "
                f"{entry.describe()} then failed{when}: {last}"
            )
        self._fail(f"{entry.describe()} failed{when}: {last}")

    def _check_processes(self) -> None:
        for entry in self._ranks.values():
            process = entry.process
            if process is not None and not process.is_alive() and not entry.stopped:
                if entry.conn is not None:  # read what it said before it went
                    try:
                        while entry.conn is not None and entry.conn.poll(0):
                            self._made.extend(self._handle(entry, entry.conn.recv()))
                    except (EOFError, OSError):
                        pass
                if not entry.stopped:  # what it said did not already lose it
                    self._lose(entry, f"{entry.describe()} exited with code {process.exitcode}")

    def _send(self, rank: int, message: tuple[Any, ...]) -> None:
        entry = self._ranks[rank]
        try:
            assert entry.conn is not None
            entry.conn.send(message)
        except (OSError, AssertionError):
            self._lose(entry, f"could not reach {entry.describe()}{self._exit_note(entry)}")

    def _lose(self, entry: _Rank, what: str) -> None:
        """Give up on a rank: with expert parallelism (or while starting, or with no rank
        left to decode) the engine dies; otherwise its requests fail and the rest go on."""
        if self.layout.expert_parallel_enabled or self._balancer is None:
            self._fail(what)
        if entry.lost is not None:
            return
        entry.lost, entry.stopped = what, True
        log.error("lost a rank; its requests fail, the others serve on", rank=entry.rank, reason=what)
        if entry.conn is not None:
            entry.conn.close()
            entry.conn = None
        if entry.process is not None and entry.process.is_alive():
            entry.process.kill()  # silent or failed: it is no longer ours to wait for
        for balancer in (self._balancer, self._prefill_balancer):
            if balancer is not None:
                balancer.remove(entry.rank)
        if self._prefill_balancer is not None and not self._prefill_balancer.ranks:
            log.warning("no prefill rank is left: decode ranks compute prompts themselves")
        for request_id, request in list(self._requests.items()):
            if request.rank == entry.rank:
                where = "prefilling" if request.prefilling else "running"
                failed = self._ended(request_id, "error", f"{what}, where this request was {where}; send it again")
                self._made.append(self._deliver(request_id, failed))
        if not self._balancer.ranks:
            self._fail(f"{what}; no rank is left to decode")

    def _fail(self, what: str) -> None:
        """Mark the engine dead, stop every worker, raise EngineDeadError."""
        if self._dead is None:
            self._dead = EngineDeadError(f"the parallel engine stopped: {what}")
            log.error("parallel engine failed", reason=what)
            self._stop_workers(grace_s=5.0)
        raise self._dead

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine has been shut down")
        if self._dead is not None:
            raise self._dead

    # ----------------------------------------------------------------------- shutdown

    def _send_stop(self) -> None:
        """Tell every worker still running to abort its requests and leave."""
        for entry in self._ranks.values():
            if entry.conn is not None and not entry.stopped:
                try:
                    entry.conn.send(("stop",))
                except OSError:  # it is gone already
                    entry.stopped = True

    def _stop_workers(self, grace_s: float) -> None:
        self._send_stop()
        deadline = time.monotonic() + grace_s
        for entry in self._ranks.values():
            process = entry.process
            if process is None:
                continue
            process.join(timeout=max(deadline - time.monotonic(), 0.0))
            if process.is_alive():
                log.warning("killing a worker that did not stop", rank=entry.rank, pid=process.pid)
                process.kill()
                process.join(timeout=5.0)
        for entry in self._ranks.values():
            if entry.conn is not None:
                entry.conn.close()
                entry.conn = None
        self._listener.close()
        if self._structured is not None:
            self._structured.shutdown()
            self._structured = None

    def shutdown(self) -> None:
        """Stop every worker (aborting what is in flight). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._dead is None:
            self._wait_stopped(SHUTDOWN_S)
        self._stop_workers(grace_s=SHUTDOWN_S if self._dead is None else 5.0)
        if self.own_worker is not None:
            self.own_worker.join(timeout=SHUTDOWN_S)

    def _wait_stopped(self, timeout_s: float) -> None:
        """Send stop and read until every worker said it stopped (or gave up)."""
        self._send_stop()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            live = [r for r in self._ranks.values() if r.conn is not None and not r.stopped]
            if not live:
                return
            for conn in wait([r.conn for r in live], timeout=0.2):
                entry = next(r for r in live if r.conn is conn)
                try:
                    while conn.poll(0):
                        message = conn.recv()
                        if message[0] == "stopped":
                            entry.stopped = True
                except (EOFError, OSError):
                    entry.stopped = True
