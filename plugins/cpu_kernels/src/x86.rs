//! The AVX2+FMA path (x86_64 only; ``lib.rs`` calls it after run-time detection).
//!
//! Per weight row and per tile of up to ``TILE`` rows of ``x``: each 32-column group's codes
//! are widened to four f32 vectors once, multiplied into every row of the tile (four FMAs per
//! row), and the group's dot is added to the row's accumulator times the broadcast scale.

use std::arch::x86_64::*;

use half::f16;

use crate::{q4, q8, Element, OutPtr, Scale, TILE};

/// Scales and offsets read as float32 vectors in whichever type they are stored: float16
/// converts with F16C (detected with AVX2 and FMA).
pub(crate) trait ScaleX86: Scale {
    /// The entry at ``p``.
    unsafe fn one(p: *const Self) -> f32;
    /// ``p[0]`` and ``p[1]`` in the two low lanes.
    unsafe fn two(p: *const Self) -> __m128;
    /// ``p[0..8]``.
    unsafe fn eight(p: *const Self) -> __m256;
}

impl ScaleX86 for f32 {
    #[inline(always)]
    unsafe fn one(p: *const f32) -> f32 {
        *p
    }
    #[inline(always)]
    unsafe fn two(p: *const f32) -> __m128 {
        _mm_castsi128_ps(_mm_loadl_epi64(p as *const __m128i))
    }
    #[inline(always)]
    unsafe fn eight(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
}

impl ScaleX86 for f16 {
    #[inline(always)]
    unsafe fn one(p: *const f16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
            (p as *const u16).read_unaligned() as i32,
        )))
    }
    #[inline(always)]
    unsafe fn two(p: *const f16) -> __m128 {
        _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()))
    }
    #[inline(always)]
    unsafe fn eight(p: *const f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
}

/// ``sum_g offsets[r, g] * sums[t, g]``: the offsets' part of ``out[t, r]`` (``groups``
/// per row; none without offsets).
#[inline(always)]
pub(crate) unsafe fn offset_term<S: ScaleX86>(
    offsets: Option<&[S]>,
    sums: &[f32],
    groups: usize,
    r: usize,
    t: usize,
) -> f32 {
    let Some(offsets) = offsets else {
        return 0.0;
    };
    let (o, s) = (
        offsets.as_ptr().add(r * groups),
        sums.as_ptr().add(t * groups),
    );
    let mut acc = _mm256_setzero_ps();
    let mut g = 0;
    while g + 8 <= groups {
        acc = _mm256_fmadd_ps(S::eight(o.add(g)), _mm256_loadu_ps(s.add(g)), acc);
        g += 8;
    }
    let mut total = hsum(acc);
    while g < groups {
        total += S::one(o.add(g)) * *s.add(g);
        g += 1;
    }
    total
}

/// The sum of the eight lanes of ``v``.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// 32 floats at ``x`` as four vectors.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load32(x: *const f32) -> [__m256; 4] {
    [
        _mm256_loadu_ps(x),
        _mm256_loadu_ps(x.add(8)),
        _mm256_loadu_ps(x.add(16)),
        _mm256_loadu_ps(x.add(24)),
    ]
}

/// ``w[i] * x[i]`` summed over ``i``, lane by lane: one 32-column group's products, left in
/// eight lanes for the caller to scale.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot32(w: &[__m256; 4], x: &[__m256; 4]) -> __m256 {
    let d = _mm256_mul_ps(w[0], x[0]);
    let d = _mm256_fmadd_ps(w[1], x[1], d);
    let d = _mm256_fmadd_ps(w[2], x[2], d);
    _mm256_fmadd_ps(w[3], x[3], d)
}

/// Eight i8 codes at ``p`` as f32.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn widen_i8(p: *const i8) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
}

/// ``dots[t] = sum_g scale_g * sum_j code_gj * x[t, 32g + j]`` for the ``T`` rows of ``x``
/// starting at ``x`` (row stride ``k``), one ``q4`` weight row.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_tile<const T: usize, S: ScaleX86>(
    x: *const f32,
    k: usize,
    codes: *const u8,
    scales: *const S,
    groups: usize,
    dots: &mut [f32; TILE],
) {
    let mask = _mm_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); T];
    for g in 0..groups {
        let w = widen_q4(codes.add(g * 16), mask);
        let s = _mm256_set1_ps(S::one(scales.add(g)));
        for (t, acc) in acc.iter_mut().enumerate() {
            *acc = _mm256_fmadd_ps(dot32(&w, &load32(x.add(t * k + g * 32))), s, *acc);
        }
    }
    for t in 0..T {
        dots[t] = hsum(acc[t]);
    }
}

/// The same for a ``q8`` weight row with ``GROUP``-column groups (16 or 32).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_tile<const T: usize, const GROUP: usize, S: ScaleX86>(
    x: *const f32,
    k: usize,
    codes: *const i8,
    scales: *const S,
    groups: usize,
    dots: &mut [f32; TILE],
) {
    let mut acc = [_mm256_setzero_ps(); T];
    for g in 0..groups {
        let c = codes.add(g * GROUP);
        let s = _mm256_set1_ps(S::one(scales.add(g)));
        let w0 = widen_i8(c);
        let w1 = widen_i8(c.add(8));
        if GROUP == 32 {
            let w = [w0, w1, widen_i8(c.add(16)), widen_i8(c.add(24))];
            for (t, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_fmadd_ps(dot32(&w, &load32(x.add(t * k + g * 32))), s, *acc);
            }
        } else {
            for (t, acc) in acc.iter_mut().enumerate() {
                let xp = x.add(t * k + g * 16);
                let mut d = _mm256_mul_ps(w0, _mm256_loadu_ps(xp));
                d = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xp.add(8)), d);
                *acc = _mm256_fmadd_ps(d, s, *acc);
            }
        }
    }
    for t in 0..T {
        dots[t] = hsum(acc[t]);
    }
}

/// Weight rows at a time for a single row of ``x`` (decode): their dots are independent
/// chains the CPU overlaps, and each group of ``x`` is loaded once for all of them.
const ROWS: usize = 4;

/// Four ``q4`` codes (one 32-column group) widened to f32 vectors.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn widen_q4(codes: *const u8, mask: __m128i) -> [__m256; 4] {
    let b = _mm_loadu_si128(codes as *const __m128i);
    let lo = _mm_and_si128(b, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), mask);
    [
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(lo, lo))),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(hi, hi))),
    ]
}

/// ``dots[i] = sum_g scale_ig * sum_j code_igj * x[32g + j]`` for ``ROWS`` consecutive ``q4``
/// weight rows and one row of ``x``; ``groups`` (x 16 bytes of codes, x 1 scale) steps between weight rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_rows_one_token<S: ScaleX86>(
    x: *const f32,
    codes: *const u8,
    scales: *const S,
    groups: usize,
) -> [f32; ROWS] {
    let mask = _mm_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); ROWS];
    for g in 0..groups {
        let xs = load32(x.add(g * 32)); // once for all ROWS weight rows
        for (i, acc) in acc.iter_mut().enumerate() {
            // As in q4_i16.rs: a few rows ahead, for the interleaved row streams.
            let ahead = codes.wrapping_add(((i + crate::q4_i16::PREFETCH_ROWS) * groups + g) * 16);
            _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
            let w = widen_q4(codes.add((i * groups + g) * 16), mask);
            let s = _mm256_set1_ps(S::one(scales.add(i * groups + g)));
            *acc = _mm256_fmadd_ps(dot32(&w, &xs), s, *acc);
        }
    }
    let mut dots = [0.0f32; ROWS];
    for (dot, acc) in dots.iter_mut().zip(acc) {
        *dot = hsum(acc);
    }
    dots
}

/// ``q4_rows_one_token`` for ``q8`` weight rows with ``GROUP``-column groups: ``ROWS``
/// independent chains instead of one row's chain of dependent FMAs. The SmolLM2 head
/// (49152 x 576) alone, largely in L3: 1.5-1.6 -> 1.1 ms on the 2-core Zen 3 EPYC; in a
/// decode step, where it comes from memory after the layers, it stays at about 1.5 ms
/// (memory, not the chain, bounds it there). Each row's arithmetic is ``q8_tile``'s, so
/// results do not change with the row count.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_rows_one_token<const GROUP: usize, S: ScaleX86>(
    x: *const f32,
    codes: *const i8,
    scales: *const S,
    k: usize,
) -> [f32; ROWS] {
    let groups = k / GROUP;
    let mut acc = [_mm256_setzero_ps(); ROWS];
    for g in 0..groups {
        let xg = x.add(g * GROUP);
        let xs = if GROUP == 32 {
            load32(xg)
        } else {
            let zero = _mm256_setzero_ps();
            [_mm256_loadu_ps(xg), _mm256_loadu_ps(xg.add(8)), zero, zero]
        };
        for (i, acc) in acc.iter_mut().enumerate() {
            let c = codes.add(i * k + g * GROUP);
            _mm_prefetch::<_MM_HINT_T0>(
                codes.wrapping_add((i + crate::q4_i16::PREFETCH_ROWS) * k + g * GROUP),
            );
            let s = _mm256_set1_ps(S::one(scales.add(i * groups + g)));
            let (w0, w1) = (widen_i8(c), widen_i8(c.add(8)));
            let d = if GROUP == 32 {
                dot32(&[w0, w1, widen_i8(c.add(16)), widen_i8(c.add(24))], &xs)
            } else {
                _mm256_fmadd_ps(w1, xs[1], _mm256_mul_ps(w0, xs[0]))
            };
            *acc = _mm256_fmadd_ps(d, s, *acc);
        }
    }
    let mut dots = [0.0f32; ROWS];
    for (dot, acc) in dots.iter_mut().zip(acc) {
        *dot = hsum(acc);
    }
    dots
}

/// Calls ``$tile::<rows, ...>`` for a tile of ``$rows`` rows (1..=TILE).
macro_rules! by_rows {
    ($rows:expr, $tile:ident $(, $c:literal)*; $($arg:expr),*) => {
        match $rows {
            8 => $tile::<8 $(, $c)*, _>($($arg),*),
            7 => $tile::<7 $(, $c)*, _>($($arg),*),
            6 => $tile::<6 $(, $c)*, _>($($arg),*),
            5 => $tile::<5 $(, $c)*, _>($($arg),*),
            4 => $tile::<4 $(, $c)*, _>($($arg),*),
            3 => $tile::<3 $(, $c)*, _>($($arg),*),
            2 => $tile::<2 $(, $c)*, _>($($arg),*),
            _ => $tile::<1 $(, $c)*, _>($($arg),*),
        }
    };
}

/// Output rows ``r0..r1`` of a ``q4_linear`` call.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4_rows<S: ScaleX86>(job: &q4::Job<S>, out: OutPtr, r0: usize, r1: usize) {
    let (m, n, k) = (job.m, job.n, job.k);
    let groups = k / 32;
    let mut dots = [0.0f32; TILE];
    let mut r = r0;
    if m == 1 {
        while r + ROWS <= r1 {
            let codes = job.codes.as_ptr().add(r * k / 2);
            let scales = job.scales.as_ptr().add(r * groups);
            let rows = q4_rows_one_token(job.x.as_ptr(), codes, scales, groups);
            for (i, dot) in rows.iter().enumerate() {
                *out.0.add(r + i) = dot + offset_term(job.offsets, job.sums, groups, r + i, 0);
            }
            r += ROWS;
        }
    }
    for r in r..r1 {
        let codes = job.codes.as_ptr().add(r * k / 2);
        let scales = job.scales.as_ptr().add(r * groups);
        let mut t0 = 0;
        while t0 < m {
            let rows = (m - t0).min(TILE);
            let x = job.x.as_ptr().add(t0 * k);
            by_rows!(rows, q4_tile; x, k, codes, scales, groups, &mut dots);
            for (t, dot) in dots.iter().enumerate().take(rows) {
                *out.0.add((t0 + t) * n + r) =
                    dot + offset_term(job.offsets, job.sums, groups, r, t0 + t);
            }
            t0 += rows;
        }
    }
}

/// Output rows ``r0..r1`` of a ``q8_linear`` call.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q8_rows<S: ScaleX86>(job: &q8::Job<S>, out: OutPtr, r0: usize, r1: usize) {
    let (m, n, k, group) = (job.m, job.n, job.k, job.group);
    let groups = k / group;
    let mut dots = [0.0f32; TILE];
    let mut r = r0;
    if m == 1 {
        while r + ROWS <= r1 {
            let codes = job.codes.as_ptr().add(r * k);
            let scales = job.scales.as_ptr().add(r * groups);
            let rows = if group == 32 {
                q8_rows_one_token::<32, S>(job.x.as_ptr(), codes, scales, k)
            } else {
                q8_rows_one_token::<16, S>(job.x.as_ptr(), codes, scales, k)
            };
            for (i, dot) in rows.iter().enumerate() {
                *out.0.add(r + i) = dot + offset_term(job.offsets, job.sums, groups, r + i, 0);
            }
            r += ROWS;
        }
    }
    for r in r..r1 {
        let codes = job.codes.as_ptr().add(r * k);
        let scales = job.scales.as_ptr().add(r * groups);
        let mut t0 = 0;
        while t0 < m {
            let rows = (m - t0).min(TILE);
            let x = job.x.as_ptr().add(t0 * k);
            if group == 32 {
                by_rows!(rows, q8_tile, 32; x, k, codes, scales, groups, &mut dots);
            } else {
                by_rows!(rows, q8_tile, 16; x, k, codes, scales, groups, &mut dots);
            }
            for (t, dot) in dots.iter().enumerate().take(rows) {
                *out.0.add((t0 + t) * n + r) =
                    dot + offset_term(job.offsets, job.sums, groups, r, t0 + t);
            }
            t0 += rows;
        }
    }
}

/// ``q4::dequantize_rows`` compiled for AVX2 (the compiler vectorises it; a multiply then
/// an add, never contracted to an FMA, so the result stays bit-equal to torch's). Into
/// bfloat16, a row at a time: dequantised into a float32 row in cache, then rounded
/// (``to_bf16``; the compiler does not vectorise the rounding written per element).
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn q4_dequantize_rows<E: Element>(
    codes: &[u8],
    scales: &[f32],
    offsets: Option<&[f32]>,
    out: OutPtr<E>,
    k: usize,
    r0: usize,
    r1: usize,
) {
    if !E::BF16 {
        return q4::dequantize_rows(codes, scales, offsets, out, k, r0, r1);
    }
    let groups = k / 32;
    let mut row = vec![0.0f32; k];
    for r in r0..r1 {
        let rows = r * groups..(r + 1) * groups;
        let offsets = offsets.map(|o| &o[rows.clone()]);
        let codes = &codes[r * k / 2..(r + 1) * k / 2];
        q4::dequantize_rows(
            codes,
            &scales[rows],
            offsets,
            OutPtr(row.as_mut_ptr()),
            k,
            0,
            1,
        );
        to_bf16(&row, out.0.add(r * k) as *mut u16);
    }
}

/// ``q8::dequantize_rows`` compiled for AVX2 (into bfloat16 a row at a time, as for ``q4``).
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn q8_dequantize_rows<E: Element>(
    codes: &[i8],
    scales: &[f32],
    offsets: Option<&[f32]>,
    out: OutPtr<E>,
    k: usize,
    group: usize,
    r0: usize,
    r1: usize,
) {
    if !E::BF16 {
        return q8::dequantize_rows(codes, scales, offsets, out, k, group, r0, r1);
    }
    let groups = k / group;
    let mut row = vec![0.0f32; k];
    for r in r0..r1 {
        let rows = r * groups..(r + 1) * groups;
        let offsets = offsets.map(|o| &o[rows.clone()]);
        let codes = &codes[r * k..(r + 1) * k];
        q8::dequantize_rows(
            codes,
            &scales[rows],
            offsets,
            OutPtr(row.as_mut_ptr()),
            k,
            group,
            0,
            1,
        );
        to_bf16(&row, out.0.add(r * k) as *mut u16);
    }
}

/// ``values`` rounded to bfloat16 at ``out`` as ``Bf16::from_f32`` rounds them (nearest, ties
/// to even; a NaN stays a quiet NaN), 16 at a time. ``values.len()`` is a multiple of 16.
#[target_feature(enable = "avx2,fma")]
unsafe fn to_bf16(values: &[f32], out: *mut u16) {
    let one = _mm256_set1_epi32(1);
    let half = _mm256_set1_epi32(0x7FFF);
    let quiet = _mm256_set1_epi32(0x40);
    let round = |v: __m256| {
        let bits = _mm256_castps_si256(v);
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), one);
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(bits, _mm256_add_epi32(half, lsb)));
        let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
        let kept = _mm256_or_si256(_mm256_srli_epi32::<16>(bits), quiet);
        _mm256_blendv_epi8(rounded, kept, nan)
    };
    for (i, chunk) in values.chunks_exact(16).enumerate() {
        let low = round(_mm256_loadu_ps(chunk.as_ptr()));
        let high = round(_mm256_loadu_ps(chunk.as_ptr().add(8)));
        // packus interleaves 128-bit lanes (values fit 16 bits unsigned); the permute undoes it.
        let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(low, high));
        _mm256_storeu_si256(out.add(i * 16) as *mut __m256i, packed);
    }
}
