"""The builtin ``directory`` KV store: one file per block under ``[cache] store_path``,
on a local disk or a filesystem several engines share (NFS, 3FS, Lustre).

A file is written under a temporary name in its final directory and renamed into place,
which POSIX filesystems do atomically, so a reader sees a whole file or none. Each file
carries its key, its payload's length and a BLAKE2b digest of the payload: a file that
was cut short, corrupted or (after a hash collision of names) holds another key fails
the check, is reported as a miss with a warning and removed, and is never loaded.

The store keeps an index of the files it knows (scanned at start, so blocks from before
a restart are served) and drops the least recently used once ``capacity_bytes`` is
reached. Several engines sharing a directory each bound what they index; a file
another one removed is simply a miss.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import structlog
import torch

from powertrain.interfaces.kv_store import KVStoreContext, StoredBlock

log = structlog.get_logger(__name__)

MAGIC = b"PTKVBLK1"
#: magic, key length (u32), payload length (u64), payload digest (16 bytes); then the key and payload.
HEADER = struct.Struct("<8sIQ16s")
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
            with open(path, "rb") as file:
                header = file.read(HEADER.size)
                if len(header) < HEADER.size:
                    return self._reject(path, key, "shorter than its header")
                magic, key_len, size, digest = HEADER.unpack(header)
                if magic != MAGIC:
                    return self._reject(path, key, "not a powertrain KV block file")
                if file.read(key_len) != key:
                    return self._reject(path, key, "holds another key")
                payload = torch.empty(size, dtype=torch.uint8)
                if file.readinto(payload.numpy()) != size or file.read(1):
                    return self._reject(path, key, f"does not hold the {size} payload bytes its header says")
        except FileNotFoundError:
            return None
        if hashlib.blake2b(payload.numpy(), digest_size=16).digest() != digest:
            return self._reject(path, key, "fails its checksum")
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
        data = payload.contiguous().numpy()
        header = HEADER.pack(MAGIC, len(key), data.nbytes, hashlib.blake2b(data, digest_size=16).digest())
        path.parent.mkdir(exist_ok=True)
        temporary = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(temporary, "wb") as file:
                file.write(header)
                file.write(key)
                file.write(memoryview(data))
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        return HEADER.size + len(key) + data.nbytes

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
