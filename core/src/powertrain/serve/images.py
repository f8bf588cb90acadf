"""A request's images, from its parsed parts to the pixels the engine gets.

Remote parts are fetched (``image_fetch``, where the operator allows it) and checked by
the protocol adapter as inline data is (``ProtocolAdapter.check_image``); every image is
then decoded off the event loop (``powertrain.images``). A refusal anywhere is an
``ApiError`` (400) naming the part's field; other requests are not affected.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

import attrs
import numpy as np

from powertrain.config import ImagesConfig
from powertrain.images import ImageDecodeError, ImageDecoder
from powertrain.interfaces.images import ImageInput
from powertrain.interfaces.protocol import ImagePart, ParsedRequest, ProtocolAdapter
from powertrain.serve.errors import ApiError
from powertrain.serve.image_fetch import ImageFetcher, ImageFetchError

T = TypeVar("T")


class ImageLoader:
    """Fetches, checks and decodes the images of the server's requests."""

    def __init__(self, adapter: ProtocolAdapter, config: ImagesConfig) -> None:
        self.adapter = adapter
        self.config = config
        self.decoder = ImageDecoder(config.max_pixels, config.decode_threads)
        self.fetcher = ImageFetcher(config) if config.fetch else None

    async def load(self, protocol: str, parsed: ParsedRequest) -> tuple[ParsedRequest, list[ImageInput]]:
        """The request with every image part fetched and checked (its ``image_tokens``
        counting them all), and the decoded images in placeholder order."""
        count = len(parsed.images)
        parts = await _all(self._fetched(protocol, part, number, count) for number, part in enumerate(parsed.images, 1))
        pixels = await _all(self._decoded(part) for part in parts)
        parsed = attrs.evolve(parsed, images=parts, image_tokens=sum(part.fit.tokens for part in parts if part.fit))
        return parsed, [ImageInput(part=part, pixels=array) for part, array in zip(parts, pixels, strict=True)]

    async def _fetched(self, protocol: str, part: ImagePart, number: int, count: int) -> ImagePart:
        if not part.is_remote:
            return part
        if self.fetcher is None or part.url is None:  # the adapter let a remote URL through unasked
            raise ApiError(400, f"{part.path}: remote image URLs are not fetched by this server", part.path)
        try:
            data, media_type = await self.fetcher.fetch(part.url, part.path)
        except ImageFetchError as exc:
            raise ApiError(400, str(exc), exc.path) from None
        return self.adapter.check_image(protocol, part, data, media_type, number, count)

    async def _decoded(self, part: ImagePart) -> np.ndarray:
        assert part.data is not None and part.media_type is not None
        try:
            pixels = await self.decoder.decode(part.data, part.media_type, part.path)
        except ImageDecodeError as exc:
            raise ApiError(400, str(exc), exc.path) from None
        if pixels.shape[:2] != (part.height, part.width):
            raise ApiError(
                400,
                f"{part.path}: the image decodes to {pixels.shape[1]}x{pixels.shape[0]} pixels but its header "
                f"says {part.width}x{part.height}; send a well-formed image",
                part.path,
            )
        return pixels

    async def aclose(self) -> None:
        self.decoder.close()
        if self.fetcher is not None:
            await self.fetcher.aclose()


async def _all(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Run them together; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
