//! ``attention.rs``'s (row, kv head) pair in AVX2+FMA intrinsics, for head dims that are a
//! multiple of eight.
//!
//! The portable loop left the vectorising to the compiler, which kept the value accumulator
//! in memory and reduced each score on its own: 1.9 ms per SmolLM2 layer of 64 decode rows
//! on one thread. Here the scores of eight keys are summed in eight registers and reduced
//! together, and a head's weighted values stay in registers (64 dims at a time) until they
//! are stored once. Every sum still runs in an order fixed by the row alone, so the results
//! stay batch- and thread-invariant (not bit-equal to the portable path: FMA rounds once).
//! bfloat16 elements are widened to float32 in registers as they are loaded.

use std::arch::x86_64::*;

use crate::attention::{exp, max_of, Element, Out, PagedAttention, Row};

/// Eight elements from ``p`` as float32 lanes (bfloat16: a 16-bit shift into the upper half).
#[inline(always)]
unsafe fn load8<E: Element>(p: *const E) -> __m256 {
    if E::BF16 {
        let halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32(halves, 16))
    } else {
        _mm256_loadu_ps(p as *const f32)
    }
}

/// Eight float32 lanes stored to ``p`` (bfloat16: each rounded as ``Element::from_f32`` does).
#[inline(always)]
unsafe fn store8<E: Element>(p: *mut E, lanes: __m256) {
    if E::BF16 {
        let mut wide = [0.0f32; 8];
        _mm256_storeu_ps(wide.as_mut_ptr(), lanes);
        for (i, value) in wide.into_iter().enumerate() {
            *p.add(i) = E::from_f32(value);
        }
    } else {
        _mm256_storeu_ps(p as *mut f32, lanes)
    }
}

/// One (row, kv head) pair: every query token's heads of the group, against the keys each
/// sees. ``job.dim`` must be a multiple of 8.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn attend<E: Element>(
    job: &PagedAttention<E>,
    row: &Row,
    kv_head: usize,
    out: Out<E>,
) {
    let (dim, heads) = (job.dim, job.heads);
    debug_assert!(dim.is_multiple_of(8));
    let group = heads / job.kv_heads;
    let first_position = row.seq_len - row.q_len;
    let lo = job.first_key(first_position);
    let offsets = job.cache_offsets(row, lo, kv_head);
    let (keys, values) = (job.key_cache.as_ptr(), job.value_cache.as_ptr());
    let mut scores = vec![0.0f32; offsets.len()];
    for q in 0..row.q_len * group {
        let (t, h) = (q / group, q % group);
        let position = first_position + t;
        let (a, b) = (job.first_key(position) - lo, position + 1 - lo);
        let offset = ((row.start + t) * heads + kv_head * group + h) * dim;
        let query = job.query.as_ptr().add(offset);
        let mut j = a;
        while j + 8 <= b {
            let dots = dots::<8, E>(query, dim, keys, &offsets[j..j + 8]);
            for (score, d) in scores[j..j + 8].iter_mut().zip(dots) {
                *score = d * job.scale;
            }
            j += 8;
        }
        while j < b {
            scores[j] = dots::<1, E>(query, dim, keys, &offsets[j..j + 1])[0] * job.scale;
            j += 1;
        }
        let seen = &mut scores[a..b];
        let max = max_of(seen);
        seen.iter_mut().for_each(|s| *s = exp(*s - max));
        let inverse = 1.0 / seen.iter().sum::<f32>();
        let target = out.0.add(offset);
        let mut c = 0;
        while c + 64 <= dim {
            weighted_values::<8, E>(values, &offsets[a..b], seen, c, inverse, target);
            c += 64;
        }
        while c < dim {
            weighted_values::<1, E>(values, &offsets[a..b], seen, c, inverse, target);
            c += 8;
        }
    }
}

/// ``query . key`` for the ``N`` keys at ``offsets``, each summed in eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dots<const N: usize, E: Element>(
    query: *const E,
    dim: usize,
    keys: *const E,
    offsets: &[usize],
) -> [f32; N] {
    let mut sums = [_mm256_setzero_ps(); N];
    let mut c = 0;
    while c < dim {
        let q = load8(query.add(c));
        for (sum, &offset) in sums.iter_mut().zip(offsets) {
            *sum = _mm256_fmadd_ps(q, load8(keys.add(offset + c)), *sum);
        }
        c += 8;
    }
    let mut dots = [0.0f32; N];
    for (dot, sum) in dots.iter_mut().zip(sums) {
        // (lanes 0-3 + lanes 4-7), then pairs, then the last two: a fixed order.
        let half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
        let pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
        *dot = _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
    }
    dots
}

/// ``target[c..c + 8V] = inverse * sum_j weights[j] * value_j[c..c + 8V]``, the sum kept in
/// ``V`` registers over every key.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn weighted_values<const V: usize, E: Element>(
    values: *const E,
    offsets: &[usize],
    weights: &[f32],
    c: usize,
    inverse: f32,
    target: *mut E,
) {
    let mut sums = [_mm256_setzero_ps(); V];
    for (&offset, &weight) in offsets.iter().zip(weights) {
        let w = _mm256_set1_ps(weight);
        let value = values.add(offset + c);
        for (i, sum) in sums.iter_mut().enumerate() {
            *sum = _mm256_fmadd_ps(w, load8(value.add(8 * i)), *sum);
        }
    }
    let inverse = _mm256_set1_ps(inverse);
    for (i, sum) in sums.into_iter().enumerate() {
        store8(target.add(c + 8 * i), _mm256_mul_ps(sum, inverse));
    }
}
