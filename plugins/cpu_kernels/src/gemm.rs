//! The many-rows path of ``q4_linear`` / ``q8_linear``: batched decode steps and prefill.
//!
//! With many rows of ``x`` the product is compute-bound, and widening codes inside the dot
//! (``x86.rs``'s tiles) costs more than it saves. So each chunk of output rows is taken a
//! ``PANEL`` of weight rows at a time: the panel is dequantised into a float32 buffer that
//! stays in cache (the same values ``QuantizedWeight.dequantize`` gives), and every row of
//! ``x`` is multiplied by it with a register-tiled dot kernel (``gemm_x86.rs`` on AVX2+FMA,
//! plain loops elsewhere). This replaced dequantising ~1M-element blocks into memory for
//! torch's ``F.linear``: on a 2-core Zen 4 VM, 64 decode rows of SmolLM2-135M took 168 ms
//! of linears per step that way against 104 ms for the float32 model (oneDNN-packed).

use std::cell::RefCell;

use crate::{KernelPath, OutPtr};

/// Weight rows dequantised and multiplied at a time (a 16 x 1536 panel is 96 KiB: it stays
/// in L2 while every row of ``x`` passes over it).
pub(crate) const PANEL: usize = 16;

/// Bytes of ``x`` one pass over the panels reads: more rows (a long prefill) are taken this
/// many bytes' worth at a time, so they stay in L2 while a panel is multiplied by them
/// (dequantising each panel once per pass costs less than streaming ``x`` from L3).
const X_BLOCK_BYTES: usize = 256 << 10;

/// Dequantises weight rows ``r0..r1`` into the row-major ``[r1 - r0, k]`` buffer it is given.
pub(crate) type Dequantize<'a> = dyn Fn(OutPtr, usize, usize) + Sync + 'a;

thread_local! {
    /// Each thread's panel buffer, kept between calls (a 96 KiB allocation per chunk would
    /// otherwise come and go hundreds of times per step).
    static PANEL_BUFFER: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// ``out[t, r] = x[t, :] . W[r, :]`` for every row ``t`` of ``x [m, k]`` and the weight
/// rows ``r0..r1`` that ``dequantize`` produces. ``k`` must be a multiple of 8.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rows(
    path: KernelPath,
    x: &[f32],
    m: usize,
    n: usize,
    k: usize,
    dequantize: &Dequantize,
    out: OutPtr,
    r0: usize,
    r1: usize,
) {
    let block_rows = (X_BLOCK_BYTES / (4 * k)).max(PANEL);
    PANEL_BUFFER.with_borrow_mut(|buffer| {
        buffer.resize(PANEL * k, 0.0);
        for t0 in (0..m).step_by(block_rows) {
            let mt = block_rows.min(m - t0);
            let xt = &x[t0 * k..(t0 + mt) * k];
            let mut r = r0;
            while r < r1 {
                let rows = PANEL.min(r1 - r);
                dequantize(OutPtr(buffer.as_mut_ptr()), r, r + rows);
                // SAFETY: columns r..r + rows of out belong to this chunk alone.
                let panel_out = OutPtr(unsafe { out.0.add(t0 * n + r) });
                let w = &buffer[..rows * k];
                match path {
                    #[cfg(target_arch = "x86_64")]
                    KernelPath::Avx2Fma => unsafe {
                        crate::gemm_x86::panel(xt, mt, n, k, w, rows, panel_out)
                    },
                    _ => panel_scalar(xt, mt, n, k, w, rows, panel_out),
                }
                r += rows;
            }
        }
    });
}

/// ``panel``'s portable form: ``out[t, j] = x[t, :] . w[j, :]`` (row stride of ``out``: ``n``).
fn panel_scalar(x: &[f32], m: usize, n: usize, k: usize, w: &[f32], rows: usize, out: OutPtr) {
    for t in 0..m {
        let xt = &x[t * k..(t + 1) * k];
        for j in 0..rows {
            let value = crate::dot(xt, &w[j * k..(j + 1) * k]);
            // SAFETY: t < m, j < rows; the caller owns these columns.
            unsafe { *out.0.add(t * n + j) = value };
        }
    }
}
