"""The Rust crate's own tests (the thread pool: every chunk once, parked workers woken,
concurrent callers, panics; the OpenMP route on the very libgomp torch loaded), run from
the one test command so CI cannot skip them."""

from __future__ import annotations

import sys
from pathlib import Path

import torch  # loads the OpenMP runtime the crate's tests then use


def loaded_libgomp() -> dict[str, str]:
    """``POWERTRAIN_TEST_LIBGOMP``: the libgomp this process loaded with torch (Linux; the
    crate's OpenMP tests fall back to the system's elsewhere)."""
    if sys.platform != "linux":
        return {}
    maps = Path("/proc/self/maps").read_text().splitlines()
    paths = sorted({line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]})
    root = str(Path(torch.__file__).parent)  # torch/lib, or torch.libs beside it (auditwheel)
    torchs = [path for path in paths if path.startswith((root + "/", root + ".libs/"))]
    chosen = torchs or paths  # torch's own copy, where another library loaded the system's too
    assert len(chosen) == 1, f"expected torch's one libgomp in this process, found {paths}"
    return {"POWERTRAIN_TEST_LIBGOMP": chosen[0]}


def test_cargo_test_passes(cargo_test) -> None:
    crate = Path(__file__).resolve().parents[1]
    cargo_test(crate, "powertrain-cpu-kernels", env=loaded_libgomp())
