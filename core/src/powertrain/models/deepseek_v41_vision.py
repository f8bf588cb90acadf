"""DeepSeek-V4.1-Flash's vision tower: an image's pixels to the rows its prompt span holds.

Follows DeepSeek's official V4.1 inference code (``vision.py``, ``image_processor.py`` and
``Transformer.encode_image`` / ``merge_image_embeddings``; ``core/tests/fixtures/deepseek_v41_vision``
holds what it computed), with the release's tensor names:

- **Preprocessing** (``prepare_image``). The image is fitted to whole 14-pixel patches whose
  3x3-merged grid costs at most ``max_n_token`` prompt positions (an image under
  ``min_pixels`` of area is scaled up first), then brought to that size as the official code
  does with Pillow: padded (aspect kept, grey 127 around it) or, past ``max_wh_ratio``,
  stretched. Pixels become ``(x / 255 - 0.5) / 0.5`` rounded to bfloat16, as the official
  code feeds its tower, cut into patches in reading order. The fit is repeated until the size settles
  (and ``detail: low`` shrinks the long side to 512 first), as DeepSeek's serving adapter
  does before the model sees the image: with the release's constants the size and token
  count equal ``powertrain_recipe.image_fit``, which the protocol side reports.
- **Tower** (``DeepseekV41Vision``): a ViT with full attention over one image and 2D RoPE
  (half the head's channels rotate by the patch's row, half by its column), then the
  aligner: 3x3 neighbouring patches (zero-padded at the right and bottom edges) concatenated
  and projected into the language model's width by a GELU MLP.
- **The span** (``encode``): ``image_start``, then per token row its aligner rows and
  ``image_newline``, then ``image_end``; every position of it carries ``image_token_id`` in the
  prompt. ``expand_image_placeholders`` widens each placeholder to its span, and the model's
  ``forward(..., image_rows=ImageRows(...))`` puts the rows in place of the token embeddings.
  Those positions also route with the MoE gate's ``bias_vl`` and take no part in Engram.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from powertrain.interfaces.images import ImageRows, expand_image_placeholders
from powertrain.layers.linear import Linear

#: The detail levels a client may ask for (as the protocol adapter spells them); only ``low``
#: changes the preprocessing.
IMAGE_DETAILS = ("low", "high", "auto", "original")
#: ``detail: low`` shrinks the long side to this many pixels first (DeepSeek's adapter).
LOW_DETAIL_SIDE = 512
#: The serving adapter re-encodes images as WebP, whose sides stop at this many pixels.
WEBP_MAX_SIDE = 16_383
_MAX_FIT_STEPS = 10
_MAX_WEBP_ROUNDS = 6
#: The grey the official preprocessing pads with.
PAD_GREY = (127, 127, 127)


# --------------------------------------------------------------------------- config

#: ``vision_config`` key -> (field, DeepSeek's flat ``inference/config.json`` name, default).
_VISION_KEYS: tuple[tuple[str, str, str, Any], ...] = (
    ("num_hidden_layers", "num_layers", "vision_n_layers", None),
    ("hidden_size", "hidden_size", "vision_dim", None),
    ("num_attention_heads", "num_heads", "vision_n_heads", None),
    ("intermediate_size", "intermediate_size", "vision_inter_dim", None),
    ("patch_size", "patch_size", "vision_patch_size", 14),
    ("rope_theta", "rope_theta", "vision_rope_theta", 10000.0),
    ("downsample_ratio", "downsample_ratio", "vision_downsample_ratio", 3),
    ("max_n_token", "max_n_token", "vision_max_n_token", 1024),
    ("min_pixels", "min_pixels", "vision_min_pixels", 544 * 544),
    ("max_wh_ratio", "max_wh_ratio", "vision_max_wh_ratio", None),
)


@attrs.frozen(kw_only=True)
class VisionArgs:
    """The ``vision_config`` fields the tower reads, and the two it takes from the text model."""

    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    rope_theta: float
    downsample_ratio: int
    max_n_token: int
    min_pixels: int
    max_wh_ratio: int | None
    #: The language model's width (the aligner's output and the span embeddings').
    text_hidden_size: int
    #: The id every position of an image span carries in the prompt.
    image_token_id: int
    norm_eps: float = 1e-6

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> VisionArgs | None:
        """The tower's sizes from a composite config's ``vision_config`` (or DeepSeek's flat
        ``vision_*`` keys); None where it has no layers (a text-only checkpoint)."""
        vision = config.get("vision_config") or {}
        text = config.get("text_config", config)
        if int(vision.get("num_hidden_layers", config.get("vision_n_layers")) or 0) <= 0:
            return None
        values: dict[str, Any] = {}
        for key, field, flat, default in _VISION_KEYS:
            value = vision.get(key, config.get(flat, default))
            if value is None and field != "max_wh_ratio":
                raise ValueError(f"DeepSeek-V4.1 vision_config: {key} is missing")
            values[field] = value
        image_token_id = config.get("image_token_id", text.get("image_token_id"))
        if image_token_id is None:
            raise ValueError("DeepSeek-V4.1 with a vision tower needs image_token_id in config.json")
        ints = ("num_layers", "hidden_size", "num_heads", "intermediate_size", "patch_size", "downsample_ratio",
                "max_n_token", "min_pixels")  # fmt: skip
        args = cls(
            **{k: int(v) if k in ints else v for k, v in values.items() if k not in ("rope_theta", "max_wh_ratio")},
            rope_theta=float(values["rope_theta"]),
            max_wh_ratio=None if values["max_wh_ratio"] is None else int(values["max_wh_ratio"]),
            text_hidden_size=int(text["hidden_size"]),
            image_token_id=int(image_token_id),
        )
        head_dim = args.hidden_size // args.num_heads
        if args.hidden_size % args.num_heads or head_dim % 4:
            raise ValueError(
                f"DeepSeek-V4.1 vision_config: hidden_size {args.hidden_size} over {args.num_heads} heads must give "
                "a head width divisible by 4 (2D RoPE rotates half of it by row and half by column)"
            )
        if args.max_n_token < 4:
            raise ValueError(f"DeepSeek-V4.1 vision_config: max_n_token {args.max_n_token} leaves no room for an image")
        return args

    @property
    def cell(self) -> int:
        """One prompt token's side in pixels."""
        return self.patch_size * self.downsample_ratio


# --------------------------------------------------------------------------- preprocessing


@attrs.frozen
class ImageFit:
    """An image's preprocessed size (whole patches) and its token grid."""

    width: int
    height: int
    rows: int
    columns: int

    @property
    def tokens(self) -> int:
        """Prompt positions: start, each row's tokens and newline, end."""
        return span_length(self.rows, self.columns)


def span_length(rows: int, columns: int) -> int:
    return rows * (columns + 1) + 2


def _grid(width: int, height: int, args: VisionArgs) -> ImageFit:
    p, r = args.patch_size, args.downsample_ratio
    return ImageFit(width, height, math.ceil((height // p) / r), math.ceil((width // p) / r))


def _within_budget(width: float, height: float, args: VisionArgs) -> ImageFit:
    """The largest size of this aspect whose grid costs at most ``max_n_token`` positions:
    ``rows * (columns + 1) = budget`` with ``rows = columns * height / width``; a grid too thin
    for one row (column) keeps one."""
    budget, cell, p = args.max_n_token - 2, args.cell, args.patch_size
    aspect = height / width
    columns = math.sqrt(budget / aspect + 0.25) - 0.5
    rows = columns * aspect
    if columns < 1.0:
        return _grid(cell, budget // 2 * cell, args)
    if rows < 1.0:
        return _grid((args.max_n_token - 3) * cell, cell, args)
    scale = min(math.floor(columns) * cell / width, math.floor(rows) * cell / height)
    return _grid(math.floor(width * scale / p) * p, math.floor(height * scale / p) * p, args)


def plan_step(width: float, height: float, args: VisionArgs) -> ImageFit:
    """One pass of the official plan (``plan_image_grid``): clip the aspect, scale up to
    ``min_pixels``, round up to whole patches, shrink into the token budget."""
    p = args.patch_size
    if args.max_wh_ratio is not None and width > height * args.max_wh_ratio:
        width = height * args.max_wh_ratio
    if 0 < width * height < args.min_pixels:
        ratio = (args.min_pixels / (width * height)) ** 0.5
        width, height = int(width * ratio), int(height * ratio)
    aligned = _grid(math.ceil(width / p) * p, math.ceil(height / p) * p, args)
    return aligned if aligned.tokens <= args.max_n_token else _within_budget(width, height, args)


def fit_image(width: int, height: int, detail: str, args: VisionArgs) -> ImageFit:
    """The size an image of ``width x height`` pixels is preprocessed to, and its grid: the
    official plan repeated until it settles, after ``detail: low``'s shrink, with the
    serving adapter's WebP side limit. ValueError where DeepSeek's adapter refuses the image."""
    if detail not in IMAGE_DETAILS:
        raise ValueError(f"unknown image detail {detail!r}; one of {', '.join(IMAGE_DETAILS)}")
    if width < 1 or height < 1:
        raise ValueError(f"an image of {width}x{height} pixels has nothing to encode")
    if detail == "low" and max(width, height) > LOW_DETAIL_SIDE:
        scale = LOW_DETAIL_SIDE / max(width, height)
        width, height = max(1, round(width * scale)), max(1, round(height * scale))
    source = (width, height)
    for _ in range(_MAX_WEBP_ROUNDS):
        fitted = _settled(*source, args)
        if fitted.width == 0 or fitted.height == 0:
            raise ValueError(
                f"a {width}x{height} image fits the image token budget only as {fitted.width}x{fitted.height} "
                "pixels; send a less elongated image"
            )
        if max(fitted.width, fitted.height) <= WEBP_MAX_SIDE:
            return fitted
        source = _within_webp(fitted.width, fitted.height, args.patch_size)
    raise ValueError(f"a {width}x{height} image has no preprocessed size within {WEBP_MAX_SIDE} pixels a side")


def _settled(width: int, height: int, args: VisionArgs) -> ImageFit:
    current = plan_step(width, height, args)
    for _ in range(1, _MAX_FIT_STEPS):
        following = plan_step(current.width, current.height, args)
        if following == current:
            return current
        current = following
    raise ValueError(f"fitting a {width}x{height} image to the image token budget did not settle")


def _within_webp(width: int, height: int, patch: int) -> tuple[int, int]:
    """The long side cut to whole patches within WebP's limit, the short side scaled with it
    and rounded up to whole patches (rounding up keeps the area above the minimum)."""
    long = max(width, height)
    new_long = WEBP_MAX_SIDE // patch * patch
    short = max(1, round(min(width, height) * new_long / long))
    new_short = -(-short // patch) * patch
    return (new_long, new_short) if width >= height else (new_short, new_long)


@attrs.frozen(kw_only=True)
class PreparedImage:
    """One image as the tower takes it: bfloat16 patches ``[patch rows * patch columns,
    3 * patch * patch]`` (reading order; channel, then row, then column within a patch)."""

    patches: torch.Tensor
    fit: ImageFit
    patch_rows: int
    patch_columns: int

    @property
    def tokens(self) -> int:
        return self.fit.tokens


def prepare_image(pixels: np.ndarray, detail: str, args: VisionArgs) -> PreparedImage:
    """A decoded RGB image (uint8 ``[height, width, 3]``) as the tower's input, sized by
    ``fit_image``. Pillow brings it to that size as the official code does (its bicubic
    ``ImageOps.pad`` with grey bars, or a plain resize past ``max_wh_ratio``)."""
    from PIL import Image, ImageOps  # only preprocessing needs Pillow

    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"an image must be uint8 [height, width, 3] RGB, got {pixels.dtype} {list(pixels.shape)}")
    height, width = pixels.shape[:2]
    fit = fit_image(width, height, detail, args)
    image = Image.fromarray(np.ascontiguousarray(pixels), "RGB")
    if args.max_wh_ratio is not None and width >= args.max_wh_ratio * height:
        image = image.resize((fit.width, fit.height))
    else:
        image = ImageOps.pad(image, (fit.width, fit.height), color=PAD_GREY)
    p = args.patch_size
    rows, columns = fit.height // p, fit.width // p
    x = torch.from_numpy(np.asarray(image, dtype=np.float32)) / 255
    x = ((x - 0.5) / 0.5).to(torch.bfloat16)  # as the official code rounds its input
    patches = x.view(rows, p, columns, p, 3).permute(0, 2, 4, 1, 3).reshape(rows * columns, 3 * p * p)
    return PreparedImage(patches=patches.contiguous(), fit=fit, patch_rows=rows, patch_columns=columns)


# --------------------------------------------------------------------------- the tower


class VisionRMSNorm(nn.Module):
    """RMSNorm in float32 with a float32 weight, whatever the activations' dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (self.weight * (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def patch_rotations(rows: int, columns: int, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin ``[rows * columns, rope_dim]``: per patch, the first half of the
    angles are its row times the frequencies, the second half its column times them."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    row = torch.arange(rows, dtype=torch.float32).repeat_interleave(columns)
    column = torch.arange(columns, dtype=torch.float32).repeat(rows)
    angles = torch.cat((row[:, None] * inv_freq, column[:, None] * inv_freq), dim=-1)
    return angles.cos(), angles.sin()


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[n, heads, head_dim]`` rotated in float32, its two halves as the pairs."""
    a, b = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.heads, self.head_dim = args.num_heads, args.hidden_size // args.num_heads
        self.wqkv = Linear(args.hidden_size, 3 * args.hidden_size, bias=True)
        self.wo = Linear(args.hidden_size, args.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.wqkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        q, k = rotate_halves(q, cos, sin), rotate_halves(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return self.wo(out.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    """SwiGLU with the gate and up projections stacked in one weight (``w1``: gate rows first)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.w1 = Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.w2 = Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(args.hidden_size, args.norm_eps)
        self.attn = VisionAttention(args)
        self.norm2 = VisionRMSNorm(args.hidden_size, args.norm_eps)
        self.mlp = VisionMLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.proj = Linear(3 * args.patch_size**2, args.hidden_size, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches)


class VisionTransformer(nn.Module):
    """Patches ``[n, 3 * p * p]`` -> normed features ``[n, hidden]``, all patches of one image
    attending to each other."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.num_layers))
        self.norm = VisionRMSNorm(args.hidden_size, args.norm_eps)

    def forward(self, patches: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
        x = self.patch_embed(patches)
        head_dim = self.args.hidden_size // self.args.num_heads
        cos, sin = patch_rotations(rows, columns, head_dim // 2, self.args.rope_theta)
        cos, sin = cos.to(x.device), sin.to(x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    """ViT features ``[rows * columns, hidden]`` -> one row per 3x3 patches (in reading order),
    ``[ceil(rows / 3) * ceil(columns / 3), text hidden]``. A merged feature lists the channels
    outermost, then the 3x3 neighbours row by row; the grid is zero-padded at the right and
    bottom to whole 3x3 cells."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.ratio = r = args.downsample_ratio
        self.w1 = Linear(args.hidden_size * r * r, args.text_hidden_size, bias=True)
        self.w2 = Linear(args.text_hidden_size, args.text_hidden_size, bias=True)

    def merge(self, features: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
        r = self.ratio
        grid = features.view(rows, columns, -1)
        grid = F.pad(grid, (0, 0, 0, -columns % r, 0, -rows % r))
        out_rows, out_columns = grid.shape[0] // r, grid.shape[1] // r
        cells = grid.view(out_rows, r, out_columns, r, -1).permute(0, 2, 4, 1, 3)
        return cells.reshape(out_rows * out_columns, -1)

    def forward(self, features: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(self.merge(features, rows, columns))))


class DeepseekV41Vision(nn.Module):
    """The tower and the span's learned delimiters, under the release's names (``vision.*``,
    ``aligner.*``, ``image_start``, ``image_end``, ``image_newline``)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.vision = VisionTransformer(args)
        self.aligner = Aligner(args)
        d = args.text_hidden_size
        self.image_start = nn.Parameter(torch.empty(d), requires_grad=False)
        self.image_end = nn.Parameter(torch.empty(d), requires_grad=False)
        self.image_newline = nn.Parameter(torch.empty(d), requires_grad=False)

    @property
    def image_token_id(self) -> int:
        return self.args.image_token_id

    def image_tokens(self, width: int, height: int, detail: str) -> int:
        """``ImageEncoder.image_tokens``: the span's positions once fitted."""
        return fit_image(width, height, detail, self.args).tokens

    def encode_image(self, pixels: np.ndarray, detail: str) -> torch.Tensor:
        """``ImageEncoder.encode_image``: preprocessing, then ``encode``."""
        return self.encode(self.prepare(pixels, detail))

    def prepare(self, pixels: np.ndarray, detail: str = "auto") -> PreparedImage:
        return prepare_image(pixels, detail, self.args)

    @torch.inference_mode()
    def aligned(self, prepared: PreparedImage) -> torch.Tensor:
        """The aligner's rows ``[rows * columns, text hidden]`` in reading order."""
        weight = self.aligner.w2.weight
        patches = prepared.patches.to(device=weight.device, dtype=weight.dtype)
        features = self.vision(patches, prepared.patch_rows, prepared.patch_columns)
        return self.aligner(features, prepared.patch_rows, prepared.patch_columns)

    @torch.inference_mode()
    def encode(self, prepared: PreparedImage) -> torch.Tensor:
        """The rows of the image's prompt span ``[prepared.tokens, text hidden]``, in prompt order:
        ``image_start``, per token row its aligner rows then ``image_newline``, ``image_end``."""
        rows, columns = prepared.fit.rows, prepared.fit.columns
        grid = self.aligned(prepared)
        if grid.shape[0] != rows * columns:
            raise RuntimeError(f"the aligner made {grid.shape[0]} rows for a {rows}x{columns} token grid")
        newline = self.image_newline.to(grid.dtype).expand(rows, 1, -1)
        body = torch.cat((grid.view(rows, columns, -1), newline), dim=1).flatten(0, 1)
        start, end = self.image_start.to(grid.dtype)[None], self.image_end.to(grid.dtype)[None]
        return torch.cat((start, body, end))


__all__: Sequence[str] = [
    "IMAGE_DETAILS",
    "DeepseekV41Vision",
    "ImageFit",
    "ImageRows",
    "PreparedImage",
    "VisionArgs",
    "expand_image_placeholders",
    "fit_image",
    "prepare_image",
    "span_length",
]
