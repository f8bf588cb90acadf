"""The Triton kernels and their host-side launchers, one concern per module.

Every module here imports triton at its top: import them only from factories.
"""

#: Attention kernel modules; each exports ``aot_specs(capability)`` for ahead-of-time compilation.
ATTENTION_MODULES = ("paged_decode", "split_kv", "prefill", "mla")
