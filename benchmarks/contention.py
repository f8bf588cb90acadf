"""One greedy stream under CPU contention: the server, the offline engine and llama.cpp,
on an idle machine and with every core taken by other processes.

A server shares its cores with whatever else runs on the host. This script decodes
``--tokens`` tokens (greedy, EOS ignored) of one request at a time on the embedded
SmolLM2-135M-Instruct GGUF with each engine, first on an idle machine, then beside
``--busy`` busy processes (``yes > /dev/null``, as many as there are cores by default),
and prints tok/s (the whole request: prefill and decode) for each, and the server's speed
as a share of the offline engine's under the same load:

* ``server``: ``powertrain serve`` (defaults) in its own process, a non-streaming Chat
  Completions request over HTTP;
* ``offline``: ``LLM()`` (defaults) in its own process, ``generate`` of the same prompt;
* ``llama.cpp``: llama-cpp-python on the same GGUF file (as many threads as torch uses),
  when an interpreter with it is found (``--llama-cpp-python``; benchmark-only, never a
  dependency).

Each number is the median of ``--repeats`` requests after one warm-up.

    uv run python benchmarks/contention.py [--tokens 100] [--busy 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch
from common import llama_cpp_python, report

from powertrain.loader import resolve_model_path

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."

OFFLINE = """
import json, statistics, sys, time
from powertrain import LLM, SamplingParams
tokens, repeats = int(sys.argv[1]), int(sys.argv[2])
with LLM() as llm:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    messages = [{"role": "user", "content": sys.argv[3]}]
    llm.chat(messages, params)  # warm-up
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        [out] = llm.chat(messages, params)
        rates.append(len(out.outputs[0].token_ids) / (time.perf_counter() - started))
print(json.dumps(statistics.median(rates)))
"""

LLAMA_CPP = """
import json, statistics, sys, time
from llama_cpp import Llama
path, threads, tokens, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
messages = [{"role": "user", "content": sys.argv[5]}]
def once():
    started = time.perf_counter()
    out = model.create_chat_completion(messages, max_tokens=tokens, temperature=0, logit_bias={0: -100.0, 2: -100.0})
    return out["usage"]["completion_tokens"] / (time.perf_counter() - started)
once()  # warm-up
print(json.dumps(statistics.median(once() for _ in range(repeats))))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """``count`` processes that keep a core busy each (``yes > /dev/null``)."""
    processes = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(count)]
    try:
        time.sleep(0.5)
        yield
    finally:
        for process in processes:
            process.kill()
            process.wait()


@contextlib.contextmanager
def server() -> Iterator[str]:
    """``powertrain serve`` with its defaults, in its own process group."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "powertrain"), "serve", "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"powertrain serve exited: {process.stderr.read().decode()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("powertrain serve did not start in 300 s")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)


def server_rate(url: str, tokens: int, repeats: int) -> float:
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
    }

    def once() -> float:
        started = time.perf_counter()
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()
        return reply["usage"]["completion_tokens"] / (time.perf_counter() - started)

    once()  # warm-up
    return statistics.median(once() for _ in range(repeats))


def run_json(command: list[str]) -> float:
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="busy processes beside the engine")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", nargs="+", default=["server", "offline", "llama.cpp"])
    parser.add_argument("--llama-cpp-python", help="an interpreter with llama-cpp-python (benchmark-only peer)")
    args = parser.parse_args()
    gguf = str(resolve_model_path("smollm2-135m").path)
    peer = llama_cpp_python(args.llama_cpp_python)
    results: dict[str, object] = {"tokens": args.tokens, "busy processes": args.busy}

    def measure(load: str) -> None:
        for engine in args.engines:
            try:
                if engine == "server":
                    with server() as url, busy_processes(args.busy if load == "contended" else 0):
                        rate = server_rate(url, args.tokens, args.repeats)
                elif engine == "offline":
                    with busy_processes(args.busy if load == "contended" else 0):
                        rate = run_json([sys.executable, "-c", OFFLINE, str(args.tokens), str(args.repeats), PROMPT])
                elif peer is None:
                    results[f"{engine} {load}"] = "skipped: no llama-cpp-python (--llama-cpp-python)"
                    continue
                else:
                    command = [peer, "-c", LLAMA_CPP, gguf, str(torch.get_num_threads()), str(args.tokens)]
                    with busy_processes(args.busy if load == "contended" else 0):
                        rate = run_json([*command, str(args.repeats), PROMPT])
                results[f"{engine} {load} tok/s"] = round(rate, 1)
            except Exception as exc:  # a failing row says why; the others go on
                results[f"{engine} {load}"] = f"failed: {type(exc).__name__}: {exc}"

    for load in ("idle", "contended"):
        measure(load)
    for load in ("idle", "contended"):
        server_rate_, offline = results.get(f"server {load} tok/s"), results.get(f"offline {load} tok/s")
        if isinstance(server_rate_, float) and isinstance(offline, float):
            results[f"server / offline, {load}"] = round(server_rate_ / offline, 3)
    report("one greedy stream, idle and beside busy processes", results)


if __name__ == "__main__":
    main()
