"""The builtin ``fcfs`` scheduler, registered like any plugin."""

from __future__ import annotations

from typing import Any

from powertrain import hookimpl
from powertrain.components import SchedulerRecord

POWERTRAIN_HOOK_API = 1


def build_fcfs(context: Any) -> Any:
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
