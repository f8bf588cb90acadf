//! Batched-decode products of bfloat16 activations with ``q4`` / ``q8`` weights on AMX tiles
//! (x86_64 CPUs with ``amx_bf16``, Linux).
//!
//! From a few rows of bfloat16 activations on, the weight is better multiplied as bfloat16
//! than widened to float32 (``x86.rs``), but handing torch a dense bfloat16 copy per call costs
//! a pass over memory for the copy and oneDNN's reorder of it on every call. Here the weight
//! is dequantised 16 rows x 32 columns at a time, one A tile (1 KiB, in L1), straight from its
//! codes: a ``q4`` group's 16 possible values are computed once (``code * scale + offset``,
//! rounded to bfloat16) and its 32 codes look them up (``vpermw``); ``q8`` codes are converted
//! and scaled 16 at a time. The tile holds the bfloat16 weight that ``dequantize()`` then
//! ``.to(torch.bfloat16)`` gives. ``tdpbf16ps`` multiplies it by up to four tiles of 16 rows of
//! ``x`` (laid out in pairs once per call) and sums in float32.
//!
//! The product computed is ``out^T = W x^T``: the weight's rows are the A tile's rows as they
//! are dequantised, only ``x`` (small at decode) is rearranged, and each 16 x 16 result is
//! transposed in registers on its way out.
//!
//! SmolLM2-135M's linears in a 64-sequence bfloat16 decode step (2-core Xeon VM,
//! ``benchmarks/step_profile.py --dtype bfloat16 --quantization keep``): 92 ms dequantising
//! to float32 then converting for oneDNN, 63 ms dequantising straight to bfloat16, 37 ms here;
//! 26 ms for the model dequantised once at load (oneDNN-packed weights, 4x the memory).

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use crate::{for_row_chunks_on, OutPtr, Scales, Threads};

/// Rows of ``x`` one call takes: four C tiles of 16 (tmm0-3), beside the A tile (tmm4) and
/// the B tiles (tmm5-7).
const MAX_ROWS: usize = crate::AMX_MAX_ROWS;

/// Whether AMX bfloat16 tiles can run here: the CPU has them (with the AVX-512 the
/// dequantisation uses), and Linux granted this process the tile state.
pub fn available() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512bf16")
            && cpu_has_amx_bf16()
            && tile_state_granted()
    })
}

fn cpu_has_amx_bf16() -> bool {
    // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
    let leaf = __cpuid_count(7, 0);
    (leaf.edx >> 22) & 1 == 1 && (leaf.edx >> 24) & 1 == 1
}

/// Linux hands out the 8 KiB tile state only on request (``ARCH_REQ_XCOMP_PERM``); the grant
/// holds for every thread of the process.
#[cfg(target_os = "linux")]
fn tile_state_granted() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn tile_state_granted() -> bool {
    false
}

/// ``ldtilecfg``'s 64-byte operand: palette 1, every tile used 16 rows of 64 bytes.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

/// Loads the configuration for tmm0-7 on this thread (the tile state is per thread).
unsafe fn configure_tiles() {
    let mut config = TileConfig {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        colsb: [0; 16],
        rows: [0; 16],
    };
    for tile in 0..8 {
        config.colsb[tile] = 64;
        config.rows[tile] = 16;
    }
    asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly));
}

unsafe fn release_tiles() {
    asm!("tilerelease", options(nostack, nomem));
}

/// Zeroes C tile ``$c``.
macro_rules! tile_zero {
    ($c:literal) => {
        asm!(concat!("tilezero tmm", $c), options(nostack, nomem))
    };
}

/// Loads tile ``$t`` from 16 rows of 64 bytes ``$stride`` bytes apart at ``$ptr``.
macro_rules! tile_load {
    ($t:literal, $ptr:expr, $stride:expr) => {
        asm!(concat!("tileloadd tmm", $t, ", [{p} + {s}*1]"), p = in(reg) $ptr, s = in(reg) $stride,
             options(nostack, readonly))
    };
}

/// Stores C tile ``$c`` as 16 rows of 16 float32 at ``$ptr``.
macro_rules! tile_store {
    ($c:literal, $ptr:expr) => {
        asm!(concat!("tilestored [{p} + {s}*1], tmm", $c), p = in(reg) $ptr, s = in(reg) 64usize,
             options(nostack))
    };
}

/// C tile ``$c`` += A (tmm4) times B tile ``$b`` (bfloat16 pairs, float32 sums).
macro_rules! tile_multiply {
    ($c:literal, $b:literal) => {
        asm!(
            concat!("tdpbf16ps tmm", $c, ", tmm4, tmm", $b),
            options(nostack, nomem)
        )
    };
}

/// A weight as the tile loop reads it: one group's 32 dequantised columns of one row at a time.
trait Codes: Sync {
    /// Columns per scale.
    fn group(&self) -> usize;
    /// Where row ``r``'s codes for columns ``32 c ..`` start (to prefetch them).
    fn codes_at(&self, r: usize, c: usize) -> *const i8;
    /// Row ``r``'s columns ``32 c .. 32 c + 32`` as bfloat16 at ``out`` (64 bytes), with the
    /// scales and offsets of the row's groups at ``scales`` / ``offsets`` (null: none).
    unsafe fn dequantize(
        &self,
        r: usize,
        c: usize,
        scales: *const f32,
        offsets: *const f32,
        out: *mut u16,
    );
}

struct Q4<'a> {
    codes: &'a [u8],
    k: usize,
}

struct Q8<'a> {
    codes: &'a [i8],
    k: usize,
    group: usize,
}

/// Rounds two vectors of float32 to one of 32 bfloat16 (``low`` first): nearest, ties to
/// even, a NaN kept a quiet NaN, as ``Bf16::from_f32``, except that values below float32's
/// normal range (under 1.2e-38) become zero (``vcvtne2ps2bf16`` flushes them). A weight's
/// float16 scales and offsets can never make one.
#[inline(always)]
unsafe fn to_bf16(low: __m512, high: __m512) -> __m512i {
    std::mem::transmute(_mm512_cvtne2ps_pbh(high, low))
}

/// ``code * scale`` then ``+ offset``, each rounded (no FMA), as ``dequantize()`` computes it.
#[inline(always)]
unsafe fn scaled(codes: __m512, scales: *const f32, offsets: *const f32, g: usize) -> __m512 {
    let v = _mm512_mul_ps(codes, _mm512_set1_ps(*scales.add(g)));
    if offsets.is_null() {
        v
    } else {
        _mm512_add_ps(v, _mm512_set1_ps(*offsets.add(g)))
    }
}

impl Codes for Q4<'_> {
    fn group(&self) -> usize {
        32
    }

    #[inline(always)]
    fn codes_at(&self, r: usize, c: usize) -> *const i8 {
        self.codes[r * self.k / 2 + c * 16..].as_ptr() as *const i8
    }

    #[inline(always)]
    unsafe fn dequantize(
        &self,
        r: usize,
        c: usize,
        scales: *const f32,
        offsets: *const f32,
        out: *mut u16,
    ) {
        // The group's 16 values, then each code looks its value up.
        let levels = _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
        );
        let levels = scaled(levels, scales, offsets, c);
        let table = to_bf16(levels, levels); // the 16 values, twice
        let bytes =
            _mm_loadu_si128(self.codes.as_ptr().add(r * self.k / 2 + c * 16) as *const __m128i);
        let wide = _mm256_cvtepu8_epi16(bytes);
        // Byte j holds column j in its low nibble, column j + 16 in its high one.
        let low = _mm256_and_si256(wide, _mm256_set1_epi16(0x0F));
        let high = _mm256_srli_epi16::<4>(wide);
        let index = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(low), high);
        let values = _mm512_permutexvar_epi16(index, table);
        _mm512_storeu_si512(out as *mut __m512i, values);
    }
}

impl Codes for Q8<'_> {
    fn group(&self) -> usize {
        self.group
    }

    #[inline(always)]
    fn codes_at(&self, r: usize, c: usize) -> *const i8 {
        self.codes[r * self.k + c * 32..].as_ptr()
    }

    #[inline(always)]
    unsafe fn dequantize(
        &self,
        r: usize,
        c: usize,
        scales: *const f32,
        offsets: *const f32,
        out: *mut u16,
    ) {
        let codes =
            _mm256_loadu_si256(self.codes.as_ptr().add(r * self.k + c * 32) as *const __m256i);
        let low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(codes)));
        let high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256::<1>(codes)));
        // Groups of 32 share one scale; groups of 16 give each half its own.
        let (g0, g1) = if self.group == 32 {
            (c, c)
        } else {
            (2 * c, 2 * c + 1)
        };
        let low = scaled(low, scales, offsets, g0);
        let high = scaled(high, scales, offsets, g1);
        let values = to_bf16(low, high);
        _mm512_storeu_si512(out as *mut __m512i, values);
    }
}

/// ``x [m, k]`` (bfloat16) as B tiles: for each 16 rows of ``x`` (zero past ``m``) and each
/// pair of columns ``p``, the 16 rows' pairs side by side (``[tile][p][16]`` 32-bit pairs),
/// so the B tile of rows ``16 j..`` and columns ``32 c..`` is 16 consecutive 64-byte rows.
fn pack_x(x: &[u16], m: usize, k: usize) -> Vec<u32> {
    let pairs = k / 2;
    let tiles = m.div_ceil(16);
    let mut packed = vec![0u32; tiles * pairs * 16];
    for t in 0..m {
        let row = &x[t * k..(t + 1) * k];
        let (j, within) = (t / 16, t % 16);
        for p in 0..pairs {
            packed[(j * pairs + p) * 16 + within] =
                u32::from(row[2 * p]) | (u32::from(row[2 * p + 1]) << 16);
        }
    }
    packed
}

/// ``out [m, n] = x [m, k] @ W^T`` in float32 for bfloat16 ``x`` (``m <= MAX_ROWS``,
/// ``k`` a multiple of 32) and a weight dequantised to bfloat16 (bit-equal to the dense
/// weight's ``.to(torch.bfloat16)``). The caller checked ``available()``.
#[allow(clippy::too_many_arguments)]
unsafe fn linear(
    x: &[u16],
    weight: &impl Codes,
    scales: Scales,
    out: OutPtr,
    m: usize,
    n: usize,
    k: usize,
    on: Threads,
) {
    assert!(
        m <= MAX_ROWS && k.is_multiple_of(32),
        "amx::linear takes up to {MAX_ROWS} rows and k a multiple of 32"
    );
    let packed = pack_x(x, m, k);
    // Tiles of 16 weight rows, so no chunk splits one.
    for_row_chunks_on(on, n.div_ceil(16), 1, |t0, t1| unsafe {
        configure_tiles();
        weight_tiles(weight, &packed, scales, out, m, n, k, t0, t1);
        release_tiles();
    });
}

/// Output columns of weight-row tiles ``t0..t1`` (16 weight rows each, the last maybe fewer).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn weight_tiles(
    weight: &impl Codes,
    packed: &[u32],
    scales: Scales,
    out: OutPtr,
    m: usize,
    n: usize,
    k: usize,
    t0: usize,
    t1: usize,
) {
    let x_tiles = m.div_ceil(16);
    let groups = k / weight.group();
    // Two A buffers, so one column's dequantisation overlaps the tile load of the last.
    let mut a = [[0u16; 16 * 32]; 2];
    let mut c = [0.0f32; 16 * 16];
    for tile in t0..t1 {
        let r0 = tile * 16;
        let rows = (n - r0).min(16);
        if rows < 16 {
            a = [[0; 16 * 32]; 2]; // rows past n stay zero
        }
        for j in 0..x_tiles {
            match j {
                0 => tile_zero!("0"),
                1 => tile_zero!("1"),
                2 => tile_zero!("2"),
                _ => tile_zero!("3"),
            }
        }
        scales.with_f32(r0 * groups, (r0 + rows) * groups, |scales, offsets| {
            for column in 0..k / 32 {
                // The next tile's codes for this column, ahead of their turn: its 16 rows
                // are 16 streams a row apart, which the hardware prefetcher does not follow.
                if tile + 1 < t1 {
                    for r in 0..(n - r0 - 16).min(16) {
                        _mm_prefetch::<_MM_HINT_T0>(weight.codes_at(r0 + 16 + r, column));
                    }
                }
                let a = &mut a[column % 2];
                for r in 0..rows {
                    let offsets = offsets.map_or(std::ptr::null(), |o| o.as_ptr().add(r * groups));
                    let scales = scales.as_ptr().add(r * groups);
                    weight.dequantize(r0 + r, column, scales, offsets, a.as_mut_ptr().add(r * 32));
                }
                tile_load!("4", a.as_ptr(), 64usize);
                let b = |j: usize| packed.as_ptr().add((j * k / 2 + column * 16) * 16);
                tile_load!("5", b(0), 64usize);
                tile_multiply!("0", "5");
                if x_tiles > 1 {
                    tile_load!("6", b(1), 64usize);
                    tile_multiply!("1", "6");
                }
                if x_tiles > 2 {
                    tile_load!("7", b(2), 64usize);
                    tile_multiply!("2", "7");
                }
                if x_tiles > 3 {
                    tile_load!("5", b(3), 64usize);
                    tile_multiply!("3", "5");
                }
            }
        });
        for j in 0..x_tiles {
            match j {
                0 => tile_store!("0", c.as_mut_ptr()),
                1 => tile_store!("1", c.as_mut_ptr()),
                2 => tile_store!("2", c.as_mut_ptr()),
                _ => tile_store!("3", c.as_mut_ptr()),
            }
            // c [weight row][x row] -> out [x row][weight row]
            let columns = transpose_16x16(&c);
            for (t, column) in columns
                .iter()
                .enumerate()
                .take(m.saturating_sub(16 * j).min(16))
            {
                let at = out.0.add((16 * j + t) * n + r0);
                if rows == 16 {
                    _mm512_storeu_ps(at, *column);
                } else {
                    _mm512_mask_storeu_ps(at, (1u16 << rows) - 1, *column);
                }
            }
        }
    }
}

/// The 16 columns of a row-major 16 x 16 ``c``, each as a vector (unpack pairs, then
/// quadruples, then 128-bit lanes twice).
#[inline(always)]
unsafe fn transpose_16x16(c: &[f32; 256]) -> [__m512; 16] {
    let rows: [__m512; 16] = std::array::from_fn(|r| _mm512_loadu_ps(c.as_ptr().add(16 * r)));
    // Pairs of rows interleaved: t[2i] = (r0 r1 by 32-bit lo), t[2i+1] = hi.
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(rows[2 * i], rows[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(rows[2 * i], rows[2 * i + 1]);
    }
    // Quadruples of rows: 64-bit interleave of pairs (0,2), (1,3) in each group of four.
    let mut u = [_mm512_setzero_ps(); 16];
    for i in 0..4 {
        let (a0, a1, b0, b1) = (t[4 * i], t[4 * i + 1], t[4 * i + 2], t[4 * i + 3]);
        u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(
            _mm512_castps_pd(a0),
            _mm512_castps_pd(b0),
        ));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(
            _mm512_castps_pd(a0),
            _mm512_castps_pd(b0),
        ));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(
            _mm512_castps_pd(a1),
            _mm512_castps_pd(b1),
        ));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(
            _mm512_castps_pd(a1),
            _mm512_castps_pd(b1),
        ));
    }
    // Each u[4i + q] holds, per 128-bit lane l, column 4l + q of rows 4i..4i+4. Gather the
    // lanes: first pairs of row groups, then all four.
    let mut v = [_mm512_setzero_ps(); 16];
    for q in 0..4 {
        let (g0, g1, g2, g3) = (u[q], u[4 + q], u[8 + q], u[12 + q]);
        v[q] = _mm512_shuffle_f32x4::<0b10_00_10_00>(g0, g1); // lanes 0,2 of g0, then of g1
        v[4 + q] = _mm512_shuffle_f32x4::<0b11_01_11_01>(g0, g1); // lanes 1,3
        v[8 + q] = _mm512_shuffle_f32x4::<0b10_00_10_00>(g2, g3);
        v[12 + q] = _mm512_shuffle_f32x4::<0b11_01_11_01>(g2, g3);
    }
    let mut columns = [_mm512_setzero_ps(); 16];
    for q in 0..4 {
        // v[q]: lanes (col q of g0 rows 0-3), (col 8+q of g0), (col q of g1 rows 4-7), (col 8+q of g1)
        // v[8+q]: the same for rows 8-15.
        columns[q] = _mm512_shuffle_f32x4::<0b10_00_10_00>(v[q], v[8 + q]);
        columns[8 + q] = _mm512_shuffle_f32x4::<0b11_01_11_01>(v[q], v[8 + q]);
        columns[4 + q] = _mm512_shuffle_f32x4::<0b10_00_10_00>(v[4 + q], v[12 + q]);
        columns[12 + q] = _mm512_shuffle_f32x4::<0b11_01_11_01>(v[4 + q], v[12 + q]);
    }
    columns
}

/// ``linear`` for a ``q4`` weight (``codes [n, k/2]``).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn q4_linear(
    x: &[u16],
    codes: &[u8],
    scales: Scales,
    out: OutPtr,
    m: usize,
    n: usize,
    k: usize,
    on: Threads,
) {
    linear(x, &Q4 { codes, k }, scales, out, m, n, k, on)
}

/// ``linear`` for a ``q8`` weight (``codes [n, k]``, groups of 16 or 32).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn q8_linear(
    x: &[u16],
    codes: &[i8],
    scales: Scales,
    out: OutPtr,
    m: usize,
    n: usize,
    k: usize,
    group: usize,
    on: Threads,
) {
    linear(x, &Q8 { codes, k, group }, scales, out, m, n, k, on)
}
