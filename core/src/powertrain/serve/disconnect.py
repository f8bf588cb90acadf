"""Watching a non-streaming request's connection while the engine works on it.

A stream notices a client that left when its next chunk cannot be sent; a request that
answers once sends nothing until the end, so without a watch a client that gave up (a
timeout, a killed process) leaves its request generating for nobody until its length
runs out, holding KV blocks and a decode slot. vLLM watches the connection the same
way (its ``with_cancellation``): wait for ASGI's ``http.disconnect`` beside the work,
and cancel the work when it comes first. Cancelling the work closes its engine stream,
which aborts the request before the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi.responses import Response
from starlette.types import Receive

T = TypeVar("T")

#: nginx's "client closed request": logged and counted, never seen by the client.
CLIENT_CLOSED_REQUEST = 499


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has closed the connection (the body was read already, so
    the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T | Response:
    """``work``'s result, or, if the client disconnects first, a 499 response once the
    work is cancelled (the access log and ``powertrain_requests_total`` count it)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled (the server shutting down)
        for pending in (watch, task):
            pending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    if task.done() and not task.cancelled():
        return task.result()
    with contextlib.suppress(asyncio.CancelledError):
        await task  # the engine stream closes here, which aborts the request
    return Response(status_code=CLIENT_CLOSED_REQUEST)
