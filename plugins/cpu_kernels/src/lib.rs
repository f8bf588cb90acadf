//! powertrain's CPU weight-only quantised matmul: ``out = x @ W^T`` where ``W`` is kept as
//! integer codes with float32 per-group scales (and offsets), the two layouts of
//! ``powertrain.interfaces.quantized``:
//!
//! - ``q4``: u8 ``[n, k/2]``; per 32-column group 16 bytes, byte ``j`` holds column ``j`` in
//!   its low nibble and column ``j + 16`` in its high nibble.
//! - ``q8``: i8 ``[n, k]``, groups of 16 or 32 columns.
//!
//! ``W[r, c] = scales[r, c / group] * code[r, c] + offsets[r, c / group]``, the scales and
//! offsets float32 or float16 (``Scales``).
//!
//! The dot of one weight row with one activation row is computed per group as
//! ``scale_g * sum(code_j * x_j) + offset_g * sum(x_j)``: the codes are widened to f32 and
//! multiplied by ``x`` directly, the scale is applied once per group, and the per-group sums
//! of ``x`` are computed once per call. Rows of ``x`` are processed in tiles so a group's
//! codes are widened once and reused across the tile; the weight row stays in L1 while all
//! tiles of ``x`` pass over it, so each weight byte is read from memory once per call.
//!
//! Two paths: AVX2+FMA intrinsics on x86_64 CPUs that have them (detected at run time), and
//! a portable scalar path elsewhere (or when forced, for tests). On the AVX2 path, one- and
//! two-row ``q4`` products may round the activations to 16 bits instead (``q4_i16.rs``),
//! with AVX-512 VNNI where the CPU has it. Work is split over the
//! output rows ``n``, on torch's own OpenMP team where the caller asks for it (``openmp.rs``),
//! else on a small pool (``pool.rs``) whose size the caller sets; the calling thread is one
//! of the threads either way.
//!
//! The crate's other kernels, for attention, are in ``attention.rs`` (paged attention for
//! decodes and other short query rows; it shares the pool and the path detection) and
//! ``rotary.rs`` (rotary embedding fused with the cache write), and ``norm.rs`` (RMSNorm
//! with its residual add). ``decoder.rs`` runs them all, layer after layer, for a whole
//! decoder stack in one call.
//!
//! Every function here trusts its caller for the sizes: the slices must hold exactly the
//! elements the shapes say (the Python layer checks every shape, dtype and contiguity).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

use half::f16;
use half::slice::HalfFloatSliceExt;

pub use attention::{paged_attention, Bf16, Element, PagedAttention};
pub use decoder::{decoder_stack, Step as DecoderStep, LAYER_ENTRIES as DECODER_LAYER_ENTRIES};
pub use norm::{rms_norm, RmsNorm};
pub use openmp::{openmp_available, set_openmp};
use pool::Pool;
pub use rotary::{rotary_store, RotaryStore};

#[cfg(target_arch = "x86_64")]
mod amx;
mod attention;
#[cfg(target_arch = "x86_64")]
mod attention_x86;
mod decoder;
mod gemm;
#[cfg(target_arch = "x86_64")]
mod gemm_x86;
mod norm;
mod openmp;
mod pool;
mod q4;
#[cfg(target_arch = "x86_64")]
mod q4_i16;
mod q8;
#[cfg(target_arch = "x86_64")]
mod q8_i16;
mod rotary;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(feature = "python")]
mod python;

/// Which implementation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelPath {
    Avx2Fma,
    Scalar,
}

impl KernelPath {
    pub fn name(self) -> &'static str {
        match self {
            KernelPath::Avx2Fma => "avx2+fma",
            KernelPath::Scalar => "scalar",
        }
    }
}

/// The environment variable that forces the scalar path (read once, at the first call).
pub const FORCE_SCALAR_ENV: &str = "POWERTRAIN_CPU_KERNELS_SCALAR";

static FORCE_SCALAR: AtomicBool = AtomicBool::new(false);

fn detected() -> KernelPath {
    static DETECTED: OnceLock<KernelPath> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        let forced = std::env::var(FORCE_SCALAR_ENV).is_ok_and(|v| !v.is_empty() && v != "0");
        if forced {
            FORCE_SCALAR.store(true, Ordering::Relaxed);
        }
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                return KernelPath::Avx2Fma;
            }
        }
        KernelPath::Scalar
    })
}

/// The path the next call takes: the best the CPU supports, unless the scalar path is forced.
pub fn kernel_path() -> KernelPath {
    let best = detected();
    if FORCE_SCALAR.load(Ordering::Relaxed) {
        KernelPath::Scalar
    } else {
        best
    }
}

static NO_VNNI: AtomicBool = AtomicBool::new(false);

/// Whether AVX-512 (F, BW, VL) with VNNI integer dot products is used (detected, unless
/// switched off).
pub fn vnni() -> bool {
    static DETECTED: OnceLock<bool> = OnceLock::new();
    let detected = *DETECTED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512f")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    });
    detected && !NO_VNNI.load(Ordering::Relaxed)
}

/// Switch VNNI off (``true``: AVX2's ``vpmaddwd`` instead) or back on where detected.
pub fn force_no_vnni(on: bool) {
    NO_VNNI.store(on, Ordering::Relaxed);
}

/// Whether ``q4_linear_amx`` / ``q8_linear_amx`` can run here: AMX bfloat16 tiles that
/// Linux granted this process (``amx.rs``), and the scalar path not forced.
pub fn amx() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        kernel_path() == KernelPath::Avx2Fma && amx::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Rows of bfloat16 ``x`` one AMX call takes.
pub const AMX_MAX_ROWS: usize = 64;

/// ``out [m, n] = x [m, k] @ W^T`` in float32 for bfloat16 ``x`` (at most ``AMX_MAX_ROWS``
/// rows) and a ``q4`` weight rounded to bfloat16, on AMX tiles (``amx.rs``). Panics where
/// ``amx()`` is false.
#[allow(clippy::too_many_arguments)]
pub fn q4_linear_amx(
    x: &[Bf16],
    codes: &[u8],
    scales: Scales,
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    on: Threads,
) {
    assert!(amx(), "AMX bfloat16 tiles are not available on this CPU");
    if m == 0 || n == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    unsafe {
        amx::q4_linear(
            bf16_bits(x),
            codes,
            scales,
            OutPtr(out.as_mut_ptr()),
            m,
            n,
            k,
            on,
        )
    }
}

/// ``q4_linear_amx`` for a ``q8`` weight with ``group``-column groups (16 or 32).
#[allow(clippy::too_many_arguments)]
pub fn q8_linear_amx(
    x: &[Bf16],
    codes: &[i8],
    scales: Scales,
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    group: usize,
    on: Threads,
) {
    assert!(amx(), "AMX bfloat16 tiles are not available on this CPU");
    assert!(
        group == 16 || group == 32,
        "q8 group must be 16 or 32, got {group}"
    );
    if m == 0 || n == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    unsafe {
        amx::q8_linear(
            bf16_bits(x),
            codes,
            scales,
            OutPtr(out.as_mut_ptr()),
            m,
            n,
            k,
            group,
            on,
        )
    }
}

#[cfg(target_arch = "x86_64")]
fn bf16_bits(x: &[Bf16]) -> &[u16] {
    // SAFETY: Bf16 is a transparent u16.
    unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u16, x.len()) }
}

/// The best path this CPU supports, whatever is forced.
pub fn best_kernel_path() -> KernelPath {
    detected()
}

/// Force the portable scalar path (``true``) or go back to the best the CPU supports.
pub fn force_scalar(on: bool) {
    detected(); // read the environment first, so it cannot override this later
    FORCE_SCALAR.store(on, Ordering::Relaxed);
}

// ---------------------------------------------------------------------------------------
// Threads

static POOL: RwLock<Option<Arc<Pool>>> = RwLock::new(None);

/// Use ``threads`` threads from now on, the calling one included (1: no pool).
pub fn set_threads(threads: usize) {
    let threads = threads.max(1);
    if threads_now() == threads {
        return;
    }
    let pool = (threads > 1).then(|| Arc::new(Pool::new(threads)));
    let old = std::mem::replace(&mut *POOL.write().unwrap_or_else(|e| e.into_inner()), pool);
    drop(old); // joins the old workers (a call still using it holds its own Arc)
}

/// The threads calls use (1 until ``set_threads`` says otherwise).
pub fn threads_now() -> usize {
    POOL.read()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .map_or(1, |p| p.threads())
}

/// Where a call's chunks run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Threads {
    /// All on the calling thread.
    Caller,
    /// On this package's pool (``set_threads``).
    Pool,
    /// On an OpenMP team of this many threads of torch's runtime (``openmp.rs``); on the
    /// calling thread alone when no runtime was given.
    OpenMp(usize),
}

impl Threads {
    /// ``OpenMp(openmp_threads)`` for a team of two or more, else ``Pool``.
    pub fn pool_or_openmp(openmp_threads: usize) -> Threads {
        if openmp_threads > 1 {
            Threads::OpenMp(openmp_threads)
        } else {
            Threads::Pool
        }
    }
}

/// Run ``work(r0, r1)`` over ``0..n`` split into chunks of at least ``min_rows`` rows, on
/// the threads ``on`` says.
fn for_row_chunks_on(on: Threads, n: usize, min_rows: usize, work: impl Fn(usize, usize) + Sync) {
    let threads = match on {
        _ if n <= min_rows => 1,
        Threads::Caller => 1,
        Threads::Pool => threads_now(),
        Threads::OpenMp(threads) => threads,
    };
    if threads <= 1 {
        work(0, n);
        return;
    }
    // About four chunks per thread evens out uneven progress, without chunks so small
    // that scheduling costs more than the rows.
    let chunk = n.div_ceil(threads * 4).max(min_rows);
    let chunks = n.div_ceil(chunk);
    let run = |i: usize| work(i * chunk, ((i + 1) * chunk).min(n));
    match on {
        Threads::OpenMp(_) if openmp::run(threads, chunks, &run) => {}
        Threads::OpenMp(_) => work(0, n),
        _ => match POOL.read().unwrap_or_else(|e| e.into_inner()).clone() {
            Some(pool) => pool.run(chunks, &run),
            None => work(0, n),
        },
    }
}

/// A raw output pointer that chunks running on different threads write disjoint parts of
/// (float32, or bfloat16 for a dense weight dequantised for torch's bfloat16 matmul).
#[derive(Clone, Copy)]
pub(crate) struct OutPtr<E = f32>(pub(crate) *mut E);
unsafe impl<E> Send for OutPtr<E> {}
unsafe impl<E> Sync for OutPtr<E> {}

impl<E> OutPtr<E> {
    /// ``count`` elements further on.
    ///
    /// # Safety
    /// The result must stay within the output.
    pub(crate) unsafe fn skip(self, count: usize) -> OutPtr<E> {
        OutPtr(self.0.add(count))
    }
}

/// A weight's per-group scales and offsets (None: every offset zero) as it stores them:
/// float32, or float16 where that holds every value exactly. GGUF's Q4_0, Q4_1 and Q8_0
/// store float16 ones; kept so, a Q4_1 group streams 20 bytes at batch-1 decode instead of
/// 24 (codes 16, scale and offset 2 each). The few-row kernels read them in their own type
/// (``Scale``); the dequantising paths convert a panel's at a time.
#[derive(Clone, Copy)]
pub enum Scales<'a> {
    F32(&'a [f32], Option<&'a [f32]>),
    F16(&'a [f16], Option<&'a [f16]>),
}

impl Scales<'_> {
    /// ``len`` scales at ``scales`` and as many offsets at ``offsets`` (0: none), float16
    /// with ``half``, else float32.
    ///
    /// # Safety
    /// The addresses must hold ``len`` initialised entries of that type, alive while in use.
    pub unsafe fn view<'a>(scales: usize, offsets: usize, len: usize, half: bool) -> Scales<'a> {
        unsafe fn part<'a, T>(ptr: usize, len: usize) -> &'a [T] {
            if len == 0 {
                return &[];
            }
            std::slice::from_raw_parts(ptr as *const T, len)
        }
        if half {
            Scales::F16(
                part(scales, len),
                (offsets != 0).then(|| part(offsets, len)),
            )
        } else {
            Scales::F32(
                part(scales, len),
                (offsets != 0).then(|| part(offsets, len)),
            )
        }
    }

    pub fn has_offsets(self) -> bool {
        matches!(self, Scales::F32(_, Some(_)) | Scales::F16(_, Some(_)))
    }

    /// ``f`` of entries ``start..stop`` of the scales and of the offsets as float32: borrowed,
    /// or converted into this thread's buffers (kept between calls: a batched step converts
    /// one panel's entries at a time, thousands of panels a step).
    pub(crate) fn with_f32<R>(
        self,
        start: usize,
        stop: usize,
        f: impl FnOnce(&[f32], Option<&[f32]>) -> R,
    ) -> R {
        thread_local! {
            static CONVERTED: std::cell::RefCell<(Vec<f32>, Vec<f32>)> =
                const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
        }
        match self {
            Scales::F32(s, o) => f(&s[start..stop], o.map(|o| &o[start..stop])),
            Scales::F16(s, o) => CONVERTED.with_borrow_mut(|(scales, offsets)| {
                scales.resize(stop - start, 0.0);
                s[start..stop].convert_to_f32_slice(scales);
                let offsets = o.map(|o| {
                    offsets.resize(stop - start, 0.0);
                    o[start..stop].convert_to_f32_slice(offsets);
                    &offsets[..]
                });
                f(scales, offsets)
            }),
        }
    }
}

/// Calls ``$body`` with ``$scales`` and ``$offsets`` bound to a ``Scales``' typed slices
/// (the body is compiled once per type).
macro_rules! with_scales {
    ($from:expr, |$scales:ident, $offsets:ident| $body:expr) => {
        match $from {
            $crate::Scales::F32($scales, $offsets) => $body,
            $crate::Scales::F16($scales, $offsets) => $body,
        }
    };
}

/// A scale or offset as stored: read as float32 where it is used.
pub(crate) trait Scale: Copy + Send + Sync {
    fn to_f32(self) -> f32;
}

impl Scale for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Scale for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

/// ``sum_g offsets[g] * sums[g]`` over one weight row's offsets and one row's group sums of
/// ``x``: the offsets' part of an output (the portable path's; ``x86.rs`` has its own).
#[inline(always)]
pub(crate) fn offset_term<S: Scale>(offsets: Option<&[S]>, sums: &[f32]) -> f32 {
    offsets.map_or(0.0, |o| {
        o.iter().zip(sums).map(|(o, s)| o.to_f32() * s).sum()
    })
}

/// ``sum(a[i] * b[i])`` in eight independent lanes: a sequential float sum is a chain of
/// dependent adds (its latency, not the arithmetic, bounds it), and the compiler may not
/// reorder it itself. Used for the offsets' term, one per output element.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let (a_rest, b_rest) = (a8.remainder(), b8.remainder());
    for (a, b) in a8.zip(b8) {
        for i in 0..8 {
            lanes[i] += a[i] * b[i];
        }
    }
    let mut total = (lanes[0] + lanes[4])
        + (lanes[1] + lanes[5])
        + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for (a, b) in a_rest.iter().zip(b_rest) {
        total += a * b;
    }
    total
}

/// Per-group sums of each row of ``x [m, k]``: ``[m, k / group]`` (for the offset term).
fn group_sums(x: &[f32], m: usize, k: usize, group: usize) -> Vec<f32> {
    let groups = k / group;
    let mut sums = vec![0.0f32; m * groups];
    for t in 0..m {
        for g in 0..groups {
            let xs = &x[t * k + g * group..t * k + (g + 1) * group];
            sums[t * groups + g] = xs.iter().sum();
        }
    }
    sums
}

/// Rows of ``x`` one tile holds (codes widened once per group are reused across them).
pub(crate) const TILE: usize = 8;

/// Rows of ``x`` up to which ``q4_linear`` (and ``q8_linear`` with 32-column groups) may
/// round activations to 16 bits (``benchmarks/quantized_linear.py``, SmolLM2's 30 layers +
/// head): with ``vpmaddwd`` only, widening the codes once per group for a tile of rows
/// (``x86.rs``) is faster from three rows on (Zen 3 EPYC); with AVX-512 VNNI the integer
/// products stay ahead up to four (2-core Xeon VM: 8.4 vs 10.1 ms at 3 rows, 10.7 vs 11.9
/// at 4, 15.3 vs 15.5 at 6, where the panels take over at 8).
pub fn int16_max_rows() -> usize {
    if vnni() {
        4
    } else {
        2
    }
}

/// ``out [m, n] = x [m, k] @ W^T`` for a ``q4`` weight (``codes [n, k/2]``, scales and
/// offsets ``[n, k/32]``). From ``gemm_min_rows`` rows of ``x`` on, the weight is
/// dequantised a panel at a time and multiplied (``gemm.rs``); below, codes are widened
/// inside the dot (``x86.rs``), or, with ``int16_activations`` and at most
/// ``int16_max_rows()`` rows on AVX2, meet activations rounded to 16 bits (``q4_i16.rs``).
#[allow(clippy::too_many_arguments)]
pub fn q4_linear(
    x: &[f32],
    codes: &[u8],
    scales: Scales,
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    gemm_min_rows: usize,
    int16_activations: bool,
    on: Threads,
) {
    if m == 0 || n == 0 {
        return;
    }
    let path = kernel_path();
    let out_ptr = OutPtr(out.as_mut_ptr());
    if m >= gemm_min_rows {
        let dequantize = |panel: OutPtr, r0: usize, r1: usize| {
            q4_dequantize_block(path, codes, scales, panel, k, r0, r1)
        };
        for_row_chunks_on(on, n, gemm::PANEL, |r0, r1| {
            gemm::rows(path, x, m, n, k, &dequantize, out_ptr, r0, r1)
        });
        return;
    }
    let sums = scales.has_offsets().then(|| group_sums(x, m, k, 32));
    with_scales!(scales, |scales, offsets| {
        let job = q4::Job {
            x,
            sums: sums.as_deref().unwrap_or(&[]),
            codes,
            scales,
            offsets,
            m,
            n,
            k,
        };
        #[cfg(target_arch = "x86_64")]
        if path == KernelPath::Avx2Fma && int16_activations && m <= int16_max_rows() {
            let activations = unsafe { q4_i16::quantize(x, m, k) };
            let vnni = vnni();
            for_row_chunks_on(on, n, 16, |r0, r1| unsafe {
                if vnni {
                    q4_i16::rows_vnni(&job, &activations, out_ptr, r0, r1)
                } else {
                    q4_i16::rows_avx2(&job, &activations, out_ptr, r0, r1)
                }
            });
            return;
        }
        for_row_chunks_on(on, n, 16, |r0, r1| match path {
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx2Fma => unsafe { x86::q4_rows(&job, out_ptr, r0, r1) },
            _ => q4::rows_scalar(&job, out_ptr, r0, r1),
        });
    })
}

/// Dense rows ``r0..r1`` of a ``q4`` weight into the ``[r1 - r0, k]`` buffer at ``out``.
fn q4_dequantize_block<E: Element>(
    path: KernelPath,
    codes: &[u8],
    scales: Scales,
    out: OutPtr<E>,
    k: usize,
    r0: usize,
    r1: usize,
) {
    let groups = k / 32;
    let codes = &codes[r0 * k / 2..r1 * k / 2];
    scales.with_f32(r0 * groups, r1 * groups, |scales, offsets| match path {
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2Fma => unsafe {
            x86::q4_dequantize_rows(codes, scales, offsets, out, k, 0, r1 - r0)
        },
        _ => q4::dequantize_rows(codes, scales, offsets, out, k, 0, r1 - r0),
    })
}

/// ``out [m, n] = x [m, k] @ W^T`` for a ``q8`` weight (``codes [n, k]``, scales and
/// offsets ``[n, k/group]``, ``group`` 16 or 32; ``gemm_min_rows`` and
/// ``int16_activations`` as for ``q4_linear``, the latter for 32-column groups:
/// ``q8_i16.rs``).
#[allow(clippy::too_many_arguments)]
pub fn q8_linear(
    x: &[f32],
    codes: &[i8],
    scales: Scales,
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    group: usize,
    gemm_min_rows: usize,
    int16_activations: bool,
    on: Threads,
) {
    assert!(
        group == 16 || group == 32,
        "q8 group must be 16 or 32, got {group}"
    );
    if m == 0 || n == 0 {
        return;
    }
    let path = kernel_path();
    let out_ptr = OutPtr(out.as_mut_ptr());
    if m >= gemm_min_rows {
        let dequantize = |panel: OutPtr, r0: usize, r1: usize| {
            q8_dequantize_block(path, codes, scales, panel, k, group, r0, r1)
        };
        for_row_chunks_on(on, n, gemm::PANEL, |r0, r1| {
            gemm::rows(path, x, m, n, k, &dequantize, out_ptr, r0, r1)
        });
        return;
    }
    let sums = scales.has_offsets().then(|| group_sums(x, m, k, group));
    with_scales!(scales, |scales, offsets| {
        let job = q8::Job {
            x,
            sums: sums.as_deref().unwrap_or(&[]),
            codes,
            scales,
            offsets,
            m,
            n,
            k,
            group,
        };
        #[cfg(target_arch = "x86_64")]
        if path == KernelPath::Avx2Fma && int16_activations && group == 32 && m <= int16_max_rows()
        {
            let activations = unsafe { q4_i16::quantize(x, m, k) };
            let vnni = vnni();
            for_row_chunks_on(on, n, 16, |r0, r1| unsafe {
                if vnni {
                    q8_i16::rows_vnni(&job, &activations, out_ptr, r0, r1)
                } else {
                    q8_i16::rows_avx2(&job, &activations, out_ptr, r0, r1)
                }
            });
            return;
        }
        for_row_chunks_on(on, n, 16, |r0, r1| match path {
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx2Fma => unsafe { x86::q8_rows(&job, out_ptr, r0, r1) },
            _ => q8::rows_scalar(&job, out_ptr, r0, r1),
        })
    })
}

/// Dense rows ``r0..r1`` of a ``q8`` weight into the ``[r1 - r0, k]`` buffer at ``out``.
#[allow(clippy::too_many_arguments)]
fn q8_dequantize_block<E: Element>(
    path: KernelPath,
    codes: &[i8],
    scales: Scales,
    out: OutPtr<E>,
    k: usize,
    group: usize,
    r0: usize,
    r1: usize,
) {
    let groups = k / group;
    let codes = &codes[r0 * k..r1 * k];
    scales.with_f32(r0 * groups, r1 * groups, |scales, offsets| match path {
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx2Fma => unsafe {
            x86::q8_dequantize_rows(codes, scales, offsets, out, k, group, 0, r1 - r0)
        },
        _ => q8::dequantize_rows(codes, scales, offsets, out, k, group, 0, r1 - r0),
    })
}

/// The dense weight ``out [n, k]`` of a ``q4`` weight, bit-equal to
/// ``QuantizedWeight.dequantize()`` (a multiply, then an add, each rounded; no FMA); in
/// bfloat16, that rounded to nearest even, as torch's ``.to(torch.bfloat16)`` rounds it.
pub fn q4_dequantize<E: Element>(
    codes: &[u8],
    scales: Scales,
    out: &mut [E],
    n: usize,
    k: usize,
    on: Threads,
) {
    let path = kernel_path();
    let out_ptr = OutPtr(out.as_mut_ptr());
    for_row_chunks_on(on, n, 16, |r0, r1| {
        // SAFETY: rows r0..r1 of out belong to this chunk alone.
        let rows = unsafe { out_ptr.skip(r0 * k) };
        q4_dequantize_block(path, codes, scales, rows, k, r0, r1)
    });
}

/// The dense weight ``out [n, k]`` of a ``q8`` weight, bit-equal to ``dequantize()`` (in
/// bfloat16: that rounded to nearest even).
#[allow(clippy::too_many_arguments)]
pub fn q8_dequantize<E: Element>(
    codes: &[i8],
    scales: Scales,
    out: &mut [E],
    n: usize,
    k: usize,
    group: usize,
    on: Threads,
) {
    assert!(
        group == 16 || group == 32,
        "q8 group must be 16 or 32, got {group}"
    );
    let path = kernel_path();
    let out_ptr = OutPtr(out.as_mut_ptr());
    for_row_chunks_on(on, n, 16, |r0, r1| {
        // SAFETY: rows r0..r1 of out belong to this chunk alone.
        let rows = unsafe { out_ptr.skip(r0 * k) };
        q8_dequantize_block(path, codes, scales, rows, k, group, r0, r1)
    });
}
