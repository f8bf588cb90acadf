"""The tiers below the device cache: a chain of KV stores (the host-memory tier, then a
storage tier), fed off the step path and read on prefix misses.

``offer`` (the device thread, after copying evicted blocks out) only queues; a writer
thread puts them into the first tier, and whatever a tier drops to make room into the
next. Until written, a queued block is still found (``fetch``). ``fetch``
(the engine thread, when a prefix lookup misses the device) reads the first tier that
has the block, and copies a block found below the first tier up into it, so the next
lookup of a hot prefix is a memory read. Without a host tier, the last blocks read from
a store stay in a small memory of ``recent_bytes`` (a request waiting for room is looked
up again every step).

``publish`` (prefill/decode disaggregation) writes blocks straight to the shared tiers,
skipping those they hold already, and says when they are there: a prefill rank hands a
prompt's blocks to a decode rank that way.

A store that fails (its directory gone, its server down) costs misses, never a step:
the failure is logged (once per tier until it recovers) and the block is treated as
absent. A store never returns bytes other than those put under a key (its contract), so
a miss is the worst a broken store can cause.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import attrs
import structlog
import torch

from powertrain.engine.host_store import HostMemoryStore
from powertrain.interfaces.kv_store import KVStore, StoredBlock

log = structlog.get_logger(__name__)


@attrs.define
class TierStats:
    """One tier's traffic since start."""

    #: Blocks a prefix lookup found here (and loaded back instead of recomputing).
    hit_blocks: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0
    #: Calls that failed (each a miss or a dropped write).
    errors: int = 0


@attrs.frozen
class _Offered:
    blocks: list[StoredBlock]
    #: Waits until the device has finished copying the payloads out (None: they are).
    ready: Callable[[], None] | None
    #: A publication: written to the shared tiers only, then this gets the blocks written.
    published: Future[int] | None = None
    #: A publication's keys that the shared tiers must hold already (no payload here).
    elsewhere: Sequence[bytes] = ()


class KVTiers:
    """``tiers``: (name, store) from the top (host memory) down."""

    def __init__(self, tiers: Sequence[tuple[str, KVStore]], recent_bytes: int = 64 * 2**20) -> None:
        if not tiers:
            raise ValueError("KVTiers needs at least one store")
        self.tiers = list(tiers)
        self._recent = HostMemoryStore(recent_bytes)
        self.stats = {name: TierStats() for name, _ in self.tiers}
        self._pending: dict[bytes, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._failing: set[str] = set()
        self._queue: queue.Queue[_Offered | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="powertrain-kv-tiers", daemon=True)
        self._writer.start()

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.tiers]

    @property
    def shared(self) -> bool:
        """Whether a tier is seen by other processes (and outlives this one): worth handing
        the cache down to at shutdown, and where ``publish`` writes."""
        return any(store.shared for _, store in self.tiers)

    # ----------------------------------------------------------------------- writing

    def offer(self, blocks: list[StoredBlock], ready: Callable[[], None] | None = None) -> None:
        """Queue ``blocks`` for the tiers; returns at once."""
        if not blocks:
            return
        with self._lock:
            for key, payload in blocks:
                self._pending[key] = payload
        self._queue.put(_Offered(blocks, ready))

    def publish(
        self,
        blocks: list[StoredBlock],
        ready: Callable[[], None] | None,
        published: Future[int],
        elsewhere: Sequence[bytes] = (),
    ) -> None:
        """Queue ``blocks`` for every shared tier; ``published`` gets how many were written
        (those a tier held already are not), or an error: the store's, or that one of the
        keys ``elsewhere`` (blocks the publisher's cache no longer has) is neither in the
        shared tier nor in this process's own tiers, to be written from there."""
        self._queue.put(_Offered(blocks, ready, published, elsewhere))

    def _write_loop(self) -> None:
        while (offered := self._queue.get()) is not None:
            try:
                if offered.ready is not None:
                    offered.ready()
                if offered.published is None:
                    self._put_down(0, offered.blocks)
                else:
                    self._publish(offered.blocks, offered.published, offered.elsewhere)
            except Exception as error:  # the writer outlives any one batch (a failed copy, a bug)
                if offered.published is not None:
                    offered.published.set_exception(error)
                else:
                    log.error("kv tiers dropped offered blocks", blocks=len(offered.blocks), error=f"{error!r}")
            finally:
                if offered.published is None:  # a publication's blocks were never pending
                    with self._lock:
                        for key, _ in offered.blocks:
                            self._pending.pop(key, None)
                self._queue.task_done()
        self._queue.task_done()

    def _put_down(self, level: int, blocks: list[StoredBlock]) -> None:
        """Put ``blocks`` into tier ``level``, and what it drops into the tiers below."""
        while blocks and level < len(self.tiers):
            dropped = self._put(*self.tiers[level], blocks)
            if dropped is None:
                return  # the tier failed: these blocks are lost, as a miss
            blocks, level = dropped, level + 1

    def _put(self, name: str, store: KVStore, blocks: list[StoredBlock]) -> list[StoredBlock] | None:
        """``store.put(blocks)``, timed and counted; None when the store failed."""
        started = time.perf_counter()
        dropped = self._call(name, store.put, blocks)
        stats = self.stats[name]
        stats.write_seconds += time.perf_counter() - started
        if dropped is not None:
            stats.bytes_written += sum(payload.numel() for _, payload in blocks)
        return dropped

    def _publish(self, blocks: list[StoredBlock], published: Future[int], elsewhere: Sequence[bytes]) -> None:
        written = 0
        for name, store in self.tiers:
            if not store.shared:
                continue
            held = self._call(name, store.contains, [*(key for key, _ in blocks), *elsewhere])
            if held is None and elsewhere:
                raise OSError(f"kv store {name!r} failed to say whether it holds the prompt's blocks (logged above)")
            held = held or [False] * len(blocks)
            missing = [block for block, there in zip(blocks, held[: len(blocks)], strict=True) if not there]
            lost = 0
            for key, there in zip(elsewhere, held[len(blocks) :], strict=True):
                if there:
                    continue
                own = self._own_copy(key)
                if own is None:
                    lost += 1
                else:
                    missing.append((key, own))
            if lost:
                raise LookupError(
                    f"{lost} of the prompt's blocks left the cache before they were published, and neither "
                    f"kv store {name!r} nor this process's own tiers hold them"
                )
            if missing and self._put(name, store, missing) is None:
                raise OSError(f"kv store {name!r} failed to take {len(missing)} published blocks (logged above)")
            written += len(missing)
        published.set_result(written)

    def _own_copy(self, key: bytes) -> torch.Tensor | None:
        """The payload under ``key`` in a tier only this process sees (its host memory), or None."""
        for name, store in self.tiers:
            if not store.shared:
                got = self._call(name, store.get, [key])
                if got and got[0] is not None:
                    return got[0]
        return None

    def flush(self) -> None:
        """Wait until everything offered so far is written (tests, shutdown)."""
        self._queue.join()

    # ----------------------------------------------------------------------- reading

    def fetch(self, key: bytes) -> tuple[str, torch.Tensor] | None:
        """The payload under ``key`` and the tier it came from, or None."""
        with self._lock:
            payload = self._pending.get(key)
        if payload is not None:
            return self.tiers[0][0], payload
        for level, (name, store) in enumerate(self.tiers):
            if not isinstance(store, HostMemoryStore):
                recent = self._recent.get([key + name.encode()])[0]
                if recent is not None:
                    return name, recent
            started = time.perf_counter()
            got = self._call(name, store.get, [key])
            payload = got[0] if got else None
            if payload is None:
                continue
            stats = self.stats[name]
            stats.read_seconds += time.perf_counter() - started
            stats.bytes_read += payload.numel()
            if level > 0 and isinstance(self.tiers[0][1], HostMemoryStore):
                self.offer([(key, payload)])  # copy it up: the next lookup of a hot prefix is a memory read
            elif not isinstance(store, HostMemoryStore):
                self._recent.put([(key + name.encode(), payload)])
            return name, payload
        return None

    def _call(self, name: str, method: Callable[[list], list], items: list) -> list | None:
        """``method(items)``; None (logged, counted) when the store fails."""
        try:
            result = method(items)
        except Exception as error:  # a store's failure is a miss, never a failed step
            self.stats[name].errors += 1
            if name not in self._failing:
                self._failing.add(name)
                log.warning("kv store failing: treated as misses", tier=name, error=f"{type(error).__name__}: {error}")
            return None
        if name in self._failing:
            self._failing.discard(name)
            log.info("kv store answering again", tier=name)
        return result

    # ----------------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Write what is queued, hand what host memory holds down to the tiers that keep
        it (a storage tier survives a restart), stop the writer, close the stores."""
        self._queue.put(None)
        self._writer.join()
        for level, (_, store) in enumerate(self.tiers[:-1]):
            if isinstance(store, HostMemoryStore):
                self._put_down(level + 1, store.drain())
        for name, store in self.tiers:
            try:
                store.close()
            except Exception as error:  # closing is best effort: the blocks are written already
                log.warning("kv store did not close cleanly", tier=name, error=f"{type(error).__name__}: {error}")
