//! A whole stack of pre-norm decoder layers (Llama-style: RMSNorm, GQA attention with
//! rotary embedding, RMSNorm, SwiGLU MLP) for one step of short query rows, in one call.
//!
//! Why: at batch-1 decode the crate's kernels are tens of microseconds each, and the torch
//! and Python glue between them (module calls, views, splits, the SiLU, about forty calls a
//! layer) cost about as much again. Here the same kernels run back to back: the norm
//! (``norm.rs``), the quantised projections (``q4_linear`` / ``q8_linear`` with the same
//! settings the per-call path uses), the rotary embedding with the cache write
//! (``rotary.rs``) and the paged attention (``attention.rs``). Only the SiLU-and-multiply is
//! computed here rather than by torch, so results agree with the per-call path to float32
//! rounding of that one activation.
//!
//! Float32 only. The caller (``powertrain_cpu_kernels.decoder``) checks every shape, dtype
//! and pointer once when it builds the layer table and every step's tensors before a call.

use crate::{
    paged_attention, q4_linear, q8_linear, rms_norm, rotary_store, PagedAttention, RmsNorm,
    RotaryStore, Scales, Threads,
};

/// Entries per projection in the layer table: format (4 or 8), group, rows ``n``, columns
/// ``k``, codes, scales, offsets (0: none), bias (0: none), ``gemm_min_rows``, whether
/// few-row activations may be rounded to 16 bits (``int16_max_rows``), whether the scales and offsets
/// are float16 (else float32).
const PROJECTION: usize = 11;
/// Entries per layer: the two norm weights, the key and value caches, four projections
/// (qkv, o, gate/up, down), heads, kv heads, head dim, sliding window (0: none), then the
/// norm epsilon and the attention scale as float32 bits.
pub const LAYER_ENTRIES: usize = 4 + 4 * PROJECTION + 6;

/// One quantised projection, read from the table.
struct Projection {
    q4: bool,
    group: usize,
    n: usize,
    k: usize,
    codes: usize,
    scales: usize,
    offsets: usize,
    bias: usize,
    gemm_min_rows: usize,
    int16: bool,
    half_scales: bool,
}

impl Projection {
    fn read(entries: &[u64]) -> Projection {
        let at = |i: usize| entries[i] as usize;
        Projection {
            q4: at(0) == 4,
            group: at(1),
            n: at(2),
            k: at(3),
            codes: at(4),
            scales: at(5),
            offsets: at(6),
            bias: at(7),
            gemm_min_rows: at(8),
            int16: at(9) != 0,
            half_scales: at(10) != 0,
        }
    }

    /// ``out [m, n] = x [m, k] @ W^T (+ bias)``.
    unsafe fn apply(&self, x: &[f32], out: &mut [f32], m: usize, on: Threads) {
        let (n, k, group) = (self.n, self.k, self.group);
        let groups = k / group;
        let scales = Scales::view(self.scales, self.offsets, n * groups, self.half_scales);
        if self.q4 {
            let codes = view::<u8>(self.codes, n * k / 2);
            q4_linear(
                x,
                codes,
                scales,
                out,
                m,
                n,
                k,
                self.gemm_min_rows,
                self.int16,
                on,
            );
        } else {
            let codes = view::<i8>(self.codes, n * k);
            q8_linear(
                x,
                codes,
                scales,
                out,
                m,
                n,
                k,
                group,
                self.gemm_min_rows,
                self.int16,
                on,
            );
        }
        if self.bias != 0 {
            let bias = view::<f32>(self.bias, n);
            for row in out.chunks_exact_mut(n) {
                row.iter_mut().zip(bias).for_each(|(o, b)| *o += b);
            }
        }
    }
}

/// One layer, read from the table.
struct Layer {
    input_norm: usize,
    post_norm: usize,
    key_cache: usize,
    value_cache: usize,
    qkv: Projection,
    o: Projection,
    gate_up: Projection,
    down: Projection,
    heads: usize,
    kv_heads: usize,
    dim: usize,
    window: usize,
    eps: f32,
    scale: f32,
}

impl Layer {
    fn read(entries: &[u64]) -> Layer {
        let at = |i: usize| entries[i] as usize;
        let projection = |i: usize| Projection::read(&entries[4 + i * PROJECTION..]);
        let rest = 4 + 4 * PROJECTION;
        Layer {
            input_norm: at(0),
            post_norm: at(1),
            key_cache: at(2),
            value_cache: at(3),
            qkv: projection(0),
            o: projection(1),
            gate_up: projection(2),
            down: projection(3),
            heads: at(rest),
            kv_heads: at(rest + 1),
            dim: at(rest + 2),
            window: at(rest + 3),
            eps: f32::from_bits(entries[rest + 4] as u32),
            scale: f32::from_bits(entries[rest + 5] as u32),
        }
    }
}

/// A step's rows and where the attention reads them (the ``AttentionMetadata`` of the step,
/// as ``paged_attention`` and ``rotary_store`` take it).
pub struct Step<'a> {
    /// Rows of the step (query tokens, all of them stored).
    pub tokens: usize,
    pub hidden: usize,
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub half: usize,
    pub slots: &'a [i64],
    pub block_tables: &'a [i32],
    pub query_start: &'a [i32],
    pub seq_lens: &'a [i32],
    pub rows: &'a [i64],
    pub max_blocks: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    /// Where the projections run, and where the attention runs (``paged_attention`` keeps
    /// small steps on the calling thread either way).
    pub threads: Threads,
    pub attention_threads: Threads,
}

unsafe fn view<'a, T>(ptr: usize, len: usize) -> &'a [T] {
    std::slice::from_raw_parts(ptr as *const T, len)
}

unsafe fn view_mut<'a, T>(ptr: usize, len: usize) -> &'a mut [T] {
    std::slice::from_raw_parts_mut(ptr as *mut T, len)
}

/// ``silu(gate) * up`` for ``gate_up [m, 2 * width]`` (gate then up in each row) into
/// ``out [m, width]``; ``silu(g) = g / (1 + exp(-g))``, as torch computes it.
fn silu_and_mul(gate_up: &[f32], out: &mut [f32], width: usize) {
    for (row, out) in gate_up
        .chunks_exact(2 * width)
        .zip(out.chunks_exact_mut(width))
    {
        let (gate, up) = row.split_at(width);
        for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    }
}

/// Runs every layer of ``table`` (``LAYER_ENTRIES`` each) on ``step``: ``x [tokens, hidden]``
/// in; the last layer's MLP output into ``out`` and the residual stream it has not been
/// added to into ``residual`` (the model's final norm adds them), as the layers would.
///
/// # Safety
/// Every address in ``table`` must hold what its entry says (the caller's checks), and the
/// step's slices and caches must match the shapes in it.
pub unsafe fn decoder_stack(
    table: &[u64],
    step: &Step,
    x: &[f32],
    out: &mut [f32],
    residual: &mut [f32],
) -> Result<(), String> {
    let (m, hidden) = (step.tokens, step.hidden);
    if table.is_empty() || !table.len().is_multiple_of(LAYER_ENTRIES) {
        return Err(format!("a layer table of {} entries", table.len()));
    }
    if x.len() != m * hidden || out.len() != m * hidden || residual.len() != m * hidden {
        return Err(format!("x, out and residual must be {m} x {hidden}"));
    }
    let mut normed = vec![0.0f32; m * hidden];
    let mut sum = vec![0.0f32; m * hidden];
    let mut projected = vec![0.0f32; m * hidden];
    // Per-layer buffers, sized by each layer (the same for every layer of a Llama stack, so
    // allocated once); every element is written before it is read.
    let (mut qkv, mut query, mut key, mut value, mut rotated, mut gate_up, mut activated) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    // The layer's input: the step's x, then each layer's MLP output.
    let mut current = x.to_vec();
    let mut first = true;
    for entries in table.chunks_exact(LAYER_ENTRIES) {
        let layer = Layer::read(entries);
        let (q_size, kv_size) = (layer.heads * layer.dim, layer.kv_heads * layer.dim);
        let width = layer.gate_up.n / 2;
        let shapes_fit = layer.qkv.n == q_size + 2 * kv_size
            && layer.qkv.k == hidden
            && (layer.o.n, layer.o.k) == (hidden, q_size)
            && (layer.gate_up.n, layer.gate_up.k) == (2 * width, hidden)
            && (layer.down.n, layer.down.k) == (hidden, width);
        if !shapes_fit {
            return Err("a layer's projections do not fit its heads and hidden size".into());
        }
        // Input norm; the first layer has no residual yet (its input is the residual).
        let input_norm = view::<f32>(layer.input_norm, hidden);
        add_and_norm(
            &current,
            first,
            residual,
            &mut sum,
            input_norm,
            layer.eps,
            &mut normed,
            hidden,
        )?;
        first = false;

        qkv.resize(m * layer.qkv.n, 0.0);
        layer.qkv.apply(&normed, &mut qkv, m, step.threads);
        query.resize(m * q_size, 0.0);
        key.resize(m * kv_size, 0.0);
        value.resize(m * kv_size, 0.0);
        for (t, row) in qkv.chunks_exact(layer.qkv.n).enumerate() {
            query[t * q_size..(t + 1) * q_size].copy_from_slice(&row[..q_size]);
            key[t * kv_size..(t + 1) * kv_size].copy_from_slice(&row[q_size..q_size + kv_size]);
            value[t * kv_size..(t + 1) * kv_size].copy_from_slice(&row[q_size + kv_size..]);
        }
        let cache_len = step.num_blocks * step.block_size * kv_size;
        let (key_cache, value_cache) = (
            view_mut::<f32>(layer.key_cache, cache_len),
            view_mut::<f32>(layer.value_cache, cache_len),
        );
        let rotation = RotaryStore {
            query: &query,
            key: &key,
            value: &value,
            cos: step.cos,
            sin: step.sin,
            slots: step.slots,
            heads: layer.heads,
            kv_heads: layer.kv_heads,
            dim: layer.dim,
            half: step.half,
            stored: m,
        };
        rotated.resize(m * q_size, 0.0);
        rotary_store(&rotation, &mut rotated, key_cache, value_cache)?;
        let attention = PagedAttention {
            query: &rotated,
            key_cache,
            value_cache,
            block_tables: step.block_tables,
            query_start: step.query_start,
            seq_lens: step.seq_lens,
            rows: step.rows,
            heads: layer.heads,
            kv_heads: layer.kv_heads,
            dim: layer.dim,
            block_size: step.block_size,
            max_blocks: step.max_blocks,
            scale: layer.scale,
            window: layer.window,
            threads: step.attention_threads,
        };
        // The query buffer is free again: the attention writes its output there.
        paged_attention(&attention, &mut query)?;
        layer.o.apply(&query, &mut projected, m, step.threads);

        let post_norm = view::<f32>(layer.post_norm, hidden);
        add_and_norm(
            &projected,
            false,
            residual,
            &mut sum,
            post_norm,
            layer.eps,
            &mut normed,
            hidden,
        )?;
        gate_up.resize(m * 2 * width, 0.0);
        layer.gate_up.apply(&normed, &mut gate_up, m, step.threads);
        activated.resize(m * width, 0.0);
        silu_and_mul(&gate_up, &mut activated, width);
        layer.down.apply(&activated, &mut current, m, step.threads);
    }
    out.copy_from_slice(&current);
    Ok(())
}

/// ``normed = norm(x + residual)`` with ``residual`` updated to the sum; with ``first``, the
/// norm of ``x`` alone and ``residual = x``.
#[allow(clippy::too_many_arguments)]
fn add_and_norm(
    x: &[f32],
    first: bool,
    residual: &mut [f32],
    sum: &mut [f32],
    weight: &[f32],
    eps: f32,
    normed: &mut [f32],
    hidden: usize,
) -> Result<(), String> {
    if first {
        residual.copy_from_slice(x);
        let job = RmsNorm {
            x,
            residual: None,
            weight,
            hidden,
            eps,
        };
        return rms_norm(&job, normed, None);
    }
    let job = RmsNorm {
        x,
        residual: Some(residual),
        weight,
        hidden,
        eps,
    };
    rms_norm(&job, normed, Some(sum))?;
    residual.copy_from_slice(sum);
    Ok(())
}
