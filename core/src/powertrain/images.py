"""Image bytes -> RGB pixels, as DeepSeek V4.1's official preprocessor reads them.

The official ``inference/image_processor.py`` opens the bytes with Pillow and calls
``convert("RGB")``; its vision encoder was trained on what that gives, so this does the
same: the first frame of an animated GIF or WebP; an alpha channel dropped, not
composited (a transparent pixel keeps the colour stored under it; Pillow's conversion
of a palette image with a transparent index does the same); EXIF orientation not
applied (the pixels are as stored, and the header's size, which the protocol adapter
fitted, stays the decoded size).

Before anything is decoded the header's size is checked against a pixel limit, so a
small file that declares a huge image (a decompression bomb) costs nothing; a file that
is not the type its media type names, or that is truncated or corrupt, is refused too.
Each refusal is an ``ImageDecodeError`` naming the request field the image came from.
``ImageDecoder`` runs decoding on a few threads, off the event loop, which also bounds
the memory decoding takes to those threads' images.
"""

from __future__ import annotations

import asyncio
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image, UnidentifiedImageError

#: Media types -> the Pillow format that must read them (no other format is tried).
FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/gif": "GIF", "image/webp": "WEBP"}

#: 8192 pixels a side, the protocol adapter's limit.
DEFAULT_MAX_PIXELS = 8192 * 8192


class ImageDecodeError(ValueError):
    """An image that cannot be decoded: ``path`` names its field in the request body."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def decode_image(data: bytes, media_type: str, path: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """``data`` (a ``media_type`` image) as RGB uint8 pixels ``[height, width, 3]``."""
    expected = FORMATS.get(media_type)
    if expected is None:
        raise ImageDecodeError(path, f"unsupported image media type {media_type!r} (expected {', '.join(FORMATS)})")
    try:
        # Only the header is read here; ``formats`` keeps Pillow from trying other decoders.
        image = Image.open(io.BytesIO(data), formats=[expected])
    except UnidentifiedImageError:
        raise ImageDecodeError(
            path, f"the image data is not a valid {media_type} image; send the media type its bytes are"
        ) from None
    except Image.DecompressionBombError as exc:  # Pillow's own limit (twice MAX_IMAGE_PIXELS), checked on open
        raise ImageDecodeError(
            path, f"the image declares more pixels than this server decodes ({exc}); send a smaller image"
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageDecodeError(path, f"the {media_type} image header cannot be read: {exc}") from None
    with image:
        width, height = image.size
        if width * height > max_pixels:
            raise ImageDecodeError(
                path,
                f"the image declares {width}x{height} = {width * height} pixels; this server decodes at most "
                f"{max_pixels}; send a smaller image",
            )
        try:
            rgb = image.convert("RGB")  # decodes the first frame
        except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
            raise ImageDecodeError(
                path, f"the {media_type} image is truncated or corrupt ({exc}); send the whole, valid file"
            ) from None
    with rgb:
        return np.asarray(rgb, dtype=np.uint8)


class ImageDecoder:
    """Decodes images on ``threads`` threads: awaiting ``decode`` never blocks the event
    loop, and at most ``threads`` images are being decoded at once."""

    def __init__(self, max_pixels: int = DEFAULT_MAX_PIXELS, threads: int = 2) -> None:
        self.max_pixels = max_pixels
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="powertrain-image")

    async def decode(self, data: bytes, media_type: str, path: str) -> np.ndarray:
        """``decode_image`` on a decoding thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, decode_image, data, media_type, path, self.max_pixels)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
