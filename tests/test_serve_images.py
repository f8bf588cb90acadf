"""Images through the real server: image chats answered on all three protocols with the
openai and anthropic SDKs, the refusals that keep it serving, and the images it hands the
engine.

The tiny random DeepSeek-V4.1 checkpoint with its vision tower runs behind the server with
the recipe adapter, whose V4.1 encoding renders each image as its ``<｜image｜>`` placeholder.
Its tower sizes images as the release does (``RELEASE_IMAGE_SIZING``), so the engine widens
each placeholder to the positions the recipe counts in usage. ``RecordedImages`` wraps the
real engine's ``add_request`` to keep what the server handed it (and calls it unchanged).
After every refusal a plain request still gets 200.
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

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from powertrain.assemble import build_engine
from powertrain.config import EngineConfig, ImagesConfig
from powertrain.engine.async_engine import AsyncEngine
from powertrain.llm import apply_overrides
from powertrain.plugins import PluginManager
from powertrain.serve.run import protocol_adapter
from powertrain.serve.settings import ServeSettings
from powertrain.testing.deepseek_v41 import RELEASE_IMAGE_SIZING, write_tiny_deepseek_v41
from powertrain.testing.server import running_server
from powertrain_recipe._native import image_fit

MODEL = "tiny-v41"
CHAT = "/v1/chat/completions"


class RecordedImages:
    """The images the server hands the engine's ``add_request``, one list per request."""

    def __init__(self, engine: Any) -> None:
        self.received: list[list[Any]] = []
        add_request = engine.add_request

        def recording(prompt: Any, params: Any = None, request_id: str | None = None, images: Any = None) -> str:
            self.received.append(list(images or ()))
            return add_request(prompt, params, request_id=request_id, **({"images": images} if images else {}))

        engine.add_request = recording


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("v41-images")
    return write_tiny_deepseek_v41(
        folder, seed=7, vision=RELEASE_IMAGE_SIZING, image_token="<｜image｜>", max_position_embeddings=4096
    )


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_deepseek_v41(tmp_path_factory.mktemp("v41-text"), seed=7, max_position_embeddings=4096)


def _engine(checkpoint: Path) -> tuple[AsyncEngine, Any, RecordedImages]:
    config = apply_overrides(EngineConfig(), {"path": str(checkpoint), "dtype": "float32", "block_size": 8})
    plugins = PluginManager.load(config.plugins)
    engine = build_engine(config, plugins)
    recorded = RecordedImages(engine)
    return AsyncEngine(engine), protocol_adapter(plugins, engine.tokenizer, engine.model_config), recorded


@pytest.fixture(scope="module")
def text_only(text_checkpoint: Path) -> Iterator[str]:
    """A server on the V4.1 checkpoint without a vision tower."""
    engine, adapter, _ = _engine(text_checkpoint)
    try:
        with running_server(engine, adapter, ServeSettings(served_model_name=MODEL)) as url:
            yield url
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def reading(checkpoint: Path) -> Iterator[tuple[AsyncEngine, Any, RecordedImages]]:
    engine, adapter, recorded = _engine(checkpoint)
    try:
        assert engine.engine.accepts_images
        yield engine, adapter, recorded
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def images_url(reading: tuple[AsyncEngine, Any, RecordedImages]) -> Iterator[str]:
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
    reading: tuple[AsyncEngine, Any, RecordedImages],
) -> None:
    engine, adapter, inner = reading
    settings = ServeSettings(served_model_name=MODEL, images=ImagesConfig(max_pixels=1000))
    with running_server(engine, adapter, settings) as url:
        before = len(inner.received)
        text = refused(url, chat_body(data_url(png_header_only(2000, 1000))))
        assert "2000x1000 = 2000000 pixels" in text and "at most 1000" in text and PART in text
        assert len(inner.received) == before + 1  # only the plain request reached the engine


def test_a_truncated_image_with_a_valid_header_is_refused(
    images_url: str, reading: tuple[AsyncEngine, Any, RecordedImages]
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
    images_url: str, reading: tuple[AsyncEngine, Any, RecordedImages]
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


def test_an_image_chat_answers_on_every_protocol_with_usage_counting_its_tokens(
    images_url: str, reading: tuple[AsyncEngine, Any, RecordedImages]
) -> None:
    """The SDKs unchanged: Chat Completions (whole and streamed), Responses and Anthropic
    Messages answer an image chat; usage counts the image tokens the recipe computes; the
    engine got the pixels; the image decides the answer (another image gives other
    log-probabilities, the same one the same)."""
    _, adapter, recorded = reading
    pixels = random_rgb(48, 64, seed=3)
    encoded = png(pixels)
    url = data_url(encoded)
    image_tokens = image_fit(64, 48)[2]
    body = chat_body(url)
    prompt_ids = adapter.parse_request("openai.chat", json.dumps(body).encode()).prompt_token_ids
    expected = len(prompt_ids) - 1 + image_tokens
    client = openai.OpenAI(base_url=f"{images_url}/v1", api_key="unused", max_retries=0)

    def chat(image_url: str, **options: Any) -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=chat_body(image_url)["messages"], max_tokens=3, temperature=0, **options
        )

    whole = chat(url, logprobs=True, top_logprobs=3)
    assert whole.usage.prompt_tokens == expected and whole.usage.completion_tokens == 3
    (image,) = recorded.received[-1]
    np.testing.assert_array_equal(image.pixels, pixels)
    assert image.part.fit.tokens == image_tokens
    streamed = list(chat(url, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole.choices[0].message.content
    assert streamed[-1].usage.prompt_tokens == expected
    again = chat(url, logprobs=True, top_logprobs=3)
    other = chat(data_url(png(random_rgb(48, 64, seed=4))), logprobs=True, top_logprobs=3)

    def first_logprobs(reply: Any) -> dict[str, float]:
        return {t.token: t.logprob for t in reply.choices[0].logprobs.content[0].top_logprobs}

    ours, cached, theirs = first_logprobs(whole), first_logprobs(again), first_logprobs(other)
    # The repeat hits the prefix cache (its image's blocks): the same values in another float32
    # summation order (test_engine_images's LOGPROB_TOLERANCE).
    assert cached.keys() == ours.keys() and all(abs(cached[t] - ours[t]) <= 2e-4 for t in ours), (cached, ours)
    print("another image:", theirs, "this one:", ours)
    assert theirs.keys() != ours.keys() or max(abs(theirs[t] - ours[t]) for t in ours) > 1e-2
    describe = {"type": "input_text", "text": "Describe."}
    responses_input = [{"role": "user", "content": [describe, {"type": "input_image", "image_url": url}]}]
    responses = client.responses.create(model=MODEL, max_output_tokens=3, input=responses_input)
    assert responses.usage.output_tokens == 3
    claude = anthropic.Anthropic(base_url=images_url, api_key="unused", max_retries=0)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(encoded).decode()}
    content = [{"type": "text", "text": "Describe."}, {"type": "image", "source": source}]
    messages = [{"role": "user", "content": content}]
    message = claude.messages.create(model=MODEL, max_tokens=3, messages=messages)
    assert message.usage.output_tokens == 3
    assert [len(images) for images in recorded.received[-2:]] == [1, 1]
    # Anthropic counts prompt tokens read from the cache apart (the image's blocks were cached above).
    message_input = message.usage.input_tokens + message.usage.cache_read_input_tokens
    for protocol, counted, request in (
        ("openai.responses", responses.usage.input_tokens, {"model": MODEL, "input": responses_input}),
        ("anthropic.messages", message_input, {"model": MODEL, "max_tokens": 3, "messages": messages}),
    ):
        ids = adapter.parse_request(protocol, json.dumps(request).encode()).prompt_token_ids
        assert counted == len(ids) - 1 + image_tokens, protocol


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
    reading: tuple[AsyncEngine, Any, RecordedImages], image_host: str
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
