"""Rotary position embeddings (RoPE) at explicit per-token positions.

Tokens of many sequences share one flat batch, so each token carries its own
position rather than an offset per sequence. The convention is HF's "rotate_half"
(the two halves of the rotary dims form the pairs), which is how HF-format Llama,
Mistral and Qwen2 checkpoints store q/k. Frequencies follow transformers'
``modeling_rope_utils`` exactly, so logits match HF to float32 rounding.

Gemma 4's "proportional" RoPE pairs dim ``i`` with ``i + head/2`` across the whole head
and rotates only the first ``partial_rotary_factor`` of the pairs; the others get
frequency zero (cos 1, sin 0), so its table spans the whole head (``rotary_width``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


@attrs.frozen(kw_only=True)
class RopeParameters:
    """RoPE settings from a config.json, whichever way it spells them."""

    theta: float = 10000.0
    rope_type: str = "default"
    partial_rotary_factor: float = 1.0
    #: linear and llama3: how much longer the context is than in pretraining.
    factor: float = 1.0
    #: llama3 only.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    #: yarn only: the ramp between interpolated and extrapolated frequencies, and the
    #: magnitude correction (``attention_factor``, else derived from mscale/mscale_all_dim).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> RopeParameters:
        """Read transformers 5's ``rope_parameters`` dict (theta and type inside it) or the
        older top-level ``rope_theta`` plus optional ``rope_scaling`` dict."""
        rope = dict(config.get("rope_scaling") or {})
        rope.update(config.get("rope_parameters") or {})
        if any(isinstance(value, Mapping) for value in rope.values()):
            raise ValueError("per-layer-type rope_parameters are not supported by this model")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        # HF falls back to max_position_embeddings when the pretraining length is not given.
        original_max = (
            rope.get("original_max_position_embeddings")
            or config.get("original_max_position_embeddings")
            or config.get("max_position_embeddings")
            or 8192
        )
        return cls(
            theta=float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0),
            rope_type=rope_type,
            partial_rotary_factor=float(
                rope.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0
            ),
            # DeepSeek-style yarn configs may leave factor out: HF derives it from the two lengths.
            factor=float(
                rope.get("factor")
                or (
                    int(config.get("max_position_embeddings") or original_max) / int(original_max)
                    if rope_type == "yarn"
                    else 1.0
                )
            ),
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            mscale=rope.get("mscale"),
            mscale_all_dim=rope.get("mscale_all_dim"),
            attention_factor=rope.get("attention_factor"),
            truncate=bool(rope.get("truncate", True)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(original_max),
        )


def rotary_width(params: RopeParameters, head_size: int) -> int:
    """How many of a head's dims the cos/sin table covers: the whole head for proportional
    RoPE (its unrotated pairs are spread over both halves), else ``partial_rotary_factor`` of it."""
    if params.rope_type == "proportional":
        return head_size
    return int(head_size * params.partial_rotary_factor)


def inverse_frequencies(params: RopeParameters, rotary_dim: int) -> torch.Tensor:
    """float32 ``[rotary_dim // 2]``, computed op for op as transformers does."""
    if params.rope_type == "proportional":
        return _proportional(params, rotary_dim)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").to(torch.float) / rotary_dim
    pos_freqs = params.theta**exponents
    inv_freq = 1.0 / pos_freqs
    if params.rope_type == "linear":
        return inv_freq / params.factor
    if params.rope_type == "llama3":
        return _llama3_scaling(inv_freq, params)
    if params.rope_type == "yarn":
        return _yarn_scaling(pos_freqs, params, rotary_dim)
    return inv_freq


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by ``factor``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(params: RopeParameters) -> float:
    """What cos/sin are multiplied by (transformers' ``attention_scaling``): 1 except for yarn."""
    if params.rope_type != "yarn":
        return 1.0
    if params.attention_factor is not None:
        return float(params.attention_factor)
    if params.mscale and params.mscale_all_dim:
        return yarn_mscale(params.factor, params.mscale) / yarn_mscale(params.factor, params.mscale_all_dim)
    return yarn_mscale(params.factor)


def _yarn_scaling(pos_freqs: torch.Tensor, params: RopeParameters, rotary_dim: int) -> torch.Tensor:
    """YaRN: high frequencies kept (extrapolated), low ones divided by ``factor``
    (interpolated), a linear ramp between (transformers' ``_compute_yarn_parameters``)."""

    def correction_dim(rotations: float) -> float:
        length = params.original_max_position_embeddings
        return (rotary_dim * math.log(length / (rotations * 2 * math.pi))) / (2 * math.log(params.theta))

    low, high = correction_dim(params.beta_fast), correction_dim(params.beta_slow)
    if params.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as HF: avoid dividing by zero
    # on the CPU like pos_freqs, whatever default device the model is built under
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (params.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _proportional(params: RopeParameters, head_size: int) -> torch.Tensor:
    """Gemma 4's full layers (transformers' ``_compute_proportional_rope_parameters``): the first
    ``partial_rotary_factor`` of the pairs at the frequencies of a whole-head table, the rest zero."""
    rotated = int(params.partial_rotary_factor * head_size // 2)
    exponents = torch.arange(0, 2 * rotated, 2, dtype=torch.int64, device="cpu").to(torch.float) / head_size
    inv_freq = 1.0 / (params.theta**exponents)
    inv_freq = torch.cat((inv_freq, torch.zeros(head_size // 2 - rotated, dtype=torch.float32, device="cpu")))
    return inv_freq / params.factor


def _llama3_scaling(inv_freq: torch.Tensor, params: RopeParameters) -> torch.Tensor:
    """Llama 3.1: slow down long wavelengths by ``factor``, keep short ones, blend between
    (transformers' ``_compute_llama3_parameters``)."""
    old_context_len = params.original_max_position_embeddings
    low_freq_wavelen = old_context_len / params.low_freq_factor
    high_freq_wavelen = old_context_len / params.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / params.factor, inv_freq)
    smooth = (old_context_len / wavelen - params.low_freq_factor) / (params.high_freq_factor - params.low_freq_factor)
    smoothed = (1 - smooth) * scaled / params.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin per token position, from a table built on first use.

    The table covers ``max_positions`` (or more when a batch needs it) and lives on the
    device of the positions it serves; it is a plain attribute, not a buffer, so
    checkpoints neither carry nor expect it.
    """

    def __init__(self, head_size: int, params: RopeParameters, max_positions: int) -> None:
        super().__init__()
        self.rotary_dim = rotary_width(params, head_size)
        self.max_positions = max_positions
        self.inv_freq = inverse_frequencies(params, self.rotary_dim)
        self.scaling = attention_factor(params)
        self._cos = torch.empty(0, self.rotary_dim // 2)
        self._sin = torch.empty(0, self.rotary_dim // 2)

    def forward(
        self, positions: torch.Tensor, num_positions: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[num_tokens, rotary_dim // 2]`` in ``dtype``.

        ``num_positions`` is a host-side bound (every position is below it), so growing
        the table never reads positions back from the device.
        """
        if self._cos.shape[0] < num_positions or self._cos.device != positions.device:
            self._build(max(num_positions, self.max_positions), positions.device)
        # HF computes in float32 and casts to the activation dtype before rotating.
        return self._cos[positions].to(dtype), self._sin[positions].to(dtype)

    def _build(self, num_positions: int, device: torch.device) -> None:
        position = torch.arange(num_positions, dtype=torch.float32, device=device)
        freqs = position[:, None] * self.inv_freq.to(device)[None, :]
        self._cos, self._sin = freqs.cos() * self.scaling, freqs.sin() * self.scaling

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, max_positions={self.max_positions}"


def deepseek_rope_tables(config: Mapping[str, Any], partial: float) -> tuple[RopeParameters, RopeParameters]:
    """DeepSeek-V4's and V4.1's "main" and "compress" RoPE tables: nested in ``rope_parameters`` (transformers 5),
    or from ``rope_theta`` / ``compress_rope_theta`` plus a top-level YaRN dict, whose
    ``attention_factor`` is forced to 1 as transformers and DeepSeek's reference do."""
    nested = config.get("rope_parameters") or {}
    if isinstance(nested.get("main"), Mapping) and isinstance(nested.get("compress"), Mapping):
        main, compress = dict(nested["main"]), dict(nested["compress"])
    else:
        flat = {
            k: v for k, v in {**(config.get("rope_scaling") or {}), **nested}.items() if k not in ("main", "compress")
        }
        main = {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
        compress = {**flat, "rope_theta": config.get("compress_rope_theta", 160000.0)}
        if compress.get("rope_type", compress.get("type")) == "yarn":
            compress["attention_factor"] = 1.0
    positions = config.get("max_position_embeddings")

    def read(table: dict[str, Any]) -> RopeParameters:
        table.setdefault("partial_rotary_factor", partial)
        return RopeParameters.from_config({"rope_parameters": table, "max_position_embeddings": positions})

    return read(main), read(compress)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, heads, head_size]``; dims past the rotary ones pass through.

    Equals HF's ``x * cos + rotate_half(x) * sin`` on the rotary dims, written per half.
    """
    half = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
