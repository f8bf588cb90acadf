"""`powertrain bench serve`: measure an OpenAI-compatible server at one or more load levels.

Each level runs a fresh workload drawn from its own seed, so one level's prompts
cannot warm the prefix cache for the next. The result is a JSON file (the command,
the config, per-level metrics, the client machine), a table and a latency-vs-load PNG.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from powertrain import __version__
from powertrain.bench import workloads
from powertrain.bench.client import ChatClient
from powertrain.bench.load import LevelRun, Load, run_level
from powertrain.bench.workloads import Conversation, LengthRange


@dataclass
class BenchConfig:
    """Everything that decides what is sent; the JSON result records it (never the API key)."""

    base_url: str
    loads: list[Load]
    model: str | None = None  # None: the first model GET /v1/models lists
    workload: str = "synthetic"
    num_requests: int = 100
    conversations: int | None = None  # multi-turn; default num_requests // turns
    turns: int = 4
    input_len: LengthRange = field(default_factory=lambda: LengthRange(128, 128))
    output_len: LengthRange = field(default_factory=lambda: LengthRange(64, 64))
    seed: int = 0
    timeout: float = 300.0
    ignore_eos: bool = False
    temperature: float | None = None
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.workload not in workloads.WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}: choose one of {', '.join(workloads.WORKLOADS)}")
        if not self.loads:
            raise ValueError("give at least one load level")
        if len({load.mode for load in self.loads}) > 1:
            raise ValueError("sweep either request rates or concurrencies, not both")
        if self.workload == "multi-turn" and self.conversations is None:
            self.conversations = max(1, self.num_requests // self.turns)

    def make_workload(self, level: int) -> list[Conversation]:
        seed = f"{self.seed}/{level}/prompts"
        if self.workload == "synthetic":
            return workloads.synthetic(self.num_requests, self.input_len, self.output_len, seed)
        assert self.conversations is not None
        return workloads.multi_turn(self.conversations, self.turns, self.input_len, self.output_len, seed)

    def body(self, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": max_tokens}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.ignore_eos:
            body["ignore_eos"] = True  # a vLLM-style extension: exact output lengths
        return body

    def to_json(self) -> dict[str, Any]:
        data = {
            "base_url": self.base_url,
            "model": self.model,
            "loads": [load.to_json() for load in self.loads],
            "workload": self.workload,
            "num_requests": self.num_requests,
            "input_len": str(self.input_len),
            "output_len": str(self.output_len),
            "seed": self.seed,
            "timeout_s": self.timeout,
            "ignore_eos": self.ignore_eos,
            "temperature": self.temperature,
            "api_key": "set" if self.api_key else None,
        }
        if self.workload == "multi-turn":
            data |= {"conversations": self.conversations, "turns": self.turns}
        return data


async def measure(config: BenchConfig, progress: Progress | None = None) -> list[LevelRun]:
    """Run every load level in turn (asking the server for its model first if none was named)."""
    runs = []
    async with ChatClient(config.base_url, config.api_key, config.timeout) as client:
        if config.model is None:
            config.model = await client.first_model()
        for level, load in enumerate(config.loads):
            conversations = config.make_workload(level)
            task = None
            if progress is not None:
                total = sum(len(c.user_turns) for c in conversations)
                task = progress.add_task(load.label, total=total)

            def advance(result: Any, settled: int, task: Any = task) -> None:
                if progress is not None:
                    progress.advance(task, settled)

            arrival_seed = f"{config.seed}/{level}/arrivals"
            before = await client.cache_counters()
            level_run = await run_level(client, conversations, load, config.body, arrival_seed, advance)
            after = await client.cache_counters()
            if before is not None and after is not None:
                level_run.cache_counters = (before, after)
            runs.append(level_run)
    return runs


def run(
    config: BenchConfig,
    command: list[str],
    output: str | Path | None,
    plot: str | Path | None,
    console: Console,
    progress_console: Console | None = None,
) -> dict[str, Any]:
    """Measure, then print the table and write the JSON result and the PNG plot."""
    from powertrain.bench.report import machine, print_table, summarize

    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=progress_console or Console(stderr=True)) as progress:
        runs = asyncio.run(measure(config, progress))
    result = {
        "powertrain": __version__,
        "command": shlex.join(redact(command)),
        "started_at": started_at,
        "config": config.to_json(),
        "levels": [summarize(level_run) for level_run in runs],
        "machine": machine(),
    }
    print_table(result, console)
    if output:
        Path(output).write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
        console.print(f"result: {output}", highlight=False)
    if plot:
        from powertrain.bench.plot import plot_latency_vs_load

        plot_latency_vs_load(result, plot)
        console.print(f"plot: {plot}", highlight=False)
    return result


def redact(argv: list[str]) -> list[str]:
    """The command line with the value of --api-key hidden: result files get shared."""
    shown, hide_next = [], False
    for arg in argv:
        if hide_next:
            shown.append("***")
            hide_next = False
        elif arg == "--api-key":
            shown.append(arg)
            hide_next = True
        elif arg.startswith("--api-key="):
            shown.append("--api-key=***")
        else:
            shown.append(arg)
    return shown
