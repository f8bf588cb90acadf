"""torch's OpenMP runtime, where the native kernels can reach it (``src/openmp.rs``).

No import of the extension here: the plugin's registration asks this too.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

#: ``POWERTRAIN_CPU_OPENMP=1`` puts the kernels on torch's OpenMP team; by default they run
#: on their own pool (with decode steps' torch ops on one thread). The team's end-of-region
#: barrier waits for every member, so when other processes take the cores, each of a decode
#: step's ~200 calls waits for the member the scheduler parked: batch-1 decode of the
#: embedded model on the 2-core Zen 4 EPYC went from 166 to 46 tok/s beside one busy
#: process and to 11-17 beside two, where the pool (whose caller runs the chunks no parked
#: worker claimed) kept 160 / 107 / 54 (``benchmarks/contention.py``). The team is faster
#: for batched steps on an otherwise idle machine (64 sequences: 144 against 173 ms per
#: step on the 2-core Xeon VM): set it there.
SWITCH = "POWERTRAIN_CPU_OPENMP"


@functools.cache
def gomp_parallel_address() -> int:
    """The address of ``GOMP_parallel`` in the OpenMP runtime torch loaded; 0 where torch's
    parallel backend is not OpenMP, where the process cannot see the symbol, or where
    ``POWERTRAIN_CPU_OPENMP`` is not 1. Looked up once (``cache_clear`` to look again)."""
    if os.environ.get(SWITCH, "0") != "1" or not torch.backends.openmp.is_available():
        return 0
    try:
        return ctypes.cast(ctypes.CDLL(None).GOMP_parallel, ctypes.c_void_p).value or 0
    except (AttributeError, OSError):  # not exported where this process can see it
        return 0
