"""The kernel's measured tuning constants (no imports, so the plugin's registration can name
them without loading the extension)."""

#: Rows of ``x`` up to which ``linear`` runs the native kernel; above it, dequantise + F.linear.
#: From ``benchmarks/quantized_linear.py`` on a 2-core AVX-512 Xeon VM, SmolLM2-135M's shapes,
#: two threads, machine otherwise idle: at 16 rows the native kernel beat blockwise dequantise
#: + F.linear on every shape (1.0-1.7x); at 64 rows dequantise + F.linear won (1.5-1.8x, the
#: head about even). Re-measure on real hardware: the dequantise step is the slow part.
GEMV_MAX_ROWS = 16
#: Weight elements dequantised at a time on the dense route (4 MB of float32): a block is
#: multiplied while it is still in cache, and a large weight (an LM head) never needs a
#: dense copy of its own.
DENSE_BLOCK = 1 << 20
