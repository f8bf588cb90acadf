"""Images between the server, the engine and a model's vision encoder.

What the server hands an engine that reads images, and how it knows the engine does.

The protocol adapter parses and checks a request's image parts (``protocol.ImagePart``);
the server fetches remote ones where its operator allows it and decodes every image to
pixels (``powertrain.images``), then passes them along with the prompt:
``engine.add_request(prompt_token_ids, params, request_id=..., images=[ImageInput, ...])``,
one per image placeholder token of the prompt, in order. The engine expands each
placeholder into its image's ``part.fit.tokens`` positions; the prompt token ids it
reports back (``RequestOutput.prompt_token_ids``) stay the ones it was given, one
placeholder per image, and usage adds the difference (``ParsedRequest.prompt_positions``).

What the engine and a model with a vision encoder exchange: the model's ``image_encoder``
(an ``ImageEncoder``; ``CausalLM`` documents the attribute) says how many prompt positions an
image takes and encodes it to the rows of its span; every position of a span carries the
encoder's ``image_token_id`` (``expand_image_placeholders``), and a step whose tokens cover
span positions passes those rows to ``forward(..., image_rows=ImageRows(...))``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np
import torch

from powertrain.interfaces.protocol import ImagePart


@attrs.frozen(kw_only=True)
class ImageInput:
    """One decoded image of a request."""

    #: The checked part: where it came from, its size and V4.1's fit (``part.fit`` is set).
    part: ImagePart
    #: RGB, uint8, ``[height, width, 3]`` at the size the image was sent at (not yet
    #: resized or padded to ``part.fit``): what DeepSeek's official preprocessor gets from
    #: Pillow's ``convert("RGB")``.
    pixels: np.ndarray = attrs.field(repr=lambda pixels: f"<{pixels.shape} {pixels.dtype}>")

    @classmethod
    def of_pixels(cls, pixels: np.ndarray, detail: str = "auto", path: str = "image") -> ImageInput:
        """An image for ``LLM.generate(..., images=)`` or ``add_request``, from decoded pixels
        (``powertrain.images.decode_image``); ``path`` names it in errors."""
        height, width = pixels.shape[:2] if getattr(pixels, "ndim", 0) >= 2 else (0, 0)
        return cls(part=ImagePart(path=path, detail=detail, width=width, height=height), pixels=pixels)


def accepts_images(engine: Any) -> bool:
    """Whether ``engine`` reads images: it says so with a true ``accepts_images`` attribute
    (an engine with a vision encoder), and then takes ``images=`` in ``add_request``.
    Every other engine gets no image and the server refuses image requests for it."""
    return bool(getattr(engine, "accepts_images", False))


@runtime_checkable
class ImageEncoder(Protocol):
    """A model's vision encoder as the engine drives it (``CausalLM.image_encoder``)."""

    #: The token id every position of an image's prompt span carries.
    image_token_id: int

    def image_tokens(self, width: int, height: int, detail: str) -> int:
        """The prompt positions an image of ``width`` x ``height`` pixels takes at ``detail``."""
        ...

    def encode_image(self, pixels: np.ndarray, detail: str) -> torch.Tensor:
        """The rows of the image's span ``[image_tokens(...), hidden]``, in prompt order, from
        RGB uint8 ``[height, width, 3]`` pixels: preprocessing and the tower, on the model's device."""
        ...


@attrs.frozen(eq=False)
class ImageRows:
    """What a forward puts in place of token embeddings: ``rows`` (int64 ``[n]``, indices into
    the flat batch) take ``embeds`` (``[n, hidden]``). A model may treat those rows apart in
    other ways too (V4.1 routes them with its image router bias and keeps them out of Engram)."""

    rows: torch.Tensor
    embeds: torch.Tensor

    def __attrs_post_init__(self) -> None:
        if self.rows.dtype != torch.int64 or self.rows.dim() != 1:
            raise ValueError(f"ImageRows.rows must be int64 [n], got {self.rows.dtype} {list(self.rows.shape)}")
        if self.embeds.dim() != 2 or self.embeds.shape[0] != self.rows.shape[0]:
            raise ValueError(f"ImageRows.embeds must be [{self.rows.shape[0]}, hidden], got {list(self.embeds.shape)}")

    @classmethod
    def of_spans(cls, spans: Sequence[tuple[int, torch.Tensor]]) -> ImageRows:
        """From ``(first flat row, span rows)`` pairs."""
        rows = [torch.arange(start, start + embeds.shape[0]) for start, embeds in spans]
        return cls(torch.cat(rows).to(torch.int64), torch.cat([embeds for _, embeds in spans]))

    def mask(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """bool ``[num_tokens]``: True at image rows."""
        mask = torch.zeros(num_tokens, dtype=torch.bool, device=device)
        mask[self.rows.to(device)] = True
        return mask


def expand_image_placeholders(
    token_ids: Sequence[int], image_token_id: int, image_tokens: Sequence[int]
) -> tuple[list[int], list[tuple[int, int]]]:
    """A prompt with one ``image_token_id`` per image, widened: each placeholder becomes
    ``image_tokens[i]`` copies of it (every span position carries the id). Returns the
    expanded ids and each image's span ``(start, length)``, in order."""
    places = [i for i, token in enumerate(token_ids) if token == image_token_id]
    if len(places) != len(image_tokens):
        raise ValueError(
            f"the prompt has {len(places)} image placeholder(s) (token {image_token_id}) but "
            f"{len(image_tokens)} image(s) came with it"
        )
    expanded: list[int] = []
    spans: list[tuple[int, int]] = []
    last = 0
    for place, count in zip(places, image_tokens, strict=True):
        if count < 3:
            raise ValueError(f"an image span holds at least start, a row and end, not {count} positions")
        expanded.extend(token_ids[last:place])
        spans.append((len(expanded), count))
        expanded.extend([image_token_id] * count)
        last = place + 1
    expanded.extend(token_ids[last:])
    return expanded, spans
