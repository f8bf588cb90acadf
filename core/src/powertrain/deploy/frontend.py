"""The front end of a multi-process engine: one engine-shaped object over every rank.

``ParallelEngine`` has what ``LLM``, ``AsyncEngine`` and the HTTP server use of an
``LLMEngine`` (``add_request``, ``step``, ``abort_request``, ``has_unfinished_requests``,
``stats``, ``shutdown``, the tokenizer and model facts), so they serve a
data/expert-parallel deployment unchanged. It checks every request itself
(``engine.admission``: a worker is no place to refuse one), picks its data-parallel
rank (``balance``), sends it there and gathers every rank's outputs.

Failure: a worker whose process exits, whose connection drops, who reports an
exception, or who stays silent for ``silence_timeout_s`` (workers report at least every
second) is a dead engine. The front end then stops every other worker (their process
group cannot continue without the lost rank), and every later call raises
``EngineDeadError`` naming the rank, its host and pid, and what happened.
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
from powertrain.parallel.layout import ParallelLayout

log = structlog.get_logger(__name__)

#: How long ``step`` waits for outputs before returning empty-handed.
STEP_WAIT_S = 0.05
#: How long ``shutdown`` lets workers finish before killing them.
SHUTDOWN_S = 30.0


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
        self.max_model_len = model_length(config, checkpoint.config)
        self.silence_timeout_s = silence_timeout_s
        self._listener = listener
        self._ranks = {rank: _Rank(rank, process=(processes or {}).get(rank)) for rank in range(layout.world_size)}
        #: Requests in flight: id -> (its rank, its prompt text or None for token ids).
        self._requests: dict[str, tuple[int, str | None]] = {}
        self._ids = itertools.count()
        self._balancer: PrefixBalancer | None = None
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
        block_size = attention[0].block_size
        # What a rank serves without recomputing: its device cache and its own tiers below it.
        blocks = min(info.num_blocks + info.tier_blocks for info in attention)
        self._cache_tokens = min(info.cache_tokens for info in attention)
        self._balancer = PrefixBalancer(
            self.layout.attention_ranks, block_size, blocks, slack=self.config.scheduler.max_num_seqs
        )
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
            params,
            request_id,
            in_use=self._requests,
            new_id=lambda: f"req-{next(self._ids)}",
            max_model_len=self.max_model_len,
            cache_tokens=self._cache_tokens,
            structured=self._grammar_checker,
        )
        assert self._balancer is not None
        rank = self._balancer.choose(admitted.token_ids)
        self._send(rank, ("add", admitted.request_id, admitted.token_ids, admitted.params))
        self._balancer.assign(rank, admitted.token_ids)
        self._ranks[rank].requests += 1
        self._requests[admitted.request_id] = (rank, admitted.text)
        return admitted.request_id

    def _grammar_checker(self) -> Any:
        if self._structured is None:
            from powertrain.engine.structured import StructuredOutputs

            self._structured = StructuredOutputs(self.tokenizer, threads=1)
        return self._structured

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Ask the request's rank to stop it; its final output comes from ``step``."""
        rank = self.rank_of(request_id)
        if rank is not None and self._dead is None:
            self._send(rank, ("abort", request_id))
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def rank_of(self, request_id: str) -> int | None:
        """The data-parallel rank serving a request in flight."""
        entry = self._requests.get(request_id)
        return None if entry is None else entry[0]

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
        """Every rank's counts added up, as of its last report."""
        return EngineStats.total([r.stats for r in self._ranks.values() if r.stats is not None])

    # ----------------------------------------------------------------------- the loop

    def step(self) -> list[RequestOutput]:
        """Outputs that arrived from any rank (waiting up to ``STEP_WAIT_S`` for some)."""
        self._check_alive()
        conns = {r.conn: r for r in self._ranks.values() if r.conn is not None and not r.stopped}
        sentinels = {r.process.sentinel: r for r in self._ranks.values() if r.process is not None}
        outputs: list[RequestOutput] = []
        for ready in wait([*conns, *sentinels], timeout=STEP_WAIT_S):
            if ready in sentinels:
                continue  # a process that exited is reported below, after its last words
            outputs.extend(self._drain(conns[ready]))
        self._check_processes()
        self._check_silence()
        return outputs

    def _check_silence(self) -> None:
        """Fail when a rank has been silent for ``silence_timeout_s``, naming every silent
        rank, the longest silent first: with expert parallelism one stuck rank stalls its
        peers in their next collective, so they fall silent too, a moment later."""
        now = time.monotonic()
        silent = sorted(
            (r for r in self._ranks.values() if not r.stopped and now - r.last_heard > 2 * HEARTBEAT_S),
            key=lambda r: r.last_heard,
        )
        if silent and now - silent[0].last_heard > self.silence_timeout_s:
            ages = ", ".join(f"{r.describe()} for {now - r.last_heard:.0f} s" for r in silent)
            self._fail(f"no word for over {self.silence_timeout_s:.0f} s from {ages}")

    def _drain(self, entry: _Rank) -> list[RequestOutput]:
        assert entry.conn is not None
        outputs = []
        try:
            while entry.conn.poll(0):
                message = entry.conn.recv()
                entry.last_heard = time.monotonic()
                outputs.extend(self._handle(entry, message))
        except (EOFError, OSError):
            self._fail(f"lost the connection to {entry.describe()}{self._exit_note(entry)}")
        return outputs

    def _handle(self, entry: _Rank, message: tuple[Any, ...]) -> list[RequestOutput]:
        kind = message[0]
        if kind == "outputs":
            _, outputs, stats, counters = message
            entry.stats, entry.counters = stats, counters
            return [self._deliver(output) for output in outputs if output.request_id in self._requests]
        if kind == "refused":
            _, request_id, why = message
            log.error("a rank refused a request the front end accepted", rank=entry.rank, why=why)
            return [self._deliver(self._aborted(request_id))]
        if kind == "failed":
            self._worker_failed(entry, message[2])
        if kind == "stopped":
            entry.stopped = True
        return []

    def _deliver(self, output: RequestOutput) -> RequestOutput:
        rank, text = self._requests[output.request_id]
        if output.finished:
            del self._requests[output.request_id]
            assert self._balancer is not None
            self._balancer.finished(rank)
        if text is not None:
            output = attrs.evolve(output, prompt=text)
        return output

    def _aborted(self, request_id: str) -> RequestOutput:
        return RequestOutput(
            request_id=request_id,
            prompt=None,
            prompt_token_ids=[],
            outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="abort")],
            finished=True,
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
                        while entry.conn.poll(0):
                            self._handle(entry, entry.conn.recv())
                    except (EOFError, OSError):
                        pass
                self._fail(f"{entry.describe()} exited with code {process.exitcode}")

    def _send(self, rank: int, message: tuple[Any, ...]) -> None:
        entry = self._ranks[rank]
        try:
            assert entry.conn is not None
            entry.conn.send(message)
        except (OSError, AssertionError):
            self._fail(f"could not reach {entry.describe()}{self._exit_note(entry)}")

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
