"""Conformance suite for quantised-linear backends: a candidate against a float64 oracle.

Subclass it in your plugin's tests::

    class TestMyQuantizedLinear(QuantizedLinearSuite):
        component = "my-quantized-linear"   # the record name

The candidate is built through its record's factory and given random weights in every format
it declares (``q4``; ``q8`` with 16- and 32-column groups; with and without offsets), on odd
shapes (one row, row and column counts that are no power of two, one token, many tokens, no
tokens) and with a bias or none. Each ``linear`` output is compared with the float64 product
of the very same activations and the weight's own ``dequantize``. A backend must refuse, in
``prepare``, a format it does not declare.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import pytest
import torch

from powertrain.interfaces import QuantizedLinearContext, QuantizedLinearKernel, QuantizedWeight
from powertrain.testing.base import ComponentSuite, Subject, generator

__all__ = ["QuantizedLinearSuite", "activation_rounding_bound", "random_quantized_weight", "scaled_errors"]

#: (format, group, with offsets) cases; a backend runs those whose format it declares.
WEIGHT_CASES = (("q4", 32, True), ("q4", 32, False), ("q8", 32, False), ("q8", 32, True), ("q8", 16, True))


def random_quantized_weight(
    gen: torch.Generator, rows: int, cols: int, format: str, group: int, offsets: bool
) -> QuantizedWeight:
    """A random weight: codes over the format's whole range, scales of both signs and mixed
    magnitudes, offsets (when asked) of both signs."""
    groups = cols // group
    if format == "q4":
        codes = torch.randint(0, 256, (rows, cols // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    else:
        codes = torch.randint(-128, 128, (rows, cols), generator=gen, dtype=torch.int32).to(torch.int8)
    magnitude = torch.exp(torch.randn(rows, groups, generator=gen)) * 1e-2
    sign = torch.where(torch.rand(rows, groups, generator=gen) < 0.2, -1.0, 1.0)
    return QuantizedWeight(
        codes=codes,
        scales=(magnitude * sign).float(),
        offsets=(torch.randn(rows, groups, generator=gen) * 0.05).float() if offsets else None,
        format=format,
        group=group,
        source=f"random {format} group {group}",
    )


def _case_id(case: tuple[str, int, bool]) -> str:
    return f"{case[0]}-g{case[1]}-{'offsets' if case[2] else 'no-offsets'}"


def scaled_errors(
    got: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight, want: torch.Tensor, activation_bits: int | None = None
) -> torch.Tensor:
    """|got - want| over the sum of the products' magnitudes, |x| @ |W|^T, per output element;
    for a kernel that rounds activations to ``activation_bits``-bit integers (see
    ``QuantizedLinearKernel``), the part of it that rounding's bound does not explain.

    That sum is what rounding scales with: a dot product whose terms cancel has a tiny result
    but the rounding of its large terms, so a relative error of the result would flake on a
    single-row weight, while this stays below a few units of the dtype's roundoff for any
    correct kernel (and is of order 1 for a wrong scale, offset or nibble).
    """
    dense = weight.dequantize(torch.float64)
    magnitude = x.abs() @ dense.abs().T
    error = (got - want).abs()
    if activation_bits is not None:
        error = (error - activation_rounding_bound(x, weight, activation_bits)).clamp_min(0)
    return error / magnitude.clamp_min(torch.finfo(torch.float32).tiny)


def activation_rounding_bound(x: torch.Tensor, weight: QuantizedWeight, bits: int) -> torch.Tensor:
    """``[tokens, rows]``: how far rounding each 32-column group of ``x`` to ``bits``-bit
    integers can move each output of ``x @ weight.T``: half a step, ``max|x_g| /
    (2**(bits - 1) - 1)``, per activation, times the weights it meets.

    Those are ``|scale * code| + |offset|``, not the dense ``|scale * code + offset|``: a
    kernel may take the offsets' term from the exact sums of ``x`` (cpu-native does) and the
    codes' from the rounded activations, and then the codes' rounding is not cancelled where
    an offset cancels the code. The embedded SmolLM2 (Q4_1) showed it: a product with a
    2,824 outlier activation moved by 0.27, past the dense weights' 0.21.
    """
    rows, cols = weight.shape
    groups = cols // weight.group
    codes = weight.integer_codes().view(rows, groups, weight.group).to(torch.float64)
    met = (codes * weight.scales.to(torch.float64).unsqueeze(-1)).abs()
    if weight.offsets is not None:
        met = met + weight.offsets.to(torch.float64).abs().unsqueeze(-1)
    weight_mass = met.reshape(rows, cols // 32, 32).sum(-1)
    group_max = x.abs().to(torch.float64).reshape(-1, cols // 32, 32).amax(-1)
    return group_max @ weight_mass.T / (2 * (2 ** (bits - 1) - 1))


def _activation_bits(kernel: QuantizedLinearKernel) -> int | None:
    """The kernel's declared activation rounding (None: none), refused below 16 bits."""
    bits = getattr(kernel, "activation_bits", None)
    if bits is None or bits >= 32:
        return None
    assert isinstance(bits, int) and bits >= 16, f"activation_bits {bits!r}: the contract allows 16 or more"
    return bits


class QuantizedLinearSuite(ComponentSuite):
    """Compares a quantised-linear backend with a float64 product over the dequantised weight.

    Class attributes a subclass may set:

    * ``dtypes``: activation dtypes to test;
    * ``tolerances``: dtype -> the largest error of an output element, scaled by the sum of
      its products' magnitudes (``scaled_errors``). float32: only accumulation order differs
      from the oracle (the weight values are exact in float32), 1e-5 admits any order over a
      few thousand columns; bfloat16 rounds the output (unit roundoff 3.9e-3), and a kernel may
      round partial sums, hence 2e-2. A wrong scale, offset, nibble order or group is of order 1.

    A kernel that declares ``activation_bits`` (``QuantizedLinearKernel``) is also allowed
    its rounding's bound, element by element; fewer than 16 bits fail the suite.
    """

    kind: ClassVar[str] = "quantized_linear"
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16)
    tolerances: ClassVar[Mapping[torch.dtype, float]] = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

    def build(self, subject: Subject, dtype: torch.dtype) -> QuantizedLinearKernel:
        context = QuantizedLinearContext(
            platform=subject.platform, device=torch.device(subject.platform.device_type), dtype=dtype
        )
        kernel = subject.provided.record.factory(context)
        assert isinstance(kernel, QuantizedLinearKernel), f"factory built {type(kernel).__name__}"
        declared = subject.provided.record.capabilities
        assert kernel.formats <= declared, (
            f"the kernel multiplies {sorted(kernel.formats)}, declared {sorted(declared)}"
        )
        return kernel

    def check(
        self,
        subject: Subject,
        seed: int,
        *,
        case: tuple[str, int, bool],
        rows: int,
        cols: int,
        tokens: int,
        dtype: torch.dtype = torch.float32,
        bias: bool = False,
    ) -> None:
        format, group, offsets = case
        self.require(subject.provided, format)
        gen = generator(seed)
        weight = random_quantized_weight(gen, rows, cols, format, group, offsets)
        x = torch.randn(tokens, cols, generator=gen).to(dtype)
        bias_tensor = torch.randn(rows, generator=gen).to(dtype) if bias else None
        device = torch.device(subject.platform.device_type)
        kernel = self.build(subject, dtype)
        before = (weight.codes.clone(), weight.scales.clone())
        prepared = kernel.prepare(weight)
        got = kernel.linear(x.to(device), prepared, None if bias_tensor is None else bias_tensor.to(device))
        assert torch.equal(weight.codes, before[0]) and torch.equal(weight.scales, before[1]), (
            "prepare changed its input"
        )
        assert got.shape == (tokens, rows) and got.dtype == dtype, f"got {got.dtype} {list(got.shape)}"
        want = x.double() @ weight.dequantize(torch.float64).T
        if bias_tensor is not None:
            want = want + bias_tensor.double()
        if tokens == 0:
            return
        worst = float(scaled_errors(got.double().cpu(), x.double(), weight, want, _activation_bits(kernel)).max())
        assert worst < self.tolerances[dtype], (
            f"{format} group {group} offsets={offsets} [{tokens}x{cols}] x [{rows}x{cols}]^T in {dtype}: "
            f"worst scaled error {worst:.2e} > {self.tolerances[dtype]:.0e} (seed {seed})"
        )

    @pytest.mark.parametrize(
        "case", WEIGHT_CASES, ids=lambda case: f"{case[0]}-g{case[1]}-{'off' if case[2] else 'nooff'}"
    )
    @pytest.mark.parametrize(("rows", "cols"), [(1, 32), (37, 96), (257, 544)])
    @pytest.mark.parametrize("tokens", [1, 3, 17, 64])
    def test_random_weights(
        self, subject: Subject, case: tuple[str, int, bool], rows: int, cols: int, tokens: int, seed: int
    ) -> None:
        self.check(subject, seed, case=case, rows=rows, cols=cols, tokens=tokens)

    @pytest.mark.parametrize("case", WEIGHT_CASES[:1] + WEIGHT_CASES[-1:], ids=["q4", "q8-g16"])
    @pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
    @pytest.mark.parametrize("tokens", [1, 33, 130])
    def test_other_activation_dtypes(
        self, subject: Subject, case: tuple[str, int, bool], dtype: torch.dtype, tokens: int, seed: int
    ) -> None:
        if dtype not in self.dtypes:  # a subclass narrowed ``dtypes`` to what its kernel takes
            pytest.skip(f"{dtype} is not among this suite's dtypes")
        self.check(subject, seed, case=case, rows=70, cols=160, tokens=tokens, dtype=dtype, bias=True)

    @pytest.mark.parametrize("case", WEIGHT_CASES[:1] + WEIGHT_CASES[-1:], ids=["q4", "q8-g16"])
    @pytest.mark.parametrize("tokens", [0, 5])
    def test_bias_and_no_tokens(self, subject: Subject, case: tuple[str, int, bool], tokens: int, seed: int) -> None:
        self.check(subject, seed, case=case, rows=45, cols=64, tokens=tokens, bias=True)

    def test_prepared_weight_serves_many_calls(self, subject: Subject, seed: int) -> None:
        """One ``prepare``, then calls of different sizes: each equals the oracle."""
        format = sorted(subject.provided.record.capabilities)[0]
        gen = generator(seed)
        weight = random_quantized_weight(gen, 29, 64, format, 32, True)
        kernel = self.build(subject, torch.float32)
        prepared = kernel.prepare(weight)
        device = torch.device(subject.platform.device_type)
        dense = weight.dequantize(torch.float64)
        for tokens in (7, 1, 40, 2):
            x = torch.randn(tokens, 64, generator=gen)
            got = kernel.linear(x.to(device), prepared, None).double().cpu()
            errors = scaled_errors(got, x.double(), weight, x.double() @ dense.T, _activation_bits(kernel))
            assert float(errors.max()) < self.tolerances[torch.float32], seed

    def test_refuses_formats_it_does_not_declare(self, subject: Subject, seed: int) -> None:
        undeclared = [case for case in WEIGHT_CASES if case[0] not in subject.provided.record.capabilities]
        if not undeclared:  # both formats declared: there is no format the kernel may refuse
            pytest.skip(f"{subject.provided.record.name} declares every format: nothing to refuse")
        format, group, offsets = undeclared[0]
        weight = random_quantized_weight(generator(seed), 8, 64, format, group, offsets)
        with pytest.raises((ValueError, TypeError), match=format):
            self.build(subject, torch.float32).prepare(weight)
