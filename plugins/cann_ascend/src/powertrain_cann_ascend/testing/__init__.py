"""Test doubles for the Ascend pack: NOT an implementation, never for serving.

``powertrain_cann_ascend.testing.standins`` holds plain-torch stand-ins for the
torch_npu operators the backends call, written from torch_npu's documentation, so the
pack's tests (and ``benchmarks/kernels_npu.py --smoke``) run everything around the
operators on machines without an NPU. They encode our reading of the docs, not what
the hardware does, so serving code must never import this package (the pack's
``test_plugin.py`` checks that it doesn't).
"""
