"""``powertrain.images``: image bytes -> RGB pixels as DeepSeek V4.1's preprocessor reads
them (Pillow's ``convert("RGB")``), and the refusals that come before decoding."""

from __future__ import annotations

import asyncio
import io
import struct
import threading
import zlib

import numpy as np
import pytest
from PIL import Image

from powertrain.images import ImageDecodeError, ImageDecoder, decode_image

PATH = "messages[0].content[1].image_url.url"


def random_rgb(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def encoded(image: Image.Image, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_header_only(width: int, height: int) -> bytes:
    """A well-formed PNG declaring ``width`` x ``height`` RGB pixels whose image data is
    one empty zlib stream: a valid header, no pixels."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"")
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


@pytest.mark.parametrize(
    ("fmt", "media_type", "options"), [("PNG", "image/png", {}), ("WEBP", "image/webp", {"lossless": True})]
)
def test_lossless_formats_decode_to_the_exact_pixels(fmt: str, media_type: str, options: dict) -> None:
    pixels = random_rgb(37, 53)
    decoded = decode_image(encoded(Image.fromarray(pixels), fmt, **options), media_type, PATH)
    assert decoded.dtype == np.uint8 and decoded.shape == (37, 53, 3)
    np.testing.assert_array_equal(decoded, pixels)


def test_jpeg_decodes_close_to_its_pixels() -> None:
    # A smooth gradient survives JPEG at high quality within a few levels.
    y, x = np.mgrid[0:64, 0:96]
    pixels = np.stack([x * 2, y * 3, (x + y)], axis=-1).astype(np.uint8)
    decoded = decode_image(encoded(Image.fromarray(pixels), "JPEG", quality=98), "image/jpeg", PATH)
    assert decoded.shape == (64, 96, 3)
    assert np.abs(decoded.astype(int) - pixels.astype(int)).max() <= 8


def test_gif_gives_its_first_frame() -> None:
    first = Image.new("P", (20, 10))
    first.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    second = first.copy()
    second.paste(1, (0, 0, 20, 10))  # all blue
    data = encoded(first, "GIF", save_all=True, append_images=[second])
    assert Image.open(io.BytesIO(data)).n_frames == 2
    decoded = decode_image(data, "image/gif", PATH)
    assert decoded.shape == (10, 20, 3)
    assert (decoded == [255, 0, 0]).all()  # red: frame 0, not the blue frame 1


def test_alpha_is_dropped_as_the_official_preprocessor_drops_it() -> None:
    """Pillow's convert("RGB") (what DeepSeek's image_processor.py calls) keeps the colour
    stored under a transparent pixel; no white or black background is composited."""
    rgba = np.zeros((4, 4, 4), dtype=np.uint8)
    rgba[..., 0] = 200  # red, fully transparent
    rgba[0, 0] = [10, 20, 30, 255]
    decoded = decode_image(encoded(Image.fromarray(rgba, "RGBA"), "PNG"), "image/png", PATH)
    assert decoded[0, 0].tolist() == [10, 20, 30]
    assert decoded[1, 1].tolist() == [200, 0, 0]


def test_exif_orientation_is_not_applied() -> None:
    pixels = random_rgb(8, 16)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    data = encoded(Image.fromarray(pixels), "JPEG", quality=100, exif=exif.tobytes())
    assert decode_image(data, "image/jpeg", PATH).shape == (8, 16, 3)  # as stored, not turned


def test_a_decompression_bomb_is_refused_from_its_header() -> None:
    # 190 bytes that declare 10^10 pixels (30 GB of RGB).
    bomb = png_header_only(100_000, 100_000)
    with pytest.raises(ImageDecodeError, match=r"10000000000 pixels") as refused:
        decode_image(bomb, "image/png", PATH)
    assert refused.value.path == PATH and str(refused.value).startswith(PATH)
    with pytest.raises(ImageDecodeError, match=r"5000x5000 = 25000000 pixels.*at most 1000000"):
        decode_image(png_header_only(5000, 5000), "image/png", PATH, max_pixels=1_000_000)
    # Under the limit the same header is read, then the missing pixel data is the error.
    with pytest.raises(ImageDecodeError, match="truncated or corrupt"):
        decode_image(png_header_only(100, 100), "image/png", PATH, max_pixels=1_000_000)


def test_a_truncated_image_is_refused_naming_the_part() -> None:
    data = encoded(Image.fromarray(random_rgb(64, 64)), "PNG")
    with pytest.raises(ImageDecodeError, match="truncated or corrupt") as refused:
        decode_image(data[: len(data) // 2], "image/png", PATH)
    assert refused.value.path == PATH
    jpeg = encoded(Image.fromarray(random_rgb(64, 64)), "JPEG")
    with pytest.raises(ImageDecodeError, match="truncated or corrupt"):
        decode_image(jpeg[: len(jpeg) // 3], "image/jpeg", PATH)


def test_a_media_type_that_lies_is_refused() -> None:
    png = encoded(Image.fromarray(random_rgb(8, 8)), "PNG")
    with pytest.raises(ImageDecodeError, match="not a valid image/jpeg image"):
        decode_image(png, "image/jpeg", PATH)
    with pytest.raises(ImageDecodeError, match="unsupported image media type 'image/bmp'"):
        decode_image(encoded(Image.fromarray(random_rgb(8, 8)), "BMP"), "image/bmp", PATH)
    with pytest.raises(ImageDecodeError, match="not a valid image/png"):
        decode_image(b"GIF89a" + b"\0" * 40, "image/png", PATH)


def test_the_decoder_runs_off_the_event_loop_on_its_own_threads() -> None:
    pixels = random_rgb(32, 32)
    data = encoded(Image.fromarray(pixels), "PNG")
    decoder = ImageDecoder(threads=2)
    seen: list[str] = []
    real = decode_image

    async def main() -> np.ndarray:
        loop_thread = threading.current_thread().name
        import powertrain.images as images

        def spy(*args: object) -> np.ndarray:
            seen.append(threading.current_thread().name)
            return real(*args)  # type: ignore[arg-type]

        images.decode_image = spy  # type: ignore[assignment]
        try:
            result = await decoder.decode(data, "image/png", PATH)
        finally:
            images.decode_image = real
        assert seen and seen[0] != loop_thread and seen[0].startswith("powertrain-image")
        return result

    try:
        np.testing.assert_array_equal(asyncio.run(main()), pixels)
        with pytest.raises(ImageDecodeError, match="truncated"):
            asyncio.run(decoder.decode(data[:100], "image/png", PATH))
    finally:
        decoder.close()
