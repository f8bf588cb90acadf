"""One load level: send a workload at a request rate or a concurrency, collect the results.

A rate is an open loop: Poisson arrivals, each request sent when due whether or not
earlier ones finished, as independent users do. A concurrency is a closed loop: C
clients, each sending its next request when its last one ends. A multi-turn
conversation's next turn can only be sent once its previous reply is in, so under a
rate an arrival may wait for a ready conversation; the achieved rate shows that.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from powertrain.bench import workloads
from powertrain.bench.client import ChatClient, RequestResult
from powertrain.bench.workloads import Conversation


@dataclass(frozen=True)
class Load:
    """One load level: `mode` is "rate" (requests per second, may be inf) or "concurrency"."""

    mode: str
    value: float

    @property
    def label(self) -> str:
        if self.mode == "rate":
            return "rate inf" if math.isinf(self.value) else f"rate {self.value:g}/s"
        return f"concurrency {self.value:g}"

    def to_json(self) -> dict[str, Any]:
        """JSON has no infinity: an unlimited rate is written "inf"."""
        if self.mode == "concurrency":
            return {"mode": self.mode, "target": int(self.value)}
        return {"mode": self.mode, "target": "inf" if math.isinf(self.value) else self.value}

    @classmethod
    def parse_list(cls, mode: str, text: str) -> list[Load]:
        """`1,2,inf` for rates, `1,4,16` for concurrencies."""
        loads = []
        for item in text.split(","):
            try:
                value = float(item) if mode == "rate" else int(item)
            except ValueError:
                raise ValueError(f"{item.strip()!r} in {text!r} is not a {mode}") from None
            if not value > 0:
                raise ValueError(f"a {mode} must be positive, not {item.strip()}")
            loads.append(cls(mode, float(value)))
        return loads


@dataclass
class LevelRun:
    """The raw outcome of one load level, before summarising."""

    load: Load
    planned: int
    results: list[RequestResult]
    duration: float
    skipped: int  # turns never sent because an earlier turn of their conversation failed
    peak_concurrency: int
    #: The server's prefix-cache counters before and after the level (``ChatClient.
    #: cache_counters``), where it exposes them.
    cache_counters: tuple[dict[str, float], dict[str, float]] | None = None
    #: CPU seconds this client process spent during the level: on the server's own machine
    #: they are cores the server did not get (a 2-core box running 64 streams: about 8%).
    client_cpu_s: float | None = None


class _Ready:
    """Conversations whose next turn may be sent now; one in flight comes back when its turn ends."""

    def __init__(self, conversations: list[Conversation]) -> None:
        self.queue = deque(conversations)
        self.in_flight = 0
        self.changed = asyncio.Condition()

    async def take(self) -> Conversation | None:
        """The next conversation to send a turn of, or None once none ever will be ready."""
        async with self.changed:
            await self.changed.wait_for(lambda: self.queue or self.in_flight == 0)
            if not self.queue:
                return None
            self.in_flight += 1
            return self.queue.popleft()

    async def finish(self, conversation: Conversation, again: bool) -> None:
        async with self.changed:
            self.in_flight -= 1
            if again:
                self.queue.append(conversation)  # behind the others: conversations interleave
            self.changed.notify_all()


async def run_level(
    client: ChatClient,
    conversations: list[Conversation],
    load: Load,
    body: Callable[[list[dict[str, Any]], int], dict[str, Any]],
    arrival_seed: int | str,
    on_result: Callable[[RequestResult, int], None] = lambda result, settled: None,
) -> LevelRun:
    """Send `conversations` at `load`, building each request with `body(messages, max_tokens)`.

    `on_result(result, settled)` hears of each answer; `settled` also counts the turns a
    failure leaves unsendable, so a progress bar reaches its end.
    """
    planned = sum(len(c.user_turns) for c in conversations)
    ready = _Ready(conversations)
    results: list[RequestResult] = []
    skipped = in_flight = peak = 0
    started, cpu_started = time.perf_counter(), time.process_time()

    async def send(conversation: Conversation) -> None:
        nonlocal skipped, in_flight, peak
        messages, max_tokens = conversation.next_request()
        in_flight += 1
        peak = max(peak, in_flight)
        result = await client.chat(body(messages, max_tokens), started)
        in_flight -= 1
        results.append(result)
        lost = 0 if result.ok else len(conversation.user_turns) - conversation.turn - 1
        skipped += lost
        if result.ok:
            conversation.record_reply(result.text)
        on_result(result, 1 + lost)
        await ready.finish(conversation, again=result.ok and not conversation.done)

    if load.mode == "rate":
        tasks = []
        for due in workloads.arrival_times(planned, load.value, arrival_seed):
            delay = started + due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            conversation = await ready.take()
            if conversation is None:
                break
            tasks.append(asyncio.create_task(send(conversation)))
        await asyncio.gather(*tasks)
    else:

        async def closed_loop_client() -> None:
            while (conversation := await ready.take()) is not None:
                await send(conversation)

        await asyncio.gather(*(closed_loop_client() for _ in range(int(load.value))))
    duration = time.perf_counter() - started
    return LevelRun(load, planned, results, duration, skipped, peak, client_cpu_s=time.process_time() - cpu_started)
