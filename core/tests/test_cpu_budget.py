"""Thread counts follow the CPUs a process may use: its affinity mask and its cgroup's CPU
quota (v1 and v2, the tightest of the cgroup and its ancestors), not the host's cores."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from powertrain.cpu_budget import cpu_budget

AFFINITY = len(os.sched_getaffinity(0))


def fake_root(tmp_path: Path, cgroup: str, files: dict[str, str]) -> Path:
    """A ``/proc/self/cgroup`` and ``/sys/fs/cgroup`` tree under ``tmp_path``."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for name, text in files.items():
        path = tmp_path / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_cgroup_v2_takes_the_tightest_quota_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    root = fake_root(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        {
            "kubepods/cpu.max": "max 100000\n",
            "kubepods/pod1/cpu.max": "50000 100000\n",  # half a CPU: rounded up to one
            "kubepods/pod1/ctr/cpu.max": "400000 100000\n",
        },
    )
    budget = cpu_budget(root)
    assert budget.cpus == 1
    assert "pod1/cpu.max: 50000 100000" in budget.reason


def test_cgroup_v1_cfs_quota_and_a_container_seeing_its_cgroup_as_the_root(tmp_path: Path) -> None:
    root = fake_root(
        tmp_path,
        "4:memory:/x\n3:cpu,cpuacct:/\n",
        {"cpu,cpuacct/cpu.cfs_quota_us": "100000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
    )
    budget = cpu_budget(root)
    assert budget.cpus == 1 and "cpu.cfs_quota_us: 100000 / 100000" in budget.reason


@pytest.mark.parametrize(
    ("cgroup", "files"),
    [
        ("0::/a\n", {"a/cpu.max": "max 100000\n"}),
        (
            "3:cpu,cpuacct:/a\n",
            {"cpu,cpuacct/a/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/a/cpu.cfs_period_us": "100000\n"},
        ),
        ("0::/a\n", {"a/cpu.max": "100000000 100000\n"}),  # 1000 CPUs: the affinity mask is tighter
        ("0::/a\n", {}),  # no cpu controller files at all
    ],
)
def test_without_a_tighter_quota_the_affinity_mask_decides(tmp_path: Path, cgroup: str, files: dict) -> None:
    budget = cpu_budget(fake_root(tmp_path, cgroup, files))
    assert budget.cpus == AFFINITY and "affinity" in budget.reason


@pytest.mark.skipif(AFFINITY < 2, reason="needs two CPUs to narrow the mask to one")
def test_an_engine_built_under_a_narrower_affinity_mask_runs_that_many_threads() -> None:
    """torch sizes its OpenMP team from the mask it saw at import (here: every CPU); the
    mask narrowed afterwards (as a container runtime or ``taskset -p`` may) must still cap
    torch's threads and the native kernels' when the engine is built."""
    probe = """
import os, torch
from powertrain import LLM
before = torch.get_num_threads()
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
with LLM(num_blocks=8, max_model_len=64) as llm:
    import powertrain_cpu_kernels._native as native
    print("THREADS", before, torch.get_num_threads(), native.threads(), llm.engine.runner.model is not None)
"""
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("THREADS"))
    assert line.split()[1:] == [str(AFFINITY), "1", "1", "True"]
