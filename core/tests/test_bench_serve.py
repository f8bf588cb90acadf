"""`powertrain bench serve` against a real HTTP server, plus its SSE reader and arrival schedule.

`powertrain serve` is not on this branch yet, so the HTTP peer here is a TEST DOUBLE:
a small FastAPI app that speaks the OpenAI streaming chat protocol, records what it
received and what it served, splits some events across network writes, and injects
failures on chosen request numbers. The benchmark client under test is the real one,
talking real HTTP over a localhost socket.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pytest
import uvicorn
from click.testing import CliRunner
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from PIL import Image

from powertrain.bench.client import StreamError, StreamReader
from powertrain.bench.plot import DPI, FIGSIZE, latency_vs_load_figure
from powertrain.bench.sse import SSEParser
from powertrain.bench.workloads import LengthRange, arrival_times
from powertrain.cli import main

POWERTRAIN = Path(sys.executable).parent / "powertrain"
MODEL = "test-model"
ALWAYS_CACHED = 4  # words the double counts as cached on every request, like a shared template prefix


# --------------------------------------------------------------------------- test double


class FakeOpenAIServer:
    """TEST DOUBLE of an OpenAI-compatible server (the HTTP peer); not the powertrain server.

    The reply to request number n is `r{n}w0 r{n}w1 ...` (min(max_tokens, 6) words, one
    chunk each), then a usage chunk whose prompt_tokens counts the words of all messages
    and whose cached_tokens counts the history's words (everything before the last
    message) plus ALWAYS_CACHED. `faults` maps n % `fault_period` to a failure kind.
    """

    def __init__(self) -> None:
        self.app = FastAPI()
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/chat/completions")(self.chat)
        self.reset()

    def reset(self, faults: dict[int, str] | None = None, fault_period: int = 1_000_000) -> None:
        self.count = 0
        self.received: list[dict[str, Any]] = []
        self.served: dict[int, dict[str, Any]] = {}
        self.faults = faults or {}
        self.fault_period = fault_period

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}, {"id": "other", "object": "model"}]}

    async def chat(self, request: Request) -> Any:
        body = await request.json()
        n = self.count
        self.count += 1
        self.received.append({"n": n, "body": body, "authorization": request.headers.get("authorization")})
        fault = self.faults.get(n % self.fault_period)
        if fault == "http500":
            return JSONResponse({"error": {"message": f"injected failure {n}"}}, status_code=500)
        messages = body["messages"]
        prompt = sum(len(m["content"].split()) for m in messages)
        cached = min(prompt, sum(len(m["content"].split()) for m in messages[:-1]) + ALWAYS_CACHED)
        words = [f"r{n}w{i}" for i in range(min(body["max_tokens"], 6))]
        return StreamingResponse(self._stream(n, fault, words, prompt, cached), media_type="text/event-stream")

    async def _stream(self, n: int, fault: str | None, words: list[str], prompt: int, cached: int) -> Any:
        for i, word in enumerate(words):
            if i == 2 and fault == "bad_json":
                yield b'data: {"choices": [{"delta": {"content": "x"\n\n'
            if i == 2 and fault == "truncate":
                return  # the connection closes cleanly, without usage or [DONE]
            if i == 2 and fault == "bad_utf8":
                yield b'data: {"choices": [{"delta": {"content": "\xff\xfe"}}]}\n\n'
            if i == 2 and fault == "error_event":
                yield b'data: {"error": {"message": "injected error event"}}\n\n'
            chunk = {"id": f"c{n}", "object": "chat.completion.chunk", "model": MODEL}
            chunk["choices"] = [{"index": 0, "delta": {"content": (" " if i else "") + word}, "finish_reason": None}]
            data = f"data: {json.dumps(chunk)}\n\n".encode()
            if i == 1:  # split one event across two writes, mid-line
                yield data[:9]
                await asyncio.sleep(0.002)
                yield data[9:]
            else:
                yield data
            await asyncio.sleep(0.002)
        if fault is None:
            self.served[n] = {"prompt": prompt, "cached": cached, "output": len(words), "text": " ".join(words)}
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": len(words),
            "total_tokens": prompt + len(words),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        yield f"data: {json.dumps({'id': f'c{n}', 'choices': [], 'usage': usage})}\n\r\n".encode()
        yield b"data: [DONE]\n\n"


@pytest.fixture(scope="module")
def server_url() -> Iterator[tuple[str, FakeOpenAIServer]]:
    fake = FakeOpenAIServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(fake.app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", fake
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture
def fake(server_url: tuple[str, FakeOpenAIServer]) -> FakeOpenAIServer:
    server_url[1].reset()
    return server_url[1]


@pytest.fixture
def url(server_url: tuple[str, FakeOpenAIServer]) -> str:
    return server_url[0]


def bench(*args: str) -> Any:
    result = CliRunner().invoke(main, ["bench", "serve", *args])
    return result


def check_level_consistency(level: dict[str, Any]) -> None:
    """Invariants every load level's metrics must satisfy."""
    requests = level["requests"]
    assert requests["completed"] + requests["failed"] == requests["sent"]
    assert requests["sent"] + requests["skipped"] == requests["planned"]
    assert level["errors"]["count"] == requests["failed"]
    assert len(level["errors"]["first"]) == min(requests["failed"], 5)
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = level[metric]
        assert stats["count"] > 0
        assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"], (metric, stats)
    assert level["ttft_ms"]["count"] == level["e2e_ms"]["count"] == requests["completed"]
    assert level["ttft_ms"]["p99"] <= level["e2e_ms"]["p99"]
    assert level["request_throughput"] == pytest.approx(requests["completed"] / level["duration_s"])
    assert 0 < level["client_cpu_s"] < 4 * level["duration_s"]  # this process's own CPU during the level
    tokens = level["tokens"]
    assert level["output_throughput"] == pytest.approx(tokens["output"] / level["duration_s"])
    assert level["total_token_throughput"] == pytest.approx((tokens["prompt"] + tokens["output"]) / level["duration_s"])
    assert 1 <= level["peak_concurrency"] <= requests["sent"]


# --------------------------------------------------------------------------- SSE reading


STREAM = (
    ": keep-alive comment\r\n"
    'data: {"a": "héllo ✓ 日本"}\r\n\r\n'
    "event: message\n"
    "data: first line\n"
    "data:second line\n"
    "\n"
    "data: cr-only\r\r"
    "id: 7\n"
    "data\n"
    "\n"
    "data: [DONE]"  # no blank line at the end of the stream
).encode()
EVENTS = ['{"a": "héllo ✓ 日本"}', "first line\nsecond line", "cr-only", "", "[DONE]"]


def parse_in_pieces(pieces: list[bytes]) -> list[str]:
    parser = SSEParser()
    events = [event for piece in pieces for event in parser.feed(piece)]
    return events + parser.close()


def test_sse_parser_reads_a_whole_stream() -> None:
    assert parse_in_pieces([STREAM]) == EVENTS


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_sse_parser_survives_a_split_anywhere(cut: int) -> None:
    """Cuts fall inside CRLF pairs, inside multi-byte characters and inside `data:`."""
    assert parse_in_pieces([STREAM[:cut], STREAM[cut:]]) == EVENTS


def test_sse_parser_byte_by_byte_and_in_odd_chunks() -> None:
    assert parse_in_pieces([STREAM[i : i + 1] for i in range(len(STREAM))]) == EVENTS
    assert parse_in_pieces([STREAM[i : i + 7] for i in range(0, len(STREAM), 7)]) == EVENTS


def test_sse_parser_gives_events_as_soon_as_they_end() -> None:
    """A token's timestamp is taken when its event ends, not when the stream does."""
    parser = SSEParser()
    assert parser.feed(b"data: one\n") == []
    assert parser.feed(b"\ndata: tw") == ["one"]
    assert parser.feed(b"o\r") == []  # the CR may be half of a CRLF
    assert parser.feed(b"\n\r\n") == ["two"]
    assert parser.close() == []


def chunk(content: str | None = None, usage: dict[str, Any] | None = None) -> str:
    choices = [] if content is None else [{"index": 0, "delta": {"content": content}}]
    return json.dumps({"choices": choices, "usage": usage})


def test_stream_reader_times_tokens_and_reads_usage() -> None:
    reader = StreamReader(sent_at=10.0)
    reader.event(json.dumps({"choices": [{"delta": {"role": "assistant"}}]}), 10.05)  # no content: not a token
    reader.event(chunk("Hel"), 10.25)
    reader.event(chunk("lo"), 10.5)
    reader.event(chunk(" you"), 11.0)
    usage = {"prompt_tokens": 40, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 30}}
    reader.event(chunk(usage=usage), 11.1)
    reader.event("[DONE]", 11.2)
    result = reader.result(start=3.0, ended_at=11.25)
    assert result.ok and result.text == "Hello you"
    assert result.ttft == pytest.approx(0.25)
    assert result.itl == pytest.approx([0.25, 0.5])
    assert result.e2e == pytest.approx(1.25)
    assert (result.prompt_tokens, result.output_tokens, result.cached_tokens) == (40, 5, 30)
    assert result.tpot == pytest.approx((1.25 - 0.25) / 4)  # usage, not the chunk count, gives the tokens


def test_stream_reader_without_usage_counts_chunks() -> None:
    reader = StreamReader(sent_at=0.0)
    for i, text in enumerate(["a", "b", "c"]):
        reader.event(chunk(text), 0.1 * (i + 1))
    reader.event("[DONE]", 0.4)
    result = reader.result(start=0.0, ended_at=0.4)
    assert not result.usage_reported and result.output_tokens == 3 and result.cached_tokens is None


@pytest.mark.parametrize(
    ("events", "message"),
    [
        (["{not json"], "not JSON"),
        (["[1, 2]"], "not a JSON object"),
        (['{"choices": "oops"}'], "unexpected chunk shape"),
        (['{"choices": [], "usage": "lots"}'], "unexpected chunk shape"),
        (['{"error": {"message": "out of memory"}}'], "error in stream: out of memory"),
        (["[DONE]", chunk("late")], "data after [DONE]"),
    ],
)
def test_stream_reader_rejects_malformed_streams(events: list[str], message: str) -> None:
    reader = StreamReader(sent_at=0.0)
    with pytest.raises(StreamError, match=message.replace("[", r"\[").replace("]", r"\]")):
        for data in events:
            reader.event(data, 0.1)


def test_stream_reader_requires_done() -> None:
    reader = StreamReader(sent_at=0.0)
    reader.event(chunk("a"), 0.1)
    with pytest.raises(StreamError, match="ended before"):
        reader.result(start=0.0, ended_at=0.2)


# --------------------------------------------------------------------------- workloads


def test_poisson_arrivals_have_exponential_gaps() -> None:
    rate, count = 20.0, 5000
    times = arrival_times(count, rate, seed=7)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert all(gap > 0 for gap in gaps)
    mean = statistics.fmean(gaps)
    # The mean of 5000 exponential gaps has a standard error of 1.4%: 5% is > 3 sigma.
    assert mean == pytest.approx(1 / rate, rel=0.05)
    assert statistics.stdev(gaps) / mean == pytest.approx(1.0, abs=0.06)  # exponential: stdev = mean
    below_median = sum(gap < 0.6931 / rate for gap in gaps) / count  # median of Exp(rate) is ln 2 / rate
    assert below_median == pytest.approx(0.5, abs=0.03)
    assert arrival_times(count, rate, seed=7) == times
    assert arrival_times(count, rate, seed=8) != times


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_times(5, float("inf"), seed=1) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_times(5, 0.0, seed=1)


def test_length_ranges() -> None:
    assert LengthRange.parse("128") == LengthRange(128, 128)
    assert LengthRange.parse("64:256") == LengthRange(64, 256)
    assert LengthRange.parse("8-16") == LengthRange(8, 16)
    for bad in ("0", "9:3", "x", "1:2:3"):
        with pytest.raises(ValueError):
            LengthRange.parse(bad)


# --------------------------------------------------------------------------- the command


FAULTS = {3: "http500", 8: "bad_json", 13: "truncate", 17: "error_event", 21: "bad_utf8"}


def test_rate_sweep_writes_consistent_json_and_a_png(url: str, fake: FakeOpenAIServer, tmp_path: Path) -> None:
    per_level = 24
    fake.reset(FAULTS, fault_period=per_level)
    output, plot = tmp_path / "run.json", tmp_path / "run.png"
    args = ["--base-url", url, "--model", MODEL, "--rates", "40,inf", "--num-requests", str(per_level)]
    args += "--input-len 8:16 --output-len 3:8 --seed 3 --api-key s3cret --output".split() + [str(output)]
    result = bench(*args)
    assert result.exit_code == 0, result.output
    assert "TTFT" in result.output and "rate inf" in result.output

    report = json.loads(output.read_text())
    assert "s3cret" not in output.read_text()
    assert report["config"]["api_key"] == "set"
    assert {r["authorization"] for r in fake.received} == {"Bearer s3cret"}
    assert report["config"]["model"] == MODEL and report["config"]["workload"] == "synthetic"
    assert report["machine"]["cores"] and report["command"]
    assert [level["load"] for level in report["levels"]] == [
        {"mode": "rate", "target": 40.0},
        {"mode": "rate", "target": "inf"},
    ]
    assert len(fake.received) == 2 * per_level
    for index, level in enumerate(report["levels"]):
        check_level_consistency(level)
        numbers = range(index * per_level, (index + 1) * per_level)
        served = [fake.served[n] for n in numbers if n in fake.served]
        assert level["requests"] == {
            "planned": per_level,
            "sent": per_level,
            "completed": per_level - len(FAULTS),
            "failed": len(FAULTS),
            "skipped": 0,
            "without_usage": 0,
        }
        errors = " | ".join(level["errors"]["first"])
        expected = (
            "HTTP 500: injected failure",
            "not JSON",
            "ended before data: [DONE]",
            "injected error event",
            "UTF-8",
        )
        for text in expected:
            assert text in errors
        tokens = level["tokens"]
        assert tokens["output"] == sum(s["output"] for s in served)
        assert tokens["prompt"] == sum(s["prompt"] for s in served)
        assert tokens["cached"] == sum(s["cached"] for s in served)
        assert level["prefix_cache_hit_rate"] == pytest.approx(tokens["cached"] / tokens["prompt"])
        assert 0 < level["prefix_cache_hit_rate"] < 1
    # Every request asks for a max_tokens in range and streams with usage.
    for record in fake.received:
        body = record["body"]
        assert 3 <= body["max_tokens"] <= 8 and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert 8 <= len(body["messages"][0]["content"].split()) <= 16
    # Each level draws its own prompts, so one level cannot warm the cache for the next.
    first_level = {json.dumps(r["body"]["messages"]) for r in fake.received[:per_level]}
    second_level = {json.dumps(r["body"]["messages"]) for r in fake.received[per_level:]}
    assert not first_level & second_level

    image = Image.open(plot)
    assert image.format == "PNG"
    assert image.size == (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))
    check_figure(report)


def check_figure(report: dict[str, Any]) -> None:
    """The plot's three panels hold the report's numbers: TTFT and TPOT p50/p99, output tok/s."""
    figure = latency_vs_load_figure(report)
    try:
        ttft, tpot, throughput = figure.axes
        levels = sorted(report["levels"], key=lambda level: level["request_throughput"])
        xs = [level["request_throughput"] for level in levels]
        for ax, metric in ((ttft, "ttft_ms"), (tpot, "tpot_ms")):
            assert [line.get_label() for line in ax.get_lines()] == ["p50", "p99"]
            for line, percentile in zip(ax.get_lines(), ("p50", "p99"), strict=True):
                assert list(line.get_xdata()) == pytest.approx(xs)
                assert list(line.get_ydata()) == pytest.approx([level[metric][percentile] for level in levels])
        [line] = throughput.get_lines()
        assert throughput.get_ylabel() == "output tokens/s"
        assert list(line.get_xdata()) == pytest.approx(xs)
        assert list(line.get_ydata()) == pytest.approx([level["output_throughput"] for level in levels])
        assert all(y > 0 for y in line.get_ydata())
    finally:
        plt.close(figure)


def test_multi_turn_resends_the_growing_history(url: str, fake: FakeOpenAIServer, tmp_path: Path) -> None:
    conversations, turns = 4, 3
    output = tmp_path / "multi.json"
    args = ["--base-url", url, "--workload", "multi-turn", "--concurrency", "2,4"]
    args += ["--conversations", str(conversations), "--turns", str(turns)]
    args += ["--input-len", "5:9", "--output-len", "4", "--output", str(output)]
    result = bench(*args)
    assert result.exit_code == 0, result.output
    report = json.loads(output.read_text())
    assert report["config"]["turns"] == turns and report["config"]["conversations"] == conversations
    assert [level["load"] for level in report["levels"]] == [
        {"mode": "concurrency", "target": 2},
        {"mode": "concurrency", "target": 4},
    ]
    planned = conversations * turns
    assert len(fake.received) == 2 * planned
    for level in report["levels"]:
        check_level_consistency(level)
        assert level["requests"]["completed"] == planned
        assert level["peak_concurrency"] <= level["load"]["target"]

    # Group the requests by conversation (its first user message) and check each turn
    # resends the previous turn's messages, the server's reply to it, and one new user turn.
    reply_to = {json.dumps(r["body"]["messages"]): fake.served[r["n"]]["text"] for r in fake.received}
    chats: dict[str, list[list[dict[str, Any]]]] = {}
    for record in fake.received:
        messages = record["body"]["messages"]
        chats.setdefault(messages[0]["content"], []).append(messages)
    assert len(chats) == 2 * conversations
    for chat in chats.values():
        chat.sort(key=len)
        assert [len(messages) for messages in chat] == [1, 3, 5]
        for previous, current in zip(chat, chat[1:], strict=False):
            assert current[: len(previous)] == previous
            assert current[len(previous)] == {"role": "assistant", "content": reply_to[json.dumps(previous)]}
            assert current[-1]["role"] == "user"

    # Shared prefixes are what the double reports as cached: the rate is its ratio exactly.
    for index, level in enumerate(report["levels"]):
        served = [fake.served[r["n"]] for r in fake.received[index * planned : (index + 1) * planned]]
        ratio = sum(s["cached"] for s in served) / sum(s["prompt"] for s in served)
        assert level["prefix_cache_hit_rate"] == pytest.approx(ratio)
        assert level["prefix_cache_hit_rate"] > 0.3  # turn 3 resends ~2/3 of its prompt
    assert Path(output.with_suffix(".png")).stat().st_size > 0  # --plot defaults to --output with .png


def test_a_failed_turn_skips_the_rest_of_its_conversation(url: str, fake: FakeOpenAIServer, tmp_path: Path) -> None:
    fake.reset({4: "http500"})
    output = tmp_path / "skip.json"
    args = ["--base-url", url, "--model", MODEL, "--workload", "multi-turn", "--conversations", "3", "--turns", "3"]
    args += ["--input-len", "4", "--output-len", "3", "--rate", "inf", "--output", str(output)]
    result = bench(*args)
    assert result.exit_code == 0, result.output
    [level] = json.loads(output.read_text())["levels"]
    failed_turn = sum(m["role"] == "assistant" for m in fake.received[4]["body"]["messages"])
    assert level["requests"]["failed"] == 1
    assert level["requests"]["skipped"] == 3 - failed_turn - 1
    assert level["requests"]["sent"] == len(fake.received) == 9 - level["requests"]["skipped"]
    check_level_consistency(level)


def test_console_script_asks_the_server_for_its_model(url: str, fake: FakeOpenAIServer, tmp_path: Path) -> None:
    """As a user runs it (the CI acceptance shape): a fresh process, no --model."""
    output, plot = tmp_path / "ci.json", tmp_path / "ci-plot.png"
    command = [str(POWERTRAIN), "bench", "serve", "--base-url", url, "--num-requests", "6", "--rate", "inf"]
    command += ["--input-len", "6", "--output-len", "4", "--output", str(output), "--plot", str(plot)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report = json.loads(output.read_text())
    assert report["config"]["model"] == MODEL
    assert report["command"].startswith("powertrain bench serve --base-url")
    assert report["levels"][0]["requests"]["completed"] == 6
    assert {r["body"]["model"] for r in fake.received} == {MODEL}
    assert Image.open(plot).format == "PNG"


def test_unreachable_server_fails_cleanly(tmp_path: Path) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    result = bench("--base-url", closed, "--output", str(tmp_path / "x.json"))
    assert result.exit_code == 1
    assert "could not list models" in result.output and "Traceback" not in result.output

    # With a model named, every request fails: counted and written, then a non-zero exit.
    output = tmp_path / "down.json"
    result = bench("--base-url", closed, "--model", "m", "--num-requests", "3", "--output", str(output))
    assert result.exit_code == 1 and "no request completed" in result.output
    [level] = json.loads(output.read_text())["levels"]
    assert level["requests"]["failed"] == 3 and "ConnectError" in level["errors"]["first"][0]
    assert level["ttft_ms"]["p50"] is None and level["prefix_cache_hit_rate"] is None


def test_bad_options_are_reported() -> None:
    for args, message in [
        (["--rate", "1", "--concurrency", "2"], "not both"),
        (["--rate", "fast"], "is not a rate"),
        (["--concurrency", "0"], "must be positive"),
        (["--input-len", "9:3"], "not a length range"),
    ]:
        result = bench(*args)
        assert result.exit_code == 1 and message in result.output, (args, result.output)
