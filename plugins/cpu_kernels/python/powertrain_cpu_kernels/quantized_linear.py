"""``NativeQuantizedLinear``: the ``QuantizedLinearKernel`` backed by the Rust kernels.

Few rows (decode) run the native kernel, which reads each weight byte once and never
builds the dense weight. More rows are compute-bound instead: the native kernel then
dequantises the weight a cache-sized panel at a time and multiplies every row by it
(``src/gemm.rs``). Dequantising into a temporary float32 ``[rows, cols]`` for torch's
``F.linear`` (MKL/oneDNN) remains as a route above ``gemv_max_rows``
(``benchmarks/quantized_linear.py`` measures the crossovers). Bfloat16 activations go to
AMX tiles where the CPU has them (``src/amx.rs``, 4-128 rows) and to torch's bfloat16
matmul on the weight dequantised to bfloat16 above that.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

import powertrain_cpu_kernels._native as _native
from powertrain.interfaces.quantized import GROUPS, QuantizedWeight
from powertrain_cpu_kernels.threads import openmp_team, use_threads
from powertrain_cpu_kernels.torch_openmp import gomp_parallel_address
from powertrain_cpu_kernels.tuning import (
    AMX_MAX_ROWS,
    BF16_AMX_MAX_ROWS,
    BF16_AMX_MIN_ROWS,
    BF16_DENSE_MIN_ROWS,
    BF16_DENSE_MIN_ROWS_AMX,
    DENSE_BLOCK,
    GEMM_MIN_ROWS,
    GEMV_MAX_ROWS,
    POOL_MAX_ROWS,
)


def _as_float16(values: torch.Tensor) -> torch.Tensor | None:
    """``values`` as float16 if that holds every one exactly, else None."""
    half = values.to(torch.float16)
    return half if torch.equal(half.to(torch.float32), values) else None


@attrs.frozen(eq=False)
class PreparedWeight:
    """A ``QuantizedWeight`` as this kernel multiplies it: on the CPU, its tensors contiguous,
    its scales and offsets float16 where that holds them exactly (GGUF stores Q4_0, Q4_1 and
    Q8_0 scales as float16; the float32 the loader widened them to streams 4 more bytes per
    32-weight group at decode: a Q4_1 group is 20 bytes read instead of 24). Its own type,
    because the Rust kernels trust the pointers they are given: ``linear`` takes only what
    ``prepare`` returned. The shape and the tensors' addresses are read here once: a decode
    step makes over a hundred calls of tens of microseconds each, and every torch attribute
    read costs a tenth of one."""

    #: The weight as prepared: ``scales`` and ``offsets`` float16 when ``half_scales``.
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    format: str
    group: int
    source: str
    rows: int = attrs.field(init=False)
    cols: int = attrs.field(init=False)
    half_scales: bool = attrs.field(init=False)
    #: ``(codes, scales, offsets or 0)`` addresses, for the native calls.
    pointers: tuple[int, int, int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        rows, width = self.codes.shape
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "cols", width * 2 if self.format == "q4" else width)
        object.__setattr__(self, "half_scales", self.scales.dtype == torch.float16)
        offsets = 0 if self.offsets is None else self.offsets.data_ptr()
        object.__setattr__(self, "pointers", (self.codes.data_ptr(), self.scales.data_ptr(), offsets))

    @classmethod
    def of(cls, weight: QuantizedWeight) -> PreparedWeight:
        """``weight`` contiguous, with float16 scales and offsets if both convert exactly."""
        scales, offsets = weight.scales.contiguous(), weight.offsets
        offsets = None if offsets is None else offsets.contiguous()
        half_scales = _as_float16(scales)
        half_offsets = None if offsets is None or half_scales is None else _as_float16(offsets)
        if half_scales is not None and (offsets is None or half_offsets is not None):
            scales, offsets = half_scales, half_offsets
        return cls(weight.codes.contiguous(), scales, offsets, weight.format, weight.group, weight.source)

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales and offsets."""
        tensors = [self.codes, self.scales] + ([self.offsets] if self.offsets is not None else [])
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors)

    @property
    def what(self) -> str:
        """The weight as error messages name it (built only when one is raised)."""
        return f"{self.format} from {self.source or 'unknown'}"


class NativeQuantizedLinear:
    """Weight-only quantised linear on the CPU for ``q4`` (group 32) and ``q8`` (group 16
    or 32) weights. ``gemv_max_rows``: the most rows of ``x`` the native kernel takes; more
    are multiplied by the weight dequantised block by block (0: always that; a large number:
    never; default: no limit where calls run on torch's OpenMP team, ``POOL_MAX_ROWS`` where
    they run on the kernels' own pool). ``gemm_min_rows``: from this many rows on, the native
    kernel dequantises panels of the weight and multiplies them, below it widens codes inside
    the dot (``src/gemm.rs``). ``dense_block``: weight elements per block on the dequantised
    route. Calls run on torch's OpenMP team where it is reachable (``threads.openmp_team``);
    elsewhere on the package's pool of ``threads`` threads, the calling one included (default:
    torch's thread count when built; the engine then runs decode steps' torch ops on one
    thread, see ``own_pool_max_rows``). ``activation_bits``: 16 lets ``q4`` products of up
    to two rows (four with AVX-512 VNNI), and ``q8`` ones with 32-column groups, on AVX2 round
    each 32-column group of activations to 16-bit integers and multiply them by the codes in
    integer multiply-adds (``src/q4_i16.rs``, ``src/q8_i16.rs``: 1.5-2x faster at batch-1
    decode; each output moves by at most ``sum_g max|x_g| / 65534 * sum_j |scale_g *
    code_gj|``, the offsets' term taking the exact sums of ``x``); 32 keeps them float32
    everywhere. ``bf16_dense_min_rows``: from this many rows of bfloat16 activations,
    multiply by the weight dequantised to bfloat16 block by block (torch's bfloat16 matmul,
    1.5-3x faster than widening where the CPU has bfloat16 dot products,
    ``tuning.BF16_DENSE_MIN_ROWS``); None: bfloat16 activations are always widened. The
    weight then carries bfloat16's rounding, as the dequantised bfloat16 model's does.
    ``bf16_amx_min_rows``: from this many up to ``BF16_AMX_MAX_ROWS`` rows of bfloat16
    activations, multiply on AMX tiles by the weight rounded to bfloat16 16 x 32 values at a
    time, ``AMX_MAX_ROWS`` rows a call (``src/amx.rs``; only where ``_native.amx()``); None:
    never."""

    formats = frozenset({"q4", "q8"})

    def __init__(
        self,
        gemv_max_rows: int | None = None,
        dense_block: int = DENSE_BLOCK,
        threads: int | None = None,
        gemm_min_rows: int = GEMM_MIN_ROWS,
        activation_bits: int = 16,
        bf16_dense_min_rows: int | None = None,
        bf16_amx_min_rows: int | None = None,
    ) -> None:
        if activation_bits not in (16, 32):
            raise ValueError(f"activation_bits must be 16 or 32, got {activation_bits!r}")
        self.activation_bits = activation_bits
        if gemv_max_rows is None:
            gemv_max_rows = GEMV_MAX_ROWS if gomp_parallel_address() else POOL_MAX_ROWS
        self.gemv_max_rows = gemv_max_rows
        self.gemm_min_rows = max(1, gemm_min_rows)
        self.dense_block = dense_block
        self.threads = torch.get_num_threads() if threads is None else max(1, threads)
        self.bf16_dense_min_rows = None if bf16_dense_min_rows is None else max(1, bf16_dense_min_rows)
        if bf16_amx_min_rows is not None and not _native.amx():
            raise ValueError(
                "bf16_amx_min_rows needs AMX bfloat16 tiles, which this CPU or operating system does not "
                "provide (_native.amx() is False); leave it None"
            )
        self.bf16_amx_min_rows = None if bf16_amx_min_rows is None else max(1, bf16_amx_min_rows)

    @classmethod
    def for_this_cpu(cls, activation_bits: int = 16) -> NativeQuantizedLinear:
        """The kernel as the plugin builds it: the bfloat16 route only where the CPU has
        bfloat16 dot-product instructions (elsewhere bfloat16 matmuls are slower than float32),
        from fewer rows where they are AMX tiles, and below it the AMX kernel where the
        kernels can use the tiles; the float32 dense route from the row count this machine's
        timing chose (``dense_route``)."""
        from powertrain.builtin.platforms import bf16_dot_flags

        flags = bf16_dot_flags()
        amx = "amx_bf16" in flags and _native.amx()
        if amx:
            min_rows = BF16_AMX_MAX_ROWS + 1
        else:
            min_rows = BF16_DENSE_MIN_ROWS_AMX if "amx_bf16" in flags else BF16_DENSE_MIN_ROWS if flags else None
        kernel = cls(
            activation_bits=activation_bits,
            bf16_dense_min_rows=min_rows,
            bf16_amx_min_rows=BF16_AMX_MIN_ROWS if amx else None,
        )
        if gomp_parallel_address():  # where the kernel shares torch's team, as torch's GEMM does
            from powertrain_cpu_kernels.dense_route import native_max_rows

            kernel.gemv_max_rows = native_max_rows(kernel)
        return kernel

    def prepare(self, weight: QuantizedWeight) -> PreparedWeight:
        if not isinstance(weight, QuantizedWeight):
            raise TypeError(f"NativeQuantizedLinear.prepare takes a QuantizedWeight, got {type(weight).__name__}")
        where = f"{weight.format} weight from {weight.source or 'unknown'}"
        if weight.format not in self.formats or weight.group not in GROUPS[weight.format]:
            raise ValueError(
                f"NativeQuantizedLinear multiplies q4 (group 32) and q8 (group 16 or 32) weights, got {where} "
                f"with group {weight.group}; dequantize it or pick another kernel"
            )
        tensors = [weight.codes, weight.scales] + ([weight.offsets] if weight.offsets is not None else [])
        devices = {str(tensor.device) for tensor in tensors}
        if devices != {"cpu"}:
            raise ValueError(f"NativeQuantizedLinear runs on the CPU; the {where} is on {', '.join(sorted(devices))}")
        rows, cols = weight.shape
        if rows == 0 or cols == 0:
            raise ValueError(f"the {where} is empty ({rows} x {cols})")
        # QuantizedWeight checked dtypes and shapes; here only the memory layout is chosen.
        return PreparedWeight.of(weight)

    def linear(self, x: torch.Tensor, prepared: PreparedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        # The decode case first, in the fewest torch calls (each costs a tenth of a
        # microsecond or more, against tens for the product): a contiguous 2-d float32 x
        # on the CPU, no bias, few rows. Anything else is checked in full below.
        if (
            bias is None
            and type(prepared) is PreparedWeight
            and x.dtype is torch.float32
            and x.is_cpu
            and x.dim() == 2
            and x.is_contiguous()
            and x.shape[1] == prepared.cols
            and 0 < x.shape[0] <= self.gemv_max_rows
        ):
            return self._native_linear(x, prepared)
        return self._checked_linear(x, prepared, bias)

    def _checked_linear(self, x: torch.Tensor, prepared: PreparedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(prepared, PreparedWeight):
            raise TypeError(
                f"NativeQuantizedLinear.linear takes what its prepare() returned, got {type(prepared).__name__}; "
                "call kernel.prepare(weight) once at load time"
            )
        rows, cols = prepared.rows, prepared.cols
        if not x.is_floating_point() or x.device.type != "cpu":
            raise ValueError(
                f"NativeQuantizedLinear takes floating-point CPU activations, got {x.dtype} on {x.device} "
                f"(weight {prepared.what})"
            )
        if x.dim() == 0 or x.shape[-1] != cols:
            raise ValueError(
                f"activations of shape {list(x.shape)} do not fit a [{rows}, {cols}] weight "
                f"({prepared.what}): the last dimension must be {cols}"
            )
        if bias is not None and (tuple(bias.shape) != (rows,) or bias.device.type != "cpu"):
            raise ValueError(
                f"bias must be a CPU tensor of shape [{rows}], got {list(bias.shape)} on {bias.device} "
                f"(weight {prepared.what})"
            )
        if x.dtype == torch.bfloat16 and self.bf16_amx_min_rows is not None and cols % 32 == 0:
            m = x.numel() // cols
            if self.bf16_amx_min_rows <= m <= BF16_AMX_MAX_ROWS and _native.amx():  # False where scalar is forced
                out = self._amx_linear(x.reshape(m, cols).contiguous(), prepared)
                if bias is not None:
                    out += bias.to(torch.float32)
                return out.view(*x.shape[:-1], rows).to(torch.bfloat16)
        if (
            x.dtype == torch.bfloat16
            and self.bf16_dense_min_rows is not None
            and x.numel() >= self.bf16_dense_min_rows * cols
        ):
            x2 = x.reshape(-1, cols)
            out = self._dense_linear(x2, prepared, bias if bias is None else bias.to(torch.bfloat16))
            return out.view(*x.shape[:-1], rows)
        plain = x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous()
        x2 = x if plain else x.reshape(-1, cols).to(torch.float32).contiguous()
        m = x2.shape[0]
        bias32 = None if bias is None else bias.to(torch.float32)
        if m == 0:
            out = x2.new_empty((0, rows))
        elif m <= self.gemv_max_rows:
            out = self._native_linear(x2, prepared)
            if bias32 is not None:
                out += bias32
        else:
            out = self._dense_linear(x2, prepared, bias32)
        return out if plain else out.view(*x.shape[:-1], rows).to(x.dtype)

    def dequantize(self, prepared: PreparedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense ``[rows, cols]`` weight: float32 bit-equal to ``QuantizedWeight.dequantize()``,
        or bfloat16 bit-equal to that ``.to(torch.bfloat16)``."""
        use_threads(self.threads)
        dense = torch.empty((prepared.rows, prepared.cols), dtype=dtype)
        self._dequantize_rows(prepared, 0, prepared.rows, dense)
        return dense

    def _dequantize_rows(self, prepared: PreparedWeight, start: int, stop: int, dense: torch.Tensor) -> None:
        """Rows ``start:stop`` of the weight into the contiguous float32 or bfloat16
        ``dense [stop - start, cols]``, written in that dtype (no float32 copy in between)."""
        if dense.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the dense weight is float32 or bfloat16, got {dense.dtype} ({prepared.what})")
        codes, scales, offsets = prepared.pointers
        groups = prepared.scales.shape[1]
        scale_bytes = groups * prepared.scales.element_size()
        codes += start * prepared.codes.shape[1] * prepared.codes.element_size()
        scales += start * scale_bytes
        offsets = offsets and offsets + start * scale_bytes
        args = (codes, scales, offsets, prepared.half_scales, dense.data_ptr(), dense.dtype == torch.bfloat16)
        if prepared.format == "q4":
            _native.q4_dequantize(*args, stop - start, prepared.cols, openmp_team())
        else:
            _native.q8_dequantize(*args, stop - start, prepared.cols, prepared.group, openmp_team())

    def _dense_linear(self, x: torch.Tensor, prepared: PreparedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """``x`` times the weight dequantised ``dense_block`` elements at a time, in ``x``'s
        dtype (float32, or bfloat16 on the bfloat16 route: dequantised straight to bfloat16,
        half the bytes written and no conversion pass)."""
        use_threads(self.threads)
        rows, cols = prepared.rows, prepared.cols
        block_rows = min(rows, max(1, self.dense_block // cols))
        buffer = torch.empty((block_rows, cols), dtype=x.dtype)
        out = None  # one block's product is the output itself
        for start in range(0, rows, block_rows):
            stop = min(start + block_rows, rows)
            block = buffer[: stop - start]
            self._dequantize_rows(prepared, start, stop, block)
            product = F.linear(x, block, None if bias is None else bias[start:stop])
            if block_rows == rows:
                return product
            if out is None:
                out = torch.empty((x.shape[0], rows), dtype=x.dtype)
            out[:, start:stop] = product
        return out

    def _amx_linear(self, x: torch.Tensor, prepared: PreparedWeight) -> torch.Tensor:
        """The float32 product of contiguous bfloat16 ``x`` on AMX tiles, ``AMX_MAX_ROWS``
        rows a call."""
        use_threads(self.threads)
        m, rows, cols = x.shape[0], prepared.rows, prepared.cols
        out = torch.empty(m, rows, dtype=torch.float32)
        codes, scales, offsets = prepared.pointers
        for start in range(0, m, AMX_MAX_ROWS):
            part = min(AMX_MAX_ROWS, m - start)
            shared = (x[start].data_ptr(), codes, scales, offsets, prepared.half_scales, out[start].data_ptr())
            if prepared.format == "q4":
                _native.q4_linear_amx(*shared, part, rows, cols, openmp_team())
            else:
                _native.q8_linear_amx(*shared, part, rows, cols, prepared.group, openmp_team())
        return out

    def _native_linear(self, x: torch.Tensor, prepared: PreparedWeight) -> torch.Tensor:
        use_threads(self.threads)
        m, rows, cols = x.shape[0], prepared.rows, prepared.cols
        out = torch.empty(m, rows, dtype=torch.float32)  # what the kernels write, whatever torch's default
        codes, scales, offsets = prepared.pointers
        shared = (x.data_ptr(), codes, scales, offsets, prepared.half_scales, out.data_ptr(), m, rows, cols)
        if prepared.format == "q4":
            _native.q4_linear(*shared, self.gemm_min_rows, self.activation_bits == 16, openmp_team())
        else:
            _native.q8_linear(*shared, prepared.group, self.gemm_min_rows, self.activation_bits == 16, openmp_team())
        return out
