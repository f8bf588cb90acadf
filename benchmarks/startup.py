"""How long from typing the command to the first answer token?

Runs ``powertrain generate`` on the embedded model as a new user would (a fresh process,
warm disk cache after one untimed run) and times from process start to the first byte it
prints, median of ``--runs``. When llama-cpp-python is installed (a benchmark-only
extra, never a dependency: ``pip install llama-cpp-python``) the same GGUF file is timed
the same way through it, streaming, with as many threads as torch uses, and the ratio is
printed; without it that row says why it is missing.

    uv run python benchmarks/startup.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import llama_cpp_python, report

from powertrain.loader import resolve_model_path

PROMPT = "What is the capital of France?"
MAX_TOKENS = 8

LLAMA_CPP = """
import sys
from llama_cpp import Llama
model = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), verbose=False)
messages = [{"role": "user", "content": sys.argv[3]}]  # powertrain generate applies the chat template too
for chunk in model.create_chat_completion(messages, max_tokens=int(sys.argv[4]), temperature=0, stream=True):
    text = chunk["choices"][0]["delta"].get("content")
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()
"""


def child_environment() -> tuple[dict[str, str], str]:
    """The children's environment, and a note on bytecode. A normal install caches compiled
    bytecode beside the sources; where ``PYTHONDONTWRITEBYTECODE`` forbids that (as on the
    project's dev machine), every run would recompile torch and powertrain (seconds), which
    no user pays twice: the children then share a bytecode cache in a temporary folder."""
    env = dict(os.environ)
    if env.pop("PYTHONDONTWRITEBYTECODE", None) and "PYTHONPYCACHEPREFIX" not in env:
        env["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="startup-bench-pycache-")
        return env, "PYTHONDONTWRITEBYTECODE was set: runs share a bytecode cache, as an install's .pyc files"
    return env, "as installed"


ENV, BYTECODE = child_environment()


def first_output_seconds(command: list[str]) -> float:
    """Seconds from starting ``command`` to the first byte on its stdout (it must succeed)."""
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=ENV)
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    elapsed = time.perf_counter() - started
    proc.stdout.read()
    if proc.wait() != 0 or not first:
        raise SystemExit(f"{' '.join(command)} failed (exit {proc.returncode})")
    return elapsed


def median_seconds(command: list[str], runs: int) -> float:
    first_output_seconds(command)  # warm the disk cache and the bytecode cache
    return statistics.median(first_output_seconds(command) for _ in range(runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--llama-cpp-python", help="a Python with llama-cpp-python installed (default: this one)")
    args = parser.parse_args()

    powertrain = shutil.which("powertrain") or str(Path(sys.executable).with_name("powertrain"))
    ours = median_seconds([powertrain, "generate", "--max-tokens", str(MAX_TOKENS), PROMPT], args.runs)
    results: dict[str, object] = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "runs": args.runs}
    results["powertrain_first_output_s"] = ours
    gguf = resolve_model_path("smollm2-135m").path
    python = llama_cpp_python(args.llama_cpp_python)
    if python is None:
        results["llama_cpp"] = "not installed (pip install llama-cpp-python, or pass --llama-cpp-python PYTHON)"
    else:
        threads = str(torch.get_num_threads())
        command = [python, "-c", LLAMA_CPP, str(gguf), threads, PROMPT, str(MAX_TOKENS)]
        theirs = median_seconds(command, args.runs)
        results["llama_cpp_first_output_s"] = theirs
        results["powertrain_over_llama_cpp"] = ours / theirs
    results["gguf"] = f"{gguf.name} ({os.path.getsize(gguf) / 2**20:.0f} MiB)"
    results["bytecode"] = BYTECODE
    report("startup: process start to first printed output, median", results)


if __name__ == "__main__":
    main()
