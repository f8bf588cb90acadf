"""Where every test's random seeds come from: one run seed, and a seed per test derived from it.

Why: a suite whose seeds are drawn afresh each run fails at random and cannot replay
its failures; a suite with hand-picked constants never explores. Here one *run seed*
decides everything:

- ``POWERTRAIN_TEST_SEED`` unset: a fixed run seed, so CI is reproducible;
- ``POWERTRAIN_TEST_SEED=random``: a new one, drawn once per run (and shared with the
  xdist workers), to explore;
- ``POWERTRAIN_TEST_SEED=<integer>``: that one, to replay a run.

``fresh_seed()`` derives its value from the run seed, the place it is called from (the
test, or the fixture being set up, with its scope's node id) and how many seeds that
place drew before. A test's seeds therefore do not depend on which worker runs it, on
what ran before it, or on whether the rest of the suite runs at all: the replay line
printed with a failure (run seed and node id) gives the same checkpoint, prompts and
inputs, module-scoped fixtures included. Python's, torch's and numpy's global generators
are seeded the same way before each fixture and each test, so code that draws from them
(``random.randint``, ``torch.randint`` without a generator) replays too.

Enable with ``pytest_plugins = ["powertrain.testing.seeds"]`` (the conformance kit,
``powertrain.testing``, enables it).
"""

from __future__ import annotations

import contextvars
import hashlib
import os
import random
import sys
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

#: The run seed: unset for the fixed default, ``random`` to explore, an integer to replay.
SEED_ENV = "POWERTRAIN_TEST_SEED"
#: The run seed of a run that names none; any fixed value serves, this one is the day it was set.
DEFAULT_RUN_SEED = 20261205
EXPLORE = "random"


def run_seed() -> int:
    """The run seed ``POWERTRAIN_TEST_SEED`` names (the fixed default where unset)."""
    value = os.environ.get(SEED_ENV, "").strip()
    if not value:
        return DEFAULT_RUN_SEED
    if value == EXPLORE:  # outside pytest (where no configure hook drew one): draw it here, once
        os.environ[SEED_ENV] = value = str(_draw())
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"{SEED_ENV}={value!r} is neither an integer nor {EXPLORE!r}: unset it for the fixed seeds, "
            f"set it to {EXPLORE!r} to explore, or to the run seed a failure's replay line printed"
        ) from None


def _draw() -> int:
    return int.from_bytes(os.urandom(4), "little")


def derive(run: int, place: str, index: int) -> int:
    """The ``index``-th seed of ``place`` in run ``run``: 32 bits (numpy's generators take no more)."""
    digest = hashlib.blake2b(f"{run}\x00{place}\x00{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


@attrs.define
class _Place:
    """Where seeds are being drawn: a test, or a fixture's setup; counts what it drew."""

    name: str
    label: str
    drawn: int = 0


_place: contextvars.ContextVar[_Place | None] = contextvars.ContextVar("powertrain_test_seed_place", default=None)
_outside = _Place("outside-tests", "outside tests")
#: What each place drew: place name -> [(label, seed)], for the replay section of a failure.
_drawn: dict[str, list[tuple[str, int]]] = {}


def fresh_seed() -> int:
    """A seed for the test or fixture calling it: a new one each call, the same ones in every
    run with the same run seed (see the module's docstring)."""
    place = _place.get() or _outside
    value = derive(run_seed(), place.name, place.drawn)
    place.drawn += 1
    _drawn.setdefault(place.name, []).append((place.label, value))
    return value


def seed_global_generators(value: int) -> None:
    """Seed Python's, torch's and (where loaded) numpy's global generators."""
    random.seed(value)
    import torch

    torch.manual_seed(value)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(value)


class _Enter:
    """Make ``name`` the place seeds are drawn from (its count starting at 0) and seed the global
    generators for it: each setup of a fixture and each test call is a place of its own."""

    def __init__(self, name: str, label: str) -> None:
        self.place = _Place(name, label)
        _drawn.pop(name, None)  # a fixture set up again (another worker, another module order) starts over

    def __enter__(self) -> None:
        self.token = _place.set(self.place)
        seed_global_generators(derive(run_seed(), self.place.name, -1))

    def __exit__(self, *exc: object) -> None:
        _place.reset(self.token)


def _fixture_place(fixturedef: Any, request: Any) -> str:
    node = request.node  # the node of the fixture's own scope: the session, a module, a class, the test
    place = f"{node.nodeid}::{fixturedef.argname}"
    if getattr(fixturedef, "params", None) is not None:
        place += f"[{request.param_index}]"
    return place


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: Any) -> Iterator[None]:
    with _Enter(_fixture_place(fixturedef, request), f"fixture {fixturedef.argname!r} ({fixturedef.scope})"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _Enter(item.nodeid, "test"):
        return (yield)


def pytest_configure(config: pytest.Config) -> None:
    # The controller draws an exploring run's seed and hands it to the xdist workers it starts.
    if os.environ.get(SEED_ENV, "").strip() == EXPLORE and not hasattr(config, "workerinput"):
        os.environ[SEED_ENV] = str(_draw())
    run_seed()  # a bad value fails now, once, with its message


def pytest_report_header(config: pytest.Config) -> str:
    how = "fixed default" if not os.environ.get(SEED_ENV, "").strip() else "set"
    return f"{SEED_ENV}={run_seed()} ({how}; '{EXPLORE}' explores, an integer replays)"


def replay_line(nodeid: str) -> str:
    return f"{SEED_ENV}={run_seed()} uv run pytest -n 0 '{nodeid}'"


def _seeds_of(item: pytest.Item) -> list[str]:
    """The seeds the test and the fixtures it uses drew, each with where it was drawn."""
    names = set(getattr(item, "fixturenames", ()))
    lines = []
    for place, seeds in _drawn.items():
        scope, _, fixture = place.rpartition("::")
        in_scope = scope == "" or (item.nodeid + "::").startswith(scope + "::")  # the session's node id is ""
        if place == item.nodeid or (fixture.partition("[")[0] in names and in_scope):
            lines += [f"  {label}: {value}" for label, value in seeds]
    return lines


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    report = yield
    if report.failed:
        seeds = _seeds_of(item)
        text = "replay: " + replay_line(item.nodeid) + "\n"
        if seeds:
            text += "seeds drawn (derived from the run seed):\n" + "\n".join(seeds) + "\n"
        report.sections.append(("replay", text))
    return report


def pytest_terminal_summary(terminalreporter: Any) -> None:
    failed = [r for kind in ("failed", "error") for r in terminalreporter.stats.get(kind, []) if hasattr(r, "nodeid")]
    lines = sorted({content.splitlines()[0] for r in failed for name, content in r.sections if name == "replay"})
    if lines:
        terminalreporter.section("replay failures (same seeds, one process)")
        for line in lines:
            terminalreporter.write_line(line.removeprefix("replay: "))
