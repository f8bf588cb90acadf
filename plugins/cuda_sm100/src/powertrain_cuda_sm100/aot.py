"""Ahead-of-time compilation of every kernel for a GPU target, without a GPU.

Each kernels module lists, in ``aot_specs(capability)``, the signatures, constexprs
and launch options its launcher uses on that capability (and, in ``attrs``, the
16-byte alignment a launch would find); this module compiles them
all with ``triton.compile`` for ``GPUTarget("cuda", <capability>, 32)`` and reports
which tensor-core instructions the PTX contains (``tcgen05.mma`` on sm_100a,
``wgmma`` on sm_90a) and how much shared memory a program takes (a launch needing more
than the SM has fails at run time: ``OutOfResources``). A spec with ``"mma": True`` is a
GEMM that must use them.

    python -m powertrain_cuda_sm100.aot 100 90      # prints one JSON line per kernel

Run it without ``TRITON_INTERPRET``: interpreted kernels cannot be compiled.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import sys
from collections.abc import Iterator
from typing import Any

#: The tensor-core MMA instruction family a GEMM must use, per compute capability major.
MMA_INSTRUCTIONS = {10: "tcgen05.mma", 9: "wgmma"}


def specs(capability: tuple[int, int]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(module, spec) for every kernel of the pack."""
    import powertrain_cuda_sm100.kernels as package

    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        make = getattr(module, "aot_specs", None)
        if make is None:
            continue
        specs = list(make(capability))
        # Attention kernels also list their float32 variants (other tiles: shared memory).
        if "element_size" in inspect.signature(make).parameters:
            specs += make(capability, element_size=4)
        for spec in specs:
            yield info.name, spec


def compile_all(major: int) -> list[dict[str, Any]]:
    """Compile every spec for ``sm_<major>0``; one result row per kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    capability = (major, 0)
    rows = []
    for module, spec in specs(capability):
        source = ASTSource(
            fn=spec["fn"], signature=spec["signature"], constexprs=spec.get("constexprs", {}), attrs=spec.get("attrs")
        )
        row: dict[str, Any] = {"capability": major * 10, "module": module, "kernel": spec["name"]}
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", major * 10, 32), options=spec.get("options"))
        except Exception as exc:  # reported per kernel, so one failure does not hide the rest
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
        else:
            ptx = compiled.asm["ptx"]
            row.update(
                ok=True,
                mma_required=bool(spec.get("mma", False)),
                tcgen05_mma="tcgen05.mma" in ptx,
                wgmma="wgmma" in ptx,
                cubin_bytes=len(compiled.asm.get("cubin", b"")),
                shared_bytes=compiled.metadata.shared,
            )
        rows.append(row)
    return rows


def main(argv: list[str]) -> int:
    majors = [int(a) // 10 for a in argv] or [10, 9]
    failed = 0
    for major in majors:
        for row in compile_all(major):
            print(json.dumps(row), flush=True)
            failed += not row["ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
