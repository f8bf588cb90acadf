"""The kernels run here on the CPU through the Triton interpreter.

TRITON_INTERPRET is read when a kernel is decorated, i.e. when a kernels module is
first imported; the plugin never imports them before a factory runs, so setting it
here (at collection, before any test) puts every kernel of this session in the
interpreter. Ahead-of-time compilation for GPU targets runs in a subprocess without
it (test_aot.py).
"""

from __future__ import annotations

import inspect
import os

import pytest

from powertrain.components import Availability, PlatformInfo

os.environ["TRITON_INTERPRET"] = "1"


def _patch_the_language_once_per_launch() -> None:
    """Triton's interpreter (3.x) rebinds ``triton.language`` to its interpreted operations at
    every call of a device function (``tl.sum``, ``tl.cumsum``, a kernel's own helpers), not
    only when a kernel launches: hundreds of attributes looked up and set again, ~2 ms each
    time, though they are already bound. In the kit's kernels that was about half of the
    interpreter's time (row_topk: 7.7 of 17.6 s in one case). Within one launch the binding
    is done once per language module here; the launch still binds at its start and restores
    at its end, so what the kernels compute is unchanged."""
    import triton.language as tl
    from triton.runtime import interpreter

    bind = interpreter._patch_lang
    bound: set[int] = set()  # the language modules this launch has bound

    class _AlreadyBound:
        def restore(self) -> None:
            pass

    def bind_once(fn):  # noqa: ANN001, ANN202 (the interpreter's own signature)
        langs = {id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)}
        if langs and langs <= bound:
            return _AlreadyBound()
        scope = bind(fn)
        bound.update(langs)
        return scope

    launch = interpreter.GridExecutor.__call__

    def launch_binding_afresh(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        bound.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            bound.clear()

    interpreter._patch_lang = bind_once
    interpreter.GridExecutor.__call__ = launch_binding_afresh


_patch_the_language_once_per_launch()

pytest_plugins = ["powertrain.testing"]

#: No NVIDIA GPU exists on the CI machine: the suites run the real kernels under the
#: Triton interpreter on CPU tensors, presented as a CUDA platform of capability 10.0.
INTERPRETER_PLATFORM = PlatformInfo(
    name="cuda",
    device_type="cpu",
    availability=Availability.yes("Triton interpreter (TRITON_INTERPRET=1): kernels run on the CPU"),
    device_count=1,
    device_name="Triton interpreter",
    capability=(10, 0),
    dist_backend="gloo",
)


@pytest.fixture
def interpreter_platform() -> PlatformInfo:
    return INTERPRETER_PLATFORM
