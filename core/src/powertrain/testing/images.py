"""``sample_images``: a seeded corpus of encoded images in the formats, colour modes, sizes and
orientations clients send, for checking a preprocessor against another on the same bytes.

No model hub or photo collection is reachable from the test machines, so the pictures are
drawn: smooth colour fields with soft blobs, edges and sensor-like noise (what resampling
treats differently from flat or white-noise images), in PNG (RGB, RGBA, grey, grey with
alpha, palette, palette with a transparent index, 16-bit grey, bilevel), JPEG (RGB, grey,
CMYK, and RGB with each EXIF orientation 2 to 8), WebP (lossless RGB, lossy with alpha) and
GIF (two frames); sides log-uniform from 24 (now and then 1) to 1,400 pixels, a few large
ones (up to 2,600 x 2,000) and a few strips of extreme aspect ratio. The same seed gives
the same bytes for the same Pillow build (a fixture made from them records each file's
SHA-256, so a changed encoder is told apart from a changed result).
"""

from __future__ import annotations

import io
import math

import attrs
import numpy as np

#: (format, what is varied) in the order the corpus cycles through them.
KINDS: tuple[tuple[str, str], ...] = (
    ("PNG", "RGB"),
    ("JPEG", "RGB"),
    ("PNG", "RGBA"),
    ("JPEG", "L"),
    ("PNG", "L"),
    ("WEBP", "RGB"),
    ("PNG", "LA"),
    ("JPEG", "CMYK"),
    ("PNG", "P"),
    ("GIF", "P"),
    ("PNG", "P-transparent"),
    ("WEBP", "RGBA"),
    ("PNG", "I;16"),
    ("JPEG", "EXIF"),
    ("PNG", "1"),
)
MEDIA_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}


@attrs.frozen
class SampleImage:
    name: str
    data: bytes = attrs.field(repr=lambda data: f"<{len(data)} bytes>")
    media_type: str
    #: Format, mode and anything else chosen (an EXIF orientation, the frame count).
    description: str
    width: int
    height: int


def photo_like(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """uint8 ``[height, width, 3]``: gradients and soft blobs (drawn at an eighth of the size
    and scaled up, bicubic), a hard edge and sensor-like noise."""
    from PIL import Image

    small_w, small_h = max(2, -(-width // 8)), max(2, -(-height // 8))
    y, x = np.mgrid[0:small_h, 0:small_w].astype(np.float32)
    y, x = y / (small_h - 1), x / (small_w - 1)
    field = np.empty((small_h, small_w, 3), dtype=np.float32)
    for channel in range(3):
        a, b, c = rng.uniform(-1, 1, 3)
        field[..., channel] = 128 + 80 * (a * x + b * y) + 40 * np.sin(2 * math.pi * (c * x + rng.uniform() * y))
    for _ in range(int(rng.integers(1, 5))):
        cy, cx, radius = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.4)
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * radius**2))
        field += blob[..., None] * rng.uniform(-90, 90, 3).astype(np.float32)
    smooth = Image.fromarray(np.clip(field, 0, 255).astype(np.uint8), "RGB").resize((width, height), Image.BICUBIC)
    image = np.asarray(smooth, dtype=np.float32).copy()
    image[:, int(width * rng.uniform(0.2, 0.8)) :] += rng.uniform(-40, 40, 3).astype(np.float32)
    image += rng.standard_normal(image.shape, dtype=np.float32) * np.float32(rng.uniform(1, 12))
    return np.clip(image, 0, 255).astype(np.uint8)


def _side(rng: np.random.Generator, least: int, most: int) -> int:
    return max(1, int(math.exp(rng.uniform(math.log(least), math.log(most)))))


def _size(rng: np.random.Generator, index: int) -> tuple[int, int]:
    if index % 17 == 5:  # a strip: extreme aspect ratio
        long, short = int(rng.integers(1200, 2600)), int(rng.integers(1, 40))
        return (long, short) if rng.uniform() < 0.5 else (short, long)
    if index % 23 == 7:  # large: scaled down to the token budget
        return int(rng.integers(1800, 2600)), int(rng.integers(1400, 2000))
    least = 1 if index % 11 == 3 else 24  # now and then a side of a few pixels
    return _side(rng, least, 1400), _side(rng, least, 1400)


def _encode(rng: np.random.Generator, kind: tuple[str, str], pixels: np.ndarray) -> tuple[bytes, str]:
    from PIL import Image

    fmt, variant = kind
    rgb = Image.fromarray(pixels, "RGB")
    options: dict[str, object] = {}
    described = f"{fmt} {variant}"
    if variant == "RGB":
        image = rgb
        if fmt == "WEBP":
            options["lossless"] = True
        if fmt == "JPEG":
            options["quality"] = int(rng.integers(40, 96))
    elif variant == "RGBA":
        alpha = Image.fromarray((pixels[..., 0] > rng.uniform(40, 200)).astype(np.uint8) * 255, "L")
        image = rgb.copy()
        image.putalpha(alpha)
        if fmt == "WEBP":
            options["quality"] = int(rng.integers(40, 96))
    elif variant == "L":
        image = rgb.convert("L")
    elif variant == "LA":
        image = rgb.convert("LA")
    elif variant == "CMYK":
        image = rgb.convert("CMYK")
    elif variant == "P":
        image = rgb.quantize(colors=int(rng.integers(2, 257)), method=Image.Quantize.FASTOCTREE)
        if fmt == "GIF":
            second = Image.fromarray(255 - pixels, "RGB").quantize(colors=64, method=Image.Quantize.FASTOCTREE)
            options.update(save_all=True, append_images=[second], duration=100)
            described += " 2 frames"
    elif variant == "P-transparent":
        image = rgb.quantize(colors=int(rng.integers(4, 200)), method=Image.Quantize.FASTOCTREE)
        options["transparency"] = int(rng.integers(0, 4))
    elif variant == "I;16":
        wide = (pixels[..., 1].astype(np.uint16) * 257 + rng.integers(0, 257, pixels.shape[:2])).astype(np.uint16)
        image = Image.fromarray(wide)  # 16-bit grey (mode I;16)
    elif variant == "1":
        image = rgb.convert("1")
    elif variant == "EXIF":
        image = rgb
        orientation = int(rng.integers(2, 9))
        exif = Image.Exif()
        exif[0x0112] = orientation
        options.update(exif=exif.tobytes(), quality=int(rng.integers(40, 96)))
        described = f"JPEG RGB EXIF orientation {orientation}"
    else:
        raise ValueError(f"unknown sample kind {kind}")
    if fmt == "PNG":
        options["compress_level"] = 1  # quick to write; the decoder does not care
    if fmt == "WEBP":
        options["method"] = 0
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue(), described


def sample_images(seed: int, count: int) -> list[SampleImage]:
    """``count`` encoded images drawn from ``seed`` (each from its own generator)."""
    images = []
    for index in range(count):
        rng = np.random.default_rng([seed, index])
        kind = KINDS[index % len(KINDS)]
        width, height = _size(rng, index)
        data, described = _encode(rng, kind, photo_like(rng, width, height))
        images.append(
            SampleImage(
                name=f"{index:03d}",
                data=data,
                media_type=MEDIA_TYPES[kind[0]],
                description=described,
                width=width,
                height=height,
            )
        )
    return images
