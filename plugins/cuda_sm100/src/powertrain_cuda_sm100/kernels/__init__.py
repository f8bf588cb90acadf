"""The Triton kernels and their host-side launchers, one concern per module.

Every module here imports triton at its top: import them only from factories.
"""
