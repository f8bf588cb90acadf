"""The weight-only quantised linear contract: weights kept as integer codes with per-group
scales, and the kernels that multiply activations by them without expanding them.

A GGUF file stores most weights in ggml's block formats (Q4_0, Q4_1, Q8_0, the k-quants).
The loader converts each, losslessly, into one of two layouts here, so a kernel handles two
formats instead of ten:

* ``q4``: 4-bit unsigned codes (0..15), groups of 32 columns. Each group is 16 bytes: byte
  ``j`` holds column ``j`` in its low nibble and column ``j + 16`` in its high nibble (ggml's
  own Q4 layout). Q4_0, Q4_1 and Q4_K become this.
* ``q8``: signed 8-bit codes, one byte per column, groups of 16 or 32 columns. Q8_0, Q5_0,
  Q5_1, Q5_K, Q6_K, Q3_K and Q2_K become this (their codes fit a byte; k-quants with 16-column
  sub-blocks keep ``group`` 16).

Every weight reads ``w[r, c] = scales[r, c // group] * code[r, c] + offsets[r, c // group]``
(no offsets: zero). Scales and offsets are float32, which holds each source format's products
(a k-quant's super-block scale times its 6-bit sub-block scale) exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import attrs
import torch

from powertrain.interfaces.platform import PlatformInfo

QuantFormat = Literal["q4", "q8"]
QUANT_FORMATS: tuple[QuantFormat, ...] = ("q4", "q8")
#: Columns per group each format allows.
GROUPS: dict[str, tuple[int, ...]] = {"q4": (32,), "q8": (16, 32)}


@attrs.frozen(eq=False)
class QuantizedWeight:
    """A ``[rows, cols]`` weight as codes with float32 per-group scales (and offsets)."""

    #: ``q4``: uint8 ``[rows, cols // 2]``; ``q8``: int8 ``[rows, cols]``.
    codes: torch.Tensor
    #: float32 ``[rows, cols // group]``.
    scales: torch.Tensor
    #: float32 ``[rows, cols // group]``, or None where every offset is zero.
    offsets: torch.Tensor | None
    format: QuantFormat
    group: int
    #: The stored type it came from (``"Q4_1"``), for logs and errors.
    source: str = ""

    def __attrs_post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ValueError(f"invalid {self.format!r} weight from {self.source or 'unknown'}: {'; '.join(problems)}")

    def _problems(self) -> list[str]:
        if self.format not in GROUPS:
            return [f"format must be one of {', '.join(QUANT_FORMATS)}"]
        problems = []
        if self.group not in GROUPS[self.format]:
            problems.append(f"group {self.group} is not one of {GROUPS[self.format]}")
        code_dtype = torch.uint8 if self.format == "q4" else torch.int8
        if self.codes.dtype != code_dtype or self.codes.dim() != 2:
            problems.append(f"codes must be 2-d {code_dtype}, got {self.codes.dim()}-d {self.codes.dtype}")
            return problems
        rows, cols = self.shape
        if cols % self.group:
            problems.append(f"{cols} columns are not a multiple of the group {self.group}")
        for name, tensor in (("scales", self.scales), ("offsets", self.offsets)):
            if tensor is None:
                continue
            if tensor.dtype != torch.float32 or tuple(tensor.shape) != (rows, cols // self.group):
                problems.append(
                    f"{name} must be float32 [{rows}, {cols // self.group}], got {tensor.dtype} {list(tensor.shape)}"
                )
        return problems

    @classmethod
    def q8_of(cls, weight: torch.Tensor, group: int = 32, source: str = "") -> QuantizedWeight:
        """A dense ``[rows, cols]`` weight rounded to ``q8``: each group's codes in
        [-127, 127] times the group's largest magnitude / 127 (ggml's Q8_0 rule, with a
        float32 scale), so a weight moves by at most half a step, max|w_group| / 254."""
        rows, cols = weight.shape
        if cols % group:
            raise ValueError(f"a {rows} x {cols} weight has no whole {group}-column groups")
        grouped = weight.detach().to(torch.float32).reshape(rows, cols // group, group)
        scales = grouped.abs().amax(dim=-1) / 127
        codes = torch.where(scales[..., None] > 0, grouped / scales[..., None].clamp_min(1e-30), 0.0)
        codes = codes.round().clamp(-127, 127).to(torch.int8).reshape(rows, cols)
        return cls(codes.contiguous(), scales.contiguous(), None, "q8", group, source or "float (rounded to q8)")

    @property
    def shape(self) -> tuple[int, int]:
        rows, width = self.codes.shape
        return rows, width * 2 if self.format == "q4" else width

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales and offsets."""
        tensors = [self.codes, self.scales] + ([self.offsets] if self.offsets is not None else [])
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors)

    def integer_codes(self) -> torch.Tensor:
        """The codes as int16 ``[rows, cols]``, one per column (unpacking ``q4``'s nibbles)."""
        if self.format == "q8":
            return self.codes.to(torch.int16)
        rows, cols = self.shape
        grouped = self.codes.view(rows, cols // 32, 16)
        low, high = grouped & 0x0F, grouped >> 4
        return torch.cat((low, high), dim=-1).reshape(rows, cols).to(torch.int16)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight (the reference every kernel is checked against)."""
        rows, cols = self.shape
        codes = self.integer_codes().view(rows, cols // self.group, self.group).to(torch.float32)
        dense = codes * self.scales.unsqueeze(-1)
        if self.offsets is not None:
            dense = dense + self.offsets.unsqueeze(-1)
        return dense.reshape(rows, cols).to(dtype)

    def select_rows(self, index: torch.Tensor | slice) -> QuantizedWeight:
        """These rows only (a row permutation, a shard, the embedding rows of some tokens)."""
        return attrs.evolve(
            self,
            codes=self.codes[index],
            scales=self.scales[index],
            offsets=None if self.offsets is None else self.offsets[index],
        )

    def widened(self, group: int) -> QuantizedWeight:
        """The same values as ``q8`` with ``group``-column groups (lossless: 4-bit codes fit
        a byte, and a 32-column group's scale repeats over its two 16-column halves)."""
        if group not in GROUPS["q8"] or self.group % group:
            raise ValueError(f"cannot widen a {self.format} weight with group {self.group} to q8 group {group}")
        repeat = self.group // group
        return QuantizedWeight(
            codes=self.integer_codes().to(torch.int8),
            scales=self.scales.repeat_interleave(repeat, dim=1),
            offsets=None if self.offsets is None else self.offsets.repeat_interleave(repeat, dim=1),
            format="q8",
            group=group,
            source=self.source,
        )

    @staticmethod
    def stack_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """Parts with the same columns stacked by rows (a fused q/k/v projection). Parts stored
        differently are first widened, losslessly, to one common ``q8`` layout."""
        if not parts:
            raise ValueError("nothing to stack")
        columns = {part.shape[1] for part in parts}
        if len(columns) != 1:
            raise ValueError(f"cannot stack weights with different column counts {sorted(columns)}")
        if len({(part.format, part.group) for part in parts}) > 1:
            group = min(part.group for part in parts)
            parts = [part if (part.format, part.group) == ("q8", group) else part.widened(group) for part in parts]
        with_offsets = any(part.offsets is not None for part in parts)
        offsets = (
            torch.cat([part.offsets if part.offsets is not None else torch.zeros_like(part.scales) for part in parts])
            if with_offsets
            else None
        )
        sources = sorted({part.source for part in parts if part.source})
        return QuantizedWeight(
            codes=torch.cat([part.codes for part in parts]),
            scales=torch.cat([part.scales for part in parts]),
            offsets=offsets,
            format=parts[0].format,
            group=parts[0].group,
            source="+".join(sources),
        )


@runtime_checkable
class QuantizedLinearKernel(Protocol):
    """Multiplies activations by a ``QuantizedWeight`` without expanding it to a dense copy
    that outlives the call.

    ``prepare`` runs once per weight at load time and may re-lay it out for the kernel (the
    result is only ever handed back to this kernel's ``linear``); ``linear`` runs per step.

    A kernel may also round activations to integers before multiplying, each 32-column group
    to its own scale (``x ~ scale_g * q``, ``|q| <= 2**(bits - 1) - 1``, nearest), if it says
    so in an ``activation_bits`` attribute (at least 16: 8-bit rounding changed greedy
    continuations of SmolLM2-135M where 16 bits did not). Without one, products are those
    of the activations as given. The conformance kit allows that rounding's error bound.
    """

    #: Formats it multiplies (a subset of ``QUANT_FORMATS``).
    formats: frozenset[str]

    def prepare(self, weight: QuantizedWeight) -> Any: ...

    def linear(self, x: torch.Tensor, prepared: Any, bias: torch.Tensor | None) -> torch.Tensor:
        """``x [tokens, cols]`` (any float dtype) times the weight's transpose, plus ``bias``:
        ``[tokens, rows]`` in ``x``'s dtype."""
        ...


@attrs.frozen(kw_only=True)
class QuantizedLinearContext:
    """What a quantised-linear backend's factory is given."""

    platform: PlatformInfo
    device: torch.device
    #: The model's activation dtype (what ``linear`` receives and returns).
    dtype: torch.dtype


def keep_linears_as_q8(model: torch.nn.Module, kernel: QuantizedLinearKernel, skip: Sequence[str] = ()) -> int:
    """Round every dense linear of ``model`` that can keep a quantised weight (``Linear``'s
    ``use_quantized``) to q8 and multiply it through ``kernel`` from now on; those named in
    ``skip`` and any whose width no q8 group divides stay as they are. Returns how many."""
    if "q8" not in kernel.formats:
        raise ValueError(f"the quantised-linear kernel multiplies {sorted(kernel.formats)}, not q8")
    rounded = 0
    for name, module in model.named_modules():
        if not getattr(module, "dense", False) or not hasattr(module, "use_quantized") or name in skip:
            continue
        group = next((g for g in GROUPS["q8"][::-1] if module.in_features % g == 0), None)  # widest first
        if group is not None:
            module.use_quantized(QuantizedWeight.q8_of(module.weight, group, source=name), kernel)
            rounded += 1
    return rounded
