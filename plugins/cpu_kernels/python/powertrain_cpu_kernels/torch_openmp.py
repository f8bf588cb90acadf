"""torch's OpenMP runtime, where the native kernels can reach it (``src/openmp.rs``).

No import of the extension here: the plugin's registration asks this too.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

#: ``POWERTRAIN_CPU_OPENMP=0`` keeps the kernels off torch's OpenMP team (on their own pool,
#: with decode steps' torch ops on one thread): an escape hatch should a runtime misbehave.
SWITCH = "POWERTRAIN_CPU_OPENMP"


@functools.cache
def gomp_parallel_address() -> int:
    """The address of ``GOMP_parallel`` in the OpenMP runtime torch loaded; 0 where torch's
    parallel backend is not OpenMP, where the process cannot see the symbol, or where
    ``POWERTRAIN_CPU_OPENMP=0``. Looked up once (``cache_clear`` to look again)."""
    if os.environ.get(SWITCH, "1") == "0" or not torch.backends.openmp.is_available():
        return 0
    try:
        return ctypes.cast(ctypes.CDLL(None).GOMP_parallel, ctypes.c_void_p).value or 0
    except (AttributeError, OSError):  # not exported where this process can see it
        return 0
