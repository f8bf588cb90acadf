//! Decode-sized ``q8`` products (32-column groups: Q8_0) with the activations rounded to
//! 16-bit integers, as ``q4_i16.rs`` does for ``q4`` (the same rounding, the same bound).
//!
//! Widening each 8-bit code to float32 (``x86.rs``) costs a sign extension and a conversion
//! per weight and four FMAs per eight; here a group's 32 codes are sign-extended to words and
//! meet its 32 rounded activations in one 512-bit ``vpdpwssd`` (AVX-512 VNNI) or two
//! 256-bit ``vpmaddwd`` (AVX2), exact in 32-bit lanes, converted once and scaled by
//! ``scale_g * dx_g``. SmolLM2-135M's head (49152 x 576, Q8_0) is a third of the bytes a
//! decoded token reads.

use std::arch::x86_64::*;

use crate::q4_i16::{Activations, PREFETCH_ROWS};
use crate::x86::{hsum, offset_term, ScaleX86};
use crate::{q8, OutPtr};

/// Weight rows per pass over a row of ``x`` (independent chains; ``x`` loaded once for all).
const ROWS: usize = 4;

/// ``dots[i]`` for the ``LEN`` weight rows from ``r`` (``scales`` theirs) and the row ``t``
/// of ``x``, with 512-bit ``vpdpwssd``: one group per vector.
#[inline(always)]
unsafe fn rows_dot_vnni<const LEN: usize, S: ScaleX86>(
    job: &q8::Job<S>,
    scales: *const S,
    x: &Activations,
    r: usize,
    t: usize,
) -> [f32; ROWS] {
    let k = job.k;
    let groups = k / 32;
    let codes = job.codes.as_ptr().add(r * k);
    let q = x.q.as_ptr().add(t * k);
    let dx = x.scales.as_ptr().add(t * groups);
    let mut acc = [_mm512_setzero_ps(); ROWS];
    for g in 0..groups {
        let xq = _mm512_loadu_si512(q.add(g * 32) as *const __m512i);
        let dx = *dx.add(g);
        for (i, acc) in acc.iter_mut().enumerate().take(LEN) {
            // As in q4_i16.rs: the interleaved row streams outrun the hardware prefetcher.
            _mm_prefetch::<_MM_HINT_T0>(codes.wrapping_add((i + PREFETCH_ROWS) * k + g * 32));
            let bytes = _mm256_loadu_si256(codes.add(i * k + g * 32) as *const __m256i);
            let dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_cvtepi8_epi16(bytes), xq);
            let scale = _mm512_set1_ps(S::one(scales.add(i * groups + g)) * dx);
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, *acc);
        }
    }
    let mut dots = [0.0f32; ROWS];
    for i in 0..LEN {
        dots[i] = _mm512_reduce_add_ps(acc[i]);
    }
    dots
}

/// The same with 256-bit ``vpmaddwd``: a group's codes as two vectors of sixteen words.
#[inline(always)]
unsafe fn rows_dot_avx2<const LEN: usize, S: ScaleX86>(
    job: &q8::Job<S>,
    scales: *const S,
    x: &Activations,
    r: usize,
    t: usize,
) -> [f32; ROWS] {
    let k = job.k;
    let groups = k / 32;
    let codes = job.codes.as_ptr().add(r * k);
    let q = x.q.as_ptr().add(t * k);
    let dx = x.scales.as_ptr().add(t * groups);
    let mut acc = [_mm256_setzero_ps(); ROWS];
    for g in 0..groups {
        let low = _mm256_loadu_si256(q.add(g * 32) as *const __m256i);
        let high = _mm256_loadu_si256(q.add(g * 32 + 16) as *const __m256i);
        let dx = *dx.add(g);
        for (i, acc) in acc.iter_mut().enumerate().take(LEN) {
            _mm_prefetch::<_MM_HINT_T0>(codes.wrapping_add((i + PREFETCH_ROWS) * k + g * 32));
            let c = codes.add(i * k + g * 32);
            let words_low = _mm256_cvtepi8_epi16(_mm_loadu_si128(c as *const __m128i));
            let words_high = _mm256_cvtepi8_epi16(_mm_loadu_si128(c.add(16) as *const __m128i));
            let dot = _mm256_add_epi32(
                _mm256_madd_epi16(words_low, low),
                _mm256_madd_epi16(words_high, high),
            );
            let scale = _mm256_set1_ps(S::one(scales.add(i * groups + g)) * dx);
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, *acc);
        }
    }
    let mut dots = [0.0f32; ROWS];
    for i in 0..LEN {
        dots[i] = hsum(acc[i]);
    }
    dots
}

/// Output rows ``r0..r1``; ``VNNI``: with ``rows_dot_vnni``, else ``rows_dot_avx2``.
#[inline(always)]
unsafe fn rows_with<const VNNI: bool, S: ScaleX86>(
    job: &q8::Job<S>,
    x: &Activations,
    out: OutPtr,
    r0: usize,
    r1: usize,
) {
    let (n, groups) = (job.n, job.k / 32);
    let mut r = r0;
    while r < r1 {
        let len = (r1 - r).min(ROWS);
        let s = job.scales.as_ptr().add(r * groups);
        for t in 0..job.m {
            let dots = match (len, VNNI) {
                (4, true) => rows_dot_vnni::<4, S>(job, s, x, r, t),
                (3, true) => rows_dot_vnni::<3, S>(job, s, x, r, t),
                (2, true) => rows_dot_vnni::<2, S>(job, s, x, r, t),
                (_, true) => rows_dot_vnni::<1, S>(job, s, x, r, t),
                (4, false) => rows_dot_avx2::<4, S>(job, s, x, r, t),
                (3, false) => rows_dot_avx2::<3, S>(job, s, x, r, t),
                (2, false) => rows_dot_avx2::<2, S>(job, s, x, r, t),
                (_, false) => rows_dot_avx2::<1, S>(job, s, x, r, t),
            };
            for (i, dot) in dots.iter().enumerate().take(len) {
                *out.0.add(t * n + r + i) =
                    dot + offset_term(job.offsets, job.sums, groups, r + i, t);
            }
        }
        r += len;
    }
}

/// Output rows ``r0..r1`` with ``vpmaddwd``.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn rows_avx2<S: ScaleX86>(
    job: &q8::Job<S>,
    x: &Activations,
    out: OutPtr,
    r0: usize,
    r1: usize,
) {
    rows_with::<false, S>(job, x, out, r0, r1)
}

/// Output rows ``r0..r1`` with 512-bit ``vpdpwssd``.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
pub(crate) unsafe fn rows_vnni<S: ScaleX86>(
    job: &q8::Job<S>,
    x: &Activations,
    out: OutPtr,
    r0: usize,
    r1: usize,
) {
    rows_with::<true, S>(job, x, out, r0, r1)
}
