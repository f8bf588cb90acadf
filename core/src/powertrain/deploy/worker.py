"""One rank's process: build its engine, take requests from the front end, run steps.

Talks to the front end over one ``multiprocessing.connection`` (pickled tuples, an
authentication key): the same code whether the front end spawned this process on its
machine or ``torchrun`` started it on another. Messages in: ``("add", request_id,
token_ids, params)``, ``("prefill", request_id, token_ids)`` (prefill/decode
disaggregation: compute the prompt's cache and publish it to the shared KV store),
``("abort", request_id)``, ``("stop",)``. Messages out:
``("hello", rank, pid, host)`` on connecting, ``("ready", WorkerInfo)`` once built,
``("outputs", [RequestOutput], EngineStats, counters)`` after every step that produced
something (and at least every ``HEARTBEAT_S`` as a sign of life),
``("prefilled", request_id, error)`` once a prefill's blocks are in the shared store
(``error`` None) or could not be put there (a decode rank then computes what it misses),
``("refused", request_id, why)`` (a request the front end should have refused),
``("failed", rank, text)`` before dying of an exception, ``("stopped", rank)``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import traceback
from concurrent.futures import Future
from multiprocessing.connection import Client, Connection
from typing import Any

import attrs
import structlog

from powertrain.assemble import build_engine
from powertrain.interfaces.errors import InvalidRequestError
from powertrain.interfaces.sampling import SamplingParams
from powertrain.log_setup import configure_logging
from powertrain.parallel.layout import RankPlacement

log = structlog.get_logger(__name__)

#: A worker with nothing to do still reports this often, so silence means trouble.
HEARTBEAT_S = 1.0
#: How long an idle expert-parallel rank waits for input between (cheap) idle rounds.
IDLE_POLL_S = 0.005
#: How long an idle rank without peers to keep in step blocks on its inbox.
IDLE_BLOCK_S = 0.5
#: How often a rank with nothing to step looks at the publications it waits for.
PUBLISH_POLL_S = 0.002
#: A prefill computes the prompt's cache and one token (thrown away: the decode rank
#: samples every token, with the request's own settings).
PREFILL_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


@attrs.frozen(kw_only=True)
class WorkerInfo:
    rank: int
    pid: int
    host: str
    holds_requests: bool
    num_blocks: int
    block_size: int
    #: Most tokens one sequence's cache holds (``LLMEngine.cache_tokens``).
    cache_tokens: int
    #: ``(first, count)`` of the routed experts this rank loaded; None: not a MoE model.
    experts: tuple[int, int] | None = None
    #: Blocks its own tiers (host memory) keep beside its device cache (``LLMEngine.tier_blocks``).
    tier_blocks: int = 0


def _expert_layers(engine: Any) -> list[Any]:
    return getattr(engine.runner.model, "routed_expert_layers", lambda: [])()


def _expert_slice(engine: Any) -> tuple[int, int] | None:
    layers = _expert_layers(engine)
    return (layers[0].first_expert, layers[0].local_experts) if layers else None


def counters(engine: Any) -> dict[str, float]:
    """Lockstep rounds and all-to-all seconds so far (empty without expert parallelism)."""
    lockstep = engine.runner.lockstep
    if lockstep is None:
        return {}
    layers = _expert_layers(engine)
    dispatcher = layers[0].dispatcher if layers else None
    return {
        "rounds": lockstep.rounds,
        "busy_rounds": lockstep.busy_rounds,
        "draft_rounds": lockstep.draft_rounds,
        "busy_draft_rounds": lockstep.busy_draft_rounds,
        "exchange_s": getattr(dispatcher, "exchange_seconds", 0.0),
    }


def see_one_device(variable: str | None, local_rank: int) -> None:
    """Make this process see only its own accelerator (before anything initialises it).

    ``variable`` is the platform's visible-devices variable
    (``PlatformInfo.visible_devices_env``); None: the platform has none, nothing to do.
    """
    if variable is None:
        return
    visible = [d for d in os.environ.get(variable, "").split(",") if d.strip()]
    os.environ[variable] = visible[local_rank] if local_rank < len(visible) else str(local_rank)


def connect(address: tuple[str, int], authkey: bytes, timeout_s: float) -> Connection:
    """The front end's connection, retried while it starts (another machine may be slower)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(address, authkey=authkey)
        except OSError:  # refused, unreachable, timed out: not up yet
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"could not reach the powertrain front end at {address[0]}:{address[1]} within {timeout_s:.0f} s; "
                    "check [parallel] frontend_port and that rank 0 is running"
                ) from None
            time.sleep(0.2)


def run_worker(
    config: Any,
    placement: RankPlacement,
    address: tuple[str, int],
    authkey: bytes,
    *,
    visible_devices: str | None = None,
    threads: int | None = None,
    log_level: str | None = None,
    connect_timeout_s: float = 600.0,
) -> None:
    """A worker's whole life; the target of spawned processes and of torchrun ranks."""
    import torch

    if log_level:
        configure_logging(log_level)
    structlog.contextvars.bind_contextvars(rank=placement.rank)
    see_one_device(visible_devices, placement.local_rank)
    if threads:
        torch.set_num_threads(threads)
    conn = connect(address, authkey, connect_timeout_s)
    conn.send(("hello", placement.rank, os.getpid(), socket.gethostname()))
    try:
        engine = build_engine(config, placement=placement)
    except BaseException as exc:
        _report_failure(conn, placement.rank, exc)
        raise
    info = WorkerInfo(
        rank=placement.rank,
        pid=os.getpid(),
        host=socket.gethostname(),
        holds_requests=placement.holds_requests,
        num_blocks=engine.block_manager.num_blocks,
        block_size=engine.block_manager.block_size,
        cache_tokens=engine.cache_tokens,
        experts=_expert_slice(engine),
        tier_blocks=engine.tier_blocks,
    )
    conn.send(("ready", info))
    try:
        WorkerLoop(engine, conn, placement.rank, handoff_timeout_s=config.parallel.handoff_timeout_s).run()
    except BaseException as exc:
        _report_failure(conn, placement.rank, exc)
        raise
    finally:
        engine.shutdown()
    with contextlib.suppress(OSError):  # a front end that gave up waiting has closed it
        conn.send(("stopped", placement.rank))
    conn.close()


def _report_failure(conn: Connection, rank: int, exc: BaseException) -> None:
    text = "".join(traceback.format_exception(exc))
    log.error("worker failed", error=f"{type(exc).__name__}: {exc}")
    with contextlib.suppress(OSError):  # the front end is gone too
        conn.send(("failed", rank, text))


class WorkerLoop:
    """Requests in, steps, outputs out; with expert parallelism, in lockstep (``lockstep``)."""

    def __init__(self, engine: Any, conn: Connection, rank: int, handoff_timeout_s: float = 30.0) -> None:
        self.engine = engine
        self.handoff_timeout_s = handoff_timeout_s
        self.conn = conn
        self.rank = rank
        self.lockstep = engine.runner.lockstep
        self.stopping = False
        self.requests: set[str] = set()
        #: Prefills in flight (their prompts), then the publications of their blocks (and
        #: when each began).
        self.prefills: dict[str, list[int]] = {}
        self.publishing: dict[str, tuple[Future[int], float]] = {}
        self._peers_busy = False
        self._broken = False  # the connection to the front end
        self._last_report = 0.0

    def run(self) -> None:
        engine = self.engine
        while True:
            self._receive(self._wait_s())
            outputs = []
            launched = engine.launched_steps
            if engine.has_unfinished_requests():
                outputs = engine.step()
            if self.lockstep is not None:
                if engine.launched_steps == launched:  # no forward this turn: keep peers in step
                    done = self.stopping and not engine.has_unfinished_requests()
                    result = engine.run_on_device(self.lockstep.idle, done)
                    self._peers_busy = result.anyone_busy
                    if result.everyone_stopping:
                        return
            elif self.stopping and not engine.has_unfinished_requests():
                return
            self._report(outputs)
            self._hand_off()

    def _wait_s(self) -> float:
        if self.stopping or self.engine.has_unfinished_requests() or self._peers_busy:
            return 0.0
        if self.publishing:
            return PUBLISH_POLL_S
        return IDLE_POLL_S if self.lockstep is not None else IDLE_BLOCK_S

    def _receive(self, wait_s: float) -> None:
        try:
            ready = self.conn.poll(wait_s)
            while ready:
                self._handle(self.conn.recv())
                ready = self.conn.poll(0)
        except (EOFError, OSError):
            if not self._broken:
                log.error("lost the front end; stopping")
            self._broken = True
            self._stop()

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind in ("add", "prefill"):
            request_id, token_ids = message[1:3]
            params = message[3] if kind == "add" else PREFILL_PARAMS
            try:
                self.engine.add_request(token_ids, params, request_id=request_id)
            except InvalidRequestError as exc:  # the front end checks first; this is a bug
                log.error("worker refused a request the front end accepted", request_id=request_id, error=str(exc))
                self._send(("refused", request_id, str(exc)))
                return
            if kind == "add":
                self.requests.add(request_id)
            else:
                self.prefills[request_id] = token_ids
        elif kind == "abort":
            self._abort(message[1])
        elif kind == "stop":
            self._stop()
        else:
            raise ValueError(f"worker {self.rank}: unknown message {kind!r} from the front end")

    def _abort(self, request_id: str) -> None:
        output = self.engine.abort_request(request_id)
        self.requests.discard(request_id)
        self.publishing.pop(request_id, None)
        if self.prefills.pop(request_id, None) is not None:
            return  # the front end has ended it already
        if output is not None:
            self._send(("outputs", [output], self.engine.stats(), counters(self.engine)))

    def _stop(self) -> None:
        """Abort everything and leave (with the peers, under expert parallelism)."""
        if self.stopping:
            return
        self.stopping = True
        for request_id in [*self.requests, *self.prefills, *self.publishing]:
            self._abort(request_id)

    def _report(self, outputs: list[Any]) -> None:
        for output in outputs:
            if output.finished:
                self.requests.discard(output.request_id)
        self._publish([o for o in outputs if o.request_id in self.prefills])
        outputs = [o for o in outputs if o.request_id not in self.prefills and o.request_id not in self.publishing]
        now = time.monotonic()
        if outputs or now - self._last_report >= HEARTBEAT_S:
            self._last_report = now
            self._send(("outputs", outputs, self.engine.stats(), counters(self.engine)))

    def _publish(self, outputs: list[Any]) -> None:
        """Publish the blocks of the prefills that finished (a prefill's own output, its one
        token, goes nowhere)."""
        for output in outputs:
            if output.finished:
                token_ids = self.prefills.pop(output.request_id)
                self.publishing[output.request_id] = (self.engine.publish_prefix(token_ids), time.monotonic())

    def _hand_off(self) -> None:
        """Tell the front end which publications are done, failed or overdue."""
        for request_id, (published, began) in list(self.publishing.items()):
            waited = time.monotonic() - began
            if published.done():
                error = published.exception()
                why = None if error is None else f"{type(error).__name__}: {error}"
            elif waited > self.handoff_timeout_s:
                why = f"the blocks were not in the store after {waited:.0f} s ([parallel] handoff_timeout_s)"
            else:
                continue
            del self.publishing[request_id]
            if why is not None:
                log.warning("a prefill's blocks were not published", request_id=request_id, error=why)
            self._send(("prefilled", request_id, why))

    def _send(self, message: tuple[Any, ...]) -> None:
        if self._broken:
            return
        try:
            self.conn.send(message)
        except OSError:
            self._broken = True
            log.error("lost the front end; stopping")
            self._stop()
