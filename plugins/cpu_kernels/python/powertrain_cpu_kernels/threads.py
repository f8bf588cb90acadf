"""Where the native kernels run their chunks: torch's OpenMP team, or their own pool."""

from __future__ import annotations

import torch

import powertrain_cpu_kernels._native as _native
from powertrain_cpu_kernels import torch_openmp


def use_threads(threads: int) -> None:
    """Run the native kernels on ``threads`` threads, the calling one included. One pool per
    process: it is only rebuilt when kernels with different thread counts alternate (never
    in an engine, where every kernel takes torch's thread count when built)."""
    if threads != _native.threads():
        _native.set_threads(threads)


def openmp_team() -> int:
    """The OpenMP team a native call runs on instead of the package's pool (0: the pool).

    While torch runs its ops on several threads, its OpenMP workers poll for their next op
    for a while and hold the cores a second pool would need; a call then goes to that same
    team, whose workers are awake. On a 2-core VM this made 64-row decode attention 1.7x
    faster than on the calling thread alone; batch-1 decode ran the same as the pool beside
    torch on one thread when the machine was idle, and 1.6x faster while another process
    kept both cores busy. Without a reachable runtime (or with torch on one thread) the pool
    has the cores."""
    threads = torch.get_num_threads()
    address = torch_openmp.gomp_parallel_address() if threads > 1 else 0
    if not address:
        return 0
    if not _native.openmp_available():
        _native.set_openmp(address)
    return threads
