"""The one thread that computes: weight loading, cache allocation and every step.

On a CPU device torch parallelises ops with OpenMP, and OpenMP keeps one thread team
per thread that has ever run a parallel region. Once two teams exist there are more
busy threads than cores and libgomp throttles its spin-waits, so every parallel
region pays a sleep/wake: on a 2-core machine loops of small ops ran about 2x slower,
and powertrain's offline benchmark rate went from 90 to 108-118 tok/s once loading
and steps shared one thread (benchmarks/offline_throughput.py). Running all heavy
work on a single thread keeps one team; the scheduling thread only builds small
tensors, which torch does not parallelise. On accelerators the same thread is where
kernels are launched from, so nothing changes there.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
T = TypeVar("T")


class DeviceThread:
    def __init__(self) -> None:
        threads = torch.get_num_threads()  # the creator's setting (per thread under OpenMP)
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="powertrain-device",
            initializer=torch.set_num_threads,
            initargs=(threads,),
        )

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        return self._executor.submit(fn, *args, **kwargs)

    def run(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn`` there and wait; its exception is raised here."""
        return self._executor.submit(fn, *args, **kwargs).result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)
