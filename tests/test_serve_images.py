"""Images through the real server: the refusals that keep it serving, and the images it
hands an engine that reads them.

The tiny random DeepSeek-V4.1 checkpoint runs behind the server with the recipe adapter,
whose V4.1 encoding renders each image as its ``<｜image｜>`` placeholder. No engine reads
images yet (the V4.1 vision tower is being written), so where a test needs one,
``ImageReadingEngine`` stands in: the real engine, saying it accepts images, recording the
ones the server hands it and running the prompt as text. Once a real vision engine exists
these tests should run on it instead. After every refusal a plain request still gets 200.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from powertrain.assemble import build_engine
from powertrain.config import EngineConfig, ImagesConfig
from powertrain.engine.async_engine import AsyncEngine
from powertrain.llm import apply_overrides
from powertrain.plugins import PluginManager
from powertrain.serve.run import protocol_adapter
from powertrain.serve.settings import ServeSettings
from powertrain.testing.deepseek_v41 import write_tiny_deepseek_v41
from powertrain.testing.server import running_server
from powertrain_recipe._native import image_fit

MODEL = "tiny-v41"
CHAT = "/v1/chat/completions"


class ImageReadingEngine:
    """A stand-in for an engine with a vision encoder (none exists yet): the real engine,
    which runs the prompt as text, plus ``accepts_images`` and a record of what it got."""

    accepts_images = True

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.received: list[list[Any]] = []

    def add_request(self, prompt: Any, params: Any = None, request_id: str | None = None, images: Any = None) -> str:
        self.received.append(list(images or ()))
        return self._engine.add_request(prompt, params, request_id=request_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_deepseek_v41(tmp_path_factory.mktemp("v41-images"), seed=7, max_position_embeddings=4096)


def _engine(checkpoint: Path, reads_images: bool) -> tuple[AsyncEngine, Any, Any]:
    config = apply_overrides(EngineConfig(), {"path": str(checkpoint), "dtype": "float32", "block_size": 8})
    plugins = PluginManager.load(config.plugins)
    engine = build_engine(config, plugins)
    inner = ImageReadingEngine(engine) if reads_images else engine
    async_engine = AsyncEngine(inner)
    return async_engine, protocol_adapter(plugins, engine.tokenizer, engine.model_config), inner


@pytest.fixture(scope="module")
def text_only(checkpoint: Path) -> Iterator[str]:
    """A server on the real engine, which has no vision encoder."""
    engine, adapter, _ = _engine(checkpoint, reads_images=False)
    try:
        with running_server(engine, adapter, ServeSettings(served_model_name=MODEL)) as url:
            yield url
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def reading(checkpoint: Path) -> Iterator[tuple[AsyncEngine, Any, ImageReadingEngine]]:
    engine, adapter, inner = _engine(checkpoint, reads_images=True)
    try:
        yield engine, adapter, inner
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def images_url(reading: tuple[AsyncEngine, Any, ImageReadingEngine]) -> Iterator[str]:
    engine, adapter, _ = reading
    with running_server(engine, adapter, ServeSettings(served_model_name=MODEL)) as url:
        yield url


# --------------------------------------------------------------------------- helpers


def png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def random_rgb(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def png_header_only(width: int, height: int) -> bytes:
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def chat_body(*urls: str, max_tokens: int = 2) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Describe."}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": parts}]}


def post(url: str, body: dict[str, Any], route: str = CHAT) -> httpx.Response:
    return httpx.post(url + route, json=body, timeout=120)


def assert_still_serving(url: str) -> None:
    reply = post(url, {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hello"}]})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2


def refused(url: str, body: dict[str, Any], status: int = 400, route: str = CHAT) -> str:
    reply = post(url, body, route)
    assert reply.status_code == status, reply.text
    assert_still_serving(url)
    return reply.text


IMAGE = png(random_rgb(30, 40))
PART = "messages[0].content[1].image_url.url"


# --------------------------------------------------------------------------- refusals


def test_a_model_without_a_vision_encoder_refuses_images_naming_it(text_only: str) -> None:
    chat = refused(text_only, chat_body(data_url(IMAGE)))
    assert f"model '{MODEL}' has no vision encoder" in chat and "prompt tokens" in chat
    responses = {
        "model": MODEL,
        "max_output_tokens": 2,
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(IMAGE)}]}],
    }
    assert MODEL in refused(text_only, responses, route="/v1/responses")
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(IMAGE).decode()}
    anthropic = {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "image", "source": source}]}],
    }
    text = refused(text_only, anthropic, route="/v1/messages")
    assert json.loads(text)["type"] == "error" and MODEL in text


def test_a_decompression_bomb_is_refused(images_url: str) -> None:
    # 190 bytes declaring 100000x100000 pixels: refused from the header by the adapter.
    text = refused(images_url, chat_body(data_url(png_header_only(100_000, 100_000))))
    assert "100000x100000" in text and "8192" in text and PART in text


def test_the_servers_pixel_limit_refuses_before_decoding(
    reading: tuple[AsyncEngine, Any, ImageReadingEngine],
) -> None:
    engine, adapter, inner = reading
    settings = ServeSettings(served_model_name=MODEL, images=ImagesConfig(max_pixels=1000))
    with running_server(engine, adapter, settings) as url:
        before = len(inner.received)
        text = refused(url, chat_body(data_url(png_header_only(2000, 1000))))
        assert "2000x1000 = 2000000 pixels" in text and "at most 1000" in text and PART in text
        assert len(inner.received) == before + 1  # only the plain request reached the engine


def test_a_truncated_image_with_a_valid_header_is_refused(
    images_url: str, reading: tuple[AsyncEngine, Any, ImageReadingEngine]
) -> None:
    """The header (all the adapter reads) is fine; decoding finds the rest missing."""
    text = refused(images_url, chat_body(data_url(IMAGE[: len(IMAGE) // 2])))
    assert "truncated or corrupt" in text and PART in text and json.loads(text)["error"]["param"] == PART


def test_a_media_type_that_lies_is_refused(images_url: str) -> None:
    text = refused(images_url, chat_body(data_url(IMAGE, "image/jpeg")))
    assert "not a valid image/jpeg image" in text and PART in text


def test_a_50_mb_image_is_refused_before_the_body_is_read(images_url: str) -> None:
    huge = "A" * (50 * 2**20)
    body = json.dumps(chat_body(f"data:image/png;base64,{huge}")).encode()
    reply = httpx.post(images_url + CHAT, content=body, headers={"content-type": "application/json"}, timeout=120)
    assert reply.status_code == 413 and "at most 4194304" in reply.text
    assert_still_serving(images_url)


def test_more_images_than_the_limit_are_refused(images_url: str) -> None:
    small = data_url(png(random_rgb(2, 2)))
    text = refused(images_url, chat_body(*[small] * 33))
    assert "33 images; a request may carry at most 32" in text


def test_a_remote_url_is_refused_while_fetching_is_off(images_url: str) -> None:
    text = refused(images_url, chat_body("https://images.example.com/cat.png"))
    assert "[server.images] fetch" in text and PART in text


# --------------------------------------------------------------------------- images handed to the engine


def test_the_engine_gets_each_images_pixels_and_usage_counts_their_tokens(
    images_url: str, reading: tuple[AsyncEngine, Any, ImageReadingEngine]
) -> None:
    _, adapter, inner = reading
    first, second = random_rgb(30, 40, seed=1), random_rgb(700, 90, seed=2)
    gif = io.BytesIO()
    Image.fromarray(second).convert("P").save(gif, format="GIF")
    body = chat_body(data_url(png(first)), data_url(gif.getvalue(), "image/gif"))
    parsed = adapter.parse_request("openai.chat", json.dumps(body).encode())
    assert parsed.image_count == 2 and parsed.prompt.count("<｜image｜>") == 2
    reply = post(images_url, body)
    assert reply.status_code == 200, reply.text
    images = inner.received[-1]
    assert [image.part.path for image in images] == [PART, "messages[0].content[2].image_url.url"]
    np.testing.assert_array_equal(images[0].pixels, first)
    expected_gif = np.asarray(Image.open(io.BytesIO(gif.getvalue())).convert("RGB"))
    np.testing.assert_array_equal(images[1].pixels, expected_gif)
    assert images[1].pixels.shape == (700, 90, 3) and images[1].part.media_type == "image/gif"
    tokens = [image.part.fit.tokens for image in images]
    # The recipe's fit (checked against DeepSeek's own in its tests) of each image's size.
    assert tokens == [image_fit(40, 30)[2], image_fit(90, 700)[2]] and sum(tokens) == parsed.image_tokens
    assert reply.json()["usage"]["prompt_tokens"] == len(parsed.prompt_token_ids) - 2 + sum(tokens)


# --------------------------------------------------------------------------- fetching


class ImageHost(BaseHTTPRequestHandler):
    """Images and misbehaviours on a local port."""

    image = IMAGE

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        port = self.server.server_address[1]
        routes = {
            "/cat.png": (200, "image/png", self.image),
            "/lies.png": (200, "image/jpeg", self.image),
            "/big.png": (200, "image/png", self.image + b"\0" * 5000),
        }
        if self.path in routes:
            status, media_type, data = routes[self.path]
            self.send_response(status)
            self.send_header("Content-Type", media_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/unsized.png":  # no Content-Length: the cap is counted as it arrives
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            for _ in range(10):
                self.wfile.write(b"\0" * 1000)
        elif self.path == "/slow.png":
            time.sleep(3)
            self.send_response(200)
            self.end_headers()
        elif self.path == "/here":
            self.redirect(f"http://127.0.0.1:{port}/cat.png")
        elif self.path == "/elsewhere":
            self.redirect(f"http://localhost:{port}/cat.png")
        else:
            self.send_response(404)
            self.end_headers()

    def redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), ImageHost)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def fetching(**overrides: Any) -> ImagesConfig:
    options: dict[str, Any] = {
        "fetch": True,
        "fetch_hosts": ("127.0.0.1",),
        "fetch_private_addresses": True,
        "fetch_max_bytes": len(IMAGE) + 100,
        "fetch_timeout_s": 1.0,
    }
    return ImagesConfig(**{**options, **overrides})


def test_fetched_images_reach_the_engine_and_misbehaving_hosts_are_refused(
    reading: tuple[AsyncEngine, Any, ImageReadingEngine], image_host: str
) -> None:
    engine, adapter, inner = reading
    with running_server(engine, adapter, ServeSettings(served_model_name=MODEL, images=fetching())) as url:
        for path in ("/cat.png", "/here"):  # directly, and through a redirect within the allow-list
            reply = post(url, chat_body(image_host + path))
            assert reply.status_code == 200, reply.text
            (image,) = inner.received[-1]
            np.testing.assert_array_equal(image.pixels, random_rgb(30, 40))
            assert image.part.url == image_host + path and image.part.fit.tokens == image_fit(40, 30)[2]
        cases = {
            "/elsewhere": "host 'localhost' is not one this server fetches images from",
            "/lies.png": "not a valid image/jpeg image",
            "/big.png": f"larger than this server's limit of {len(IMAGE) + 100} bytes",
            "/unsized.png": f"larger than this server's limit of {len(IMAGE) + 100} bytes",
            "/slow.png": "took longer than 1 s",
            "/missing.png": "answered 404",
        }
        for path, message in cases.items():
            text = refused(url, chat_body(image_host + path))
            assert message in text and PART in text, (path, text)
        off_list = image_host.replace("127.0.0.1", "localhost") + "/cat.png"
        assert "not one this server fetches images from" in refused(url, chat_body(off_list))
    strict = ServeSettings(served_model_name=MODEL, images=fetching(fetch_private_addresses=False))
    with running_server(engine, adapter, strict) as url:
        text = refused(url, chat_body(image_host + "/cat.png"))
        assert "non-public address 127.0.0.1" in text and "fetch_private_addresses" in text
