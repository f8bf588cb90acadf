"""An asyncio front for the engine: stream each request's tokens as they come.

The engine is not thread-safe, so one thread owns it and runs the loop; asyncio
callers hand it requests and aborts through a queue and get outputs back on their
event loop. A caller that stops listening (a client gone) aborts its request, which
frees its cache blocks at once.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import structlog

from powertrain.interfaces.engine import Engine, EngineStats
from powertrain.interfaces.errors import EngineDeadError, RequestFailedError
from powertrain.interfaces.outputs import RequestOutput
from powertrain.interfaces.sampling import SamplingParams

log = structlog.get_logger(__name__)


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._ids = itertools.count()
        self._stopping = threading.Event()
        #: The engine's counts as of its loop's last turn (readable from any thread).
        self.stats: EngineStats = engine.stats()
        self._thread = threading.Thread(target=self._loop, name="powertrain-engine", daemon=True)
        self._thread.start()

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        images: Sequence[Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every step that added tokens; the last one
        has ``finished=True``. Invalid input raises InvalidRequestError on first iteration;
        a request that failed where it ran (``RequestOutput.error``) raises
        RequestFailedError. ``images`` (``interfaces.images.ImageInput``, for an engine
        that ``accepts_images``) go to ``add_request`` as ``images=``; without them
        ``add_request`` is called as before."""
        if self._stopping.is_set() or not self._thread.is_alive():
            raise EngineDeadError("the engine is shut down or has failed; no new requests are accepted")
        request_id = request_id or f"async-{next(self._ids)}"
        outputs: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        self._inbox.put(("add", (request_id, prompt, params, images)))
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the consumer went away (or failed): stop the work
                self._inbox.put(("abort", request_id))

    def is_alive(self) -> bool:
        """Whether new requests are accepted."""
        return not self._stopping.is_set() and self._thread.is_alive()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def shutdown(self) -> None:
        """Abort everything in flight, stop the loop and the engine."""
        self._stopping.set()
        self._inbox.put(("stop", None))
        self._thread.join()
        self.engine.shutdown()

    # ----------------------------------------------------------------------- loop thread

    def _deliver(self, request_id: str, item: Any) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, outputs = stream
            loop.call_soon_threadsafe(outputs.put_nowait, item)

    def _handle(self, kind: str, payload: Any) -> bool:
        if kind == "stop":
            for request_id in list(self._streams):
                output = self.engine.abort_request(request_id)
                self._deliver(request_id, output or EngineDeadError("the engine shut down"))
            return False
        if kind == "abort":
            output = self.engine.abort_request(payload)
            if output is not None:
                self._deliver(payload, output)
            return True
        request_id, prompt, params, images = payload
        try:
            if images:
                self.engine.add_request(prompt, params, request_id=request_id, images=images)  # type: ignore[call-arg]
            else:
                self.engine.add_request(prompt, params, request_id=request_id)
        except Exception as exc:  # refused input goes back to its caller only
            self._deliver(request_id, exc)
        return True

    def _fail_streams(self, exc: Exception) -> None:
        """The engine failed: accept nothing more, and end every open stream with the reason."""
        log.error("engine loop stopped", error=f"{type(exc).__name__}: {exc}")
        self._stopping.set()
        for request_id in list(self._streams):
            self._deliver(request_id, EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}"))

    def _loop(self) -> None:
        running = True
        while running:
            block = not self.engine.has_unfinished_requests()
            try:
                kind, payload = self._inbox.get(block=block, timeout=0.5 if block else None)
                running = self._handle(kind, payload)
                while running:  # drain whatever else arrived
                    kind, payload = self._inbox.get_nowait()
                    running = self._handle(kind, payload)
            except queue.Empty:
                pass
            except Exception as exc:  # an abort that found the engine dead
                self._fail_streams(exc)
                return
            self.stats = self.engine.stats()
            if not running or not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:
                self._fail_streams(exc)
                return
            for output in outputs:
                self._deliver(output.request_id, output if output.error is None else RequestFailedError(output.error))
