"""What the server hands an engine that reads images, and how it knows the engine does.

The protocol adapter parses and checks a request's image parts (``protocol.ImagePart``);
the server fetches remote ones where its operator allows it and decodes every image to
pixels (``powertrain.images``), then passes them along with the prompt:
``engine.add_request(prompt_token_ids, params, request_id=..., images=[ImageInput, ...])``,
one per image placeholder token of the prompt, in order. The engine expands each
placeholder into its image's ``part.fit.tokens`` positions; the prompt token ids it
reports back (``RequestOutput.prompt_token_ids``) stay the ones it was given, one
placeholder per image, and usage adds the difference (``ParsedRequest.prompt_positions``).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

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


def accepts_images(engine: Any) -> bool:
    """Whether ``engine`` reads images: it says so with a true ``accepts_images`` attribute
    (an engine with a vision encoder), and then takes ``images=`` in ``add_request``.
    Every other engine gets no image and the server refuses image requests for it."""
    return bool(getattr(engine, "accepts_images", False))
