"""Is there an Ascend NPU here, and if not, exactly why not.

Detection goes step by step so the reason is precise: torch_npu installed? CANN
toolkit found? torch_npu importable (it loads the CANN libraries)? any device?
Nothing here imports torch_npu at module import.

About torch's device-backend autoload: since torch 2.5, ``import torch`` imports every
installed package registered under the ``torch.backends`` entry point — torch_npu is
one — unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``. With torch_npu installed but CANN
missing or broken, that makes ``import torch`` itself fail, before any powertrain code
runs. powertrain never relies on autoload (detection imports torch_npu explicitly),
so on such a machine set ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``; ``autoload_hint`` says so
in the unavailability reason.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from powertrain.components import Availability, PlatformInfo

if TYPE_CHECKING:
    import torch

#: Where CANN's set_env.sh points, and where the installer puts the toolkit by default.
CANN_ENV_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
CANN_DEFAULT_PATHS = ("/usr/local/Ascend/ascend-toolkit/latest",)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a finder that refuses it: as good as absent
        return False


def cann_home() -> Path | None:
    """The CANN toolkit directory, from set_env.sh's variables or the default install path."""
    for name in CANN_ENV_VARS:
        value = os.environ.get(name)
        if value and Path(value).is_dir():
            return Path(value)
    for path in CANN_DEFAULT_PATHS:
        if Path(path).is_dir():
            return Path(path)
    return None


def autoload_hint() -> str:
    if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") == "0":
        return ""
    return " (with torch_npu installed but CANN unusable, set TORCH_DEVICE_BACKEND_AUTOLOAD=0 so `import torch` works)"


def npu_free_memory(device: torch.device) -> int:
    """Free bytes on an NPU now (torch_npu's ``mem_get_info``): the KV cache is sized from it, as on CUDA."""
    free, _ = importlib.import_module("torch_npu").npu.mem_get_info(device)
    return int(free)


def npu_set_device(device: torch.device) -> None:
    """Make ``device`` this process's current NPU: HCCL sets up groups on the current device."""
    importlib.import_module("torch_npu").npu.set_device(device)


#: What is true of Ascend NPUs whether or not detection finds one (components.PlatformInfo).
NPU_FACTS: dict[str, Any] = {
    "dist_backend": "hccl",
    "device_per_rank": True,
    "visible_devices_env": "ASCEND_RT_VISIBLE_DEVICES",
    "set_device": npu_set_device,
    "free_memory": npu_free_memory,
    "keeps_fp8_weights": True,
    "pinned_host_copies": True,
}


def unavailable(reason: str) -> PlatformInfo:
    return PlatformInfo(name="npu", device_type="npu", availability=Availability.no(reason), **NPU_FACTS)


def detect_npu() -> PlatformInfo:
    """The ``npu`` platform: device count, SoC name and memory through torch_npu, HCCL."""
    if not _installed("torch_npu"):
        return unavailable("torch_npu is not installed (pip install torch-npu matching your CANN and torch versions)")
    home = cann_home()
    if home is None:
        return unavailable(
            "the CANN toolkit was not found: neither $ASCEND_HOME_PATH nor $ASCEND_TOOLKIT_HOME is set "
            f"(source set_env.sh) and {CANN_DEFAULT_PATHS[0]} does not exist" + autoload_hint()
        )
    try:
        torch_npu = importlib.import_module("torch_npu")
    except Exception as exc:  # a CANN/torch_npu mismatch surfaces as any exception type
        failure = f"{type(exc).__name__}: {exc}"
        return unavailable(f"import torch_npu failed with CANN at {home}: {failure}" + autoload_hint())
    try:
        count = torch_npu.npu.device_count()
    except Exception as exc:
        return unavailable(f"torch_npu could not query devices: {type(exc).__name__}: {exc}")
    if count == 0:
        reason = "no Ascend NPU visible to torch_npu"
        if os.environ.get("ASCEND_RT_VISIBLE_DEVICES", None) == "":
            reason += " (ASCEND_RT_VISIBLE_DEVICES is empty)"
        return unavailable(reason)
    properties = torch_npu.npu.get_device_properties(0)
    soc = torch_npu.npu.get_device_name(0)
    return PlatformInfo(
        name="npu",
        device_type="npu",
        availability=Availability.yes(f"{count} x {soc} (CANN at {home})"),
        device_count=count,
        device_name=soc,
        total_memory_bytes=int(getattr(properties, "total_memory", 0)),
        **NPU_FACTS,
    )
