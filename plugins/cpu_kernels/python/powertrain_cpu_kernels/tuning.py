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
#: runs about four times the rate of its AVX-512 one) but the kernels cannot use them
#: (``_native.amx()`` false: not Linux, or the tile state refused). 2-core Xeon VM with AMX,
#: SmolLM2-135M's decode step (``benchmarks/step_profile.py --dtype bfloat16 --quantization
#: keep``), linears widened vs dequantised straight to bfloat16: 50.4 vs 53.4 ms at 24 rows,
#: 77.5 vs 58.6 at 40.
BF16_DENSE_MIN_ROWS_AMX = 32
#: Rows of bfloat16 activations from which ``linear`` multiplies on AMX tiles (``src/amx.rs``)
#: where ``_native.amx()``. 2-core Xeon VM, SmolLM2's 30 q4 layers + q8 head
#: (``benchmarks/quantized_linear.py --dtype bfloat16``), AMX vs widened vs dequantised to
#: bfloat16 for oneDNN, ms: 10.11 / 4.38 / 29.2 at 1 row, 10.54 / 10.94 / 37.6 at 4, 10.84 /
#: 19.67 / 37.9 at 8, 12.19 / 32.06 / 39.0 at 16, 23.38 / 102.4 / 48.9 at 64 (oneDNN on the
#: dense bfloat16 weight: 5.32, 10.68, 10.73, 11.13, 18.75).
BF16_AMX_MIN_ROWS = 4
#: The crate's ``AMX_MAX_ROWS``: rows of ``x`` one AMX call takes (four 16-row tiles).
AMX_MAX_ROWS = 64
#: Rows of bfloat16 activations up to which ``linear`` stays on AMX tiles, 64 rows a call
#: (the weight dequantised again per call); above, the dequantised-to-bfloat16 route. Same VM,
#: SmolLM2's 30 q4 layers + q8 head, 64-row AMX calls vs the route: 39.9 vs 51.5 ms at 96
#: rows, 57.3 vs 61.4 at 128, 70.7 vs 68.3 at 192, 101.7 vs 82.8 at 256.
BF16_AMX_MAX_ROWS = 128
