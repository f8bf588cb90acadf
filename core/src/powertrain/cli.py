"""`powertrain ...`: the command line. The only place that configures logging.

Each command imports what it needs when it runs: ``--help`` and ``--version`` answer
without importing torch (seconds) or the engine.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import click

from powertrain import __version__
from powertrain.deploy.torchrun import launched_by_torchrun, leave

if TYPE_CHECKING:
    from powertrain.components import Availability
    from powertrain.interfaces.outputs import RequestOutput
    from powertrain.plugins import PluginInfo, PluginManager

EXIT_PROBLEM = 1


class _LoggedCommand(click.Command):
    """A command that configures logging when it runs, not when the group parses its
    options: ``powertrain generate --help`` then imports no logging setup (structlog and
    rich take a quarter of a second) before printing help."""

    def invoke(self, ctx: click.Context) -> Any:
        import structlog

        from powertrain import startup
        from powertrain.log_setup import configure_logging

        configure_logging(ctx.find_root().params["log_level"])
        structlog.get_logger(__name__).info(
            "startup phase", phase="python and imports", seconds=startup.since_process_start()
        )
        return super().invoke(ctx)


class _Commands(click.Group):
    command_class = _LoggedCommand
    group_class = type  # subgroups (config, bench) are _Commands too


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="powertrain")
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    default="warning",
    show_default=True,
    envvar="POWERTRAIN_LOG_LEVEL",
)
def main(log_level: str) -> None:
    """powertrain: an open, pluggable LLM inference engine."""


def _fail(lines: list[str] | str) -> None:
    for line in [lines] if isinstance(lines, str) else lines:
        click.echo(f"error: {line}", err=True)
    sys.exit(EXIT_PROBLEM)


def _load_config_or_exit(path: str | None) -> Any:
    from powertrain.config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as exc:
        _fail(exc.lines())


# --------------------------------------------------------------------------- plugins


def _component_availability(manager: PluginManager, kind: str, record: Any) -> Availability:
    """Usable on some platform detected here? Records without a platform always are."""
    from powertrain.components import Availability

    if kind == "platform":
        return manager.platforms()[record.name].availability
    if not hasattr(record, "availability"):
        return Availability.yes()
    platform, reasons = manager.best_platform(record)
    return Availability.yes(f"on {platform.name}") if platform else Availability.no("; ".join(reasons))


def describe_plugins(manager: PluginManager) -> dict[str, Any]:
    """Everything `powertrain plugins` shows, as plain data (also its --json output)."""
    from powertrain.components import Availability

    plugins = []
    for info in manager.plugins.values():
        provides: dict[str, list[dict[str, Any]]] = {}
        for kind, names in info.provides.items():
            by_name = {p.record.name: p.record for p in manager.records(kind) if p.plugin is info}
            provides[kind] = []
            for name in names:
                availability = (
                    _component_availability(manager, kind, by_name[name])
                    if name in by_name
                    else (Availability.no("shadowed by a conflicting plugin"))
                )
                absent = dict(getattr(by_name.get(name), "absent", {}))
                provides[kind].append(
                    {"name": name, "available": availability.available, "reason": availability.reason, "absent": absent}
                )
        plugins.append({**_plugin_status(info, provides), "provides": provides})
    platforms = {
        name: {
            "available": info.available,
            "reason": info.availability.reason,
            "device_count": info.device_count,
            "device_name": info.device_name,
            "capability": list(info.capability) if info.capability else None,
            "total_memory_bytes": info.total_memory_bytes,
            "dist_backend": info.dist_backend,
        }
        for name, info in manager.platforms().items()
    }
    return {
        "powertrain": __version__,
        "plugins": plugins,
        "platforms": platforms,
        "conflicts": manager.conflicts(),
        "warnings": manager.warnings,
    }


def _plugin_status(info: PluginInfo, provides: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    base = {
        "name": info.name,
        "distribution": info.distribution,
        "version": info.version,
        "source": info.source,
        "module": info.module,
        "hook_api": info.hook_api,
    }
    if info.status != "loaded":
        return {**base, "status": info.status, "reason": info.error}
    components = [c for items in provides.values() for c in items]
    if not components or any(c["available"] for c in components):
        return {**base, "status": "available", "reason": ""}
    reasons = sorted({c["reason"] for c in components})
    # A platform's own reason reappears inside its components' ("platform npu: ..."): once is enough.
    reasons = [r for r in reasons if not any(r != other and r in other for other in reasons)]
    return {**base, "status": "unavailable", "reason": "; ".join(reasons)}


@main.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--config", "config_path", type=click.Path(dir_okay=False), help="engine.toml whose [plugins] section applies."
)
def plugins_command(as_json: bool, config_path: str | None) -> None:
    """List plugins, what they provide, and whether they can run here."""
    from powertrain.plugins import PluginError, PluginManager

    config = _load_config_or_exit(config_path)
    try:
        manager = PluginManager.load(config.plugins, strict=False)
    except PluginError as exc:
        _fail(str(exc))
    report = describe_plugins(manager)
    cache, cache_error = _kv_cache_or_error(config, manager) if config_path else (None, None)
    if as_json:
        extra = {"kv_cache": cache, "kv_cache_error": cache_error} if config_path else {}
        click.echo(json.dumps({**report, **extra}, indent=2))
    else:
        _print_plugins(report)
        if config_path:
            _print_kv_cache(cache, cache_error)
    if report["conflicts"]:
        _fail(report["conflicts"])


def _print_plugins(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    # Piped output gets a wide fixed width instead of wrapping names at 80 columns.
    console = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 160)
    table = Table(title=f"powertrain {report['powertrain']} plugins", expand=False)
    for column in ("plugin", "distribution", "version", "provides", "status"):
        table.add_column(column, overflow="fold")
    styles = {"available": "green", "unavailable": "yellow", "disabled": "dim", "broken": "red", "refused": "red"}
    for plugin in report["plugins"]:
        provides = (
            "\n".join(f"{kind}: {', '.join(c['name'] for c in items)}" for kind, items in plugin["provides"].items())
            or "-"
        )
        status = plugin["status"] + (f": {plugin['reason']}" if plugin["reason"] else "")
        table.add_row(
            plugin["name"],
            plugin["distribution"],
            plugin["version"],
            provides,
            f"[{styles[plugin['status']]}]{status}[/]",
        )
    console.print(table)
    for plugin in report["plugins"]:
        for kind, items in plugin["provides"].items():
            for item in items:
                for tag, why in item["absent"].items():
                    console.print(f"{kind} {item['name']}: no {tag}: {why}", highlight=False)
    for name, platform in report["platforms"].items():
        state = "available" if platform["available"] else "unavailable"
        console.print(f"platform {name}: {state}: {platform['reason']}", highlight=False)
    for warning in report["warnings"]:
        console.print(f"warning: {warning}", highlight=False, style="yellow")


def _kv_cache_or_error(config: Any, manager: PluginManager) -> tuple[dict[str, Any] | None, str | None]:
    """The KV cache accounting of ``config`` (``assemble.describe_kv_cache``), or why none."""
    from powertrain.assemble import AssemblyError, describe_kv_cache
    from powertrain.loader import LoadError
    from powertrain.plugins import PluginError

    try:
        return describe_kv_cache(config, manager), None
    except (LoadError, AssemblyError, PluginError, ValueError) as exc:
        return None, f"kv cache: {exc}"


def _print_kv_cache(cache: dict[str, Any] | None, error: str | None) -> None:
    if cache is None:
        click.echo(f"  {error}")
        return
    click.echo(
        f"  kv cache ({cache['architecture']}, {cache['dtype']}, block_size {cache['block_size']}): "
        f"{cache['bytes_per_token']:g} bytes/token in all, a dense uncompressed cache "
        f"{cache['dense_bytes_per_token']:g}; {cache['gib']} GiB"
    )
    if "saved_by_sharing_bytes_per_token" in cache:
        click.echo(
            f"    layers reading other layers' groups save {cache['saved_by_sharing_bytes_per_token']:g} "
            f"bytes/token ({cache['unshared_bytes_per_token']:g} without sharing)"
        )
    for group in cache["groups"]:
        shared = (
            f", read by {group['read_by_layers']} more (saves {group['saved_bytes_per_token']:g})"
            if group.get("read_by_layers")
            else ""
        )
        click.echo(
            f"    {group['name']:<12} {group['retention']:<12} 1 entry/{group['tokens_per_entry']} tokens, "
            f"{group['layers']} layers: {group['bytes_per_token']:g} bytes/token{shared}"
        )
    blocks = ", ".join(f"{name}: {count}" for name, count in cache["blocks"].items())
    click.echo(f"    blocks: {blocks}")


# --------------------------------------------------------------------------- config


@main.group("config")
def config_group() -> None:
    """Validate engine.toml files."""


@config_group.command("check")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def config_check(path: str, as_json: bool) -> None:
    """Validate PATH and show what each component resolves to here, and why."""
    from powertrain.assemble import AssemblyError, plan
    from powertrain.config import ConfigError
    from powertrain.plugins import PluginError, PluginManager

    config = _load_config_or_exit(path)
    try:
        manager = PluginManager.load(config.plugins)
        result = plan(config, manager, strict=False)
    except (ConfigError, PluginError, AssemblyError) as exc:
        _fail(exc.lines() if isinstance(exc, ConfigError) else str(exc).splitlines())
    rows = [
        {
            "kind": r.kind,
            "requested": r.requested,
            "resolved": r.name,
            "plugin": r.provided.plugin.name if r.provided else None,
            "reason": r.reason,
            "error": r.error,
        }
        for r in result.resolutions.values()
    ]
    problems = list(result.problems)
    cache, cache_error = (None, None) if problems else _kv_cache_or_error(config, manager)
    if cache_error:
        problems.append(cache_error)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "config": path,
                    "ok": not problems,
                    "components": rows,
                    "sections": sorted(result.sections),
                    "kv_cache": cache,
                },
                indent=2,
            )
        )
    else:
        click.echo(f"{path}: {'ok' if not result.problems else 'problems found'}")
        for row in rows:
            target = row["resolved"] or "-"
            click.echo(f"  {row['kind']:<14} {row['requested']:<18} -> {target:<20} {row['error'] or row['reason']}")
        for name in sorted(result.sections):
            click.echo(f"  [{name}] validated by its plugin")
        if cache is not None:
            _print_kv_cache(cache, None)
        for warning in manager.warnings:
            click.echo(f"warning: {warning}", err=True)
    if problems:
        _fail([f"{config.source}: {problem}" for problem in problems])


# --------------------------------------------------------------------------- generate


def _parallel_options(command: Any) -> Any:
    """--data-parallel / --expert-parallel / --prefill-ranks, overriding the config's
    [parallel] section."""
    command = click.option(
        "--prefill-ranks",
        type=click.IntRange(min=0),
        help="Data-parallel ranks that only prefill, handing blocks to the others through the "
        "shared [components] kv_store ([parallel]).",
    )(command)
    command = click.option(
        "--expert-parallel",
        type=click.IntRange(min=1),
        help="Expert-parallel ranks: each process holds num_experts / N routed experts ([parallel]).",
    )(command)
    return click.option(
        "--data-parallel",
        type=click.IntRange(min=1),
        help="Data-parallel attention ranks, each with its own requests and KV cache ([parallel]).",
    )(command)


def _with_parallel(config: Any, **parallel: int | None) -> Any:
    from powertrain.llm import apply_overrides

    return apply_overrides(config, {k: v for k, v in parallel.items() if v is not None})


@main.command("generate")
@click.argument("prompts", nargs=-1)
@click.option("--file", "prompt_file", type=click.File("r"), help="Prompts, one per line ('-' for stdin).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="engine.toml to use.")
@click.option("--model", help="Model: an embedded name, a HF folder or a .gguf file (overrides [model] path).")
@click.option("--chat/--no-chat", default=True, show_default=True, help="Apply the model's chat template.")
@click.option("--system", help="A system message (with --chat).")
@click.option("--max-tokens", type=int, default=256, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 disables it.")
@click.option("--min-p", type=float, default=0.0, show_default=True)
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, help="Make sampling reproducible.")
@click.option("--stop", multiple=True, help="A stop string (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt.")
@_parallel_options
def generate_command(
    prompts: tuple[str, ...],
    prompt_file: Any,
    config_path: str | None,
    model: str | None,
    chat: bool,
    system: str | None,
    as_json: bool,
    data_parallel: int | None,
    expert_parallel: int | None,
    prefill_ranks: int | None,
    **sampling: Any,
) -> None:
    """Generate text for PROMPTS (default model: the embedded SmolLM2-135M-Instruct)."""
    from powertrain.assemble import AssemblyError
    from powertrain.config import ConfigError
    from powertrain.interfaces.errors import EngineDeadError, InvalidRequestError
    from powertrain.interfaces.sampling import SamplingParams
    from powertrain.llm import LLM
    from powertrain.loader import LoadError
    from powertrain.parallel.layout import ParallelLayoutError
    from powertrain.plugins import PluginError

    texts = list(prompts) + ([line.rstrip("\n") for line in prompt_file if line.strip()] if prompt_file else [])
    if not texts:
        _fail('give at least one prompt, e.g. powertrain generate "What is the capital of France?"')
    config = _load_config_or_exit(config_path)
    try:
        config = _with_parallel(
            config, data_parallel=data_parallel, expert_parallel=expert_parallel, prefill_ranks=prefill_ranks
        )
        params = SamplingParams(**sampling)
        with LLM(model, config=config) as llm:
            prefix = [{"role": "system", "content": system}] if system else []
            conversations = [[*prefix, {"role": "user", "content": text}] for text in texts]
            if len(texts) == 1 and not as_json:
                # One answer: print it as it is generated, so the first words show at once.
                prompt = llm.tokenizer.apply_chat_template(conversations[0]) if chat else texts[0]
                _print_as_generated(llm.stream(prompt, params))
                return
            outputs = llm.chat(conversations, params) if chat else llm.generate(texts, params)
    except (
        ConfigError,
        PluginError,
        AssemblyError,
        LoadError,
        InvalidRequestError,
        EngineDeadError,
        ParallelLayoutError,
    ) as exc:
        _fail(exc.lines() if isinstance(exc, ConfigError) else str(exc).splitlines())
    for index, (text, output) in enumerate(zip(texts, outputs, strict=True)):
        completion = output.outputs[0]
        if as_json:
            record = {
                "prompt": text,
                "text": completion.text,
                "finish_reason": completion.finish_reason,
                "prompt_tokens": len(output.prompt_token_ids),
                "output_tokens": len(completion.token_ids),
            }
            if output.error is not None:
                record["error"] = output.error
            click.echo(json.dumps(record))
        else:
            click.echo(f"--- [{index}] {text}\n{completion.text}\n")
    failed = [output.error for output in outputs if output.error is not None]
    if failed:  # a rank serving them died; the others' answers are above
        _fail([f"{len(failed)} of {len(outputs)} prompts failed: {failed[0]}"])


def _print_as_generated(outputs: Iterator[RequestOutput]) -> None:
    """Each step's new text as it arrives (click.echo flushes), then a newline."""
    printed, output = "", None
    for output in outputs:
        text = output.outputs[0].text
        click.echo(text[len(printed) :], nl=False)
        printed = text
    click.echo()
    if output is not None and output.error is not None:  # the rank serving it died
        _fail([output.error])


@main.command("serve")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="engine.toml to use.")
@click.option("--model", help="Model: an embedded name, a HF folder or a .gguf file (overrides [model] path).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option(
    "--api-key",
    envvar="POWERTRAIN_API_KEY",
    help="Require this key (Authorization: Bearer or x-api-key). Env: POWERTRAIN_API_KEY.",
)
@click.option("--served-model-name", help="The model name clients send (default: the model path).")
@click.option("--max-body-bytes", type=int, default=4 * 2**20, show_default=True, help="Larger bodies get 413.")
@click.option("--graceful-shutdown", type=float, default=10.0, show_default=True, help="Seconds for in-flight work.")
@_parallel_options
@click.pass_context
def serve_command(
    ctx: click.Context,
    config_path: str | None,
    model: str | None,
    host: str,
    port: int,
    api_key: str | None,
    served_model_name: str | None,
    max_body_bytes: int,
    graceful_shutdown: float,
    data_parallel: int | None,
    expert_parallel: int | None,
    prefill_ranks: int | None,
) -> None:
    """Serve OpenAI- and Anthropic-compatible APIs (default model: the embedded SmolLM2-135M-Instruct)."""
    from powertrain.assemble import AssemblyError
    from powertrain.config import ConfigError
    from powertrain.llm import apply_overrides
    from powertrain.loader import LoadError
    from powertrain.log_setup import configure_logging
    from powertrain.parallel.layout import ParallelLayoutError
    from powertrain.plugins import PluginError
    from powertrain.serve.run import NoProtocolAdapterError, serve
    from powertrain.serve.settings import ServeSettings

    # A server logs its requests: info level unless --log-level was given, always JSON lines.
    parent = ctx.parent
    explicit = parent is not None and parent.get_parameter_source("log_level") != click.core.ParameterSource.DEFAULT
    configure_logging(parent.params["log_level"] if explicit and parent else "info", json=True)
    config = _load_config_or_exit(config_path)
    if model is not None:
        config = apply_overrides(config, {"path": model})
    settings = ServeSettings(
        host=host,
        port=port,
        api_key=api_key or None,
        served_model_name=served_model_name,
        max_body_bytes=max_body_bytes,
        graceful_shutdown_s=graceful_shutdown,
        images=config.server.images,
    )
    try:
        parallel = {"data_parallel": data_parallel, "expert_parallel": expert_parallel, "prefill_ranks": prefill_ranks}
        serve(_with_parallel(config, **parallel), settings)
    except (ConfigError, PluginError, AssemblyError, LoadError, NoProtocolAdapterError, ParallelLayoutError) as exc:
        _fail(exc.lines() if isinstance(exc, ConfigError) else str(exc).splitlines())


# --------------------------------------------------------------------------- bench


@main.group("bench")
def bench_group() -> None:
    """Benchmarks against a running server."""


@bench_group.command("serve")
@click.option("--base-url", default="http://127.0.0.1:8000", show_default=True, help="The OpenAI-compatible server.")
@click.option("--model", help="Model name to request (default: the first one GET /v1/models lists).")
@click.option("--api-key", envvar="POWERTRAIN_API_KEY", help="Sent as a Bearer token (env POWERTRAIN_API_KEY).")
@click.option(
    "--workload",
    type=click.Choice(["synthetic", "multi-turn"]),
    default="synthetic",
    show_default=True,
    help="synthetic: independent random-word prompts; multi-turn: chats resending their history.",
)
@click.option(
    "--rate",
    "--rates",
    "rates",
    help="Request rates (req/s), comma-separated for a sweep; Poisson arrivals; inf sends all at once. [default: inf]",
)
@click.option(
    "--concurrency",
    "--concurrencies",
    "concurrencies",
    help="Closed-loop concurrencies, comma-separated for a sweep (instead of --rate).",
)
@click.option("--num-requests", type=click.IntRange(min=1), default=100, show_default=True, help="Per load level.")
@click.option("--conversations", type=click.IntRange(min=1), help="multi-turn: chats [default: num-requests / turns].")
@click.option("--turns", type=click.IntRange(min=1), default=4, show_default=True, help="multi-turn: turns per chat.")
@click.option("--input-len", default="128", show_default=True, help="Words per prompt (each turn): N or MIN:MAX.")
@click.option("--output-len", default="64", show_default=True, help="max_tokens per request: N or MIN:MAX.")
@click.option("--ignore-eos", is_flag=True, help="Send ignore_eos (a vLLM extension) for exact output lengths.")
@click.option("--temperature", type=float, help="Sampling temperature (default: the server's).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds prompts and arrival times.")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds per request.")
@click.option(
    "--output", type=click.Path(dir_okay=False), default="result.json", show_default=True, help="JSON result."
)
@click.option("--plot", type=click.Path(dir_okay=False), help="Latency-vs-load PNG [default: --output with .png].")
def bench_serve_command(
    rates: str | None,
    concurrencies: str | None,
    input_len: str,
    output_len: str,
    output: str,
    plot: str | None,
    **options: Any,
) -> None:
    """Measure a serving endpoint: TTFT, TPOT, ITL, throughput and prefix-cache hits vs load.

    Example: powertrain bench serve --rates 1,2,4 --num-requests 200 --output run.json
    """
    from pathlib import Path

    from rich.console import Console

    from powertrain.bench.client import ServerError
    from powertrain.bench.load import Load
    from powertrain.bench.serve import BenchConfig, run
    from powertrain.bench.workloads import LengthRange

    if rates and concurrencies:
        _fail("give --rate or --concurrency, not both")
    try:
        if concurrencies:
            loads = Load.parse_list("concurrency", concurrencies)
        else:
            loads = Load.parse_list("rate", rates or "inf")
        config = BenchConfig(
            loads=loads, input_len=LengthRange.parse(input_len), output_len=LengthRange.parse(output_len), **options
        )
    except ValueError as exc:
        _fail(str(exc))
    console = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 160)
    plot = plot or str(Path(output).with_suffix(".png"))
    try:
        result = run(config, [Path(sys.argv[0]).name, *sys.argv[1:]], output, plot, console)
    except ServerError as exc:
        _fail(str(exc))
    idle = [level["load"] for level in result["levels"] if not level["requests"]["completed"]]
    if idle:
        _fail([f"no request completed at {load['mode']} {load['target']}" for load in idle])


def run() -> None:
    """The ``powertrain`` command. A rank under torchrun ends without the interpreter's
    teardown, however the command ended (``deploy.torchrun.leave``)."""
    try:
        main()
    except SystemExit as ended:
        if not launched_by_torchrun():
            raise
        if ended.code is None or isinstance(ended.code, int):
            leave(ended.code or 0)
        click.echo(ended.code, err=True)
        leave(EXIT_PROBLEM)


if __name__ == "__main__":  # pragma: no cover
    run()
