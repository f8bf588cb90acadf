//! Rotary embedding fused with the cache write: one pass rotates the step's queries,
//! rotates its keys and writes them and the values to their cache slots.
//!
//! In plain torch that is a rotation of the query, one of the key (each a slice, two
//! multiplies, a subtract or add and a concatenation) and two indexed copies into the
//! cache: about ten small ops per layer, more time than a decode's attention itself.
//!
//! The rotation is ``layers.rotary.apply_rotary``'s, bit for bit: per half,
//! ``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin``, each product rounded before the
//! subtraction or addition (never fused), and dims past ``2 * half`` copied.
//!
//! In bfloat16 each of those products, sums and differences is rounded to bfloat16 as torch
//! rounds it (``Element``), so the bits are still ``apply_rotary``'s.
//!
//! Layouts (float32 or bfloat16, one type for all but the slots; contiguous): query
//! ``[tokens, heads, dim]``, key and value
//! ``[tokens, kv_heads, dim]``, cos and sin ``[tokens, half]``, slots ``[tokens]`` int64
//! (the first ``stored`` are written), caches ``[slots, kv_heads, dim]`` (blocks flattened).

use crate::Element;

/// One call's inputs (see the module docs for the layouts).
pub struct RotaryStore<'a, E: Element = f32> {
    pub query: &'a [E],
    pub key: &'a [E],
    pub value: &'a [E],
    pub cos: &'a [E],
    pub sin: &'a [E],
    pub slots: &'a [i64],
    pub heads: usize,
    pub kv_heads: usize,
    pub dim: usize,
    pub half: usize,
    /// Tokens whose key and value are written (the rest are padding).
    pub stored: usize,
}

/// Rotated queries into ``rotated``; rotated keys and the values into the caches at their
/// slots. Checks every size and slot first, so nothing is written when one is wrong.
pub fn rotary_store<E: Element>(
    job: &RotaryStore<E>,
    rotated: &mut [E],
    key_cache: &mut [E],
    value_cache: &mut [E],
) -> Result<(), String> {
    let (dim, half) = (job.dim, job.half);
    let row = job.kv_heads * dim;
    if dim == 0 || 2 * half > dim || job.kv_heads == 0 {
        return Err(format!(
            "rotary over 2 x {half} dims of {dim}, {} kv heads",
            job.kv_heads
        ));
    }
    let tokens = job.query.len() / (job.heads * dim);
    if rotated.len() != job.query.len()
        || job.key.len() < job.stored * row
        || job.value.len() < job.stored * row
        || job.cos.len() != tokens * half
        || job.sin.len() != tokens * half
        || job.slots.len() < job.stored
        || job.stored > tokens
        || key_cache.len() != value_cache.len()
    {
        return Err(format!(
            "sizes do not match {tokens} tokens ({} stored) of {} heads x {dim}",
            job.stored, job.heads
        ));
    }
    let num_slots = key_cache.len() / row;
    if let Some((t, slot)) = job.slots[..job.stored]
        .iter()
        .enumerate()
        .find(|(_, &s)| s < 0 || s as usize >= num_slots)
    {
        return Err(format!(
            "token {t}: slot {slot} is not one of the cache's {num_slots} slots"
        ));
    }
    for t in 0..tokens {
        let (cos, sin) = (
            &job.cos[t * half..(t + 1) * half],
            &job.sin[t * half..(t + 1) * half],
        );
        let queries = t * job.heads * dim..(t + 1) * job.heads * dim;
        for (x, out) in job.query[queries.clone()]
            .chunks_exact(dim)
            .zip(rotated[queries].chunks_exact_mut(dim))
        {
            rotate(x, cos, sin, out);
        }
        if t < job.stored {
            let slot = job.slots[t] as usize;
            let target = slot * row..(slot + 1) * row;
            for (x, out) in job.key[t * row..(t + 1) * row]
                .chunks_exact(dim)
                .zip(key_cache[target.clone()].chunks_exact_mut(dim))
            {
                rotate(x, cos, sin, out);
            }
            value_cache[target].copy_from_slice(&job.value[t * row..(t + 1) * row]);
        }
    }
    Ok(())
}

/// One head's vector rotated by one token's angles, every product, sum and difference
/// rounded to ``E`` as torch rounds it (a no-op in float32).
#[inline]
fn rotate<E: Element>(x: &[E], cos: &[E], sin: &[E], out: &mut [E]) {
    let half = cos.len();
    let (x1, rest) = x.split_at(half);
    let (x2, pass) = rest.split_at(half);
    let (o1, rest) = out.split_at_mut(half);
    let (o2, out_pass) = rest.split_at_mut(half);
    let round = |v: f32| E::from_f32(v).to_f32();
    for i in 0..half {
        let (a, b) = (x1[i].to_f32(), x2[i].to_f32());
        let (c, s) = (cos[i].to_f32(), sin[i].to_f32());
        o1[i] = E::from_f32(round(a * c) - round(b * s));
        o2[i] = E::from_f32(round(b * c) + round(a * s));
    }
    out_pass.copy_from_slice(pass);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_outside_the_cache_is_refused_before_anything_is_written() {
        let (heads, dim, half) = (2, 4, 2);
        let query = vec![1.0f32; 2 * heads * dim];
        let kv = vec![2.0f32; 2 * dim];
        let trig = vec![0.5f32; 2 * half];
        let job = RotaryStore {
            query: &query,
            key: &kv,
            value: &kv,
            cos: &trig,
            sin: &trig,
            slots: &[1, 3],
            heads,
            kv_heads: 1,
            dim,
            half,
            stored: 2,
        };
        let mut rotated = vec![0.0f32; query.len()];
        let (mut keys, mut values) = (vec![0.0f32; 3 * dim], vec![0.0f32; 3 * dim]);
        let error = rotary_store(&job, &mut rotated, &mut keys, &mut values).unwrap_err();
        assert_eq!(error, "token 1: slot 3 is not one of the cache's 3 slots");
        assert!(rotated
            .iter()
            .chain(&keys)
            .chain(&values)
            .all(|&v| v == 0.0));
    }
}
