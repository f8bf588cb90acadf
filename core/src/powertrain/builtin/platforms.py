"""The `cpu` and `cuda` platforms.

CUDA detection goes through torch: capability and memory when torch sees a GPU,
"unavailable: <reason>" otherwise (no GPU, a CPU-only torch build, a broken driver).
Each detection also fills the facts core acts on (components.PlatformInfo), so core
never asks which platform it runs on.
"""

from __future__ import annotations

import os
import platform
from typing import TYPE_CHECKING, Any

from powertrain import hookimpl
from powertrain.components import Availability, PlatformInfo, PlatformRecord
from powertrain.cpu_budget import cpu_budget

if TYPE_CHECKING:
    import torch

POWERTRAIN_HOOK_API = 1


def cpu_model() -> str | None:
    """The CPU's model name (Linux; None elsewhere): speed depends on the vendor's libraries."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), None)
    except OSError:
        return None


#: CPU flags (Linux ``/proc/cpuinfo``) of bfloat16 dot-product instructions: with one,
#: oneDNN multiplies bfloat16 at about twice float32's rate (2-3x measured on a Zen 4
#: with avx512_bf16); without, its bfloat16 kernels convert and run at float32's rate.
BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as info:
            line = next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def bf16_dot_flags() -> list[str]:
    """This CPU's bfloat16 dot-product flags (``BF16_DOT_FLAGS`` it has), sorted."""
    return sorted(set(BF16_DOT_FLAGS) & cpu_flags())


def onednn_bf16_supported() -> bool:
    """Whether this CPU runs oneDNN's bfloat16 kernels, as torch itself decides before it
    refuses a bfloat16 weight reorder (x86: avx512bw + avx512vl + avx512dq, or
    avx_ne_convert; Arm: bf16). False when this torch cannot say."""
    import torch

    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return probe is not None and bool(probe())


def cpu_linear_packing() -> tuple[frozenset[torch.dtype], str]:
    """The dtypes whose linear weights this CPU packs for oneDNN, and why these."""
    import torch

    from powertrain.layers.linear import onednn_packing_ops  # imports torch: not at plugin import

    capability = torch.backends.cpu.get_cpu_capability()
    if not onednn_packing_ops():
        return frozenset(), f"torch {torch.__version__} has no oneDNN linear packing (no mkldnn or its linear ops)"
    if not onednn_bf16_supported():
        return frozenset({torch.float32}), (
            "oneDNN packs bfloat16 weights only on CPUs with bfloat16 kernels (x86: avx512bw, avx512vl and "
            f"avx512dq, or avx_ne_convert); torch reports this CPU lacks them (vector capability {capability}), "
            "so only float32 weights are packed"
        )
    return frozenset({torch.float32, torch.bfloat16}), (
        f"oneDNN packs float32 and bfloat16 weights on this CPU (vector capability {capability})"
    )


def detect_cpu() -> PlatformInfo:
    import torch

    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not every OS exposes these
        memory = 0
    packed, note = cpu_linear_packing()
    bf16_dot = bf16_dot_flags()
    budget = cpu_budget()
    return PlatformInfo(
        name="cpu",
        device_type="cpu",
        availability=Availability.yes(f"{os.cpu_count()} cores, {budget.cpus} usable ({budget.reason})"),
        device_count=1,
        device_name=cpu_model() or platform.processor() or platform.machine(),
        total_memory_bytes=memory,
        dist_backend="gloo",
        host=True,
        auto_dtype=torch.float32,
        auto_dtype_note=(
            "float32 is exact; bfloat16 rounds every activation (greedy outputs change) and "
            + (
                "is slower here: this CPU has no oneDNN bfloat16 kernels"
                if torch.bfloat16 not in packed
                else f"multiplies about twice as fast on this CPU's bfloat16 dot products ({', '.join(bf16_dot)}): "
                "set dtype = bfloat16 for throughput"
                if bf16_dot
                else "halves dense weight bytes on this CPU's oneDNN bfloat16 kernels"
            )
            + "; GGUF weights kept quantised read the same bytes in either"
        ),
        shares_host_cores=True,
        host_cpus=budget.cpus,
        host_cpus_reason=budget.reason,
        packed_linear_dtypes=packed,
        linear_packing_note=note,
    )


def cuda_free_memory(device: torch.device) -> int:
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def cuda_set_device(device: torch.device) -> None:
    import torch

    torch.cuda.set_device(device)


#: What is true of CUDA whether or not detection finds a GPU.
CUDA_FACTS: dict[str, Any] = {
    "dist_backend": "nccl",
    "device_per_rank": True,
    "visible_devices_env": "CUDA_VISIBLE_DEVICES",
    "set_device": cuda_set_device,
    "barrier_needs_device_ids": True,
    "free_memory": cuda_free_memory,
    "keeps_fp8_weights": True,
    "pinned_host_copies": True,
    "cuda_graphs": True,
}


def detect_cuda() -> PlatformInfo:
    import torch

    def unavailable(reason: str) -> PlatformInfo:
        return PlatformInfo(name="cuda", device_type="cuda", availability=Availability.no(reason), **CUDA_FACTS)

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
        **CUDA_FACTS,
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
