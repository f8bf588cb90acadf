"""The frame every per-kind suite builds on: find the component, skip honestly."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import pytest
import torch

from powertrain.components import PlatformInfo
from powertrain.plugins import PluginManager, Provided
from powertrain.testing.seeds import fresh_seed


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def shuffled_block_tables(needed: Sequence[int], gen: torch.Generator) -> tuple[list[list[int]], int]:
    """Block lists of ``needed[i]`` blocks each, drawn without repeats from a shuffled pool
    twice their total (non-contiguous, out of order, with unused blocks between them), and
    the pool's size: where a kernel reads the wrong block, it reads another sequence's or garbage."""
    pool_size = 2 * sum(needed) + 1
    pool = torch.randperm(pool_size, generator=gen).tolist()
    tables, used = [], 0
    for count in needed:
        tables.append(pool[used : used + count])
        used += count
    return tables, pool_size


def random_index_rows(
    available: Sequence[int], query_lens: Sequence[int], topk: int, gen: torch.Generator
) -> torch.Tensor:
    """int32 ``[sum(query_lens), topk]``: per query token, duplicate-free indices below its
    sequence's ``available[i]``, ``-1`` in the unused columns (scattered over the row, not
    only at its end). Rows cycle (from a random offset) through: all -1; as many as the row
    can hold; and random counts. Indices range over all that is available, including what
    the query could not see yet: a sparse backend attends to what is listed, no more."""
    indices = torch.full((sum(query_lens), topk), -1, dtype=torch.int32)
    offset = int(torch.randint(0, 4, (1,), generator=gen).item())
    row = 0
    for count_max, query_len in zip(available, query_lens, strict=True):
        for _ in range(query_len):
            most = min(topk, count_max)
            kind = (row + offset) % 4
            if kind == 0 or most == 0:
                count = 0
            else:
                count = most if kind == 1 else int(torch.randint(1, most + 1, (1,), generator=gen).item())
            chosen = torch.randperm(count_max, generator=gen)[:count]
            columns = torch.randperm(topk, generator=gen)[:count]
            indices[row, columns] = chosen.to(torch.int32)
            row += 1
    return indices


def assert_names_numbers(message: str, numbers: Sequence[tuple[int, str]], where: str) -> None:
    """An error message must name each ``(number, what)`` as a whole number of its own."""
    for number, what in numbers:
        assert re.search(rf"(?<![\d-]){number}(?!\d)", message), (
            f"the ValueError should name the {what} {number}, it says {message!r}: {where}"
        )


def find_component(manager: PluginManager, kind: str, name: str) -> Provided:
    for provided in manager.records(kind):
        if provided.record.name == name:
            return provided
    names = [p.record.name for p in manager.records(kind)]
    broken = manager.broken()
    raise LookupError(
        f"no {kind} named {name!r} is registered; registered: {', '.join(names) or '(none)'}"
        + (f"; broken plugins: {broken}" if broken else "")
    )


def usable_platform(manager: PluginManager, provided: Provided) -> PlatformInfo:
    """The first platform the record runs on that is available here, or a pytest skip."""
    platform, reasons = manager.best_platform(provided.record)
    if platform is None:
        # Absent hardware is not a failure (DESIGN §5): the record's own reason is reported.
        pytest.skip(f"{provided.record.name} is unavailable on this machine ({'; '.join(reasons)})")
    return platform


@attrs.frozen
class Subject:
    """The component under test: its record, the plugins it came from, where it runs."""

    plugins: PluginManager
    provided: Provided
    platform: PlatformInfo


class ComponentSuite:
    """Subclass as ``class TestMine(<Kind>Suite): component = "my-name"``.

    The suite finds the record through the real plugin manager (so the entry point
    is exercised), skips with the record's own reason where it cannot run, and skips
    tests whose capability the record does not declare.
    """

    kind: ClassVar[str]
    component: ClassVar[str]

    @pytest.fixture
    def provided(self, powertrain_plugins: PluginManager) -> Provided:
        return find_component(powertrain_plugins, self.kind, self.component)

    @pytest.fixture
    def platform_info(self, powertrain_plugins: PluginManager, provided: Provided) -> PlatformInfo:
        return usable_platform(powertrain_plugins, provided)

    @pytest.fixture
    def subject(self, powertrain_plugins: PluginManager, provided: Provided, platform_info: PlatformInfo) -> Subject:
        return Subject(plugins=powertrain_plugins, provided=provided, platform=platform_info)

    @staticmethod
    def require(provided: Provided, *capabilities: str) -> None:
        declared = getattr(provided.record, "capabilities", frozenset())
        missing = set(capabilities) - set(declared)
        if missing:
            # Declared capabilities decide which tests apply (DESIGN §5).
            pytest.skip(f"{provided.record.name} does not declare {sorted(missing)}")

    @pytest.fixture
    def seed(self, request: Any) -> int:
        value = fresh_seed()
        request.node.user_properties.append(("seed", value))
        return value
