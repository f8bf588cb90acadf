//! ``q4``: the portable scalar path, and the parts the AVX2 path shares.

use crate::{offset_term, Element, OutPtr, Scale};

/// One ``q4_linear`` call: ``x [m, k]``, ``sums [m, k/32]`` (when there are offsets),
/// ``codes [n, k/2]``, ``scales`` / ``offsets`` ``[n, k/32]``.
pub(crate) struct Job<'a, S: Scale> {
    pub x: &'a [f32],
    /// Empty where there are no offsets.
    pub sums: &'a [f32],
    pub codes: &'a [u8],
    pub scales: &'a [S],
    pub offsets: Option<&'a [S]>,
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// Output rows ``r0..r1`` (columns of ``out``), every row of ``x``.
pub(crate) fn rows_scalar<S: Scale>(job: &Job<S>, out: OutPtr, r0: usize, r1: usize) {
    let (k, n) = (job.k, job.n);
    let groups = k / 32;
    for r in r0..r1 {
        let codes = &job.codes[r * k / 2..(r + 1) * k / 2];
        let scales = &job.scales[r * groups..(r + 1) * groups];
        let offsets = job.offsets.map(|o| &o[r * groups..(r + 1) * groups]);
        for t in 0..job.m {
            let x = &job.x[t * k..(t + 1) * k];
            let mut acc = 0.0f32;
            for g in 0..groups {
                let c = &codes[g * 16..g * 16 + 16];
                let xg = &x[g * 32..g * 32 + 32];
                let mut dot = 0.0f32;
                for j in 0..16 {
                    dot += f32::from(c[j] & 0x0F) * xg[j] + f32::from(c[j] >> 4) * xg[j + 16];
                }
                acc += dot * scales[g].to_f32();
            }
            let sums = job.sums.get(t * groups..(t + 1) * groups).unwrap_or(&[]);
            let value = acc + offset_term(offsets, sums);
            // SAFETY: t < m, r < n; this chunk alone writes column r.
            unsafe { *out.0.add(t * n + r) = value };
        }
    }
}

/// Dense rows ``r0..r1`` of the weight into ``out [n, k]``: ``code * scale`` then ``+ offset``,
/// each rounded, as ``QuantizedWeight.dequantize`` computes it.
#[inline(always)]
pub(crate) fn dequantize_rows<E: Element>(
    codes: &[u8],
    scales: &[f32],
    offsets: Option<&[f32]>,
    out: OutPtr<E>,
    k: usize,
    r0: usize,
    r1: usize,
) {
    let groups = k / 32;
    for r in r0..r1 {
        // SAFETY: rows r0..r1 of out belong to this chunk alone.
        let dense = unsafe { std::slice::from_raw_parts_mut(out.0.add(r * k), k) };
        for g in 0..groups {
            let c = &codes[r * k / 2 + g * 16..r * k / 2 + g * 16 + 16];
            let s = scales[r * groups + g];
            let (low, high) = dense[g * 32..g * 32 + 32].split_at_mut(16);
            match offsets {
                Some(offsets) => {
                    let o = offsets[r * groups + g];
                    for j in 0..16 {
                        low[j] = E::from_f32(f32::from(c[j] & 0x0F) * s + o);
                        high[j] = E::from_f32(f32::from(c[j] >> 4) * s + o);
                    }
                }
                None => {
                    for j in 0..16 {
                        low[j] = E::from_f32(f32::from(c[j] & 0x0F) * s);
                        high[j] = E::from_f32(f32::from(c[j] >> 4) * s);
                    }
                }
            }
        }
    }
}
