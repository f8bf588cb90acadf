"""Serving: `powertrain serve` against llama.cpp's `llama-server`, and HTTP against offline.

Both servers get the same `powertrain bench serve` workload: ``--requests`` chats (128)
of ``--words`` random words (64), each asking for ``--max-tokens`` (64) greedy tokens with
``ignore_eos``, so every request produces exactly as many tokens on both servers. It runs
once per ``--concurrency`` (16 and 64), each level with its own prompts (seeded by the
level, so both servers see the same ones). The table prints output tok/s and the p50 TTFT
and TPOT per server and level, with the ratio powertrain / llama-server.

llama-server (a benchmark-only peer, never a dependency) runs when it is on PATH or given
with ``--llama-server``, on the GGUF file powertrain's loader resolves ``--model`` to, with
``-t --threads -np <concurrency>`` (one fresh server per level: its slots are fixed at
start). When it is absent the script says so and reports powertrain alone.

``--dtype`` sets powertrain's ``[model] dtype`` (auto: the platform's choice, float32 on a
CPU; bfloat16 runs the matmuls at about twice float32's rate where the CPU has bfloat16
dot products, e.g. AVX512-BF16). ``--quantization`` sets powertrain's ``[model]
quantization`` (server and offline alike):
``auto`` (the default) keeps a GGUF's weights quantised where the native kernel is
installed, as a user's server does; ``dequantize`` expands them to float32 at load, which
costs about five times the weight memory and reads more bytes per step, but spares every
batched step the per-block dequantisation (see ``step_profile.py``).

Server overhead (issue 22 item 2): the highest level's prompts also run offline through
``powertrain.LLM.chat`` in a process of its own (same sampling), and the ratio HTTP /
offline output tok/s says what the server layer costs. The load generator runs on the same
machine, which the offline run does not share: its share of the cores during that level is
printed too (``client_cpu_s`` of the bench result), to read the ratio by. Every engine and
server runs in its own process (offline_throughput.py says why: OpenMP pools); servers are
waited for on ``/health``, get one short warm-up chat before the measured levels, and are
always terminated, even when a run fails. A powertrain level with a failed request, or with
output tokens other than requests x max-tokens, is an error; llama-server's failed requests
are counted beside its numbers (any other llama-server error still prints powertrain's).
``--quick`` (16 chats of 16 words, 16 tokens, concurrency 4 and 16) checks that everything
runs; its numbers are too small to compare.

    uv run python benchmarks/serve_vs_llamacpp.py [--quick] [--llama-server PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from common import report

from powertrain.bench.load import Load
from powertrain.bench.serve import BenchConfig
from powertrain.bench.workloads import LengthRange
from powertrain.loader import resolve_model_path
from powertrain.log_setup import configure_logging

POWERTRAIN = Path(sys.executable).parent / "powertrain"
READY_TIMEOUT_S = 600.0
# Issue 22's workload, and a small one for --quick.
FULL = {"requests": 128, "words": 64, "max_tokens": 64, "concurrency": [16, 64]}
QUICK = {"requests": 16, "words": 16, "max_tokens": 16, "concurrency": [4, 16]}
SLOT_CONTEXT = 512  # llama-server's context per slot: the chat template, the prompt and the reply fit


# --------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def server(name: str, command: list[str], port: int, log_dir: Path) -> Iterator[str]:
    """Start ``command``, yield its base URL once /health answers 200, and always stop it."""
    log_path = log_dir / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(name, proc, url, log_path)
            yield url
        finally:
            stop(proc)


def wait_ready(name: str, proc: subprocess.Popen, url: str, log_path: Path) -> None:
    """Poll /health (llama-server answers 503 while loading) until 200; a server that exits
    or never gets ready is an error quoting the end of its log."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before it was ready:\n{tail(log_path)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name} was not ready after {READY_TIMEOUT_S:.0f} s:\n{tail(log_path)}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (a graceful shutdown), then SIGKILL if it lingers."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def powertrain_command(model: str, port: int, config: Path) -> list[str]:
    return [str(POWERTRAIN), "--log-level", "warning", "serve", "--config", str(config), "--model", model] + [
        "--port", str(port),
    ]  # fmt: skip


def engine_config(args: argparse.Namespace, work: Path) -> Path:
    """The engine.toml the server runs with: ``[model] dtype`` and ``quantization`` from
    ``--dtype`` and ``--quantization``."""
    path = work / "engine.toml"
    path.write_text(f'[model]\ndtype = "{args.dtype}"\nquantization = "{args.quantization}"\n')
    return path


def llama_command(binary: str, gguf: Path, port: int, threads: int, slots: int) -> list[str]:
    return [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]  + [
        "-t", str(threads), "-np", str(slots), "-c", str(slots * SLOT_CONTEXT),
    ]  # fmt: skip


def find_llama_server(given: str | None) -> str | None:
    """``--llama-server`` (which must exist), else llama-server on PATH, else None."""
    if given:
        found = shutil.which(given)
        if found is None:
            raise SystemExit(f"--llama-server {given!r}: no such executable")
        return found
    return shutil.which("llama-server")


def gguf_of(model: str) -> Path | None:
    """The GGUF file powertrain loads for ``model`` (None for a HF folder: llama-server needs a GGUF)."""
    resolved = resolve_model_path(model)
    return resolved.path if resolved.kind == "gguf" else None


# --------------------------------------------------------------------------- the workload


def bench_config(args: argparse.Namespace, concurrency: int, base_url: str = "unused") -> BenchConfig:
    """One level's workload, seeded by the concurrency: both servers and the offline run see the same."""
    return BenchConfig(
        base_url=base_url,
        loads=[Load("concurrency", concurrency)],
        num_requests=args.requests,
        input_len=LengthRange(args.words, args.words),
        output_len=LengthRange(args.max_tokens, args.max_tokens),
        seed=concurrency,
        ignore_eos=True,
        temperature=0.0,
    )


def bench_serve(args: argparse.Namespace, url: str, concurrency: int, out: Path) -> dict[str, Any]:
    """`powertrain bench serve` against ``url`` in its own process; its one level's metrics."""
    config = bench_config(args, concurrency)
    command = [str(POWERTRAIN), "bench", "serve", "--base-url", url, "--concurrency", str(concurrency)]
    command += ["--num-requests", str(config.num_requests), "--input-len", str(config.input_len)]
    command += ["--output-len", str(config.output_len), "--seed", str(config.seed), "--ignore-eos"]
    command += ["--temperature", "0", "--output", str(out), "--plot", str(out.with_suffix(".png"))]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench serve against {url} failed:\n{proc.stderr.strip()}\n{proc.stdout.strip()}")
    [level] = json.loads(out.read_text())["levels"]
    return level


def warm_up(url: str) -> None:
    """One short chat, so neither server's first-request costs land in a measured level."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as response:
        model = json.load(response)["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        response.read()


def summary(level: dict[str, Any], requested: int, peer: bool = False) -> dict[str, Any]:
    """Output tok/s and p50 TTFT/TPOT. Raises if a request failed or produced a different
    length, except for the ``peer``: llama-server drops a few requests at high concurrency
    (so did the runs issue 22 reports), and its numbers then still count what it produced,
    beside how many failed."""
    requests, output = level["requests"], level["tokens"]["output"]
    failed = requests["failed"]
    if (failed or output != requested) and not (peer and failed and output < requested):
        raise RuntimeError(
            f"{failed} failed requests, {output} output tokens instead of {requested}: {level['errors']['first']}"
        )
    return {
        "tok/s": level["output_throughput"],
        "ttft": level["ttft_ms"]["p50"],
        "tpot": level["tpot_ms"]["p50"],
        "failed": failed,
        # the load generator's share of this machine's cores, which the server did not get
        "client": level["client_cpu_s"] / (level["duration_s"] * (os.cpu_count() or 1)),
    }


# --------------------------------------------------------------------------- offline


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    """The highest level's chats through LLM.chat in this process: output tok/s."""
    from powertrain import LLM, SamplingParams

    conversations = bench_config(args, max(args.concurrency)).make_workload(0)
    chats = [[{"role": "user", "content": c.user_turns[0]}] for c in conversations]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with LLM(args.model, dtype=args.dtype, quantization=args.quantization) as llm:
        llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=4))  # warm up, as the servers
        started = time.perf_counter()
        outputs = llm.chat(chats, params)
        elapsed = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != expected(args):
        raise RuntimeError(f"offline: {produced} output tokens instead of {expected(args)}")
    return {"tok/s": produced / elapsed, "tokens": produced, "seconds": elapsed}


def offline_in_subprocess() -> dict[str, Any]:
    """This script with the same arguments and --offline, in a fresh process; its last stdout line."""
    proc = subprocess.run([sys.executable, *sys.argv, "--offline"], capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the offline run failed (exit {proc.returncode}):\n{proc.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


# --------------------------------------------------------------------------- main


def measure_powertrain(args: argparse.Namespace, work: Path) -> dict[int, dict[str, Any]]:
    """Every level against one powertrain server (its batch holds max_num_seqs = 64 chats)."""
    port = free_port()
    command = powertrain_command(args.model, port, engine_config(args, work))
    with server("powertrain", command, port, work) as url:
        warm_up(url)
        return {
            c: summary(bench_serve(args, url, c, work / f"powertrain-{c}.json"), expected(args))
            for c in args.concurrency
        }


def measure_llama(args: argparse.Namespace, binary: str, gguf: Path, work: Path) -> dict[int, dict[str, Any]]:
    """Each level against a fresh llama-server with as many slots as the concurrency."""
    results = {}
    for concurrency in args.concurrency:
        port = free_port()
        command = llama_command(binary, gguf, port, args.threads, concurrency)
        with server(f"llama-server-{concurrency}", command, port, work) as url:
            warm_up(url)
            level = bench_serve(args, url, concurrency, work / f"llama-{concurrency}.json")
            results[concurrency] = summary(level, expected(args), peer=True)
            if level["requests"]["failed"]:
                print(f"llama-server c{concurrency}: {level['errors']['first']}", file=sys.stderr)
    return results


def expected(args: argparse.Namespace) -> int:
    return args.requests * args.max_tokens


def rows(ours: dict[int, dict[str, Any]], theirs: dict[int, dict[str, Any]] | None) -> dict[str, Any]:
    """One row per level and metric: powertrain, llama-server and the ratio powertrain / llama-server."""
    results: dict[str, Any] = {}
    for concurrency, mine in ours.items():
        peer = (theirs or {}).get(concurrency)
        for metric, label in (("tok/s", "output tok/s"), ("ttft", "TTFT p50 ms"), ("tpot", "TPOT p50 ms")):
            row = f"c{concurrency} {label}"
            if peer is None:
                results[f"{row} powertrain"] = mine[metric]
                continue
            ratio = mine[metric] / peer[metric] if peer[metric] else float("nan")
            failed = f" ({peer['failed']} failed)" if peer["failed"] else ""
            results[row] = (
                f"powertrain {mine[metric]:.1f} | llama-server {peer[metric]:.1f}{failed} | ratio {ratio:.3f}"
            )
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="an embedded name, a HF folder or a .gguf file")
    parser.add_argument("--llama-server", help="the llama-server binary [default: llama-server on PATH]")
    parser.add_argument("--requests", type=int, help=f"chats per level [{FULL['requests']}]")
    parser.add_argument("--words", type=int, help=f"random words per chat [{FULL['words']}]")
    parser.add_argument("--max-tokens", type=int, help=f"output tokens per chat, EOS ignored [{FULL['max_tokens']}]")
    parser.add_argument("--concurrency", type=int, nargs="+", help="concurrencies [16 64]")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="llama-server -t")
    parser.add_argument("--keep", help="a folder to keep the server logs and bench results (JSON, PNG) in")
    parser.add_argument("--quick", action="store_true", help=f"a small run: defaults {QUICK}")
    parser.add_argument("--dtype", default="auto", help="[model] dtype for powertrain (server and offline)")
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "keep", "dequantize"],
        help="[model] quantization for powertrain (server and offline) [auto: kept where a native kernel is]",
    )
    parser.add_argument("--offline", action="store_true", help=argparse.SUPPRESS)  # the offline child
    args = parser.parse_args()
    for name, default in (QUICK if args.quick else FULL).items():  # counts given explicitly win
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def main() -> None:
    args = parse_args()
    if args.offline:
        print(json.dumps(run_offline(args)))
        return
    binary = find_llama_server(args.llama_server)
    gguf = gguf_of(args.model)
    results: dict[str, Any] = {
        "workload": f"{args.requests} chats x {args.words} random words, {args.max_tokens} tokens, greedy, ignore_eos",
        "model": str(gguf or args.model),
        "powertrain [model] dtype": args.dtype,
        "powertrain [model] quantization": args.quantization,
    }
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        print("powertrain serve...", file=sys.stderr, flush=True)
        ours = measure_powertrain(args, work)
        theirs = None
        if binary is None:
            results["llama-server"] = "not found (not on PATH, no --llama-server): powertrain alone"
        elif gguf is None:
            results["llama-server"] = f"skipped: {args.model} is not a GGUF file"
        else:
            print(f"llama-server ({binary})...", file=sys.stderr, flush=True)
            results["llama-server"] = f"{binary}, -t {args.threads} -np <concurrency>"
            try:
                theirs = measure_llama(args, binary, gguf, work)
            except RuntimeError as error:  # the peer failing still leaves powertrain's numbers worth printing
                print(f"llama-server failed: {error}", file=sys.stderr)
                results["llama-server"] = f"failed ({str(error).splitlines()[0].rstrip(':')}): powertrain alone"
        results |= rows(ours, theirs)
        print("offline LLM.chat...", file=sys.stderr, flush=True)
        offline = offline_in_subprocess()
    top = max(args.concurrency)
    results["offline LLM.chat output tok/s"] = offline["tok/s"]
    results[f"HTTP c{top} output tok/s"] = ours[top]["tok/s"]
    results[f"ratio HTTP c{top} / offline output tok/s"] = ours[top]["tok/s"] / offline["tok/s"]
    results[f"bench client's share of the cores at c{top}"] = ours[top]["client"]
    report(f"serving, powertrain vs llama-server, {args.model}", results)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    configure_logging("warning")  # a script is the application: LLM leaves logging to it
    try:
        main()
    except RuntimeError as error:  # a server or run that failed: its message, not a traceback
        raise SystemExit(f"serve_vs_llamacpp: {error}") from None
