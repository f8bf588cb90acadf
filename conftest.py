"""Settings for the whole test run (every package's tests sit below this folder).

Many tests start fresh Python processes: the installed ``powertrain`` command, spawned
engine workers, a new virtual environment's interpreter. Each imports torch and the
plugin stack. Where the environment sets ``PYTHONDONTWRITEBYTECODE`` (and the venv
holds no ``.pyc`` files), every one of those processes compiles the same thousands of
modules from source again: several CPU seconds each, most of a short CLI test. The
child processes of this run therefore share one bytecode cache in a temporary folder
(``PYTHONPYCACHEPREFIX``), so each module is compiled once per run; nothing is written
into the virtual environment, and what the processes execute is unchanged.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and not os.environ.get("PYTHONPYCACHEPREFIX"):
        cache = tempfile.mkdtemp(prefix="powertrain-test-pycache-")
        os.environ.pop("PYTHONDONTWRITEBYTECODE")
        os.environ["PYTHONPYCACHEPREFIX"] = cache
        config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))
