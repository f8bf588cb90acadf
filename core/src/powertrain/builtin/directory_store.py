"""The builtin ``directory`` KV store: one file per block under ``[cache] store_path``,
on a local disk or a filesystem several engines share (NFS, 3FS, Lustre).

A file is written under a temporary name in its final directory and renamed into place,
which POSIX filesystems do atomically, so a reader sees a whole file or none. Each file
is a framed block (``interfaces.kv_store.frame_block``: its key, its payload's length
and digest): a file that was cut short, corrupted or holds another key fails the check,
is reported as a miss with a warning and removed, and is never loaded.

The store keeps an index of the files it knows (scanned at start, so blocks from before
a restart are served) and drops the least recently used once ``capacity_bytes`` is
reached. Several engines sharing a directory each bound what they index; a file
another one removed is simply a miss.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import structlog
import torch

from powertrain.interfaces.kv_store import KVStoreContext, StoredBlock, frame_block, unframe_block

log = structlog.get_logger(__name__)

SUFFIX = ".kvb"
#: A temporary file older than this is left over from a writer that died: removed at start.
STALE_TEMPORARY_S = 3600.0


class DirectoryStore:
    shared = True

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int | None) -> None:
        if not str(path):
            raise ValueError("the directory KV store needs a directory: set [cache] store_path")
        self.root = Path(path).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, oldest first
        self._lock = threading.Lock()
        self._scan()

    @classmethod
    def build(cls, context: KVStoreContext) -> DirectoryStore:
        return cls(context.path, context.capacity_bytes)

    # ----------------------------------------------------------------------- files

    def file_of(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / (name + SUFFIX)

    def _scan(self) -> None:
        """Index the blocks already here, oldest access first; clear dead writers' leftovers."""
        found = []
        now = time.time()
        for path in self.root.glob("*/*"):
            try:
                stat = path.stat()
                if path.name.endswith(".tmp"):
                    if now - stat.st_mtime > STALE_TEMPORARY_S:
                        path.unlink(missing_ok=True)
                    continue
                if path.suffix == SUFFIX:
                    found.append((stat.st_mtime, bytes.fromhex(path.stem), stat.st_size))
            except (OSError, ValueError):
                continue  # removed meanwhile by another engine, or not ours
        for _, key, size in sorted(found):
            self._index[key] = size
            self.used_bytes += size
        if found:
            log.info("kv store directory holds blocks", path=str(self.root), blocks=len(found), bytes=self.used_bytes)

    def _check_root(self) -> None:
        if not self.root.is_dir():
            raise FileNotFoundError(f"the KV store directory {self.root} is gone")

    # ----------------------------------------------------------------------- the contract

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_root()
        return [self.file_of(key).is_file() for key in keys]

    def get(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        self._check_root()
        return [self._read(key) for key in keys]

    def _read(self, key: bytes) -> torch.Tensor | None:
        path = self.file_of(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        payload = unframe_block(key, data)
        if isinstance(payload, str):
            return self._reject(path, key, payload)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        return payload

    def _reject(self, path: Path, key: bytes, why: str) -> None:
        log.warning("kv store block dropped as a miss", file=str(path), why=why)
        path.unlink(missing_ok=True)
        self._forget(key)
        return None

    def put(self, blocks: Sequence[StoredBlock]) -> list[StoredBlock]:
        self._check_root()
        for key, payload in blocks:
            path = self.file_of(key)
            if path.is_file():
                with self._lock:
                    if key in self._index:
                        self._index.move_to_end(key)
                continue
            size = self._write(path, key, payload)
            with self._lock:
                self._index[key] = size
                self.used_bytes += size
        self._trim()
        return []

    def _write(self, path: Path, key: bytes, payload: torch.Tensor) -> int:
        header, data = frame_block(key, payload)
        path.parent.mkdir(exist_ok=True)
        temporary = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(temporary, "wb") as file:
                file.write(header)
                file.write(data)
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        return len(header) + len(data)

    def _trim(self) -> None:
        while True:
            with self._lock:
                if self.capacity_bytes is None or self.used_bytes <= self.capacity_bytes or not self._index:
                    return
                key, size = self._index.popitem(last=False)
                self.used_bytes -= size
            self.file_of(key).unlink(missing_ok=True)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.used_bytes -= size

    def evict(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.file_of(key).unlink(missing_ok=True)
            self._forget(key)

    def close(self) -> None:
        with self._lock:
            self._index.clear()
