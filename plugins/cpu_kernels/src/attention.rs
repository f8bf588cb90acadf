//! Paged attention for short query rows: decodes, speculative verifications, short chunks.
//!
//! Why a kernel of its own: in plain torch a batch of decodes costs a gather of every row's
//! blocks into a padded buffer, masks, one ``scaled_dot_product_attention`` per length
//! bucket and a scatter back, per layer; for a 64-sequence CPU decode step that was more
//! time than the model's matmuls. Here each (sequence, kv head) pair reads its keys and
//! values straight from the paged cache through the block table, once, for all the query
//! heads that share that kv head and all of the row's query tokens.
//!
//! Keys are taken in segments of ``SEGMENT`` positions, cut at absolute positions, and each
//! (pair, segment) is a work item of its own: a long row's keys spread over every thread
//! (split-K, as flash-decoding does on GPUs) where its pairs alone would leave threads idle
//! (a batch-1 decode of a 3-kv-head model has three pairs). Per item and query token: scores
//! ``q . k * scale`` for the segment's keys that token sees (causal, and inside the sliding
//! window if there is one), an exact two-pass softmax (max, then exponentials and their
//! sum), and the unnormalised weighted sum of values. ``combine`` then rescales the
//! segments' sums to their common maximum, in segment order, and divides once. A token's
//! arithmetic depends only on its position and the keys it sees, never on its batch, its
//! row's other tokens or the thread that runs it: results are batch-invariant, and a token
//! verified in a chunk gets the bits it gets decoded alone. For a token that sees a single
//! segment, ``combine`` multiplies by exactly one, so short rows get the bits of an
//! unsegmented softmax.
//!
//! Elements are float32 or bfloat16 (``Element``), the same type for query, caches and out;
//! bfloat16 is widened to float32 as it is read, every sum runs in float32, and the output is
//! rounded to bfloat16 (to nearest, ties to even, as torch rounds) once, as it is stored.
//!
//! Layouts (contiguous): query and out ``[tokens, heads, dim]``; key and value
//! cache ``[blocks, block_size, kv_heads, dim]``; block tables ``[batch, max_blocks]`` int32;
//! ``query_start`` ``[batch + 1]`` and ``seq_lens`` ``[batch]`` int32. A row's query tokens
//! are the last ``q_len`` positions of its ``seq_len`` tokens (their keys already stored).

use crate::{for_row_chunks_on, kernel_path, KernelPath, Threads};

/// What query, caches and output hold: float32, or bfloat16 (a float32's upper 16 bits).
pub trait Element: Copy + Send + Sync + 'static {
    const BF16: bool;
    fn to_f32(self) -> f32;
    fn from_f32(value: f32) -> Self;
}

impl Element for f32 {
    const BF16: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        value
    }
}

/// A bfloat16 value, as torch stores it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Element for Bf16 {
    const BF16: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
    /// Rounded to nearest, ties to even (torch's rounding); a NaN stays a (quiet) NaN.
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        let bits = value.to_bits();
        let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16;
        // A select rather than an early return, so loops of it vectorise.
        let nan = (bits >> 16) | 0x40;
        Bf16(if value.is_nan() { nan } else { rounded } as u16)
    }
}

/// Where a call's output goes, shared by the threads (each writes its own pairs' vectors).
#[derive(Clone, Copy)]
pub(crate) struct Out<E>(pub(crate) *mut E);
unsafe impl<E> Send for Out<E> {}
unsafe impl<E> Sync for Out<E> {}

/// One call's inputs (see the module docs for the layouts).
pub struct PagedAttention<'a, E: Element = f32> {
    pub query: &'a [E],
    pub key_cache: &'a [E],
    pub value_cache: &'a [E],
    pub block_tables: &'a [i32],
    pub query_start: &'a [i32],
    pub seq_lens: &'a [i32],
    /// The sequences to attend (indices into ``seq_lens``); other rows' outputs are untouched.
    pub rows: &'a [i64],
    pub heads: usize,
    pub kv_heads: usize,
    pub dim: usize,
    pub block_size: usize,
    pub max_blocks: usize,
    pub scale: f32,
    /// Each token sees itself and the ``window - 1`` tokens before it; 0: no window.
    pub window: usize,
    /// Where the pairs run.
    pub threads: Threads,
}

/// Where one (row, kv head) pair reads and writes.
#[derive(Clone, Copy)]
pub(crate) struct Row {
    /// First flat query token.
    pub(crate) start: usize,
    pub(crate) q_len: usize,
    pub(crate) seq_len: usize,
    pub(crate) table: usize,
}

/// A call's work (query tokens x visible keys x heads) below which one thread runs all its
/// items. With the keys split, a batch-1 decode gains from a second thread from about 230
/// keys on (SmolLM2, 2-core AVX2 EPYC: 30 layers at 300 keys 1.39 -> 1.00 ms, at 1,000
/// 6.1 -> 4.0 ms, against 2^14, the threshold of the unsplit kernel).
const PARALLEL_WORK: usize = 1 << 11;

/// Key positions per segment. Small enough that a batch-1 decode at a 1k context has a dozen
/// items to spread, and a segment's keys and values (``2 * 256 * dim`` elements per kv head)
/// stay in L2 while the group's query heads reread them; large enough that ``combine``
/// (``dim`` multiply-adds per segment and head) is noise beside the segment's own work.
pub(crate) const SEGMENT: usize = 256;

/// Floats per (query token, head) in a segment's partial result: the unnormalised weighted
/// values (``dim``), then the segment's maximum score and its sum of exponentials.
pub(crate) fn partial_len(dim: usize) -> usize {
    dim + 2
}

/// One work item: one pair's keys at positions ``lo..hi``, its partial results at
/// ``scratch[first..]`` (``q_len * group`` entries of ``partial_len``).
struct Piece {
    pair: usize,
    lo: usize,
    hi: usize,
    first: usize,
}

/// A (row, kv head) pair and the range of its pieces.
struct Pair {
    row: usize,
    kv_head: usize,
    pieces: std::ops::Range<usize>,
}

impl<E: Element> PagedAttention<'_, E> {
    /// Checks every row against the buffers, so the kernel never reads out of bounds.
    fn plan(&self) -> Result<Vec<Row>, String> {
        let (heads, kv_heads, dim) = (self.heads, self.kv_heads, self.dim);
        if kv_heads == 0 || dim == 0 || self.block_size == 0 || heads % kv_heads != 0 {
            return Err(format!(
                "heads ({heads}) must be a multiple of kv_heads ({kv_heads}), both and dim ({dim}) and \
                 block_size ({}) positive",
                self.block_size
            ));
        }
        let batch = self.seq_lens.len();
        let tokens = self.query.len() / (heads * dim);
        let per_block = self.block_size * kv_heads * dim;
        let num_blocks = self.key_cache.len() / per_block;
        if self.query_start.len() != batch + 1
            || self.block_tables.len() != batch * self.max_blocks
            || self.value_cache.len() != self.key_cache.len()
        {
            return Err(
                "query_start, block_tables or the value cache do not match the batch".into(),
            );
        }
        let mut plan = Vec::with_capacity(self.rows.len());
        for &row in self.rows {
            let r = usize::try_from(row)
                .ok()
                .filter(|&r| r < batch)
                .ok_or_else(|| format!("row {row} is not a sequence of this batch of {batch}"))?;
            let (start, end) = (self.query_start[r], self.query_start[r + 1]);
            let seq_len = self.seq_lens[r];
            if start < 0 || end < start || end as usize > tokens || seq_len < end - start {
                return Err(format!(
                    "sequence {r}: query tokens {start}..{end} of {tokens} with {seq_len} cached tokens"
                ));
            }
            let seq_len = seq_len as usize;
            let q_len = (end - start) as usize;
            if seq_len > self.max_blocks * self.block_size {
                return Err(format!(
                    "sequence {r}: {seq_len} tokens do not fit its {} blocks of {}",
                    self.max_blocks, self.block_size
                ));
            }
            let table = r * self.max_blocks;
            let first = self.first_key(seq_len - q_len) / self.block_size;
            for (i, &block) in self.block_tables[table..][first..seq_len.div_ceil(self.block_size)]
                .iter()
                .enumerate()
            {
                if block < 0 || block as usize >= num_blocks {
                    return Err(format!(
                        "sequence {r}: block table entry {} is {block}, not one of the cache's {num_blocks} blocks",
                        first + i
                    ));
                }
            }
            plan.push(Row {
                start: start as usize,
                q_len,
                seq_len,
                table,
            });
        }
        Ok(plan)
    }

    /// The first key the query at position ``position`` sees.
    pub(crate) fn first_key(&self, position: usize) -> usize {
        if self.window == 0 {
            0
        } else {
            (position + 1).saturating_sub(self.window)
        }
    }

    /// Offsets of the vectors of ``kv_head`` at positions ``lo..hi`` in either cache, walked
    /// block by block: one block-table read and one division per block, not per token (a
    /// division costs about as much as scoring a key).
    pub(crate) fn cache_offsets(
        &self,
        row: &Row,
        lo: usize,
        hi: usize,
        kv_head: usize,
    ) -> Vec<usize> {
        let (size, stride) = (self.block_size, self.kv_heads * self.dim);
        let mut offsets = Vec::with_capacity(hi - lo);
        let mut position = lo;
        while position < hi {
            let block = self.block_tables[row.table + position / size] as usize;
            let slot = position % size;
            let end = hi.min(position - slot + size);
            let first = (block * size + slot) * stride + kv_head * self.dim;
            offsets.extend((0..end - position).map(|i| first + i * stride));
            position = end;
        }
        offsets
    }
}

/// Attention of the chosen rows' query tokens, written into ``out`` at the same tokens.
pub fn paged_attention<E: Element>(job: &PagedAttention<E>, out: &mut [E]) -> Result<(), String> {
    if out.len() != job.query.len() {
        return Err("out must have the query's shape".into());
    }
    let plan = job.plan()?;
    let group = job.heads / job.kv_heads;
    let (mut pairs, mut pieces, mut floats) = (Vec::new(), Vec::new(), 0);
    for (r, row) in plan.iter().enumerate().filter(|(_, row)| row.q_len > 0) {
        let lo = job.first_key(row.seq_len - row.q_len);
        for kv_head in 0..job.kv_heads {
            let first = pieces.len();
            for segment in lo / SEGMENT..row.seq_len.div_ceil(SEGMENT) {
                pieces.push(Piece {
                    pair: pairs.len(),
                    lo: lo.max(segment * SEGMENT),
                    hi: row.seq_len.min((segment + 1) * SEGMENT),
                    first: floats,
                });
                floats += row.q_len * group * partial_len(job.dim);
            }
            pairs.push(Pair {
                row: r,
                kv_head,
                pieces: first..pieces.len(),
            });
        }
    }
    let mut partials = vec![0.0f32; floats];
    let scratch = Out(partials.as_mut_ptr());
    let work: usize = plan.iter().map(|r| r.q_len * r.seq_len).sum::<usize>() * job.heads;
    let out = Out(out.as_mut_ptr());
    let path = kernel_path();
    let run = |p0: usize, p1: usize| {
        for piece in &pieces[p0..p1] {
            let pair = &pairs[piece.pair];
            let row = &plan[pair.row];
            // SAFETY: each piece writes only its own partials, which ``floats`` counted.
            let partial = unsafe { scratch.0.add(piece.first) };
            match path {
                #[cfg(target_arch = "x86_64")]
                KernelPath::Avx2Fma => unsafe {
                    attend_avx2(job, row, pair.kv_head, piece.lo..piece.hi, partial)
                },
                _ => attend(job, row, pair.kv_head, piece.lo..piece.hi, partial),
            }
            if pair.pieces.len() == 1 {
                // SAFETY: the pair's only piece is complete, and only this item reads it.
                unsafe {
                    combine(
                        job,
                        row,
                        pair.kv_head,
                        &pieces[pair.pieces.clone()],
                        scratch,
                        out,
                    )
                };
            }
        }
    };
    let threads = if work < PARALLEL_WORK {
        Threads::Caller
    } else {
        job.threads
    };
    for_row_chunks_on(threads, pieces.len(), 1, run);
    for pair in pairs.iter().filter(|pair| pair.pieces.len() > 1) {
        // SAFETY: every piece has run; the threads are done with the partials.
        unsafe {
            combine(
                job,
                &plan[pair.row],
                pair.kv_head,
                &pieces[pair.pieces.clone()],
                scratch,
                out,
            )
        };
    }
    Ok(())
}

/// A pair's output from its pieces' partials: each segment's sums rescaled to the largest
/// maximum among the segments a token saw, summed in segment order, divided by the total.
///
/// # Safety
/// ``partials`` holds every piece's complete results, and no other thread writes the pair's
/// output vectors (which ``plan`` checked are inside ``out``).
unsafe fn combine<E: Element>(
    job: &PagedAttention<E>,
    row: &Row,
    kv_head: usize,
    pieces: &[Piece],
    partials: Out<f32>,
    out: Out<E>,
) {
    let (dim, heads) = (job.dim, job.heads);
    let group = heads / job.kv_heads;
    let entry = partial_len(dim);
    let mut sum = vec![0.0f32; dim];
    for q in 0..row.q_len * group {
        let seen = || {
            pieces
                .iter()
                .map(move |p| {
                    std::slice::from_raw_parts(partials.0.add(p.first + q * entry), entry)
                })
                .filter(|e| e[dim + 1] != 0.0) // a segment the token saw has a total of at least 1 (or NaN)
        };
        let max = seen().fold(f32::NEG_INFINITY, |m, e| m.max(e[dim]));
        let mut total = 0.0f32;
        sum.fill(0.0);
        for e in seen() {
            let w = exp(e[dim] - max); // exactly 1 for the segment holding the maximum
            total += w * e[dim + 1];
            sum.iter_mut().zip(&e[..dim]).for_each(|(s, v)| *s += w * v);
        }
        let inverse = 1.0 / total;
        let (t, h) = (q / group, q % group);
        let offset = ((row.start + t) * heads + kv_head * group + h) * dim;
        let target = std::slice::from_raw_parts_mut(out.0.add(offset), dim);
        target
            .iter_mut()
            .zip(&sum)
            .for_each(|(o, s)| *o = E::from_f32(s * inverse));
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_avx2<E: Element>(
    job: &PagedAttention<E>,
    row: &Row,
    kv_head: usize,
    keys: std::ops::Range<usize>,
    partial: *mut f32,
) {
    if job.dim.is_multiple_of(8) {
        crate::attention_x86::attend(job, row, kv_head, keys, partial)
    } else {
        attend(job, row, kv_head, keys, partial)
    }
}

/// One piece: a (row, kv head) pair's keys at positions ``keys``, every query token's heads
/// of the group. Writes each (token, head)'s partial result (``partial_len``) to
/// ``partial``; a token that sees none of these keys gets a total of 0. Inlined into each
/// path, so the compiler vectorises the lane loops with that path's instructions.
///
/// Per query row (one query token's head): its scores four keys at a time (four
/// independent sums, so the adds of one do not wait for another's), the softmax, then the
/// values four at a time into one accumulator. Keys and values are addressed through
/// offsets computed once per piece.
#[inline(always)]
fn attend<E: Element>(
    job: &PagedAttention<E>,
    row: &Row,
    kv_head: usize,
    keys: std::ops::Range<usize>,
    partial: *mut f32,
) {
    let (dim, heads) = (job.dim, job.heads);
    let group = heads / job.kv_heads;
    let first_position = row.seq_len - row.q_len;
    let lo = keys.start;
    let offsets = job.cache_offsets(row, lo, keys.end, kv_head);
    let key = |j: usize| &job.key_cache[offsets[j]..offsets[j] + dim];
    let value = |j: usize| &job.value_cache[offsets[j]..offsets[j] + dim];
    let mut scores = vec![0.0f32; offsets.len()];
    let mut query = vec![0.0f32; dim];
    for q in 0..row.q_len * group {
        let (t, h) = (q / group, q % group);
        // SAFETY: the caller sized ``partial`` for every (token, head) of the group.
        let entry = unsafe {
            std::slice::from_raw_parts_mut(partial.add(q * partial_len(dim)), partial_len(dim))
        };
        let (sum, stats) = entry.split_at_mut(dim);
        // The keys this query row sees, as indices into ``offsets``.
        let (a, b) = seen_keys(job, first_position + t, &keys);
        if a >= b {
            stats.copy_from_slice(&[f32::NEG_INFINITY, 0.0]);
            continue;
        }
        let offset = ((row.start + t) * heads + kv_head * group + h) * dim;
        query
            .iter_mut()
            .zip(&job.query[offset..offset + dim])
            .for_each(|(q, e)| *q = e.to_f32());
        let mut j = a;
        while j + 4 <= b {
            let dots = dot4(&query, [key(j), key(j + 1), key(j + 2), key(j + 3)]);
            for (score, d) in scores[j..j + 4].iter_mut().zip(dots) {
                *score = d * job.scale;
            }
            j += 4;
        }
        for (j, score) in scores.iter_mut().enumerate().take(b).skip(j) {
            *score = dot4(&query, [key(j); 4])[0] * job.scale;
        }
        let seen = &mut scores[a..b];
        let max = max_of(seen);
        seen.iter_mut().for_each(|s| *s = exp(*s - max));
        let total: f32 = seen.iter().sum();
        sum.fill(0.0);
        let mut j = a;
        while j + 4 <= b {
            let w = [scores[j], scores[j + 1], scores[j + 2], scores[j + 3]];
            axpy4(sum, w, [value(j), value(j + 1), value(j + 2), value(j + 3)]);
            j += 4;
        }
        for (j, &w) in scores.iter().enumerate().take(b).skip(j) {
            sum.iter_mut()
                .zip(value(j))
                .for_each(|(s, v)| *s += w * v.to_f32());
        }
        stats.copy_from_slice(&[max, total]);
    }
}

/// The keys that the query token at ``position`` sees among ``keys``, as indices ``a..b``
/// from ``keys.start`` (empty when it sees none of them).
#[inline(always)]
pub(crate) fn seen_keys<E: Element>(
    job: &PagedAttention<E>,
    position: usize,
    keys: &std::ops::Range<usize>,
) -> (usize, usize) {
    let a = job.first_key(position).max(keys.start) - keys.start;
    let b = (position + 1).min(keys.end).saturating_sub(keys.start);
    (a, b)
}

/// The largest of ``values`` (not empty), in eight lanes so it vectorises.
#[inline(always)]
pub(crate) fn max_of(values: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = values.chunks_exact(8);
    let rest = chunks.remainder();
    for chunk in chunks {
        for i in 0..8 {
            lanes[i] = lanes[i].max(chunk[i]);
        }
    }
    rest.iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

/// ``query . keys[i]`` for four keys, each summed in eight lanes (so the loop vectorises).
#[inline(always)]
fn dot4<E: Element>(query: &[f32], keys: [&[E]; 4]) -> [f32; 4] {
    let mut lanes = [[0.0f32; 8]; 4];
    let chunks = query.len() / 8;
    for c in 0..chunks {
        let q = &query[c * 8..c * 8 + 8];
        for (lane, key) in lanes.iter_mut().zip(&keys) {
            let k = &key[c * 8..c * 8 + 8];
            for i in 0..8 {
                lane[i] += q[i] * k[i].to_f32();
            }
        }
    }
    let mut dots = [0.0f32; 4];
    for ((dot, lane), key) in dots.iter_mut().zip(&lanes).zip(&keys) {
        let mut total =
            (lane[0] + lane[4]) + (lane[1] + lane[5]) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
        for i in chunks * 8..query.len() {
            total += query[i] * key[i].to_f32();
        }
        *dot = total;
    }
    dots
}

/// ``sum += w[0] * values[0] + ... + w[3] * values[3]``, element by element.
#[inline(always)]
fn axpy4<E: Element>(sum: &mut [f32], w: [f32; 4], values: [&[E]; 4]) {
    let n = sum.len();
    let [v0, v1, v2, v3] = values.map(|v| &v[..n]);
    for i in 0..n {
        sum[i] += (w[0] * v0[i].to_f32() + w[1] * v1[i].to_f32())
            + (w[2] * v2[i].to_f32() + w[3] * v3[i].to_f32());
    }
}

/// ``e^x`` for ``x <= 0`` (a score minus its row's maximum), to within a few ulp: Cephes'
/// ``expf`` (``2^n`` times a degree-6 polynomial of the remainder). Plain float ops, so a
/// loop of them vectorises, unlike a libm call per score.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    let x = x.max(-87.0); // e^-87 is below f32's normal range; the softmax ignores it anyway
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let p = ((((1.987_569_2e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5; // Cephes' 5.0000001201e-1 rounds to 0.5 in f32
    let y = p * r * r + r + 1.0;
    // 2^n from bits: n + 127 (in 1..=127 here) lands in the low mantissa bits of
    // 2^23 + n + 127, and a shift moves it into the exponent. Unlike a float-to-int cast
    // (saturating in Rust), this vectorises.
    y * f32::from_bits((n + 127.0 + 8_388_608.0).to_bits() << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even_like_torch() {
        // bfloat16 steps by 2^-7 near 1. 1 + 2^-8 lies halfway between 1 and 1 + 2^-7 and
        // goes to the even one, 1; 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6
        // and goes to the even one, 1 + 2^-6.
        assert_eq!(Bf16::from_f32(1.0 + 1.0 / 256.0).to_f32(), 1.0);
        assert_eq!(Bf16::from_f32(1.0 + 3.0 / 256.0).to_f32(), 1.0 + 1.0 / 64.0);
        assert_eq!(Bf16::from_f32(-2.5).to_f32(), -2.5);
        assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
        assert_eq!(Bf16::from_f32(f32::MAX).to_f32(), f32::INFINITY);
    }

    #[test]
    fn exp_matches_libm_over_the_softmax_range() {
        let mut worst = 0.0f64;
        for i in 0..=87_000 {
            let x = -(i as f32) / 1000.0;
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
    }
}
