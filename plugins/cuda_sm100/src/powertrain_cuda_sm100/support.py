"""Where the pack runs: compute capability, triton, and the Triton interpreter.

Kept free of triton imports (``find_spec`` only), so the plugin module can ask it
while loading on any machine.
"""

from __future__ import annotations

import importlib.util
import os

from powertrain.components import Availability, PlatformInfo

#: Compute capabilities the kernels are compiled and tested for: (major, minor) -> name.
#: 10.x (Blackwell, tcgen05 MMA) is what the autotune configs are tuned for; 9.x
#: (Hopper, wgmma) runs the same kernels with its own configs.
TARGETS = {(10, 0): "sm_100a (Blackwell)", (9, 0): "sm_90a (Hopper)"}
MIN_CAPABILITY = (9, 0)


def availability(platform: PlatformInfo) -> Availability:
    """Available on a CUDA GPU of capability >= 9.0 with triton installed; else why not."""
    if not _triton_installed():
        return Availability.no("triton is not installed (pip install triton)")
    capability = platform.capability
    if capability is None:
        return Availability.no(f"platform {platform.name} reports no CUDA compute capability")
    if capability < MIN_CAPABILITY:
        return Availability.no(
            f"{platform.device_name or 'this GPU'} has compute capability {capability[0]}.{capability[1]}; "
            f"the Triton kernels need >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Hopper or Blackwell)"
        )
    tuned = "tuned" if capability >= (10, 0) else "runs (configs tuned for SM100)"
    return Availability.yes(f"compute capability {capability[0]}.{capability[1]}: {tuned}")


def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except ImportError:  # a finder that refuses it: as good as absent
        return False


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``: kernels run on the CPU through numpy.

    The interpreter multiplies bf16/fp16 ``tl.dot`` operands wrongly (measured: errors
    of 1e10 on N(0,1) inputs with triton 3.9), so kernels upcast dot operands to
    float32 when this is set (their ``DOT_F32`` constexpr); compiled kernels keep
    native tensor-core dtypes. Its float32 -> bfloat16 casts also truncate where GPUs
    round to nearest, so interpreted bf16 results may be one ulp off.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
