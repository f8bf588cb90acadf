//! The Python face of the crate (module ``powertrain_cpu_kernels._native``).
//!
//! Tensors cross as raw addresses (``tensor.data_ptr()``) plus their sizes; the Python layer
//! (``quantized_linear.py``) checks every dtype, shape and contiguity first, because nothing
//! here can. The GIL is released while a kernel runs.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::{Bf16, Scales};

/// # Safety
/// ``ptr`` must address ``len`` initialised ``T`` (the Python caller's checks).
unsafe fn view<'a, T>(ptr: usize, len: usize) -> &'a [T] {
    if len == 0 {
        return &[];
    }
    std::slice::from_raw_parts(ptr as *const T, len)
}

unsafe fn view_mut<'a, T>(ptr: usize, len: usize) -> &'a mut [T] {
    if len == 0 {
        return &mut [];
    }
    std::slice::from_raw_parts_mut(ptr as *mut T, len)
}

fn check_group(group: usize) -> PyResult<()> {
    if group == 16 || group == 32 {
        Ok(())
    } else {
        Err(PyValueError::new_err(format!(
            "q8 group must be 16 or 32, got {group}"
        )))
    }
}

/// ``out [m, n] = x [m, k] @ W^T`` for a ``q4`` weight; ``offsets`` 0 means none, and
/// ``half_scales`` says the scales and offsets are float16 (else float32). From
/// ``gemm_min_rows`` rows of ``x`` on, panels of the weight are dequantised and multiplied;
/// ``int16_activations`` lets products of up to ``int16_max_rows()`` rows round activations
/// to 16 bits.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn q4_linear(
    py: Python<'_>,
    x: usize,
    codes: usize,
    scales: usize,
    offsets: usize,
    half_scales: bool,
    out: usize,
    m: usize,
    n: usize,
    k: usize,
    gemm_min_rows: usize,
    int16_activations: bool,
    openmp_threads: usize,
) {
    py.detach(|| unsafe {
        let scales = Scales::view(scales, offsets, n * (k / 32), half_scales);
        crate::q4_linear(
            view(x, m * k),
            view(codes, n * (k / 2)),
            scales,
            view_mut(out, m * n),
            m,
            n,
            k,
            gemm_min_rows,
            int16_activations,
            crate::Threads::pool_or_openmp(openmp_threads),
        )
    })
}

/// ``out [m, n] = x [m, k] @ W^T`` for a ``q8`` weight with ``group``-column groups (panels
/// from ``gemm_min_rows`` rows on, and 16-bit activations for 32-column groups, as
/// ``q4_linear``).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn q8_linear(
    py: Python<'_>,
    x: usize,
    codes: usize,
    scales: usize,
    offsets: usize,
    half_scales: bool,
    out: usize,
    m: usize,
    n: usize,
    k: usize,
    group: usize,
    gemm_min_rows: usize,
    int16_activations: bool,
    openmp_threads: usize,
) -> PyResult<()> {
    check_group(group)?;
    py.detach(|| unsafe {
        let scales = Scales::view(scales, offsets, n * (k / group), half_scales);
        crate::q8_linear(
            view(x, m * k),
            view::<i8>(codes, n * k),
            scales,
            view_mut(out, m * n),
            m,
            n,
            k,
            group,
            gemm_min_rows,
            int16_activations,
            crate::Threads::pool_or_openmp(openmp_threads),
        )
    });
    Ok(())
}

/// ``out [m, n] (float32) = x [m, k] (bfloat16) @ W^T`` for a ``q4`` weight on AMX tiles
/// (``m`` at most ``AMX_MAX_ROWS``; only where ``amx()``).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn q4_linear_amx(
    py: Python<'_>,
    x: usize,
    codes: usize,
    scales: usize,
    offsets: usize,
    half_scales: bool,
    out: usize,
    m: usize,
    n: usize,
    k: usize,
    openmp_threads: usize,
) -> PyResult<()> {
    check_amx(m, k)?;
    py.detach(|| unsafe {
        let scales = Scales::view(scales, offsets, n * (k / 32), half_scales);
        crate::q4_linear_amx(
            view::<Bf16>(x, m * k),
            view(codes, n * (k / 2)),
            scales,
            view_mut(out, m * n),
            m,
            n,
            k,
            crate::Threads::pool_or_openmp(openmp_threads),
        )
    });
    Ok(())
}

/// ``q4_linear_amx`` for a ``q8`` weight with ``group``-column groups.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn q8_linear_amx(
    py: Python<'_>,
    x: usize,
    codes: usize,
    scales: usize,
    offsets: usize,
    half_scales: bool,
    out: usize,
    m: usize,
    n: usize,
    k: usize,
    group: usize,
    openmp_threads: usize,
) -> PyResult<()> {
    check_group(group)?;
    check_amx(m, k)?;
    py.detach(|| unsafe {
        let scales = Scales::view(scales, offsets, n * (k / group), half_scales);
        crate::q8_linear_amx(
            view::<Bf16>(x, m * k),
            view::<i8>(codes, n * k),
            scales,
            view_mut(out, m * n),
            m,
            n,
            k,
            group,
            crate::Threads::pool_or_openmp(openmp_threads),
        )
    });
    Ok(())
}

fn check_amx(m: usize, k: usize) -> PyResult<()> {
    if !crate::amx() {
        return Err(PyValueError::new_err(
            "AMX bfloat16 tiles are not available on this CPU (check amx() first)",
        ));
    }
    if m > crate::AMX_MAX_ROWS || !k.is_multiple_of(32) {
        return Err(PyValueError::new_err(format!(
            "the AMX product takes at most {} rows and a multiple of 32 columns, got {m} x {k}",
            crate::AMX_MAX_ROWS
        )));
    }
    Ok(())
}

/// Whether the AMX products run here (AMX bfloat16 tiles granted to this process).
#[pyfunction]
fn amx() -> bool {
    crate::amx()
}

/// The dense ``q4`` weight into ``out [n, k]`` (bit-equal to ``QuantizedWeight.dequantize()``),
/// float32, or bfloat16 (``out_bf16``: that rounded to nearest even).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn q4_dequantize(
    py: Python<'_>,
    codes: usize,
    scales: usize,
    offsets: usize,
    half_scales: bool,
    out: usize,
    out_bf16: bool,
    n: usize,
    k: usize,
    openmp_threads: usize,
) {
    py.detach(|| unsafe {
        let scales = Scales::view(scales, offsets, n * (k / 32), half_scales);
        let codes = view(codes, n * (k / 2));
        let on = crate::Threads::pool_or_openmp(openmp_threads);
        if out_bf16 {
            crate::q4_dequantize(codes, scales, view_mut::<Bf16>(out, n * k), n, k, on)
        } else {
            crate::q4_dequantize(codes, scales, view_mut::<f32>(out, n * k), n, k, on)
        }
    })
}

/// The dense ``q8`` weight into ``out [n, k]``, float32 or bfloat16 (``out_bf16``).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn q8_dequantize(
    py: Python<'_>,
    codes: usize,
    scales: usize,
    offsets: usize,
    half_scales: bool,
    out: usize,
    out_bf16: bool,
    n: usize,
    k: usize,
    group: usize,
    openmp_threads: usize,
) -> PyResult<()> {
    check_group(group)?;
    py.detach(|| unsafe {
        let scales = Scales::view(scales, offsets, n * (k / group), half_scales);
        let codes = view::<i8>(codes, n * k);
        let on = crate::Threads::pool_or_openmp(openmp_threads);
        if out_bf16 {
            crate::q8_dequantize(codes, scales, view_mut::<Bf16>(out, n * k), n, k, group, on)
        } else {
            crate::q8_dequantize(codes, scales, view_mut::<f32>(out, n * k), n, k, group, on)
        }
    });
    Ok(())
}

/// Attention of the short rows ``rows`` of a paged batch into ``out`` (see ``attention.rs``);
/// ``bf16``: every tensor holds bfloat16, else float32.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn paged_attention(
    py: Python<'_>,
    query: usize,
    key_cache: usize,
    value_cache: usize,
    block_tables: usize,
    query_start: usize,
    seq_lens: usize,
    rows: usize,
    out: usize,
    tokens: usize,
    heads: usize,
    kv_heads: usize,
    dim: usize,
    num_blocks: usize,
    block_size: usize,
    batch: usize,
    max_blocks: usize,
    num_rows: usize,
    scale: f32,
    window: usize,
    pool: bool,
    openmp_threads: usize,
    bf16: bool,
) -> PyResult<()> {
    /// The call on elements of type ``E``.
    unsafe fn run<E: crate::Element>(
        pointers: [usize; 8],
        shape: [usize; 10],
        scale: f32,
        threads: crate::Threads,
    ) -> Result<(), String> {
        let [query, key_cache, value_cache, block_tables, query_start, seq_lens, rows, out] =
            pointers;
        let [tokens, heads, kv_heads, dim, num_blocks, block_size, batch, max_blocks, num_rows, window] =
            shape;
        let cache = num_blocks * block_size * kv_heads * dim;
        let job = crate::PagedAttention::<E> {
            query: view(query, tokens * heads * dim),
            key_cache: view(key_cache, cache),
            value_cache: view(value_cache, cache),
            block_tables: view(block_tables, batch * max_blocks),
            query_start: view(query_start, batch + 1),
            seq_lens: view(seq_lens, batch),
            rows: view(rows, num_rows),
            heads,
            kv_heads,
            dim,
            block_size,
            max_blocks,
            scale,
            window,
            threads,
        };
        crate::paged_attention(&job, view_mut(out, tokens * heads * dim))
    }
    let pointers = [
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start,
        seq_lens,
        rows,
        out,
    ];
    let shape = [
        tokens, heads, kv_heads, dim, num_blocks, block_size, batch, max_blocks, num_rows, window,
    ];
    let threads = match crate::Threads::pool_or_openmp(openmp_threads) {
        crate::Threads::Pool if !pool => crate::Threads::Caller,
        threads => threads,
    };
    py.detach(|| unsafe {
        if bf16 {
            run::<Bf16>(pointers, shape, scale, threads)
        } else {
            run::<f32>(pointers, shape, scale, threads)
        }
    })
    .map_err(PyValueError::new_err)
}

/// Rotate queries into ``rotated`` and write rotated keys and values to their cache slots
/// (see ``rotary.rs``).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn rotary_store(
    py: Python<'_>,
    query: usize,
    key: usize,
    value: usize,
    cos: usize,
    sin: usize,
    slots: usize,
    rotated: usize,
    key_cache: usize,
    value_cache: usize,
    tokens: usize,
    stored: usize,
    heads: usize,
    kv_heads: usize,
    dim: usize,
    half: usize,
    num_slots: usize,
    bf16: bool,
) -> PyResult<()> {
    /// The call on elements of type ``E``.
    unsafe fn run<E: crate::Element>(
        pointers: [usize; 9],
        shape: [usize; 7],
    ) -> Result<(), String> {
        let [query, key, value, cos, sin, slots, rotated, key_cache, value_cache] = pointers;
        let [tokens, stored, heads, kv_heads, dim, half, num_slots] = shape;
        let job = crate::RotaryStore::<E> {
            query: view(query, tokens * heads * dim),
            key: view(key, stored * kv_heads * dim),
            value: view(value, stored * kv_heads * dim),
            cos: view(cos, tokens * half),
            sin: view(sin, tokens * half),
            slots: view(slots, stored),
            heads,
            kv_heads,
            dim,
            half,
            stored,
        };
        let cache = num_slots * kv_heads * dim;
        crate::rotary_store(
            &job,
            view_mut(rotated, tokens * heads * dim),
            view_mut(key_cache, cache),
            view_mut(value_cache, cache),
        )
    }
    let pointers = [
        query,
        key,
        value,
        cos,
        sin,
        slots,
        rotated,
        key_cache,
        value_cache,
    ];
    let shape = [tokens, stored, heads, kv_heads, dim, half, num_slots];
    py.detach(|| unsafe {
        if bf16 {
            run::<Bf16>(pointers, shape)
        } else {
            run::<f32>(pointers, shape)
        }
    })
    .map_err(PyValueError::new_err)
}

/// ``layers.norm.RMSNorm`` of ``x [rows, hidden]`` into ``normed``; with a ``residual``
/// (0: none) it is added first and the sum written to ``sum`` (see ``norm.rs``).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn rms_norm(
    x: usize,
    residual: usize,
    weight: usize,
    normed: usize,
    sum: usize,
    rows: usize,
    hidden: usize,
    eps: f32,
    bf16: bool,
) -> PyResult<()> {
    /// The call on elements of type ``E``.
    unsafe fn run<E: crate::Element>(
        pointers: [usize; 5],
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<(), String> {
        let [x, residual, weight, normed, sum] = pointers;
        let len = rows * hidden;
        let job = crate::RmsNorm::<E> {
            x: view(x, len),
            residual: (residual != 0).then(|| view::<E>(residual, len)),
            weight: view(weight, hidden),
            hidden,
            eps,
        };
        let sum = (sum != 0).then(|| view_mut(sum, len));
        crate::rms_norm(&job, view_mut(normed, len), sum)
    }
    let pointers = [x, residual, weight, normed, sum];
    unsafe {
        if bf16 {
            run::<Bf16>(pointers, rows, hidden, eps)
        } else {
            run::<f32>(pointers, rows, hidden, eps)
        }
    }
    .map_err(PyValueError::new_err)
}

/// Every layer of a pre-norm decoder stack for one step of short rows (see ``decoder.rs``):
/// ``table`` holds ``layers * LAYER_ENTRIES`` u64 entries; ``x``, ``out`` and ``residual``
/// are ``[tokens, hidden]`` float32; the step's tensors are ``rotary_store``'s and
/// ``paged_attention``'s.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn decoder_stack(
    py: Python<'_>,
    table: usize,
    layers: usize,
    x: usize,
    out: usize,
    residual: usize,
    tokens: usize,
    hidden: usize,
    cos: usize,
    sin: usize,
    half: usize,
    slots: usize,
    block_tables: usize,
    query_start: usize,
    seq_lens: usize,
    rows: usize,
    batch: usize,
    max_blocks: usize,
    num_rows: usize,
    num_blocks: usize,
    block_size: usize,
    attention_pool: bool,
    openmp_threads: usize,
) -> PyResult<()> {
    let threads = crate::Threads::pool_or_openmp(openmp_threads);
    let attention_threads = match threads {
        crate::Threads::Pool if !attention_pool => crate::Threads::Caller,
        threads => threads,
    };
    py.detach(|| unsafe {
        let step = crate::DecoderStep {
            tokens,
            hidden,
            cos: view(cos, tokens * half),
            sin: view(sin, tokens * half),
            half,
            slots: view(slots, tokens),
            block_tables: view(block_tables, batch * max_blocks),
            query_start: view(query_start, batch + 1),
            seq_lens: view(seq_lens, batch),
            rows: view(rows, num_rows),
            max_blocks,
            num_blocks,
            block_size,
            threads,
            attention_threads,
        };
        crate::decoder_stack(
            view(table, layers * crate::DECODER_LAYER_ENTRIES),
            &step,
            view(x, tokens * hidden),
            view_mut(out, tokens * hidden),
            view_mut(residual, tokens * hidden),
        )
    })
    .map_err(PyValueError::new_err)
}

/// Entries per layer in ``decoder_stack``'s table.
#[pyfunction]
fn decoder_layer_entries() -> usize {
    crate::DECODER_LAYER_ENTRIES
}

/// The path calls take now: ``"avx2+fma"`` or ``"scalar"``.
#[pyfunction]
fn kernel_path() -> &'static str {
    crate::kernel_path().name()
}

/// The best path this CPU supports (detected at run time), whatever is forced.
#[pyfunction]
fn best_kernel_path() -> &'static str {
    crate::best_kernel_path().name()
}

/// Force the portable scalar path (``True``), or go back to the best this CPU supports.
#[pyfunction]
fn force_scalar(on: bool) {
    crate::force_scalar(on)
}

/// Worker threads for the kernels from now on (1: the calling thread only).
#[pyfunction]
fn set_threads(py: Python<'_>, threads: usize) {
    py.detach(|| crate::set_threads(threads))
}

/// Run calls that ask for an OpenMP team on the runtime whose ``GOMP_parallel`` is at
/// ``address`` (see ``openmp.rs``; 0: none). The caller vouches for the address: Python
/// takes it from the runtime torch loaded, which stays loaded.
#[pyfunction]
fn set_openmp(address: usize) {
    unsafe { crate::set_openmp(address) }
}

/// Whether an OpenMP runtime was given.
#[pyfunction]
fn openmp_available() -> bool {
    crate::openmp_available()
}

/// The worker threads the kernels use now.
#[pyfunction]
fn threads() -> usize {
    crate::threads_now()
}

/// Whether AVX-512 VNNI integer dot products are in use.
#[pyfunction]
fn vnni() -> bool {
    crate::vnni()
}

/// Switch VNNI off (``True``) or back on where detected.
#[pyfunction]
fn force_no_vnni(on: bool) {
    crate::force_no_vnni(on)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(q4_linear, m)?)?;
    m.add_function(wrap_pyfunction!(rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(q8_linear, m)?)?;
    m.add_function(wrap_pyfunction!(q4_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(q4_linear_amx, m)?)?;
    m.add_function(wrap_pyfunction!(q8_linear_amx, m)?)?;
    m.add_function(wrap_pyfunction!(amx, m)?)?;
    m.add_function(wrap_pyfunction!(q8_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(paged_attention, m)?)?;
    m.add_function(wrap_pyfunction!(rotary_store, m)?)?;
    m.add_function(wrap_pyfunction!(decoder_stack, m)?)?;
    m.add_function(wrap_pyfunction!(decoder_layer_entries, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_path, m)?)?;
    m.add_function(wrap_pyfunction!(best_kernel_path, m)?)?;
    m.add_function(wrap_pyfunction!(force_scalar, m)?)?;
    m.add_function(wrap_pyfunction!(vnni, m)?)?;
    m.add_function(wrap_pyfunction!(force_no_vnni, m)?)?;
    m.add_function(wrap_pyfunction!(set_threads, m)?)?;
    m.add_function(wrap_pyfunction!(threads, m)?)?;
    m.add_function(wrap_pyfunction!(set_openmp, m)?)?;
    m.add_function(wrap_pyfunction!(openmp_available, m)?)?;
    Ok(())
}
