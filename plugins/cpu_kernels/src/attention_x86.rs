//! ``attention.rs``'s (row, kv head) pair in AVX2+FMA intrinsics, for head dims that are a
//! multiple of eight.
//!
//! The portable loop left the vectorising to the compiler, which kept the value accumulator
//! in memory and reduced each score on its own: 1.9 ms per SmolLM2 layer of 64 decode rows
//! on one thread. Here the scores of eight keys are summed in eight registers and reduced
//! together, and a head's weighted values stay in registers (64 dims at a time) until they
//! are stored once. Every sum still runs in an order fixed by the row alone, so the results
//! stay batch- and thread-invariant (not bit-equal to the portable path: FMA rounds once).
//! bfloat16 elements are widened to float32 in registers as they are loaded; the partial
//! results stay float32, and ``attention::combine`` rounds the output once.

use std::arch::x86_64::*;

use crate::attention::{exp, max_of, partial_len, seen_keys, Element, PagedAttention, Row};

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

/// Asks for the ``count`` elements at ``p`` to be brought into the caches, a line at a time.
#[inline(always)]
unsafe fn prefetch<E: Element>(p: *const E, count: usize) {
    let bytes = count * std::mem::size_of::<E>();
    let mut line = 0;
    while line < bytes {
        _mm_prefetch::<_MM_HINT_T0>((p as *const i8).add(line));
        line += 64;
    }
}

/// One piece (see ``attention::attend``): a pair's keys at positions ``keys``, every query
/// token's heads of the group. ``job.dim`` must be a multiple of 8. The scores run keys
/// outer and heads inner, so each key is read from memory once for the whole group and
/// reread from L1 by its other heads.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn attend<E: Element>(
    job: &PagedAttention<E>,
    row: &Row,
    kv_head: usize,
    keys: std::ops::Range<usize>,
    partial: *mut f32,
) {
    let (dim, heads) = (job.dim, job.heads);
    debug_assert!(dim.is_multiple_of(8));
    let group = heads / job.kv_heads;
    let entry = partial_len(dim);
    let first_position = row.seq_len - row.q_len;
    let offsets = job.cache_offsets(row, keys.start, keys.end, kv_head);
    let n = offsets.len();
    let (key_cache, values) = (job.key_cache.as_ptr(), job.value_cache.as_ptr());
    let mut scores = vec![0.0f32; group * n];
    for t in 0..row.q_len {
        let (a, b) = seen_keys(job, first_position + t, &keys);
        let head = |h: usize| ((row.start + t) * heads + kv_head * group + h) * dim;
        if a >= b {
            for h in 0..group {
                let stats = partial.add((t * group + h) * entry + dim);
                *stats = f32::NEG_INFINITY;
                *stats.add(1) = 0.0;
            }
            continue;
        }
        let mut j = a;
        while j + 8 <= b {
            // A key's vectors sit a block table's hop apart, which the hardware prefetcher
            // does not follow: ask for the next eight keys, and these keys' values (read
            // after the softmax, from the caches then), while these scores are computed.
            // Without it most of the kernel's samples sat on loads waiting for memory;
            // with it a 16-row bfloat16 SmolLM2 decode step (~300 positions) spends 12.1 ms
            // in attention instead of 16.2, a 64-row float32 one 29.5 instead of 37.5
            // (`benchmarks/step_profile.py`, 2-core Xeon). Two chunks ahead gained nothing.
            for &offset in &offsets[(j + 8).min(b)..(j + 16).min(b)] {
                prefetch(key_cache.add(offset), dim);
            }
            for &offset in &offsets[j..j + 8] {
                prefetch(values.add(offset), dim);
            }
            for h in 0..group {
                let query = job.query.as_ptr().add(head(h));
                let dots = dots::<8, E>(query, dim, key_cache, &offsets[j..j + 8]);
                for (score, d) in scores[h * n + j..h * n + j + 8].iter_mut().zip(dots) {
                    *score = d * job.scale;
                }
            }
            j += 8;
        }
        while j < b {
            for h in 0..group {
                let query = job.query.as_ptr().add(head(h));
                scores[h * n + j] =
                    dots::<1, E>(query, dim, key_cache, &offsets[j..j + 1])[0] * job.scale;
            }
            j += 1;
        }
        for h in 0..group {
            let seen = &mut scores[h * n + a..h * n + b];
            let max = max_of(seen);
            seen.iter_mut().for_each(|s| *s = exp(*s - max));
            let target = partial.add((t * group + h) * entry);
            let mut c = 0;
            while c + 64 <= dim {
                weighted_values::<8, E>(values, &offsets[a..b], seen, c, target);
                c += 64;
            }
            while c < dim {
                weighted_values::<1, E>(values, &offsets[a..b], seen, c, target);
                c += 8;
            }
            *target.add(dim) = max;
            *target.add(dim + 1) = seen.iter().sum::<f32>();
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

/// ``target[c..c + 8V] = sum_j weights[j] * value_j[c..c + 8V]``, the sum kept in ``V``
/// registers over every key.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn weighted_values<const V: usize, E: Element>(
    values: *const E,
    offsets: &[usize],
    weights: &[f32],
    c: usize,
    target: *mut f32,
) {
    let mut sums = [_mm256_setzero_ps(); V];
    for (&offset, &weight) in offsets.iter().zip(weights) {
        let w = _mm256_set1_ps(weight);
        let value = values.add(offset + c);
        for (i, sum) in sums.iter_mut().enumerate() {
            *sum = _mm256_fmadd_ps(w, load8(value.add(8 * i)), *sum);
        }
    }
    for (i, sum) in sums.into_iter().enumerate() {
        _mm256_storeu_ps(target.add(c + 8 * i), sum);
    }
}
