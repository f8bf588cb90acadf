//! Decode-sized ``q4`` products with the activations rounded to 16-bit integers (x86_64).
//!
//! Widening each 4-bit code to float32 costs two conversions per weight (``x86.rs``); at a
//! few rows of ``x`` those, not memory, bound the product. Here each 32-column group of a
//! row of ``x`` is rounded once per call to ``i16`` with its own scale
//! (``x ~ dx_g * q``, ``|q| <= 32767``), and each code meets its activation in an integer
//! multiply-add: ``vpmaddwd`` (AVX2) or ``vpdpwssd`` (AVX-512 VNNI, two groups per 512-bit
//! vector: about 10% faster on a Zen 4 VM, which splits 512-bit operations in two) sums pairs
//! of ``code * q`` into 32-bit lanes, exactly. A group's integer dot is converted once and
//! scaled by ``scale_g * dx_g``. The offsets' term keeps the float32 group sums of ``x``.
//! AVX2 also takes two groups per 256-bit load, their nibbles unpacked within 128-bit lanes
//! (``rows_dot_pairs_avx2``): about 3 fewer instructions per 32 weights than widening one
//! group across lanes, which on the 2-core Zen 3 EPYC made SmolLM2's 120 q4 products of a
//! batch-1 step 6.2-6.8 -> 5.0-5.6 ms and its greedy decode 113 -> 127 tok/s (medians,
//! old and new library alternating).
//!
//! The rounding moves each activation by at most ``dx_g / 2 = max|x_g| / 65534``: an output
//! changes by at most ``sum_g max|x_g| / 65534 * sum_j |scale_g * code_gj|``: the codes
//! alone, for the offsets meet the exact sums, so an offset never cancels that rounding
//! (bound checked by the tests). llama.cpp rounds activations to 8 bits for the same product, 256 times coarser;
//! on the embedded SmolLM2 that changed greedy continuations where 16 bits did not.

use std::arch::x86_64::*;

use crate::x86::{offset_term, ScaleX86};
use crate::{q4, OutPtr};

/// ``q`` in [-32767, 32767] per group: ``x[t, 32g + j] ~ scales[t, g] * q[t, 32g + j]``.
pub(crate) struct Activations {
    pub q: Vec<i16>,
    pub scales: Vec<f32>,
}

/// Rounds ``x [m, k]`` (``k`` a multiple of 32) group by group. A group holding a NaN or an
/// infinity gets a NaN scale, which carries it to every output it meets.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn quantize(x: &[f32], m: usize, k: usize) -> Activations {
    let groups = m * k / 32;
    let mut q = vec![0i16; m * k];
    let mut scales = vec![0.0f32; groups];
    let sign = _mm256_set1_ps(-0.0);
    for (g, scale) in scales.iter_mut().enumerate() {
        let xs = x.as_ptr().add(g * 32);
        let v = [0, 8, 16, 24].map(|j| _mm256_loadu_ps(xs.add(j)));
        // max with the accumulator second: a NaN in v is kept (maxps returns its second operand then).
        let amax = v.iter().fold(_mm256_setzero_ps(), |a, v| {
            _mm256_max_ps(_mm256_andnot_ps(sign, *v), a)
        });
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), amax);
        let amax = lanes
            .iter()
            .fold(0.0f32, |a, v| if *v > a || v.is_nan() { *v } else { a });
        if amax == 0.0 {
            continue; // q and the scale stay 0
        }
        if !amax.is_finite() {
            *scale = f32::NAN;
            continue;
        }
        *scale = amax / 32767.0;
        let inverse = _mm256_set1_ps(32767.0 / amax);
        // cvtps rounds to nearest even; packs interleaves 128-bit lanes, the permute undoes it.
        let i = v.map(|v| _mm256_cvtps_epi32(_mm256_mul_ps(v, inverse)));
        let packed = [
            _mm256_packs_epi32(i[0], i[1]),
            _mm256_packs_epi32(i[2], i[3]),
        ];
        for (half, p) in packed.iter().enumerate() {
            let ordered = _mm256_permute4x64_epi64::<0b11_01_10_00>(*p);
            _mm256_storeu_si256(
                q.as_mut_ptr().add(g * 32 + half * 16) as *mut __m256i,
                ordered,
            );
        }
    }
    Activations { q, scales }
}

/// Weight rows per pass over a row of ``x``: independent accumulation chains, and each group
/// of ``x`` loaded once for all of them.
const ROWS: usize = 4;

/// How many weight rows ahead codes are prefetched (4 to 16 measured alike; without, the
/// model's q4 weights streamed at 14-15 GB/s, with, at about 25).
pub(crate) const PREFETCH_ROWS: usize = 8;

/// The integer multiply-add: ``acc + sum of pairs of a * b`` in eight 32-bit lanes.
trait MulAdd {
    unsafe fn mul_add(acc: __m256i, a: __m256i, b: __m256i) -> __m256i;
}

struct Avx2;
struct Vnni;

impl MulAdd for Avx2 {
    #[inline(always)]
    unsafe fn mul_add(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
    }
}

impl MulAdd for Vnni {
    #[inline(always)]
    unsafe fn mul_add(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        _mm256_dpwssd_epi32(acc, a, b)
    }
}

/// ``dots[i]`` for ``ROWS`` weight rows from ``r`` (``LEN`` of them real; ``scales`` theirs,
/// as float32) and the row ``t`` of ``x``, over the groups from ``first`` on.
#[inline(always)]
unsafe fn rows_dot<M: MulAdd, const LEN: usize, S: ScaleX86>(
    job: &q4::Job<S>,
    scales: *const S,
    x: &Activations,
    r: usize,
    t: usize,
    first: usize,
) -> [f32; ROWS] {
    let k = job.k;
    let groups = k / 32;
    let nibble = _mm256_set1_epi16(0x0F);
    let codes = job.codes.as_ptr().add(r * k / 2);
    let q = x.q.as_ptr().add(t * k);
    let dx = x.scales.as_ptr().add(t * groups);
    let mut acc = [_mm256_setzero_ps(); ROWS];
    for g in first..groups {
        let low = _mm256_loadu_si256(q.add(g * 32) as *const __m256i);
        let high = _mm256_loadu_si256(q.add(g * 32 + 16) as *const __m256i);
        let dx = *dx.add(g);
        for (i, acc) in acc.iter_mut().enumerate().take(LEN) {
            // The rows after these, a few blocks ahead: the hardware prefetcher alone
            // follows too few of the interleaved row streams to keep memory busy.
            _mm_prefetch::<_MM_HINT_T0>(
                codes.wrapping_add(((i + PREFETCH_ROWS) * groups + g) * 16) as *const i8,
            );
            let bytes = _mm_loadu_si128(codes.add((i * groups + g) * 16) as *const __m128i);
            let words = _mm256_cvtepu8_epi16(bytes);
            let dot = M::mul_add(
                M::mul_add(_mm256_setzero_si256(), _mm256_and_si256(words, nibble), low),
                _mm256_srli_epi16::<4>(words),
                high,
            );
            let scale = _mm256_set1_ps(S::one(scales.add(i * groups + g)) * dx);
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, *acc);
        }
    }
    let mut dots = [0.0f32; ROWS];
    for i in 0..LEN {
        dots[i] = crate::x86::hsum(acc[i]);
    }
    dots
}

/// ``rows_dot`` with AVX-512: two groups per 512-bit vector, half the instructions per
/// weight. Codes of groups ``g`` and ``g + 1`` are 32 consecutive bytes; widened to words,
/// their low nibbles are columns 0-15 of both groups and their high nibbles columns 16-31,
/// so ``x``'s two groups are regrouped the same way (once per pair, for all ``ROWS`` rows).
/// Lanes 0-7 of the integer dot then belong to group ``g``, lanes 8-15 to ``g + 1``. An odd
/// last group takes the 256-bit path.
#[inline(always)]
unsafe fn rows_dot_pairs<const LEN: usize, S: ScaleX86>(
    job: &q4::Job<S>,
    scales: *const S,
    x: &Activations,
    r: usize,
    t: usize,
) -> [f32; ROWS] {
    let k = job.k;
    let groups = k / 32;
    let nibble = _mm512_set1_epi16(0x0F);
    let low_half = _mm512_setr_epi64(0, 1, 2, 3, 8, 9, 10, 11);
    let high_half = _mm512_setr_epi64(4, 5, 6, 7, 12, 13, 14, 15);
    let spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    let codes = job.codes.as_ptr().add(r * k / 2);
    let q = x.q.as_ptr().add(t * k);
    let dx = x.scales.as_ptr().add(t * groups);
    // Two consecutive floats at p, as [p[0] x 8, p[1] x 8].
    let pair = |two: __m128| _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(two));
    let f32_pair = |p: *const f32| pair(_mm_castsi128_ps(_mm_loadl_epi64(p as *const __m128i)));
    let mut acc = [_mm512_setzero_ps(); ROWS];
    let mut g = 0;
    while g + 2 <= groups {
        let a = _mm512_loadu_si512(q.add(g * 32) as *const __m512i);
        let b = _mm512_loadu_si512(q.add(g * 32 + 32) as *const __m512i);
        let low = _mm512_permutex2var_epi64(a, low_half, b);
        let high = _mm512_permutex2var_epi64(a, high_half, b);
        let dx = f32_pair(dx.add(g));
        for (i, acc) in acc.iter_mut().enumerate().take(LEN) {
            _mm_prefetch::<_MM_HINT_T0>(
                codes.wrapping_add(((i + PREFETCH_ROWS) * groups + g) * 16) as *const i8,
            );
            let bytes = _mm256_loadu_si256(codes.add((i * groups + g) * 16) as *const __m256i);
            let words = _mm512_cvtepu8_epi16(bytes);
            let dot =
                _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_and_si512(words, nibble), low);
            let dot = _mm512_dpwssd_epi32(dot, _mm512_srli_epi16::<4>(words), high);
            let scale = _mm512_mul_ps(pair(S::two(scales.add(i * groups + g))), dx);
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, *acc);
        }
        g += 2;
    }
    let mut dots = [0.0f32; ROWS];
    for i in 0..LEN {
        dots[i] = _mm512_reduce_add_ps(acc[i]);
    }
    with_odd_group::<Vnni, LEN, S>(dots, job, scales, x, r, t, g)
}

/// ``dots`` plus ``rows_dot``'s step for the odd last group ``g`` of a pairs kernel (none
/// when ``g`` is past the last group).
#[inline(always)]
unsafe fn with_odd_group<M: MulAdd, const LEN: usize, S: ScaleX86>(
    mut dots: [f32; ROWS],
    job: &q4::Job<S>,
    scales: *const S,
    x: &Activations,
    r: usize,
    t: usize,
    g: usize,
) -> [f32; ROWS] {
    if g < job.k / 32 {
        let tail = rows_dot::<M, LEN, S>(job, scales, x, r, t, g);
        for i in 0..LEN {
            dots[i] += tail[i];
        }
    }
    dots
}

/// ``rows_dot`` two groups per 256-bit load, for AVX2 without VNNI. The codes of groups
/// ``g`` and ``g + 1`` are 32 consecutive bytes; their low and high nibbles, unpacked to words
/// against zero within each 128-bit lane (cheaper than ``rows_dot``'s lane-crossing widening),
/// give four vectors whose lanes 0-7 hold eight columns of group ``g`` and lanes 8-15 the same
/// columns of ``g + 1``. ``x``'s two groups are regrouped the same way once per pair, for all
/// ``ROWS`` rows. After the four ``vpmaddwd`` and their sum, 32-bit lanes 0-3 belong to ``g``
/// and 4-7 to ``g + 1``, each scaled by its own group's scales. An odd last group takes
/// ``rows_dot``.
#[inline(always)]
unsafe fn rows_dot_pairs_avx2<const LEN: usize, S: ScaleX86>(
    job: &q4::Job<S>,
    scales: *const S,
    x: &Activations,
    r: usize,
    t: usize,
) -> [f32; ROWS] {
    let k = job.k;
    let groups = k / 32;
    let nibble = _mm256_set1_epi8(0x0F);
    let zero = _mm256_setzero_si256();
    let spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    let codes = job.codes.as_ptr().add(r * k / 2);
    let q = x.q.as_ptr().add(t * k);
    let dx = x.scales.as_ptr().add(t * groups);
    // Two consecutive floats at p, as [p[0] x 4, p[1] x 4].
    let pair = |two: __m128| _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), spread);
    let f32_pair = |p: *const f32| pair(_mm_castsi128_ps(_mm_loadl_epi64(p as *const __m128i)));
    let mut acc = [_mm256_setzero_ps(); ROWS];
    let mut g = 0;
    while g + 2 <= groups {
        let load = |i: usize| _mm256_loadu_si256(q.add(g * 32 + 16 * i) as *const __m256i);
        let (a_low, a_high, b_low, b_high) = (load(0), load(1), load(2), load(3));
        let xs = [
            _mm256_permute2x128_si256::<0x20>(a_low, b_low),
            _mm256_permute2x128_si256::<0x31>(a_low, b_low),
            _mm256_permute2x128_si256::<0x20>(a_high, b_high),
            _mm256_permute2x128_si256::<0x31>(a_high, b_high),
        ];
        let dx = f32_pair(dx.add(g));
        for (i, acc) in acc.iter_mut().enumerate().take(LEN) {
            _mm_prefetch::<_MM_HINT_T0>(
                codes.wrapping_add(((i + PREFETCH_ROWS) * groups + g) * 16) as *const i8,
            );
            let bytes = _mm256_loadu_si256(codes.add((i * groups + g) * 16) as *const __m256i);
            let low = _mm256_and_si256(bytes, nibble);
            let high = _mm256_and_si256(_mm256_srli_epi16::<4>(bytes), nibble);
            let dot = _mm256_add_epi32(
                _mm256_add_epi32(
                    _mm256_madd_epi16(_mm256_unpacklo_epi8(low, zero), xs[0]),
                    _mm256_madd_epi16(_mm256_unpackhi_epi8(low, zero), xs[1]),
                ),
                _mm256_add_epi32(
                    _mm256_madd_epi16(_mm256_unpacklo_epi8(high, zero), xs[2]),
                    _mm256_madd_epi16(_mm256_unpackhi_epi8(high, zero), xs[3]),
                ),
            );
            let scale = _mm256_mul_ps(pair(S::two(scales.add(i * groups + g))), dx);
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, *acc);
        }
        g += 2;
    }
    let mut dots = [0.0f32; ROWS];
    for i in 0..LEN {
        dots[i] = crate::x86::hsum(acc[i]);
    }
    with_odd_group::<Avx2, LEN, S>(dots, job, scales, x, r, t, g)
}

/// Output rows ``r0..r1``; ``VNNI``: with ``rows_dot_pairs`` (AVX-512), else
/// ``rows_dot_pairs_avx2``.
#[inline(always)]
unsafe fn rows_with<const VNNI: bool, S: ScaleX86>(
    job: &q4::Job<S>,
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
                (4, true) => rows_dot_pairs::<4, S>(job, s, x, r, t),
                (3, true) => rows_dot_pairs::<3, S>(job, s, x, r, t),
                (2, true) => rows_dot_pairs::<2, S>(job, s, x, r, t),
                (_, true) => rows_dot_pairs::<1, S>(job, s, x, r, t),
                (4, false) => rows_dot_pairs_avx2::<4, S>(job, s, x, r, t),
                (3, false) => rows_dot_pairs_avx2::<3, S>(job, s, x, r, t),
                (2, false) => rows_dot_pairs_avx2::<2, S>(job, s, x, r, t),
                (_, false) => rows_dot_pairs_avx2::<1, S>(job, s, x, r, t),
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
    job: &q4::Job<S>,
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
    job: &q4::Job<S>,
    x: &Activations,
    out: OutPtr,
    r0: usize,
    r1: usize,
) {
    rows_with::<true, S>(job, x, out, r0, r1)
}
