"""Settings for the whole test run (every package's tests sit below this folder).

Many tests start fresh Python processes: the installed ``powertrain`` command, spawned
engine workers, a new virtual environment's interpreter. Each imports torch and the
plugin stack. Where the environment sets ``PYTHONDONTWRITEBYTECODE`` (and the venv
holds no ``.pyc`` files), every one of those processes compiles the same thousands of
modules from source again: several CPU seconds each, most of a short CLI test. The
child processes of this run therefore share one bytecode cache in a temporary folder
(``PYTHONPYCACHEPREFIX``), so each module is compiled once per run; nothing is written
into the virtual environment, and what the processes execute is unchanged.

Parallel workers (pytest-xdist) share the cores: each computes with torch on its share of
them (``torch.set_num_threads``), not on all. Two workers each running an OpenMP team as
wide as a 2-core box oversubscribe it, and every parallel region then waits at its
barrier for a thread the scheduler parked (the engine tests ran 16% faster on their
share: 169 -> 143 s on a 2-core EPYC). Processes the tests start keep sizing themselves.

The run also gets a cache folder of its own (``POWERTRAIN_CACHE_DIR``, e.g. the linear
choice timings), so tests never read or write the user's ``~/.cache/powertrain``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from powertrain.cpu_budget import cpu_budget

#: The conformance kit (with one run seed for every test: POWERTRAIN_TEST_SEED), and no process left behind.
pytest_plugins = ["powertrain.testing", "powertrain.testing.processes"]


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, cpu_budget().cpus // workers))
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and not os.environ.get("PYTHONPYCACHEPREFIX"):
        cache = tempfile.mkdtemp(prefix="powertrain-test-pycache-")
        os.environ.pop("PYTHONDONTWRITEBYTECODE")
        os.environ["PYTHONPYCACHEPREFIX"] = cache
        config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))
    if not os.environ.get("POWERTRAIN_CACHE_DIR"):
        cache_dir = tempfile.mkdtemp(prefix="powertrain-test-cache-")
        os.environ["POWERTRAIN_CACHE_DIR"] = cache_dir
        config.add_cleanup(lambda: shutil.rmtree(cache_dir, ignore_errors=True))


@pytest.fixture
def cargo_test():
    """``cargo_test(crate, what, env)``: run a Rust crate's own tests (``cargo test``, with
    ``env`` added to the environment) and fail with their output unless they pass, so the one
    test command covers them and CI cannot skip them."""

    def run(crate: Path, what: str, env: dict[str, str] | None = None) -> None:
        cargo = shutil.which("cargo")
        assert cargo, f"cargo is not on PATH: install Rust (rustup) to build and test {what}"
        # A target folder of its own, so this run never waits on (or disturbs) the extension build.
        env = {**os.environ, **(env or {}), "CARGO_TARGET_DIR": str(crate / "target" / "cargo-test")}
        command = [cargo, "test", "--quiet"]
        proc = subprocess.run(command, cwd=crate, env=env, capture_output=True, text=True, timeout=1500)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
        assert "test result: ok" in proc.stdout

    return run
