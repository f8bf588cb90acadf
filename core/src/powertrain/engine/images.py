"""The engine's side of images: a request's images laid into its prompt, encoded once,
handed to the steps whose tokens cover them, and named in the prefix cache's hashes.

``lay_out_images`` (at ``add_request``, engine thread) widens each image placeholder to the
positions the model's ``ImageEncoder`` gives the image, and digests the pixels.
``ModelRunner.prepare`` cuts the step's chunk of each sequence into ``ImagePiece`` s, the
span rows it covers; on the device thread ``EncodedImages.rows_for`` encodes each image the
first time a piece needs it (one image at a time: the tower's batch is its own, whatever
else the step holds) and keeps the rows, by digest, in a bounded least-recently-used store:
a prompt prefilled in chunks is encoded once, and so is an image that comes back (a
preempted request recomputing its span, the tail of a span a prefix hit does not cover,
another request with the same image) while its rows are held.

Every position of a span carries the same token id, so the prefix cache hashes a block
together with the digests of the images it covers (``image_salt``): the same image shares
cached blocks, two different images never do.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from powertrain.interfaces.errors import InvalidRequestError
from powertrain.interfaces.images import ImageEncoder, ImageInput, ImageRows, expand_image_placeholders


@attrs.frozen(eq=False)
class PromptImage:
    """One image of a request: its span in the (expanded) prompt, its content digest and pixels."""

    start: int
    length: int
    #: BLAKE2b of the detail, the size and the pixels: what the prefix cache and the store of
    #: encoded images key it by.
    digest: bytes
    pixels: np.ndarray = attrs.field(repr=False)
    detail: str
    #: Where the image came from in the request (``ImagePart.path``), for errors.
    path: str

    @property
    def end(self) -> int:
        return self.start + self.length


#: What the store of encoded images holds at most (a release-sized image's span is 1,024 or
#: so rows of the model's width: about 8 MiB in bfloat16 at V4.1-Flash's 4,096).
ENCODED_IMAGES_BYTES = 256 << 20


class EncodedImages:
    """Encoded span rows by image digest, least recently used first out once over
    ``capacity_bytes`` (an image larger than that is encoded for its step and not kept).
    Device thread only."""

    def __init__(self, encoder: ImageEncoder, capacity_bytes: int = ENCODED_IMAGES_BYTES) -> None:
        self.encoder = encoder
        self.capacity_bytes = capacity_bytes
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._bytes = 0
        #: Images encoded so far (misses of the store).
        self.encodings = 0

    def rows_for(self, image: PromptImage) -> torch.Tensor:
        """The image's span rows ``[length, hidden]``, encoded now if not held."""
        rows = self._rows.get(image.digest)
        if rows is not None:
            self._rows.move_to_end(image.digest)
            return rows
        rows = self.encoder.encode_image(image.pixels, image.detail)
        if rows.dim() != 2 or rows.shape[0] != image.length:
            raise RuntimeError(
                f"the vision encoder gave {list(rows.shape)} for {image.path}, "
                f"whose span holds {image.length} positions"
            )
        self.encodings += 1
        size = rows.numel() * rows.element_size()
        if size <= self.capacity_bytes:
            while self._bytes + size > self.capacity_bytes:
                _, dropped = self._rows.popitem(last=False)
                self._bytes -= dropped.numel() * dropped.element_size()
            self._rows[image.digest] = rows
            self._bytes += size
        return rows

    def clear(self) -> None:
        """Drop every held image (a benchmark timing the tower each time)."""
        self._rows.clear()
        self._bytes = 0

    def image_rows(self, pieces: Sequence[ImagePiece]) -> ImageRows:
        """A step's image rows (``forward(..., image_rows=)``), encoding each image not held."""
        return ImageRows.of_spans(
            [(piece.row, self.rows_for(piece.image)[piece.offset : piece.offset + piece.count]) for piece in pieces]
        )


@attrs.frozen
class ImagePiece:
    """The rows ``[offset, offset + count)`` of ``image``'s span, at flat rows ``row..`` of a step."""

    row: int
    image: PromptImage
    offset: int
    count: int


def pixel_digest(pixels: np.ndarray, detail: str) -> bytes:
    """A digest naming what the tower sees: the detail level, the size and every pixel."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{detail}:{pixels.shape[1]}x{pixels.shape[0]}:".encode())
    digest.update(np.ascontiguousarray(pixels).data)
    return digest.digest()


def lay_out_images(
    token_ids: Sequence[int], images: Sequence[ImageInput], encoder: ImageEncoder
) -> tuple[list[int], tuple[PromptImage, ...]]:
    """The prompt with each image placeholder widened to its image's span, and the images
    placed there. Raises InvalidRequestError (naming the image) for pixels that are not RGB
    uint8, for a placeholder count other than the image count, and where the protocol
    adapter sized an image otherwise than this model's encoder does."""
    counts, wheres = [], []
    for index, image in enumerate(images):
        if not isinstance(image, ImageInput):
            raise InvalidRequestError(f"images[{index}] must be an ImageInput, got {type(image).__name__}")
        pixels, where = image.pixels, image.part.path or f"images[{index}]"
        wheres.append(where)
        if not isinstance(pixels, np.ndarray) or pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
            shape = list(getattr(pixels, "shape", ()))
            raise InvalidRequestError(
                f"{where}: pixels must be RGB uint8 [height, width, 3], got {getattr(pixels, 'dtype', type(pixels))} "
                f"{shape}; decode the image with powertrain.images.decode_image"
            )
        height, width = pixels.shape[:2]
        try:
            tokens = encoder.image_tokens(width, height, image.part.detail)
        except ValueError as error:  # a size or detail level the encoder cannot take
            raise InvalidRequestError(f"{where}: {error}") from error
        fit = image.part.fit
        if fit is not None and fit.tokens != tokens:
            raise InvalidRequestError(
                f"{where}: the protocol adapter counts this {width}x{height} image as {fit.tokens} prompt "
                f"positions, this model's vision encoder as {tokens}: the adapter's image rules and the "
                "checkpoint's vision_config disagree; serve the model with an adapter that sizes images as it does"
            )
        counts.append(tokens)
    try:
        expanded, spans = expand_image_placeholders(token_ids, encoder.image_token_id, counts)
    except ValueError as error:
        raise InvalidRequestError(f"{error}; send one image placeholder token per image, in order") from error
    placed = tuple(
        PromptImage(
            start=start,
            length=length,
            digest=pixel_digest(image.pixels, image.part.detail),
            pixels=image.pixels,
            detail=image.part.detail,
            path=where,
        )
        for image, where, (start, length) in zip(images, wheres, spans, strict=True)
    )
    return expanded, placed


def image_pieces(images: Sequence[PromptImage], start: int, end: int, row: int) -> list[ImagePiece]:
    """The pieces of image spans that a chunk of positions ``[start, end)`` of a sequence covers,
    the chunk's first position sitting at flat row ``row`` of the step."""
    pieces = []
    for image in images:
        first, last = max(start, image.start), min(end, image.end)
        if first < last:
            pieces.append(ImagePiece(row + first - start, image, first - image.start, last - first))
    return pieces


def image_salt(images: Sequence[PromptImage], start: int, end: int) -> bytes:
    """What the prefix cache hashes beside the token ids of a block covering positions
    ``[start, end)``: the digests of the images it holds (nothing for text)."""
    return b"".join(image.digest for image in images if image.start < end and image.end > start)


def model_image_encoder(model: Any) -> ImageEncoder | None:
    """The model's ``image_encoder`` (``CausalLM``), checked against the contract; None: text only."""
    encoder = getattr(model, "image_encoder", None)
    if encoder is not None and not isinstance(encoder, ImageEncoder):
        raise TypeError(f"{type(model).__name__}.image_encoder does not satisfy interfaces.images.ImageEncoder")
    return encoder
