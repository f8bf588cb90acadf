"""The builtin ``fcfs`` scheduler, registered like any plugin."""

from __future__ import annotations

from typing import TYPE_CHECKING

from powertrain import hookimpl
from powertrain.components import SchedulerRecord

if TYPE_CHECKING:
    from powertrain.builtin.fcfs_scheduler import FcfsScheduler
    from powertrain.interfaces.scheduling import SchedulerContext, Seq

POWERTRAIN_HOOK_API = 1


def build_fcfs(context: SchedulerContext[Seq]) -> FcfsScheduler[Seq]:
    from powertrain.builtin.fcfs_scheduler import FcfsScheduler

    return FcfsScheduler(context)


@hookimpl
def powertrain_schedulers() -> list[SchedulerRecord]:
    return [
        SchedulerRecord(
            name="fcfs",
            factory=build_fcfs,
            description="first come, first served; continuous batching, chunked prefill, prefix-cache aware",
        )
    ]
