"""How many CPUs this process may really compute on: its affinity mask and its cgroup's
CPU quota, not the host's core count.

A container limited to 2 CPUs (``docker --cpus 2``, a Kubernetes CPU limit) on a 64-core
host sees 64 cores in ``os.cpu_count()``, and torch's OpenMP team starts as many threads
as the affinity mask holds (all 64 there). Those threads then take turns on two CPUs'
worth of time, and every parallel region waits at its barrier for whichever of them the
kernel's scheduler has parked: decode slows down many times over. Thread pools size
themselves from ``cpu_budget()`` instead.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import attrs

#: cgroup v1's CPU bandwidth controller (a kernel name, not a platform's).
CPU_CONTROLLER = "cpu"


@attrs.frozen
class CpuBudget:
    """The CPUs this process may use, and what limits them (for the log)."""

    cpus: int
    reason: str


def cpu_budget(root: Path = Path("/")) -> CpuBudget:
    """The smaller of the affinity mask's CPUs and the cgroup CPU quota (rounded up); at
    least 1. ``root`` is where ``/proc`` and ``/sys/fs/cgroup`` are found (tests)."""
    affinity = _affinity()
    limits = [(affinity, f"{affinity} CPUs in the affinity mask")]
    quota = _cgroup_quota(root)
    if quota is not None:
        cpus, where = quota
        limits.append((cpus, f"the cgroup CPU quota ({where})"))
    cpus, reason = min(limits, key=lambda limit: limit[0])
    return CpuBudget(max(1, cpus), reason)


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def _cgroup_quota(root: Path) -> tuple[int, str] | None:
    """The tightest CPU quota of this process's cgroup and its ancestors, in CPUs (quota /
    period rounded up) with the file that sets it; None without one."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    found: list[tuple[float, str]] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: one unified tree
            found += _walk(root / "sys/fs/cgroup", path, _v2_quota)
        elif CPU_CONTROLLER in controllers.split(","):  # cgroup v1: the cpu controller's hierarchy
            for mount in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
                base = root / "sys/fs/cgroup" / mount
                if base.is_dir():
                    found += _walk(base, path, _v1_quota)
                    break
    if not found:
        return None
    cpus, where = min(found)
    return math.ceil(cpus - 1e-9), where


def _walk(base: Path, path: str, read: Callable[[Path], tuple[float, str] | None]) -> list[tuple[float, str]]:
    """``read(folder)`` for the cgroup's folder and each ancestor up to ``base``. A
    container often sees its own cgroup as the root (``/``): then ``base`` itself."""
    found = []
    folder = base / path.strip("/")
    while True:
        quota = read(folder)
        if quota is not None:
            found.append(quota)
        if folder == base or base not in folder.parents:
            return found
        folder = folder.parent


def _v2_quota(folder: Path) -> tuple[float, str] | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return int(quota) / int(period), f"{folder / 'cpu.max'}: {quota} {period}"


def _v1_quota(folder: Path) -> tuple[float, str] | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:  # -1: no limit
        return None
    return quota / period, f"{folder / 'cpu.cfs_quota_us'}: {quota} / {period}"
