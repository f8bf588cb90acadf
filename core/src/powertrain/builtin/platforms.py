"""The `cpu` and `cuda` platforms.

CUDA detection goes through torch: capability and memory when torch sees a GPU,
"unavailable: <reason>" otherwise (no GPU, a CPU-only torch build, a broken driver).
"""

from __future__ import annotations

import os
import platform

from powertrain import hookimpl
from powertrain.components import Availability, PlatformInfo, PlatformRecord

POWERTRAIN_HOOK_API = 1


def detect_cpu() -> PlatformInfo:
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not every OS exposes these
        memory = 0
    return PlatformInfo(
        name="cpu",
        device_type="cpu",
        availability=Availability.yes(f"{os.cpu_count()} cores"),
        device_count=1,
        device_name=platform.processor() or platform.machine(),
        total_memory_bytes=memory,
        dist_backend="gloo",
    )


def detect_cuda() -> PlatformInfo:
    import torch

    def unavailable(reason: str) -> PlatformInfo:
        return PlatformInfo(name="cuda", device_type="cuda", dist_backend="nccl", availability=Availability.no(reason))

    if torch.version.cuda is None:
        return unavailable(f"torch {torch.__version__} was built without CUDA")
    try:
        count = torch.cuda.device_count()
    except RuntimeError as exc:  # a driver that torch cannot talk to
        return unavailable(f"CUDA runtime error: {exc}")
    if count == 0:
        reason = "no CUDA device visible to torch"
        if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
            reason += " (CUDA_VISIBLE_DEVICES is empty)"
        return unavailable(reason)
    props = torch.cuda.get_device_properties(0)
    return PlatformInfo(
        name="cuda",
        device_type="cuda",
        availability=Availability.yes(f"{count} x {props.name}"),
        device_count=count,
        device_name=props.name,
        capability=(props.major, props.minor),
        total_memory_bytes=props.total_memory,
        dist_backend="nccl",
    )


@hookimpl
def powertrain_platforms() -> list[PlatformRecord]:
    return [
        PlatformRecord(
            name="cpu",
            device_type="cpu",
            dist_backend="gloo",
            detect=detect_cpu,
            priority=0,
            description="host CPU through torch; always available",
        ),
        PlatformRecord(
            name="cuda",
            device_type="cuda",
            dist_backend="nccl",
            detect=detect_cuda,
            priority=100,
            description="NVIDIA GPUs through torch.cuda",
        ),
    ]
