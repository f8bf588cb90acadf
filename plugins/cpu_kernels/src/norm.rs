//! RMSNorm with the residual add before it, as ``layers.norm.RMSNorm`` computes it in float32:
//! ``sum = x + residual`` (when there is one), then ``(sum * rsqrt(mean(sum^2) + eps)) * weight``,
//! each product rounded on its own (never fused). In torch that is about eight small ops per
//! norm, two norms per layer; here it is one pass per row. Only the order of the squares'
//! sum differs from torch (eight lanes, then their total), so results agree to float32
//! rounding, not bit for bit. In bfloat16 the sum, the normalised row and the weighted row
//! are each rounded to bfloat16 where ``layers.norm`` rounds them (``Element``); the mean of
//! squares runs in float32, as there.

use crate::Element;

/// One call: ``x``, ``residual`` and the outputs are ``[rows, hidden]``, ``weight`` ``[hidden]``.
pub struct RmsNorm<'a, E: Element = f32> {
    pub x: &'a [E],
    pub residual: Option<&'a [E]>,
    pub weight: &'a [E],
    pub hidden: usize,
    pub eps: f32,
}

/// ``normed`` (and ``sum``, ``x + residual``, where there is a residual) for every row.
pub fn rms_norm<E: Element>(
    job: &RmsNorm<E>,
    normed: &mut [E],
    mut sum: Option<&mut [E]>,
) -> Result<(), String> {
    let hidden = job.hidden;
    let rows = job.x.len().checked_div(hidden).unwrap_or(0);
    let sizes_ok = hidden > 0
        && job.x.len() == rows * hidden
        && normed.len() == job.x.len()
        && job.weight.len() == hidden
        && job.residual.is_none_or(|r| r.len() == job.x.len())
        && sum.as_ref().is_none_or(|s| s.len() == job.x.len())
        && job.residual.is_some() == sum.is_some();
    if !sizes_ok {
        return Err(format!(
            "rms_norm sizes do not match {rows} rows of {hidden}"
        ));
    }
    let round = |v: f32| E::from_f32(v).to_f32();
    // The row to normalise, in float32: x, or x + residual (also stored in ``sum``).
    let mut values = vec![0.0f32; hidden];
    for row in 0..rows {
        let span = row * hidden..(row + 1) * hidden;
        let x = &job.x[span.clone()];
        match (job.residual, sum.as_deref_mut()) {
            (Some(residual), Some(sum)) => {
                let pairs = x.iter().zip(&residual[span.clone()]);
                for ((v, s), (a, b)) in values.iter_mut().zip(&mut sum[span.clone()]).zip(pairs) {
                    *s = E::from_f32(a.to_f32() + b.to_f32());
                    *v = s.to_f32();
                }
            }
            _ => values.iter_mut().zip(x).for_each(|(v, a)| *v = a.to_f32()),
        }
        let inverse = 1.0 / (squares(&values) / hidden as f32 + job.eps).sqrt();
        for ((o, v), w) in normed[span].iter_mut().zip(&values).zip(job.weight) {
            *o = E::from_f32(w.to_f32() * round(v * inverse));
        }
    }
    Ok(())
}

/// ``sum(v^2)`` in eight independent lanes (a sequential sum is a chain of dependent adds).
fn squares(values: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let chunks = values.chunks_exact(8);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, v) in lanes.iter_mut().zip(chunk) {
            *lane += v * v;
        }
    }
    let mut total = lanes.iter().sum::<f32>();
    for v in rest {
        total += v * v;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The float64 RMSNorm of each row, for comparison.
    fn reference(x: &[f32], weight: &[f32], eps: f64) -> Vec<f64> {
        let hidden = weight.len();
        let mut out = Vec::new();
        for row in x.chunks(hidden) {
            let mean = row.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / hidden as f64;
            let inverse = 1.0 / (mean + eps).sqrt();
            out.extend(
                row.iter()
                    .zip(weight)
                    .map(|(v, w)| f64::from(*w) * f64::from(*v) * inverse),
            );
        }
        out
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        // A fixed pseudo-random sequence (no rand crate here): a 32-bit LCG scaled to [-2, 2).
        let mut state = seed;
        (0..n)
            .map(|_| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (state >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
            })
            .collect()
    }

    #[test]
    fn normalises_each_row_and_adds_the_residual_first() {
        let (rows, hidden) = (3, 77);
        let (x, residual, weight) = (
            values(rows * hidden, 1),
            values(rows * hidden, 2),
            values(hidden, 3),
        );
        let mut normed = vec![0.0; rows * hidden];
        let mut sum = vec![0.0; rows * hidden];
        let job = RmsNorm {
            x: &x,
            residual: Some(&residual),
            weight: &weight,
            hidden,
            eps: 1e-5,
        };
        rms_norm(&job, &mut normed, Some(&mut sum)).unwrap();
        let added: Vec<f32> = x.iter().zip(&residual).map(|(a, b)| a + b).collect();
        assert_eq!(sum, added);
        for (got, want) in normed.iter().zip(reference(&added, &weight, 1e-5)) {
            assert!(
                (f64::from(*got) - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{got} vs {want}"
            );
        }
        let plain = RmsNorm {
            x: &x,
            residual: None,
            weight: &weight,
            hidden,
            eps: 1e-5,
        };
        rms_norm(&plain, &mut normed, None).unwrap();
        for (got, want) in normed.iter().zip(reference(&x, &weight, 1e-5)) {
            assert!(
                (f64::from(*got) - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{got} vs {want}"
            );
        }
    }

    #[test]
    fn refuses_sizes_that_do_not_match() {
        let (x, weight) = (values(10, 1), values(4, 2));
        let mut normed = vec![0.0; 10];
        let job = RmsNorm {
            x: &x,
            residual: None,
            weight: &weight,
            hidden: 4,
            eps: 1e-5,
        };
        assert!(rms_norm(&job, &mut normed, None).is_err()); // 10 is not a multiple of 4
        let residual = values(10, 3);
        let job = RmsNorm {
            x: &x,
            residual: Some(&residual),
            weight: &weight,
            hidden: 5,
            eps: 1e-5,
        };
        assert!(rms_norm(&job, &mut normed, None).is_err()); // a residual needs a sum output
    }
}
