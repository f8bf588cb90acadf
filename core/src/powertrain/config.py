"""engine.toml -> frozen attrs config, with errors a person can act on.

Loading is strict: an unknown key, a wrong type or a bad value is a ConfigError
whose lines read ``engine.toml: components.atention: unknown key (did you mean
attention?)``. Tables other than the core ones belong to plugins; they are kept raw
here and validated by the owning plugin's attrs class in ``validate_sections`` once
plugins are loaded. No file at all means every default.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import cattrs
from cattrs.errors import (
    AttributeValidationNote,
    BaseValidationError,
    ForbiddenExtraKeysError,
    IterableValidationNote,
)

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATION_MODES = ("auto", "keep", "dequantize")


class ConfigError(ValueError):
    """A config the engine cannot run with. One line per problem: file, path, what."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        return [f"{self.source}: {path}: {what}" if path else f"{self.source}: {what}" for path, what in self.problems]


def _positive(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"must be at least 1, got {value}", attribute)


def _port(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if not 0 <= value <= 65535:
        raise ValueError(f"must be a TCP port (0-65535), got {value}", attribute)


def _power_of_two(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if value < 1 or value & (value - 1) or value > 1024:
        raise ValueError(f"must be a power of two between 1 and 1024, got {value}", attribute)


def _one_of(*choices: str) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: str) -> None:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}; got {value!r}", attribute)

    return check


def _names(instance: Any, attribute: attrs.Attribute, value: tuple[str, ...] | None) -> None:
    for name in value or ():
        if not name:
            raise ValueError("plugin names must not be empty", attribute)


def _non_negative(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if value < 0:
        raise ValueError(f"must be 0 or more, got {value}", attribute)


def _graph_sizes(instance: Any, attribute: attrs.Attribute, value: tuple[int, ...]) -> None:
    if not value or any(size < 1 for size in value) or list(value) != sorted(set(value)):
        raise ValueError(f"must be increasing batch sizes of at least 1, got {list(value)}", attribute)


def _optional_positive(instance: Any, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"must be positive when set, got {value}", attribute)


@attrs.frozen(kw_only=True)
class ModelConfig:
    #: "smollm2-135m" (the embedded default), a HF checkpoint folder or a GGUF file.
    path: str = "smollm2-135m"
    dtype: str = attrs.field(default="auto", validator=_one_of(*DTYPES))
    #: What happens to a GGUF file's quantised weights: "keep" multiplies them as stored (a
    #: quantised-linear kernel: a quarter of float32's bytes read per token), "dequantize"
    #: expands them to ``dtype`` at load; "auto" keeps them where this platform has a native
    #: quantised-linear kernel.
    quantization: str = attrs.field(default="auto", validator=_one_of(*QUANTIZATION_MODES))
    #: Longest sequence (prompt + output); default: the model's own limit.
    max_model_len: int | None = attrs.field(default=None, validator=_optional_positive)
    #: Seed of the generator for requests that bring no seed of their own.
    seed: int = 0
    #: Sampling defaults for what a request leaves unset (temperature, top_p, top_k, min_p,
    #: repetition_penalty): "auto" takes the model's own (an HF folder's
    #: generation_config.json, a GGUF file's general.sampling.* keys, the embedded model's
    #: recommended settings), "none" powertrain's (temperature 1, no filters), or a path to
    #: a generation_config.json (or the folder holding one).
    generation_config: str = "auto"


@attrs.frozen(kw_only=True)
class ComponentsConfig:
    """Which implementation of each component kind; "auto" = best available here."""

    platform: str = "auto"
    attention: str = "auto"
    moe: str = "auto"
    #: The kernel for weights kept quantised ([model] quantization).
    quantized_linear: str = "auto"
    communication: str = "auto"
    scheduler: str = "fcfs"
    #: "none" disables speculative decoding.
    speculative: str = "none"
    #: The storage tier below the host-memory one ([cache] store_*): "directory" (a local
    #: disk or a shared filesystem), a plugin's store, or "none".
    kv_store: str = "none"


@attrs.frozen(kw_only=True)
class CacheConfig:
    block_size: int = attrs.field(default=16, validator=_power_of_two)
    prefix_caching: bool = True
    #: KV cache budget; default: a quarter of RAM (at most 4 GiB) on CPU, 85% of the
    #: memory left after the weights on an accelerator.
    memory_gib: float | None = attrs.field(default=None, validator=_optional_positive)
    #: Exact number of blocks (overrides memory_gib); mostly for tests and experiments.
    num_blocks: int | None = attrs.field(default=None, validator=_optional_positive)
    #: Host-memory tier: full prefix blocks evicted from the device cache are kept here
    #: (and loaded back on a hit) up to this many GiB; 0: no host tier.
    host_memory_gib: float = attrs.field(default=0.0, validator=_non_negative)
    #: Storage tier ([components] kv_store): what the host tier drops goes here, up to
    #: this many GiB (None: the store's own limit, if any).
    store_gib: float | None = attrs.field(default=None, validator=_optional_positive)
    #: Where a file-keeping store ("directory") keeps its blocks; the same directory after
    #: a restart serves the blocks computed before it.
    store_path: str = ""


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    #: Sequences running at once.
    max_num_seqs: int = attrs.field(default=64, validator=_positive)
    #: Tokens computed per step; long prompts are chunked to fit.
    max_num_batched_tokens: int = attrs.field(default=2048, validator=_positive)
    chunked_prefill: bool = True
    #: Schedule step N+1 on the CPU while step N runs (DESIGN §3).
    async_scheduling: bool = True
    #: Speculative steps overlap too ("on"), run synchronously ("off"), or "auto": overlap
    #: except where the platform computes on the host's own cores, where the engine
    #: thread's work competes with the step (benchmarks/speculative.py measured 0.81-0.96x
    #: synchronous speed on a 2-core CPU). Only with async_scheduling.
    speculative_overlap: str = attrs.field(default="auto", validator=_one_of("auto", "on", "off"))


@attrs.frozen(kw_only=True)
class ParallelConfig:
    #: Data-parallel attention ranks: each holds its own requests and KV cache.
    data_parallel: int = attrs.field(default=1, validator=_positive)
    #: Expert-parallel ranks: each holds num_experts / expert_parallel routed experts.
    #: Processes: max(data_parallel, expert_parallel) (powertrain.parallel.layout).
    expert_parallel: int = attrs.field(default=1, validator=_positive)
    #: Prefill/decode disaggregation: this many data-parallel ranks only prefill. A new
    #: request's prompt is computed on one of them, its cache blocks are published to the
    #: shared KV store (``[components] kv_store``), and one of the other ranks loads them and
    #: decodes. 0: every rank does both (powertrain.deploy.frontend).
    prefill_ranks: int = attrs.field(default=0, validator=_non_negative)
    #: With prefill ranks, a prompt shorter than this is computed on its decode rank: its
    #: prefill costs a decode step little, and the hand-off would cost it more.
    prefill_rank_min_tokens: int = attrs.field(default=256, validator=_non_negative)
    #: A prefill rank whose prompt's blocks are not in the store this long after its prefill
    #: (a hung filesystem, a stalled server) hands the request on anyway: the decode rank
    #: computes what it misses.
    handoff_timeout_s: float = attrs.field(default=30.0, validator=_positive)
    #: Under torchrun, the port rank 0's front end listens on for the workers (0: a free
    #: port, announced in torchrun's store; MASTER_PORT + 1 where torchrun serves none).
    frontend_port: int = attrs.field(default=0, validator=_port)
    #: Seconds the workers may take to load the model and join the process group.
    startup_timeout_s: float = attrs.field(default=1800.0, validator=_positive)
    #: A worker silent this long (they report every second) is declared dead.
    silence_timeout_s: float = attrs.field(default=60.0, validator=_positive)


@attrs.frozen(kw_only=True)
class EngineOptionsConfig:
    #: A request's rows get the same arithmetic however the scheduler batches them: only
    #: backends that declare "batch-invariant" serve attention, MoE and kept-quantised
    #: linears (a named one that does not is refused, by name), and the model's own
    #: matmuls run in whole row tiles (``layers.linear.make_batch_invariant``).
    batch_invariant: bool = False
    #: Decode steps as CUDA graphs (``engine.cuda_graphs``): captured at startup for each
    #: of ``cuda_graph_batch_sizes`` and replayed, padded to the next size. "auto": where
    #: the platform can capture and the model and its attention/MoE backends declare it
    #: (the startup log says why not otherwise); "on": that, or refuse to start; "off": eager.
    cuda_graphs: str = attrs.field(default="auto", validator=_one_of("auto", "on", "off"))
    #: The captured batch sizes; a decode step of more sequences runs eager.
    cuda_graph_batch_sizes: tuple[int, ...] = attrs.field(
        default=(1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128), validator=_graph_sizes
    )


def _fetch_hosts(instance: Any, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    for host in value:
        if not host or "/" in host or ":" in host.strip("[]") and not host.startswith("["):
            raise ValueError(
                f"must be host names (images.example.com, .example.com for its subdomains), got {host!r}", attribute
            )
    if instance.fetch and not value:
        raise ValueError(
            'fetch = true needs the hosts images may come from (fetch_hosts = ["images.example.com"])', attribute
        )


@attrs.frozen(kw_only=True)
class ImagesConfig:
    """How the server reads image parts (``[server.images]``)."""

    #: Fetch ``http(s)`` image URLs (off: a remote URL is a 400 asking for inline data).
    fetch: bool = False
    #: The hosts images may be fetched from, redirects included: exact names, or a name
    #: with a leading dot for its subdomains (".example.com"). Required with ``fetch``.
    fetch_hosts: tuple[str, ...] = attrs.field(default=(), validator=_fetch_hosts)
    #: A larger image (its Content-Length or what arrives) is refused.
    fetch_max_bytes: int = attrs.field(default=20 * 2**20, validator=_positive)
    #: The whole fetch of one image, redirects included.
    fetch_timeout_s: float = attrs.field(default=10.0, validator=_optional_positive)
    #: Fetch from private, loopback, link-local and other non-public addresses too (a
    #: host on the allow-list may resolve to one; refused unless this is set).
    fetch_private_addresses: bool = False
    #: Images whose header declares more pixels are refused before they are decoded.
    max_pixels: int = attrs.field(default=8192 * 8192, validator=_positive)
    #: Images decoded at once (threads); with ``max_pixels`` this bounds decoding memory
    #: (about 7 bytes a pixel each).
    decode_threads: int = attrs.field(default=2, validator=_positive)


@attrs.frozen(kw_only=True)
class ServerConfig:
    """What ``powertrain serve`` reads from engine.toml (``[server]``); host, port and
    keys are command-line flags."""

    images: ImagesConfig = ImagesConfig()


@attrs.frozen(kw_only=True)
class PluginsConfig:
    #: If set, only these external (entry-point) plugins load; builtins always do.
    allow: tuple[str, ...] | None = attrs.field(default=None, validator=_names)
    #: Plugins (builtin or external) that must not load.
    disable: tuple[str, ...] = attrs.field(default=(), validator=_names)


CORE_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "components": ComponentsConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "engine": EngineOptionsConfig,
    "plugins": PluginsConfig,
    "server": ServerConfig,
}


@attrs.frozen(kw_only=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()
    components: ComponentsConfig = ComponentsConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    engine: EngineOptionsConfig = EngineOptionsConfig()
    plugins: PluginsConfig = PluginsConfig()
    server: ServerConfig = ServerConfig()
    #: Plugin-owned tables, raw until ``validate_sections``.
    sections: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)
    #: Where this config came from, used as the prefix of every error.
    source: str = "<defaults>"


# --------------------------------------------------------------------------- strict structuring


def _strict_converter() -> cattrs.Converter:
    """A cattrs converter that refuses coercions (``"16"`` is not an int)."""
    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)

    def exact(expected: type, accept: tuple[type, ...]) -> Any:
        def structure(value: Any, _: type) -> Any:
            if isinstance(value, bool) and expected is not bool:
                raise TypeError(f"expected {expected.__name__}, got bool {value!r}")
            if not isinstance(value, accept):
                raise TypeError(f"expected {expected.__name__}, got {type(value).__name__} {value!r}")
            return expected(value)

        return structure

    converter.register_structure_hook(int, exact(int, (int,)))
    converter.register_structure_hook(float, exact(float, (int, float)))
    converter.register_structure_hook(str, exact(str, (str,)))
    converter.register_structure_hook(bool, exact(bool, (bool,)))

    def string_list(value: Any, _: type) -> tuple[str, ...]:
        # Only a TOML array is a list: a bare string would otherwise become its characters.
        if not isinstance(value, list):
            raise TypeError(f"expected a list of strings, got {type(value).__name__} {value!r}")
        return tuple(converter.structure(value, list[str]))

    converter.register_structure_hook_func(lambda tp: tp == tuple[str, ...], string_list)

    def int_list(value: Any, _: type) -> tuple[int, ...]:
        if not isinstance(value, list):
            raise TypeError(f"expected a list of integers, got {type(value).__name__} {value!r}")
        return tuple(converter.structure(value, list[int]))

    converter.register_structure_hook_func(lambda tp: tp == tuple[int, ...], int_list)
    return converter


_converter = _strict_converter()


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _problems(exc: BaseException, path: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    """Flatten a cattrs error tree into (dotted path, message) pairs."""
    if isinstance(exc, ForbiddenExtraKeysError):
        valid = [a.name for a in attrs.fields(exc.cl)]
        for key in sorted(exc.extra_fields):
            yield ".".join((*path, key)), _unknown(key, valid, "key")
    elif isinstance(exc, BaseValidationError):
        for sub, note in exc.group_exceptions()[0]:
            if isinstance(note, AttributeValidationNote):
                yield from _problems(sub, (*path, note.name))
            elif isinstance(note, IterableValidationNote):
                yield from _problems(sub, (*path[:-1], f"{path[-1]}[{note.index}]") if path else (f"[{note.index}]",))
            else:
                yield from _problems(sub, path)
        for sub in exc.group_exceptions()[1]:
            yield from _problems(sub, path)
    elif isinstance(exc, KeyError):
        yield ".".join(path), "missing required value"
    elif len(exc.args) >= 2 and isinstance(exc.args[1], attrs.Attribute):
        # attrs validators pass the offending attribute along; ours do too.
        yield ".".join((*path, exc.args[1].name)), str(exc.args[0])
    else:
        yield ".".join(path), str(exc)


def _unknown(key: str, valid: list[str], what: str) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean {close[0]}?" if close else f"valid: {', '.join(sorted(valid)) or '(none)'}"
    return f"unknown {what} ({hint})"


def structure(raw: Any, cls: type, source: str, path: tuple[str, ...]) -> Any:
    """Build ``cls`` from a TOML table or raise a ConfigError naming file and path."""
    if not isinstance(raw, dict):
        raise ConfigError(source, [(".".join(path), f"expected a table, got {type(raw).__name__} {raw!r}")])
    try:
        return _converter.structure(raw, cls)
    except (BaseValidationError, ForbiddenExtraKeysError) as exc:
        raise ConfigError(source, list(_problems(exc, path))) from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(source, [(".".join(path), str(exc))]) from None


def parse_config(data: Mapping[str, Any], source: str = "<config>") -> EngineConfig:
    """Build an EngineConfig from an already parsed TOML document."""
    core: dict[str, Any] = {}
    problems: list[tuple[str, str]] = []
    sections: dict[str, Mapping[str, Any]] = {}
    for name, table in data.items():
        if name in CORE_SECTIONS:
            try:
                core[name] = structure(table, CORE_SECTIONS[name], source, (name,))
            except ConfigError as exc:
                problems.extend(exc.problems)
        elif isinstance(table, dict):
            sections[name] = table
        else:
            problems.append((name, f"expected a [{name}] table, got {type(table).__name__} {table!r}"))
    if problems:
        raise ConfigError(source, problems)
    return EngineConfig(**core, sections=sections, source=source)


def load_config(path: str | Path | None) -> EngineConfig:
    """Read engine.toml; ``None`` means the defaults."""
    if path is None:
        return EngineConfig()
    path = Path(path)
    source = path.name
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(path), [("", "no such config file")]) from None
    except OSError as exc:
        raise ConfigError(str(path), [("", f"cannot read: {exc.strerror}")]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(source, [("", f"not UTF-8 text (byte {exc.start}); TOML files are UTF-8")]) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, [("", f"invalid TOML: {exc}")]) from None
    return parse_config(data, source)


def validate_sections(
    config: EngineConfig,
    section_classes: Mapping[str, type],
    broken_plugins: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Validate plugin tables with the plugins' classes; absent tables get defaults.

    ``broken_plugins`` (name -> error) is mentioned when a table has no owner, since
    a plugin that failed to import may be the one that would have owned it.
    """
    problems: list[tuple[str, str]] = []
    result: dict[str, Any] = {}
    for name, table in config.sections.items():
        cls = section_classes.get(name)
        if cls is None:
            message = _unknown(name, [*CORE_SECTIONS, *section_classes], "section")
            if broken_plugins:
                message += "; plugins that failed to load, which may own it: " + ", ".join(
                    f"{plugin} ({error})" for plugin, error in broken_plugins.items()
                )
            problems.append((name, message))
            continue
        try:
            result[name] = structure(dict(table), cls, config.source, (name,))
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError(config.source, problems)
    for name, cls in section_classes.items():
        if name not in result:
            try:
                result[name] = cls()
            except TypeError as exc:
                raise ConfigError(config.source, [(name, f"section is required here: {exc}")]) from None
    return result
