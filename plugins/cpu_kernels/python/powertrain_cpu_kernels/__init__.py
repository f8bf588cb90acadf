"""powertrain's CPU kernels in Rust: the weight-only quantised matmul (``q4`` and ``q8``
codes, the layouts of ``powertrain.interfaces.quantized``, times float activations) and
paged attention for decodes and other short query rows.

The kernels (``_native``) use AVX2+FMA where the CPU has it (detected at run time) and a
portable scalar path elsewhere; ``NativeQuantizedLinear`` is the ``QuantizedLinearKernel``
and ``NativePagedAttention`` the attention backend the engine calls. Importing this package
registers nothing.
"""

from __future__ import annotations

from powertrain_cpu_kernels._native import best_kernel_path, force_scalar, kernel_path
from powertrain_cpu_kernels.attention import NativePagedAttention
from powertrain_cpu_kernels.quantized_linear import NativeQuantizedLinear, PreparedWeight

__all__ = [
    "NativePagedAttention",
    "NativeQuantizedLinear",
    "PreparedWeight",
    "best_kernel_path",
    "force_scalar",
    "kernel_path",
]
