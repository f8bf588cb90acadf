"""The KV stores and the tiers over them: payloads come back bit for bit or not at all,
capacities hold, a damaged or vanished store costs misses (with a logged reason) and
never an exception on the serving path."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import structlog
import torch

from powertrain.builtin.directory_store import DirectoryStore
from powertrain.engine.host_store import HostMemoryStore
from powertrain.engine.kv_tiers import KVTiers
from powertrain.interfaces import KVStore
from powertrain.interfaces.kv_store import BLOCK_HEADER as HEADER
from powertrain.testing.kv_store import random_blocks


@pytest.fixture
def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_both_stores_satisfy_the_contract(tmp_path: Path) -> None:
    assert isinstance(HostMemoryStore(None), KVStore)
    assert isinstance(DirectoryStore(tmp_path, None), KVStore)
    assert DirectoryStore(tmp_path, None).shared and not HostMemoryStore(None).shared


def test_host_store_drops_least_recently_used_first_and_hands_them_back(gen: torch.Generator) -> None:
    blocks = random_blocks(5, gen, size=100)
    store = HostMemoryStore(capacity_bytes=300)
    assert store.put(blocks[:3]) == []
    store.get([blocks[0][0]])  # block 0 is now the most recently used
    dropped = store.put(blocks[3:4])
    assert [key for key, _ in dropped] == [blocks[1][0]]
    assert store.contains([key for key, _ in blocks]) == [True, False, True, True, False]
    assert torch.equal(store.get([blocks[3][0]])[0], blocks[3][1])
    assert store.used_bytes == 300
    too_big = (b"big", torch.zeros(301, dtype=torch.uint8))
    assert store.put([too_big]) == [too_big]  # never fits: straight down


def test_directory_store_round_trips_and_survives_a_restart(tmp_path: Path, gen: torch.Generator) -> None:
    blocks = random_blocks(6, gen, size=1000)
    store = DirectoryStore(tmp_path / "kv", capacity_bytes=None)
    assert store.put(blocks) == []
    assert all(
        torch.equal(got, payload) for got, (_, payload) in zip(store.get([k for k, _ in blocks]), blocks, strict=True)
    )
    assert not list((tmp_path / "kv").glob("*/.*.tmp")), "a temporary file was left behind"
    again = DirectoryStore(tmp_path / "kv", capacity_bytes=None)
    assert again.used_bytes == store.used_bytes > 6000
    assert all(
        torch.equal(got, payload) for got, (_, payload) in zip(again.get([k for k, _ in blocks]), blocks, strict=True)
    )
    assert again.get([b"never put"]) == [None]


def test_directory_store_keeps_within_its_capacity(tmp_path: Path, gen: torch.Generator) -> None:
    blocks = random_blocks(10, gen, size=1000)
    per_file = HEADER.size + 17 + 1000
    store = DirectoryStore(tmp_path, capacity_bytes=4 * per_file)
    for block in blocks:
        store.put([block])
    assert store.used_bytes == 4 * per_file
    assert store.contains([k for k, _ in blocks]) == [False] * 6 + [True] * 4
    assert len(list(tmp_path.glob("*/*.kvb"))) == 4


@pytest.mark.parametrize(
    "damage",
    ["truncated", "flipped-byte", "other-key", "empty", "garbage"],
)
def test_a_damaged_file_is_a_logged_miss_and_is_removed(tmp_path: Path, gen: torch.Generator, damage: str) -> None:
    (key, payload), (other_key, _) = random_blocks(2, gen, size=4096)
    store = DirectoryStore(tmp_path, capacity_bytes=None)
    store.put([(key, payload)])
    path = store.file_of(key)
    data = bytearray(path.read_bytes())
    if damage == "truncated":  # a writer that died mid-file on a filesystem without atomic renames
        data = data[: len(data) - 1000]
    elif damage == "flipped-byte":
        data[-7] ^= 0x40
    elif damage == "other-key":
        data[HEADER.size : HEADER.size + len(key)] = other_key
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(random.randbytes(len(data)))  # the global generator: seeded per test
    path.write_bytes(bytes(data))
    with structlog.testing.capture_logs() as logs:
        assert store.get([key]) == [None]
    assert any(entry["event"] == "kv store block dropped as a miss" for entry in logs), logs
    assert not path.exists()
    assert store.used_bytes == 0


def test_a_vanished_directory_raises_and_the_tiers_turn_that_into_misses(tmp_path: Path, gen: torch.Generator) -> None:
    blocks = random_blocks(4, gen, size=512)
    store = DirectoryStore(tmp_path / "kv", capacity_bytes=None)
    tiers = KVTiers([("host", HostMemoryStore(600)), ("directory", store)])
    try:
        tiers.offer(blocks[:2])
        tiers.flush()
        assert store.contains([blocks[0][0]]) == [True]  # the host tier holds one: the other went down
        shutil.rmtree(tmp_path / "kv")
        with pytest.raises(FileNotFoundError):
            store.get([blocks[0][0]])
        with structlog.testing.capture_logs() as logs:
            assert tiers.fetch(blocks[0][0]) is None
            tiers.offer(blocks[2:])
            tiers.flush()
        assert [e["event"] for e in logs].count("kv store failing: treated as misses") == 1, logs
        assert tiers.stats["directory"].errors >= 2
        found = tiers.fetch(blocks[3][0])  # the host tier still serves the last one offered
        assert found is not None and found[0] == "host" and torch.equal(found[1], blocks[3][1])
    finally:
        tiers.close()


def test_tiers_spill_down_promote_up_and_find_what_is_still_queued(tmp_path: Path, gen: torch.Generator) -> None:
    blocks = random_blocks(8, gen, size=256)
    host = HostMemoryStore(capacity_bytes=3 * 256)
    tiers = KVTiers([("host", host), ("directory", DirectoryStore(tmp_path, None))])
    try:
        tiers.offer(blocks)
        for key, payload in blocks:  # queued, being written or written: always found
            found = tiers.fetch(key)
            assert found is not None and torch.equal(found[1], payload)
        tiers.flush()
        # The host tier keeps 3 (which ones depends on the copies up the lookups above
        # made while the writer ran); the others went down to the directory.
        in_host = host.contains([k for k, _ in blocks])
        assert sum(in_host) == 3 and host.used_bytes == 3 * 256
        assert tiers.stats["directory"].bytes_written >= 5 * 256
        below = blocks[in_host.index(False)]
        tier, payload = tiers.fetch(below[0]) or ("", None)
        assert tier == "directory" and torch.equal(payload, below[1])
        tiers.flush()
        assert host.contains([below[0]]) == [True], "a block read from below is copied up"
    finally:
        tiers.close()
    # Closing hands host memory down: every block is in the directory afterwards.
    assert DirectoryStore(tmp_path, None).contains([k for k, _ in blocks]) == [True] * 8
