"""No test leaves a process behind: one still alive when the session ends fails the run.

Why: a server, rank or redis-server a failing test forgot keeps a port, a core and memory
for the rest of the run, and the next run's tests then fail for a reason of their own.
Every pytest process marks the processes started under it through environment variables
they inherit (``POWERTRAIN_TEST_OWNER``: the pytest process's pid; ``POWERTRAIN_TEST_RUNNING``:
the test then running), grandchildren an exited parent left behind included. When the
session ends (after every fixture's teardown), any marked process still alive is killed
and named, with the test that started it, as an error of the last test. A child started
with an environment that drops the variables is not seen: pass ``{**os.environ, ...}``.

Enable with ``pytest_plugins = ["powertrain.testing.processes"]`` (this repository's root
conftest does; it needs ``psutil``, which the conformance kit does not require).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import attrs
import psutil
import pytest

OWNER_ENV = "POWERTRAIN_TEST_OWNER"
#: The test running when a process started (set before each test), to name it in the error.
TEST_ENV = "POWERTRAIN_TEST_RUNNING"
#: How long a left-behind process gets to end after SIGTERM before SIGKILL.
GRACE_S = 5.0


@attrs.frozen
class LeftBehind:
    pid: int
    command: str
    started_during: str


def marked_processes(owner: int) -> list[tuple[psutil.Process, str]]:
    """Live processes (not zombies) whose environment carries ``OWNER_ENV=owner``, each with
    the test that was running when it (or the ancestor it inherited the mark from) started."""
    mark = f"{OWNER_ENV}={owner}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == owner:
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            if mark not in environ:
                continue
            process = psutil.Process(int(entry.name))
            if process.status() != psutil.STATUS_ZOMBIE:
                test = next((v for v in environ if v.startswith(f"{TEST_ENV}=".encode())), b"=collection")
                found.append((process, test.partition(b"=")[2].decode(errors="replace")))
        except (OSError, psutil.Error):  # gone meanwhile, or not ours to read
            continue
    return found


def end(processes: list[psutil.Process]) -> None:
    """SIGTERM, then SIGKILL what is still alive after ``GRACE_S``."""
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=GRACE_S)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=GRACE_S)


def pytest_configure(config: pytest.Config) -> None:
    # Set after this process started, so /proc shows it for what this process starts, not
    # for the process itself (each xdist worker marks its own children).
    os.environ[OWNER_ENV] = str(os.getpid())


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> None:
    os.environ[TEST_ENV] = item.nodeid


def multiprocessing_helpers() -> set[int]:
    """Python's own per-process helpers (resource tracker, fork server): started once by the
    first spawned process and meant to live as long as this process, not left behind."""
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    pids = {
        getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None),
        getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None),
    }
    return {pid for pid in pids if pid}


def left_behind() -> list[LeftBehind]:
    """The marked processes still alive, ended; what they were and which test started them."""
    helpers = multiprocessing_helpers()
    marked = [(process, test) for process, test in marked_processes(os.getpid()) if process.pid not in helpers]
    found = []
    for process, test in marked:
        try:
            found.append(LeftBehind(process.pid, " ".join(process.cmdline())[:300], test))
        except psutil.Error:
            continue
    end([process for process, _ in marked])
    return found


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind() -> Iterator[None]:
    """Autouse and session-scoped: its check runs after every other fixture's teardown."""
    yield
    found = left_behind()
    if found:
        lines = [f"  pid {p.pid}: {p.command!r}, started during {p.started_during}" for p in found]
        pytest.fail(
            f"{len(found)} process(es) outlived the tests that started them (now killed):\n"
            + "\n".join(lines)
            + "\nEnd every process a test starts in a finally block or a fixture's teardown.",
            pytrace=False,
        )
