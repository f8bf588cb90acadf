"""The native kernels' thread pool, shared by every kernel of this package."""

from __future__ import annotations

import powertrain_cpu_kernels._native as _native


def use_threads(threads: int) -> None:
    """Run the native kernels on ``threads`` threads, the calling one included. One pool per
    process: it is only rebuilt when kernels with different thread counts alternate (never
    in an engine, where every kernel takes torch's thread count when built)."""
    if threads != _native.threads():
        _native.set_threads(threads)
