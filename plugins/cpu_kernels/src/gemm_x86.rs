//! ``gemm.rs``'s panel product in AVX2+FMA intrinsics.
//!
//! A tile of ``MR`` rows of ``x`` by ``NR`` weight rows keeps its ``MR * NR`` dot products
//! in eight-lane accumulators (3 x 4: twelve registers, plus three for ``x`` and one for the
//! weight: all sixteen). Each step over eight columns loads three ``x`` vectors and four
//! weight vectors for twelve FMAs, so the FMA units, not the loads, set the pace. The
//! lanes are summed once per tile at the end.

use std::arch::x86_64::*;

use crate::x86::hsum;
use crate::OutPtr;

const MR: usize = 3;
const NR: usize = 4;

/// ``out[i * n + j] = x[i, :] . w[j, :]`` for ``i < M``, ``j < N`` (rows ``k`` floats apart).
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::needless_range_loop)] // acc[i][j]: both indices name the tile's cell
unsafe fn tile<const M: usize, const N: usize>(
    x: *const f32,
    w: *const f32,
    k: usize,
    out: *mut f32,
    n: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); N]; M];
    let mut c = 0;
    while c < k {
        let mut xs = [_mm256_setzero_ps(); M];
        for (i, xv) in xs.iter_mut().enumerate() {
            *xv = _mm256_loadu_ps(x.add(i * k + c));
        }
        for j in 0..N {
            let wv = _mm256_loadu_ps(w.add(j * k + c));
            for i in 0..M {
                acc[i][j] = _mm256_fmadd_ps(xs[i], wv, acc[i][j]);
            }
        }
        c += 8;
    }
    for (i, row) in acc.iter().enumerate() {
        for (j, lanes) in row.iter().enumerate() {
            *out.add(i * n + j) = hsum(*lanes);
        }
    }
}

/// Calls ``tile::<m, N>`` for ``m`` in 1..=MR.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_rows<const N: usize>(
    m: usize,
    x: *const f32,
    w: *const f32,
    k: usize,
    out: *mut f32,
    n: usize,
) {
    match m {
        3 => tile::<3, N>(x, w, k, out, n),
        2 => tile::<2, N>(x, w, k, out, n),
        _ => tile::<1, N>(x, w, k, out, n),
    }
}

/// ``out[t * n + j] = x[t, :] . w[j, :]`` for every row ``t`` of ``x [m, k]`` and the
/// ``rows`` rows of ``w`` (row-major, ``k`` columns, ``k`` a multiple of 8).
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn panel(
    x: &[f32],
    m: usize,
    n: usize,
    k: usize,
    w: &[f32],
    rows: usize,
    out: OutPtr,
) {
    debug_assert!(k.is_multiple_of(8) && x.len() >= m * k && w.len() >= rows * k);
    let mut t = 0;
    while t < m {
        let mt = MR.min(m - t);
        let xt = x.as_ptr().add(t * k);
        let mut j = 0;
        while j < rows {
            let nj = NR.min(rows - j);
            let (wj, o) = (w.as_ptr().add(j * k), out.0.add(t * n + j));
            match nj {
                4 => tile_rows::<4>(mt, xt, wj, k, o, n),
                3 => tile_rows::<3>(mt, xt, wj, k, o, n),
                2 => tile_rows::<2>(mt, xt, wj, k, o, n),
                _ => tile_rows::<1>(mt, xt, wj, k, o, n),
            }
            j += nj;
        }
        t += mt;
    }
}
