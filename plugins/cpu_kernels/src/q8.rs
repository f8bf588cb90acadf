//! ``q8``: the portable scalar path, and the parts the AVX2 path shares.

use crate::{offset_term, Element, OutPtr, Scale};

/// One ``q8_linear`` call: ``x [m, k]``, ``sums [m, k/group]`` (when there are offsets),
/// ``codes [n, k]``, ``scales`` / ``offsets`` ``[n, k/group]``.
pub(crate) struct Job<'a, S: Scale> {
    pub x: &'a [f32],
    /// Empty where there are no offsets.
    pub sums: &'a [f32],
    pub codes: &'a [i8],
    pub scales: &'a [S],
    pub offsets: Option<&'a [S]>,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub group: usize,
}

/// Output rows ``r0..r1`` (columns of ``out``), every row of ``x``.
pub(crate) fn rows_scalar<S: Scale>(job: &Job<S>, out: OutPtr, r0: usize, r1: usize) {
    let (k, n, group) = (job.k, job.n, job.group);
    let groups = k / group;
    for r in r0..r1 {
        let codes = &job.codes[r * k..(r + 1) * k];
        let scales = &job.scales[r * groups..(r + 1) * groups];
        let offsets = job.offsets.map(|o| &o[r * groups..(r + 1) * groups]);
        for t in 0..job.m {
            let x = &job.x[t * k..(t + 1) * k];
            let mut acc = 0.0f32;
            for g in 0..groups {
                let c = &codes[g * group..(g + 1) * group];
                let xg = &x[g * group..(g + 1) * group];
                let dot: f32 = c.iter().zip(xg).map(|(c, x)| f32::from(*c) * x).sum();
                acc += dot * scales[g].to_f32();
            }
            let sums = job.sums.get(t * groups..(t + 1) * groups).unwrap_or(&[]);
            let value = acc + offset_term(offsets, sums);
            // SAFETY: t < m, r < n; this chunk alone writes column r.
            unsafe { *out.0.add(t * n + r) = value };
        }
    }
}

/// Dense rows ``r0..r1`` of the weight into ``out [n, k]`` (``code * scale`` then ``+ offset``).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn dequantize_rows<E: Element>(
    codes: &[i8],
    scales: &[f32],
    offsets: Option<&[f32]>,
    out: OutPtr<E>,
    k: usize,
    group: usize,
    r0: usize,
    r1: usize,
) {
    let groups = k / group;
    for r in r0..r1 {
        // SAFETY: rows r0..r1 of out belong to this chunk alone.
        let dense = unsafe { std::slice::from_raw_parts_mut(out.0.add(r * k), k) };
        let codes = &codes[r * k..(r + 1) * k];
        for g in 0..groups {
            let c = &codes[g * group..(g + 1) * group];
            let d = &mut dense[g * group..(g + 1) * group];
            let s = scales[r * groups + g];
            match offsets {
                Some(offsets) => {
                    let o = offsets[r * groups + g];
                    for (d, c) in d.iter_mut().zip(c) {
                        *d = E::from_f32(f32::from(*c) * s + o);
                    }
                }
                None => {
                    for (d, c) in d.iter_mut().zip(c) {
                        *d = E::from_f32(f32::from(*c) * s);
                    }
                }
            }
        }
    }
}
