"""powertrain-cuda-sm100: Triton kernels for NVIDIA Blackwell (SM100) and Hopper (SM90).

Importing this package (or its plugin module) never imports triton; the kernels
are imported by the backend factories, when an engine on a suitable GPU builds them.
"""
