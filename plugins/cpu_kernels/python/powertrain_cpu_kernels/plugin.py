"""Registers ``cpu-native``, the Rust weight-only quantised matmul for GGUF weights kept
quantised on a CPU (``[model] quantization``), and ``cpu-paged``, the attention backend
whose decodes and other short rows attend in Rust.

Importing this module loads nothing heavy: the extension is imported by the availability
check and the factory, when assembly (or the conformance kit) asks for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from powertrain import hookimpl
from powertrain.builtin.attention import BUCKETED_CAPABILITIES
from powertrain.components import AttentionBackendRecord, Availability, PlatformInfo, QuantizedLinearRecord
from powertrain_cpu_kernels.torch_openmp import gomp_parallel_address
from powertrain_cpu_kernels.tuning import POOL_MAX_ROWS

if TYPE_CHECKING:
    from powertrain.interfaces import AttentionBackendContext, QuantizedLinearContext
    from powertrain_cpu_kernels.attention import NativePagedAttention
    from powertrain_cpu_kernels.quantized_linear import NativeQuantizedLinear

POWERTRAIN_HOOK_API = 1


def native_available(platform: PlatformInfo) -> Availability:
    try:
        import powertrain_cpu_kernels._native as _native
    except ImportError as error:  # a broken or partial install
        return Availability.no(f"the native extension does not load: {error}")
    return Availability.yes(f"{_native.kernel_path()} kernels")


def build_native(context: QuantizedLinearContext) -> NativeQuantizedLinear:
    from powertrain_cpu_kernels.quantized_linear import NativeQuantizedLinear

    return NativeQuantizedLinear.for_this_cpu()


def build_native_float32(context: QuantizedLinearContext) -> NativeQuantizedLinear:
    from powertrain_cpu_kernels.quantized_linear import NativeQuantizedLinear

    return NativeQuantizedLinear.for_this_cpu(activation_bits=32)


def build_paged(context: AttentionBackendContext) -> NativePagedAttention:
    from powertrain_cpu_kernels.attention import NativePagedAttention

    return NativePagedAttention()


@hookimpl
def powertrain_attention_backends() -> list[AttentionBackendRecord]:
    return [
        AttentionBackendRecord(
            name="cpu-paged",
            platforms={"cpu"},
            capabilities={*BUCKETED_CAPABILITIES, "fused-rotary", "fused-rmsnorm", "fused-decoder"},
            # Above torch-bucketed (10), which it extends: the CPU default when installed.
            priority=20,
            check=native_available,
            factory=build_paged,
            description=(
                "torch-bucketed with decodes and other short rows attending in Rust, straight from "
                "the paged cache, and RMSNorm in one native pass (float32; other dtypes take the "
                "plain-torch path); small steps of Llama-shaped models with weights kept quantised "
                "run their whole decoder stack in one native call"
            ),
        )
    ]


@hookimpl
def powertrain_quantized_linear_backends() -> list[QuantizedLinearRecord]:
    def record(name: str, priority: int, factory: Callable, description: str) -> QuantizedLinearRecord:
        return QuantizedLinearRecord(
            name=name,
            platforms={"cpu"},
            capabilities={"q4", "q8"},
            priority=priority,
            # Calls run on torch's OpenMP team where it is reachable (threads.openmp_team);
            # elsewhere decode-sized calls run on the kernel's own pool, torch on one thread.
            own_pool_max_rows=0 if gomp_parallel_address() else POOL_MAX_ROWS,
            check=native_available,
            factory=factory,
            description=description,
        )

    return [
        record(
            "cpu-native",
            10,
            build_native,
            "Rust q4/q8 x float matmul (AVX2+FMA where the CPU has it, else portable); "
            "few rows read each quantised byte once, more multiply dequantised panels of it; "
            "q4 and Q8_0 products of up to 2 rows (4 with AVX-512 VNNI) round activations to 16 bits on AVX2",
        ),
        record(
            "cpu-native-f32",
            5,
            build_native_float32,
            "cpu-native with float32 activations everywhere (batch-1 q4 decode 1.5-2x slower)",
        ),
    ]
