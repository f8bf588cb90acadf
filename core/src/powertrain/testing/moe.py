"""Conformance suite for MoE backends: a candidate against a float64 oracle.

Subclass it in your plugin's tests::

    class TestMyMoE(MoEBackendSuite):
        component = "my-moe"                # the record name
        hidden_size = 256                   # optional: widths your kernel supports

The candidate is built through its record's factory and gets random experts (float,
or FP8 block-scaled where it declares ``fp8-block``) through ``prepare``; every
``forward`` / ``forward_grouped`` output is compared with a per-token loop in
float64 over the very same (rounded, or dequantized) weights and inputs. Routing
is random but shaped like the cases kernels get wrong: experts no token picks, one
expert taking most pairs, an expert reached from every top-k slot, a single token,
ragged token counts, no tokens, and expert-parallel slices whose foreign ids must
contribute nothing. Declared dtypes (``fp32``, ``bf16``, ``fp16``) decide which
dtypes run; ``swiglu-limit`` adds DeepSeek-V4's clamped SwiGLU on inputs that cross the limit,
``fp4`` its packed FP4 experts. A backend must refuse, in ``prepare``, experts that need a
capability it does not declare.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import pytest
import torch

from powertrain.components import Availability
from powertrain.interfaces import ExpertWeights, MoEBackend, MoEBackendContext, MoERouter
from powertrain.interfaces.moe import RoutingConfig
from powertrain.layers.moe import route
from powertrain.loader.fp4 import dequantize_fp4
from powertrain.loader.fp8 import dequantize_blocks, quantize_blocks
from powertrain.testing.base import ComponentSuite, Subject, generator
from powertrain.testing.checkpoints import quantize_fp4

__all__ = ["MoEBackendSuite", "reference_moe", "row_errors"]

#: The capability tag that makes a backend responsible for a dtype.
DTYPE_CAPABILITIES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


# --------------------------------------------------------------------------- the oracle


def _expert64(w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    gate, up = (w13 @ x).chunk(2)
    if swiglu_limit is not None:  # transformers' DeepseekV4Experts._apply_gate
        gate, up = gate.clamp(max=swiglu_limit), up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return w2 @ (torch.nn.functional.silu(gate) * up)


def reference_moe(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    first_expert: int = 0,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """``sum_k weight[t,k] * expert_{id[t,k]}(hidden[t])`` in float64, one token and slot at a time.

    ``w13``/``w2`` hold the local experts (already dequantized); ids outside
    ``first_expert ... first_expert + len(w13) - 1`` contribute nothing. ``swiglu_limit``
    clamps the SwiGLU as ``ExpertWeights.swiglu_limit`` says.
    """
    hidden, w13, w2 = hidden.double().cpu(), w13.double().cpu(), w2.double().cpu()
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for token in range(hidden.shape[0]):
        for slot in range(topk_ids.shape[1]):
            local = int(topk_ids[token, slot]) - first_expert
            if 0 <= local < w13.shape[0]:
                weight = float(topk_weights[token, slot])
                out[token] += weight * _expert64(w13[local], w2[local], hidden[token], swiglu_limit)
    return out


def row_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per token: ``|got - want| / |want|`` over the row, float64; rows the oracle
    makes zero are measured against the mean row norm (or absolutely, if all are zero)."""
    norms = want.norm(dim=-1)
    typical = float(norms.mean()) if norms.numel() and float(norms.max()) > 0 else 1.0
    return (got - want).norm(dim=-1) / torch.where(norms > 0, norms, typical)


def _reference_grouped(
    hidden: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor, swiglu_limit: float | None = None
) -> torch.Tensor:
    hidden, w13, w2 = hidden.double().cpu(), w13.double().cpu(), w2.double().cpu()
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    row = 0
    for local, count in enumerate(counts):
        for _ in range(count):
            out[row] = _expert64(w13[local], w2[local], hidden[row], swiglu_limit)
            row += 1
    return out


def _clamped_share(hidden: torch.Tensor, expert_of_row: torch.Tensor, w13: torch.Tensor, limit: float) -> float:
    """The share of SwiGLU inputs (gate above ``limit``, up outside +-``limit``) that the clamp
    changes, over rows ``hidden`` each sent to local expert ``expert_of_row``."""
    pre = torch.einsum("rnh,rh->rn", w13.double()[expert_of_row], hidden.double())
    gate, up = pre.chunk(2, dim=-1)
    return float(((gate > limit).sum() + (up.abs() > limit).sum()) / pre.numel())


# --------------------------------------------------------------------------- random inputs


def _randint(gen: torch.Generator, low: int, high: int) -> int:
    """Uniform in [low, high]."""
    return int(torch.randint(low, high + 1, (1,), generator=gen).item())


def _distinct_ids(
    gen: torch.Generator, num_tokens: int, top_k: int, pool: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``top_k`` different experts per token, drawn from ``pool`` (as a router picks
    them), with odds proportional to ``bias`` where given."""
    odds = torch.ones(len(pool)) if bias is None else bias.float()
    picks = torch.multinomial(odds.expand(num_tokens, -1), top_k, replacement=False, generator=gen)
    return pool[picks].to(torch.int32).reshape(num_tokens, top_k)


def _block_magnitudes(gen: torch.Generator, shape: tuple[int, int, int], block: tuple[int, int]) -> torch.Tensor:
    """A factor per ``block`` of magnitude between ~1/5 and ~5, spread over its elements."""
    experts, rows, cols = shape
    per_block = torch.exp(0.8 * torch.randn(experts, -(-rows // block[0]), -(-cols // block[1]), generator=gen))
    return per_block.repeat_interleave(block[0], dim=1)[:, :rows].repeat_interleave(block[1], dim=2)[:, :, :cols]


def _routing_weights(gen: torch.Generator, num_tokens: int, top_k: int) -> torch.Tensor:
    # Positive and unequal, like scaled router scores; never all ones, so a backend
    # that ignores or misplaces them is caught.
    return 0.1 + 2.4 * torch.rand(num_tokens, top_k, generator=gen)


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- the suite


class MoEBackendSuite(ComponentSuite):
    """Compares a MoE backend with a float64 per-token reference.

    Class attributes a subclass may set:

    * ``dtypes``: the dtypes to test (each runs only if the record declares its tag);
    * ``hidden_size``, ``intermediate_size``, ``num_experts``: layer widths, for
      kernels that only support some (``fp8_hidden_size`` / ``fp8_intermediate_size``
      for the FP8 test, multiples of ``fp8_block_shape``);
    * ``tolerances`` (float experts) and ``fp8_tolerances`` (FP8 experts): dtype ->
      the largest relative error of a token's output row (see the comment below).
      Loosen only with a reason you can state, since this is what "conformant" means.
    """

    kind: ClassVar[str] = "moe"
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)
    hidden_size: ClassVar[int] = 128
    intermediate_size: ClassVar[int] = 64
    num_experts: ClassVar[int] = 16
    fp8_block_shape: ClassVar[tuple[int, int]] = (128, 128)
    fp8_hidden_size: ClassVar[int] = 256
    fp8_intermediate_size: ClassVar[int] = 256
    # Tolerances bound each token's relative error, |got - want| / |want| over its
    # output row (a row the oracle makes zero, all of its experts on another rank,
    # is measured against the batch's mean row norm). Measured per row rather than
    # per element because the output is a signed sum of up to top_k expert outputs:
    # an element near zero after cancellation carries the rounding of the large
    # terms, so elementwise bounds either flake or must be loose everywhere, while a
    # row's relative error is a stable average over hidden_size elements. Any
    # routing, weighting, scale or grouping mistake is of order 1.
    #
    # float32: the oracle sees the same float32 values, so only accumulation order
    # differs (torch-grouped: ~1e-6); 1e-5 also admits GPU GEMMs (TF32 off). fp16
    # has 11 significant bits (unit roundoff u = 4.9e-4) and bf16 8 (u = 3.9e-3); a
    # kernel rounds at least the gate/up output, the activation and the result, so
    # a few u: torch-grouped measures up to ~2u on random data, the limits are ~10u.
    tolerances: ClassVar[Mapping[torch.dtype, float]] = {
        torch.float32: 1e-5,
        torch.float16: 5e-3,
        torch.bfloat16: 3e-2,
    }
    # The FP8 oracle multiplies the dequantized weights with unquantized activations.
    # Block-scaled FP8 GEMMs (DeepGEMM, DeepSeek's own fp8_gemm) also quantize the
    # activations per 1x128 group to e4m3 (3 mantissa bits: up to 6.25% relative
    # rounding, ~2.5% RMS), before both GEMMs: a row's relative error is then ~4%.
    # 0.1 accepts that and still fails any wrong scale, block or expert.
    fp8_tolerances: ClassVar[Mapping[torch.dtype, float]] = {
        torch.float32: 0.1,
        torch.float16: 0.1,
        torch.bfloat16: 0.1,
    }
    # The FP4 oracle multiplies the dequantized FP4 weights (exact in float32) with unquantized
    # activations; FP4 GEMMs (DeepSeek's fp4_gemm) quantize activations to FP8 as above.
    fp4_tolerances: ClassVar[Mapping[torch.dtype, float]] = fp8_tolerances

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        # Parametrised here rather than with marks so a subclass's ClassVars take effect.
        if "dtype" in metafunc.fixturenames:
            metafunc.parametrize("dtype", self.dtypes, ids=_dtype_id)

    # ----------------------------------------------------------------------- building

    def _build(self, subject: Subject, dtype: torch.dtype) -> tuple[Any, torch.device]:
        self.require(subject.provided, DTYPE_CAPABILITIES[dtype])
        device = torch.device(subject.platform.device_type)
        backend = subject.provided.record.factory(
            MoEBackendContext(platform=subject.platform, device=device, dtype=dtype)
        )
        assert isinstance(backend, MoEBackend), (
            f"{subject.provided.record.name}'s factory returned {backend!r}, which does not satisfy MoEBackend"
        )
        return backend, device

    def _float_experts(
        self, gen: torch.Generator, local_experts: int, dtype: torch.dtype, hidden: int, intermediate: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random experts whose matmuls keep unit variance, rounded to ``dtype`` on the CPU."""
        w13 = torch.randn(local_experts, 2 * intermediate, hidden, generator=gen) / hidden**0.5
        w2 = torch.randn(local_experts, hidden, intermediate, generator=gen) / intermediate**0.5
        return w13.to(dtype), w2.to(dtype)

    def _prepare(
        self,
        backend: Any,
        device: torch.device,
        w13: torch.Tensor,
        w2: torch.Tensor,
        num_experts: int,
        first_expert: int = 0,
        **fields: Any,
    ) -> Any:
        """``backend.prepare`` of these experts on ``device``; ``fields``: further ExpertWeights fields."""
        weights = ExpertWeights(
            w13=w13.to(device),
            w2=w2.to(device),
            num_experts=num_experts,
            first_expert=first_expert,
            **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in fields.items()},
        )
        return backend.prepare(weights)

    # ----------------------------------------------------------------------- running

    def _check_forward(
        self,
        backend: Any,
        prepared: Any,
        device: torch.device,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        want: torch.Tensor,
        where: str,
        quantized: str = "",
    ) -> None:
        inputs = (hidden.to(device), topk_ids.to(device), topk_weights.to(device))
        untouched = tuple(t.clone() for t in inputs)
        got = backend.forward(*inputs, prepared)
        for name, before, after in zip(("hidden", "topk_ids", "topk_weights"), untouched, inputs, strict=True):
            assert torch.equal(before, after), f"forward modified its {name} argument: {where}"
        self._compare(got, want, hidden.dtype, where, quantized)

    def _compare(self, got: Any, want: torch.Tensor, dtype: torch.dtype, where: str, quantized: str = "") -> None:
        """``quantized``: "" (float experts), "FP8" or "FP4", which picks the tolerances."""
        assert isinstance(got, torch.Tensor), f"returned {type(got).__name__}, not a tensor: {where}"
        assert tuple(got.shape) == tuple(want.shape), (
            f"output shape {tuple(got.shape)}, expected {tuple(want.shape)}: {where}"
        )
        assert got.dtype == dtype, f"output dtype {got.dtype}, expected the input's {dtype}: {where}"
        got64 = got.detach().cpu().double()
        assert torch.isfinite(got64).all(), f"output has non-finite values: {where}"
        limit = {"": self.tolerances, "FP8": self.fp8_tolerances, "FP4": self.fp4_tolerances}[quantized][dtype]
        error = row_errors(got64, want)
        if error.numel() and float(error.max()) > limit:
            worst = int(error.argmax())
            pytest.fail(
                f"token {worst}'s output row is off by {float(error[worst]):.3g} relative to the float64 oracle "
                f"(limit {limit} for {_dtype_id(dtype)}{f' with {quantized} experts' if quantized else ''}; "
                f"{int((error > limit).sum())} of {error.numel()} rows over it): {where}"
            )

    def _routed_case(
        self,
        subject: Subject,
        dtype: torch.dtype,
        seed: int,
        what: str,
        ids_of: Callable[[torch.Generator], torch.Tensor],
        num_tokens: int,
        top_k: int,
    ) -> None:
        """One forward on random experts and hidden states with ``ids_of(gen)`` routing."""
        backend, device = self._build(subject, dtype)
        gen = generator(seed)
        w13, w2 = self._float_experts(gen, self.num_experts, dtype, self.hidden_size, self.intermediate_size)
        prepared = self._prepare(backend, device, w13, w2, self.num_experts)
        hidden = torch.randn(num_tokens, self.hidden_size, generator=gen).to(dtype)
        topk_ids = ids_of(gen)
        topk_weights = _routing_weights(gen, num_tokens, top_k)
        want = reference_moe(hidden, topk_ids, topk_weights, w13, w2)
        where = f"{what}, {num_tokens} tokens, top_k={top_k}, {_dtype_id(dtype)} (seed={seed})"
        self._check_forward(backend, prepared, device, hidden, topk_ids, topk_weights, want, where)

    # ----------------------------------------------------------------------- tests

    @pytest.mark.parametrize("num_tokens", [1, 7, 33], ids=lambda t: f"tokens{t}")
    def test_random_routing(self, subject: Subject, dtype: torch.dtype, num_tokens: int, seed: int) -> None:
        """Random routing over a subset of experts, so some experts get no tokens at all."""
        top_k = 4
        pool = torch.randperm(self.num_experts, generator=generator(seed))[: self.num_experts * 3 // 4]

        def ids_of(gen: torch.Generator) -> torch.Tensor:
            return _distinct_ids(gen, num_tokens, top_k, pool)

        self._routed_case(subject, dtype, seed, f"experts {sorted(pool.tolist())} only", ids_of, num_tokens, top_k)

    def test_batch_invariant(self, subject: Subject, dtype: torch.dtype, seed: int) -> None:
        """A declared 'batch-invariant' backend gives a token the same output bits alone and
        at a random place among 15 others, whose routes crowd its experts or not."""
        self.require(subject.provided, "batch-invariant")
        backend, device = self._build(subject, dtype)
        gen = generator(seed)
        top_k, others = 4, 15
        w13, w2 = self._float_experts(gen, self.num_experts, dtype, self.hidden_size, self.intermediate_size)
        prepared = self._prepare(backend, device, w13, w2, self.num_experts)
        hidden = torch.randn(others + 1, self.hidden_size, generator=gen).to(dtype)
        ids = _distinct_ids(gen, others + 1, top_k, torch.arange(self.num_experts))
        weights = _routing_weights(gen, others + 1, top_k)
        place = _randint(gen, 0, others)
        order = [*range(1, place + 1), 0, *range(place + 1, others + 1)]  # token 0 at ``place``
        alone = backend.forward(hidden[:1].to(device), ids[:1].to(device), weights[:1].to(device), prepared)
        batch = backend.forward(hidden[order].to(device), ids[order].to(device), weights[order].to(device), prepared)[
            place : place + 1
        ]
        assert torch.equal(alone.cpu(), batch.cpu()), (
            f"a token's output differs alone and at position {place} of {others + 1} (largest difference "
            f"{(alone.float() - batch.float()).abs().max().item():.3e}, {_dtype_id(dtype)}, seed={seed}): a backend "
            "declaring 'batch-invariant' must not let the batch change a token's arithmetic"
        )

    def test_cuda_graphs(self, subject: Subject, dtype: torch.dtype, seed: int) -> None:
        """A declared 'cuda-graphs' backend's forward, captured in a CUDA graph and replayed
        with other rows (other tokens, experts and weights, the same count), equals an eager
        forward of those rows bit for bit. It skips where the platform cannot capture."""
        self.require(subject.provided, "cuda-graphs")
        if not subject.platform.cuda_graphs:
            # Capture needs the platform's graph runtime; a backend's forward has no padded or
            # bounded variant to check without it (the attention kit has one: test_cuda_graphs).
            pytest.skip(f"platform {subject.platform.name} here cannot capture CUDA graphs (PlatformInfo.cuda_graphs)")
        backend, device = self._build(subject, dtype)
        gen = generator(seed)
        tokens, top_k = 24, 4
        w13, w2 = self._float_experts(gen, self.num_experts, dtype, self.hidden_size, self.intermediate_size)
        prepared = self._prepare(backend, device, w13, w2, self.num_experts)

        def rows() -> tuple[torch.Tensor, ...]:
            hidden = torch.randn(tokens, self.hidden_size, generator=gen).to(dtype)
            ids = _distinct_ids(gen, tokens, top_k, torch.arange(self.num_experts))
            return hidden.to(device), ids.to(device), _routing_weights(gen, tokens, top_k).to(device)

        static = rows()
        with torch.inference_mode():
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                backend.forward(*static, prepared)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = backend.forward(*static, prepared)
            other = rows()
            for buffer, value in zip(static, other, strict=True):
                buffer.copy_(value)
            graph.replay()
            eager = backend.forward(*other, prepared)
        assert torch.equal(out, eager), (
            f"the replayed graph differs from an eager forward of the same rows ({_dtype_id(dtype)}, seed={seed})"
        )

    def test_one_busy_expert(self, subject: Subject, dtype: torch.dtype, seed: int) -> None:
        """Nearly every token picks the same expert (in a random slot), the rest spread thin."""
        num_tokens, top_k = 41, 3
        busy = _randint(generator(seed), 0, self.num_experts - 1)

        def ids_of(gen: torch.Generator) -> torch.Tensor:
            others = torch.tensor([e for e in range(self.num_experts) if e != busy])
            ids = _distinct_ids(gen, num_tokens, top_k, others)
            slots = torch.randint(0, top_k, (num_tokens,), generator=gen)
            takes = torch.rand(num_tokens, generator=gen) < 0.9
            ids[takes, slots[takes]] = busy
            return ids

        self._routed_case(subject, dtype, seed, f"expert {busy} takes ~90% of tokens", ids_of, num_tokens, top_k)

    def test_expert_in_every_slot(self, subject: Subject, dtype: torch.dtype, seed: int) -> None:
        """One expert reached from each of the top_k slots, so its group mixes slots
        and a backend that pairs rows with the wrong slot's weight is caught."""
        num_tokens, top_k = 24, 6
        target = _randint(generator(seed), 0, self.num_experts - 1)

        def ids_of(gen: torch.Generator) -> torch.Tensor:
            others = torch.tensor([e for e in range(self.num_experts) if e != target])
            ids = _distinct_ids(gen, num_tokens, top_k, others)
            ids[torch.arange(num_tokens), torch.arange(num_tokens) % top_k] = target
            return ids

        self._routed_case(subject, dtype, seed, f"expert {target} in every slot", ids_of, num_tokens, top_k)

    def test_top1(self, subject: Subject, dtype: torch.dtype, seed: int) -> None:
        """top_k = 1 (a single weighted expert per token)."""
        num_tokens = 19

        def ids_of(gen: torch.Generator) -> torch.Tensor:
            return torch.randint(0, self.num_experts, (num_tokens, 1), generator=gen, dtype=torch.int32)

        self._routed_case(subject, dtype, seed, "top-1 routing", ids_of, num_tokens, 1)

    def test_no_tokens(self, subject: Subject, dtype: torch.dtype, seed: int) -> None:
        """An empty batch (an expert-parallel rank may have nothing this step)."""
        backend, device = self._build(subject, dtype)
        gen = generator(seed)
        w13, w2 = self._float_experts(gen, self.num_experts, dtype, self.hidden_size, self.intermediate_size)
        prepared = self._prepare(backend, device, w13, w2, self.num_experts)
        empty = torch.empty(0, self.hidden_size, dtype=dtype)
        ids, weights = torch.empty(0, 4, dtype=torch.int32), torch.empty(0, 4)
        want = torch.empty(0, self.hidden_size, dtype=torch.float64)
        self._check_forward(backend, prepared, device, empty, ids, weights, want, f"no tokens (seed={seed})")
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
        got = backend.forward_grouped(empty.to(device), counts, prepared)
        self._compare(got, want, dtype, f"forward_grouped with no rows (seed={seed})")

    @pytest.mark.parametrize("num_tokens", [1, 29], ids=lambda t: f"tokens{t}")
    def test_expert_parallel_slice(self, subject: Subject, dtype: torch.dtype, num_tokens: int, seed: int) -> None:
        """A rank holding experts first..first+local-1 of more: ids outside contribute nothing."""
        backend, device = self._build(subject, dtype)
        gen = generator(seed)
        global_experts, top_k = 4 * self.num_experts, 4
        first_expert = _randint(gen, 1, global_experts - self.num_experts)
        w13, w2 = self._float_experts(gen, self.num_experts, dtype, self.hidden_size, self.intermediate_size)
        prepared = self._prepare(backend, device, w13, w2, global_experts, first_expert)
        hidden = torch.randn(num_tokens, self.hidden_size, generator=gen).to(dtype)
        local = torch.arange(first_expert, first_expert + self.num_experts)
        foreign = torch.tensor([e for e in range(global_experts) if not first_expert <= e < first_expert + len(local)])
        # Local experts three times as likely as foreign ones, so both are common; the
        # first token mixes the two, the last (if there are two) is entirely foreign.
        odds = torch.ones(global_experts)
        odds[local] = 3.0
        topk_ids = _distinct_ids(gen, num_tokens, top_k, torch.arange(global_experts), odds)
        topk_ids[0] = torch.cat([_distinct_ids(gen, 1, 2, local)[0], _distinct_ids(gen, 1, top_k - 2, foreign)[0]])
        if num_tokens > 1:
            topk_ids[-1] = _distinct_ids(gen, 1, top_k, foreign)[0]
        topk_weights = _routing_weights(gen, num_tokens, top_k)
        want = reference_moe(hidden, topk_ids, topk_weights, w13, w2, first_expert)
        where = (
            f"local experts {first_expert}..{first_expert + self.num_experts - 1} of {global_experts}, "
            f"{num_tokens} tokens, {_dtype_id(dtype)} (seed={seed})"
        )
        self._check_forward(backend, prepared, device, hidden, topk_ids, topk_weights, want, where)

    def test_forward_grouped(self, subject: Subject, dtype: torch.dtype, seed: int) -> None:
        """Rows already grouped by local expert (some groups empty), unweighted, as after dispatch."""
        backend, device = self._build(subject, dtype)
        gen = generator(seed)
        w13, w2 = self._float_experts(gen, self.num_experts, dtype, self.hidden_size, self.intermediate_size)
        prepared = self._prepare(backend, device, w13, w2, 2 * self.num_experts, self.num_experts)
        counts = torch.randint(1, 9, (self.num_experts,), generator=gen)
        counts[torch.randperm(self.num_experts, generator=gen)[: self.num_experts // 3]] = 0
        hidden = torch.randn(int(counts.sum()), self.hidden_size, generator=gen).to(dtype)
        want = _reference_grouped(hidden, counts.tolist(), w13, w2)
        got = backend.forward_grouped(hidden.to(device), counts.to(device), prepared)
        self._compare(got, want, dtype, f"forward_grouped, rows per expert {counts.tolist()} (seed={seed})")

    def test_fp8_block_scaled(self, subject: Subject, dtype: torch.dtype, seed: int) -> None:
        """FP8 e4m3 experts with float32 block scales, through forward and forward_grouped."""
        self.require(subject.provided, "fp8-block")
        backend, device = self._build(subject, dtype)
        gen = generator(seed)
        hidden_size, intermediate, block = self.fp8_hidden_size, self.fp8_intermediate_size, self.fp8_block_shape
        w13, w2 = self._float_experts(gen, self.num_experts, torch.float32, hidden_size, intermediate)
        # Blocks of very different magnitude, so a scale applied to the wrong block shows.
        w13 = w13 * _block_magnitudes(gen, tuple(w13.shape), block)
        w2 = w2 * _block_magnitudes(gen, tuple(w2.shape), block)
        (q13, s13), (q2, s2) = quantize_blocks(w13, block), quantize_blocks(w2, block)
        prepared = self._prepare(
            backend, device, q13, q2, self.num_experts, w13_scale=s13, w2_scale=s2, block_shape=block
        )
        real13, real2 = dequantize_blocks(q13, s13, block), dequantize_blocks(q2, s2, block)

        num_tokens, top_k = 27, 4
        hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(dtype)
        topk_ids = _distinct_ids(gen, num_tokens, top_k, torch.arange(self.num_experts))
        topk_weights = _routing_weights(gen, num_tokens, top_k)
        want = reference_moe(hidden, topk_ids, topk_weights, real13, real2)
        where = f"FP8 {block[0]}x{block[1]} blocks, {num_tokens} tokens, {_dtype_id(dtype)} (seed={seed})"
        self._check_forward(backend, prepared, device, hidden, topk_ids, topk_weights, want, where, "FP8")

        counts = torch.randint(0, 5, (self.num_experts,), generator=gen)
        rows = torch.randn(int(counts.sum()), hidden_size, generator=gen).to(dtype)
        got = backend.forward_grouped(rows.to(device), counts.to(device), prepared)
        want = _reference_grouped(rows, counts.tolist(), real13, real2)
        self._compare(got, want, dtype, f"forward_grouped, {where}", "FP8")

    #: DeepSeek-V4's swiglu_limit; the swiglu-limit test draws hidden states large enough to cross it.
    swiglu_limit: ClassVar[float] = 10.0

    def test_swiglu_limit(self, subject: Subject, dtype: torch.dtype, seed: int) -> None:
        """Clamped SwiGLU (DeepSeek-V4), through forward and forward_grouped, on hidden states
        scaled so that the clamp changes a good share of the gate/up values (asserted, so a
        backend computing plain SwiGLU fails), and on unit-scale ones (so a backend computing
        another gate than SiLU fails)."""
        self.require(subject.provided, "swiglu-limit")
        backend, device = self._build(subject, dtype)
        gen = generator(seed)
        limit = self.swiglu_limit
        w13, w2 = self._float_experts(gen, self.num_experts, dtype, self.hidden_size, self.intermediate_size)
        prepared = self._prepare(backend, device, w13, w2, self.num_experts, swiglu_limit=limit)

        # Gate/up values are ~N(0, scale**2): at 1.3 * limit about 30% of them are clamped.
        scale = limit * (1.0 + 0.6 * float(torch.rand(1, generator=gen)))
        num_tokens, top_k = 23, 4
        hidden = (scale * torch.randn(num_tokens, self.hidden_size, generator=gen)).to(dtype)
        topk_ids = _distinct_ids(gen, num_tokens, top_k, torch.arange(self.num_experts))
        topk_weights = _routing_weights(gen, num_tokens, top_k)
        where = f"swiglu_limit {limit}, hidden x{scale:.3g}, {num_tokens} tokens, {_dtype_id(dtype)} (seed={seed})"
        share = _clamped_share(hidden.repeat_interleave(top_k, dim=0), topk_ids.reshape(-1).long(), w13, limit)
        assert share > 0.15, f"the clamp changes only {share:.1%} of the SwiGLU inputs, too few to test it: {where}"
        want = reference_moe(hidden, topk_ids, topk_weights, w13, w2, swiglu_limit=limit)
        plain = reference_moe(hidden, topk_ids, topk_weights, w13, w2)
        assert float(row_errors(plain, want).min()) > 10 * self.tolerances[dtype], (
            f"plain SwiGLU would pass this test: {where}"
        )
        self._check_forward(backend, prepared, device, hidden, topk_ids, topk_weights, want, where)
        # At unit scale the clamp rarely acts and the gate's own shape decides: at the scale
        # above, x * sigmoid(1.702 x) in place of SiLU moves rows by only 0.6-1.9%, inside
        # bfloat16's tolerance; here by far more.
        small = torch.randn(num_tokens, self.hidden_size, generator=gen).to(dtype)
        want = reference_moe(small, topk_ids, topk_weights, w13, w2, swiglu_limit=limit)
        self._check_forward(backend, prepared, device, small, topk_ids, topk_weights, want, f"unit scale, {where}")

        counts = torch.randint(0, 6, (self.num_experts,), generator=gen)
        rows = (scale * torch.randn(int(counts.sum()), self.hidden_size, generator=gen)).to(dtype)
        got = backend.forward_grouped(rows.to(device), counts.to(device), prepared)
        want = _reference_grouped(rows, counts.tolist(), w13, w2, limit)
        self._compare(got, want, dtype, f"forward_grouped, {where}")

        # Without a limit the same backend computes plain SwiGLU again.
        prepared = self._prepare(backend, device, w13, w2, self.num_experts)
        self._check_forward(backend, prepared, device, hidden, topk_ids, topk_weights, plain, f"no limit, {where}")

    def test_fp4_experts(self, subject: Subject, dtype: torch.dtype, seed: int) -> None:
        """Packed FP4 experts (e2m1, ue8m0 per 32 columns), through forward and forward_grouped,
        against the float64 oracle on their dequantized weights."""
        self.require(subject.provided, "fp4")
        backend, device = self._build(subject, dtype)
        gen = generator(seed)
        w13, w2 = self._float_experts(gen, self.num_experts, torch.float32, self.hidden_size, self.intermediate_size)
        # Groups of 32 columns of very different magnitude, so a scale applied to the wrong group shows.
        w13 = w13 * _block_magnitudes(gen, tuple(w13.shape), (1, 32))
        w2 = w2 * _block_magnitudes(gen, tuple(w2.shape), (1, 32))
        (q13, s13), (q2, s2) = quantize_fp4(w13), quantize_fp4(w2)
        q13, q2 = q13.view(torch.uint8), q2.view(torch.uint8)
        prepared = self._prepare(backend, device, q13, q2, self.num_experts, w13_scale=s13, w2_scale=s2, fp4=True)
        real13, real2 = dequantize_fp4(q13, s13), dequantize_fp4(q2, s2)
        assert not torch.equal(real13, w13), "FP4 rounding changed nothing: the test would not see a missed scale"

        num_tokens, top_k = 27, 4
        hidden = torch.randn(num_tokens, self.hidden_size, generator=gen).to(dtype)
        topk_ids = _distinct_ids(gen, num_tokens, top_k, torch.arange(self.num_experts))
        topk_weights = _routing_weights(gen, num_tokens, top_k)
        want = reference_moe(hidden, topk_ids, topk_weights, real13, real2)
        where = f"FP4 experts, {num_tokens} tokens, {_dtype_id(dtype)} (seed={seed})"
        self._check_forward(backend, prepared, device, hidden, topk_ids, topk_weights, want, where, "FP4")

        counts = torch.randint(0, 5, (self.num_experts,), generator=gen)
        rows = torch.randn(int(counts.sum()), self.hidden_size, generator=gen).to(dtype)
        got = backend.forward_grouped(rows.to(device), counts.to(device), prepared)
        want = _reference_grouped(rows, counts.tolist(), real13, real2)
        self._compare(got, want, dtype, f"forward_grouped, {where}", "FP4")

    def test_refuses_experts_needing_what_it_does_not_declare(self, subject: Subject, seed: int) -> None:
        """Experts with a clamped SwiGLU or packed FP4 weights, given to a backend that does not
        declare ``swiglu-limit`` / ``fp4``: ``prepare`` raises ValueError naming the backend,
        never computes something else."""
        declared = subject.provided.record.capabilities
        # A backend running both has nothing to refuse (test_swiglu_limit / test_fp4_experts check it).
        if {"swiglu-limit", "fp4"} <= declared:
            pytest.skip(f"{subject.provided.record.name} declares both swiglu-limit and fp4")
        dtype = next((d for d in self.dtypes if DTYPE_CAPABILITIES[d] in declared), None)
        if dtype is None:  # the suite's dtypes are none this backend runs: it cannot be built to ask
            pytest.skip(f"{subject.provided.record.name} declares none of the dtypes {self.dtypes}")
        backend, device = self._build(subject, dtype)
        gen = generator(seed)
        w13, w2 = self._float_experts(gen, 2, dtype, self.hidden_size, self.intermediate_size)
        cases = {}
        if "swiglu-limit" not in declared:
            cases["swiglu-limit"] = dict(w13=w13, w2=w2, swiglu_limit=self.swiglu_limit)
        if "fp4" not in declared:
            (q13, s13), (q2, s2) = quantize_fp4(w13), quantize_fp4(w2)
            cases["fp4"] = dict(
                w13=q13.view(torch.uint8), w2=q2.view(torch.uint8), w13_scale=s13, w2_scale=s2, fp4=True
            )
        name = subject.provided.record.name
        for tag, fields in cases.items():
            experts = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
            with pytest.raises(ValueError) as refused:
                backend.prepare(ExpertWeights(num_experts=2, **experts))
            assert name in str(refused.value), f"the refusal of {tag} experts does not name {name}: {refused.value}"

    # ----------------------------------------------------------------------- routing

    #: Routing configs a fused gating op is asked about: DeepSeek-V3's (sigmoid, noaux_tc
    #: with a correction bias, groups), V2's (softmax, group-limited), plain top-k.
    routing_configs: ClassVar[Mapping[str, RoutingConfig]] = {
        "v3-noaux_tc": RoutingConfig(
            num_experts=32, top_k=4, scoring="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
            norm_topk_prob=True, routed_scaling_factor=2.5,
        ),
        "v2-group-limited": RoutingConfig(
            num_experts=32, top_k=4, scoring="softmax", topk_method="group_limited_greedy", n_group=4, topk_group=2,
        ),
        "greedy-softmax": RoutingConfig(num_experts=16, top_k=2, scoring="softmax", topk_method="greedy"),
        "greedy-sigmoid-normed": RoutingConfig(
            num_experts=16, top_k=3, scoring="sigmoid", topk_method="greedy", norm_topk_prob=True,
            routed_scaling_factor=1.5,
        ),
        "v4-sqrtsoftplus": RoutingConfig(
            num_experts=16, top_k=4, scoring="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True,
            routed_scaling_factor=1.5,
        ),
        # DeepSeek-V4's hash layers take their experts from the token id, which ``route`` of
        # a fused gating op is not given: a backend must refuse it (the layer routes in the core).
        "v4-hash": RoutingConfig(
            num_experts=16, top_k=4, scoring="sqrtsoftplus", topk_method="hash", norm_topk_prob=True,
        ),
    }  # fmt: skip

    def test_fused_routing(self, subject: Subject, seed: int) -> None:
        """``route`` chooses the experts ``layers.moe.route`` chooses, with the same weights,
        for every config ``routing_support`` accepts; refusals say why."""
        self.require(subject.provided, "fused-routing")
        dtype = next(d for d in self.dtypes if DTYPE_CAPABILITIES[d] in subject.provided.record.capabilities)
        backend, device = self._build(subject, dtype)
        assert isinstance(backend, MoERouter), f"{subject.provided.record.name} declares fused-routing"
        gen = generator(seed)
        served = []
        for name, config in self.routing_configs.items():
            support = backend.routing_support(config)
            assert isinstance(support, Availability), f"routing_support({name}) returned {support!r}"
            if config.topk_method == "hash":
                assert not support.available, f"routing_support accepted {name}, but route() gets no token ids"
            if not support.available:
                assert support.reason, f"routing_support refused {name} without a reason"
                continue
            served.append(name)
            logits = 2 * torch.randn(37, config.num_experts, generator=gen)
            bias = 0.3 * torch.randn(config.num_experts, generator=gen) if config.uses_correction_bias else None
            ids, weights = backend.route(logits.to(device), config, None if bias is None else bias.to(device))
            want_ids, want_weights = route(logits, config, bias)
            where = f"routing {name} (seed={seed})"
            assert ids.dtype == torch.int32 and tuple(ids.shape) == tuple(want_ids.shape), f"ids {ids.dtype}: {where}"
            # Within a token the order of the chosen experts is free: compare sorted by id.
            order, want_order = ids.cpu().long().sort(dim=1), want_ids.long().sort(dim=1)
            assert torch.equal(order.values, want_order.values), f"different experts chosen: {where}"
            torch.testing.assert_close(
                weights.cpu().float().gather(1, order.indices),
                want_weights.gather(1, want_order.indices),
                atol=1e-4,
                rtol=1e-4,
                msg=lambda detail, where=where: f"routing weights differ: {where}\n{detail}",
            )
        assert served, (
            f"{subject.provided.record.name} declares fused-routing but serves none of {list(self.routing_configs)}"
        )
