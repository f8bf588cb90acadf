"""The kernel's measured tuning constants (no imports, so the plugin's registration can name
them without loading the extension)."""

#: Rows of ``x`` up to which ``linear`` runs the native kernel where it shares torch's OpenMP
#: team; above it, blockwise dequantise + F.linear. Since the native kernel multiplies
#: dequantised panels (``GEMM_MIN_ROWS``) it beat that route on SmolLM2-135M's layers at every
#: row count measured: on a 2-core Zen 4 VM (``benchmarks/quantized_linear.py``), 30 layers +
#: head took 114 vs 254 ms at 64 rows, 440 vs 618 at 256, 2762 vs 2995 at 2048. So: no limit.
GEMV_MAX_ROWS = 1 << 30
#: The same where the kernels run on their own pool beside torch (no reachable OpenMP
#: runtime): decode-sized calls only, the steps in which the engine leaves the cores to the
#: pool (``own_pool_max_rows``); in larger steps torch's threads hold them.
POOL_MAX_ROWS = 16
#: Rows of ``x`` from which the native kernel dequantises the weight a panel at a time and
#: multiplies the panel (``src/gemm.rs``) instead of widening codes inside each dot. Zen 4 VM,
#: SmolLM2-135M's 30 layers + head: widening 8.0 / 11.6 / 16.8 / 20.1 / 32.3 ms at 2 / 4 / 6 /
#: 8 / 12 rows, panels 12.2 / 14.7 / 16.2 / 19.0 / 24.6.
GEMM_MIN_ROWS = 8
#: Weight elements dequantised at a time on the dense route (4 MB of float32): a block is
#: multiplied while it is still in cache, and a large weight (an LM head) never needs a
#: dense copy of its own.
DENSE_BLOCK = 1 << 20
#: Rows of bfloat16 activations from which ``linear`` multiplies by the weight dequantised to
#: bfloat16 (oneDNN's bfloat16 matmul) instead of widening the activations for the float32
#: kernel, on CPUs with bfloat16 dot-product instructions. 2-core Zen 4 VM (avx512_bf16), a
#: random q4 weight, widened vs dequantised-to-bfloat16 (``/tmp`` microbenchmark, ms):
#: 3072x576 at 64 / 128 / 256 / 2048 rows 1.88 / 5.35 / 6.93 / 57.1 vs 1.60 / 3.14 / 3.23 /
#: 25.9; 576x1536 1.40 / 2.80 / 5.54 / 36.5 vs 1.43 / 1.81 / 2.46 / 11.2; 960x576 at 64 rows
#: 0.72 vs 0.94. Below 128 rows the dequantisation does not pay on every shape.
BF16_DENSE_MIN_ROWS = 128
#: The same where the CPU has AMX tiles for bfloat16 (``amx_bf16``: oneDNN's bfloat16 matmul
#: runs about four times the rate of its AVX-512 one). 2-core Xeon VM with AMX, a random q4
#: weight (float16 scales), widened vs dequantised-to-bfloat16, ms at 32 / 64 / 128 rows:
#: 3072x576 0.72 / 1.36 / 2.77 vs 0.86 / 0.97 / 1.12; 576x1536 0.37 / 0.71 / 1.38 vs
#: 0.42 / 0.46 / 0.50; 960x576 0.24 / 0.42 / 0.80 vs 0.27 / 0.29 / 0.33; the 49152x576
#: head 10.5 / 22.3 / 44.1 vs 15.7 / 15.1 / 18.5. From 64 rows on it pays on every shape.
BF16_DENSE_MIN_ROWS_AMX = 64
