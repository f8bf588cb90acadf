"""Starting a multi-process engine: worker processes here, or ranks under torchrun.

``start_engine(config)`` is what ``LLM``, ``powertrain generate`` and ``powertrain serve``
call. One process (``[parallel]`` world size 1): a plain ``LLMEngine``. Several on this
machine: the calling process becomes the front end and spawns one worker per rank;
they join torch.distributed through a ``file://`` rendezvous. Under ``torchrun``
(several machines), every rank runs the same command: rank 0 is the front end *and*
rank 0's worker (in a thread), the others only work and exit when it stops them; the
process group comes from torchrun's environment (``env://``) and the workers reach the
front end at ``MASTER_ADDR:frontend_port``, authenticated with the shared secret
``POWERTRAIN_PARALLEL_SECRET``. Without a configured ``frontend_port`` rank 0 listens on
a free port and announces it in torchrun's own store.
"""

from __future__ import annotations

import datetime
import hashlib
import multiprocessing
import os
import shutil
import tempfile
import threading
import weakref
from multiprocessing.connection import Listener
from typing import Any

import attrs
import structlog

from powertrain.assemble import build_engine, plan
from powertrain.assemble.tiers import build_store
from powertrain.components import PlatformInfo
from powertrain.config import EngineConfig
from powertrain.deploy.frontend import ParallelEngine
from powertrain.deploy.torchrun import launched_by_torchrun, leave
from powertrain.deploy.worker import run_worker
from powertrain.interfaces.engine import Engine
from powertrain.loader import load_checkpoint
from powertrain.log_setup import current_level
from powertrain.parallel.layout import ParallelLayout, ParallelLayoutError, RankPlacement, layout_of
from powertrain.plugins import PluginManager

log = structlog.get_logger(__name__)

SECRET_ENV = "POWERTRAIN_PARALLEL_SECRET"
#: Where rank 0 announces its front end's port in torchrun's store.
FRONTEND_PORT_KEY = "powertrain/frontend_port"
#: How long a worker waits for rank 0 to announce its port (rank 0 loads no weights first).
ANNOUNCE_TIMEOUT_S = 600.0


@attrs.frozen
class TorchrunRank:
    """What torchrun tells each process it starts."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environment(cls) -> TorchrunRank | None:
        env = os.environ
        if not launched_by_torchrun():
            return None
        try:
            return cls(
                rank=int(env["RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                local_rank=int(env["LOCAL_RANK"]),
                local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
                master_addr=env["MASTER_ADDR"],
                master_port=int(env["MASTER_PORT"]),
            )
        except KeyError as missing:
            raise ParallelLayoutError(
                f"torchrun-style environment without {missing}: launch the workers with torchrun, "
                "which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT"
            ) from None


def start_engine(config: EngineConfig, plugins: PluginManager | None = None) -> Engine:
    """The engine ``config`` asks for: an ``LLMEngine`` or a ``ParallelEngine`` front end,
    both ``interfaces.Engine``."""
    layout = layout_of(config)
    if layout.prefill_ranks:
        _check_shared_store(config, plugins, layout)
    torchrun = TorchrunRank.from_environment()
    if torchrun is not None and torchrun.world_size > 1:
        return _start_under_torchrun(config, plugins, layout, torchrun)
    if layout.world_size == 1:
        return build_engine(config, plugins)
    return _start_local(config, plugins, layout)


def _check_shared_store(config: EngineConfig, plugins: PluginManager | None, layout: ParallelLayout) -> None:
    """Refuse disaggregation without a store every rank sees, before any rank loads a model."""
    store = build_store(plan(config, plugins, strict=False))
    if store is not None:
        store[1].close()
    if store is None or not store[1].shared:
        chosen = f"kv_store = {store[0]!r} is this process's own" if store is not None else "no kv_store is set"
        raise ParallelLayoutError(
            f"[parallel] prefill_ranks = {layout.prefill_ranks}: prefill ranks hand their blocks to decode ranks "
            f'through a KV store every rank sees, and {chosen}; set [components] kv_store = "directory" with '
            '[cache] store_path on a filesystem every rank reaches, or "redis"'
        )


def _platform(config: EngineConfig, plugins: PluginManager | None) -> PlatformInfo:
    return plan(config, plugins, strict=False).platform


def _start_local(config: EngineConfig, plugins: PluginManager | None, layout: ParallelLayout) -> ParallelEngine:
    checkpoint = load_checkpoint(config.model.path)  # the front end's tokenizer; no weights
    platform = _platform(config, plugins)
    authkey = os.urandom(32)
    listener = Listener(("127.0.0.1", 0), authkey=authkey)
    rendezvous = tempfile.mkdtemp(prefix="powertrain-dist-")
    cpus = platform.host_cpus or os.cpu_count() or 1  # the usable CPUs, not the host's core count
    threads = max(1, cpus // layout.world_size) if platform.shares_host_cores else None
    context = multiprocessing.get_context("spawn")
    processes = {}
    for rank in range(layout.world_size):
        placement = RankPlacement(layout=layout, rank=rank, init_method=f"file://{rendezvous}/init", local_rank=rank)
        processes[rank] = context.Process(
            target=run_worker,
            args=(config, placement, listener.address, authkey),
            kwargs={"visible_devices": platform.visible_devices_env, "threads": threads, "log_level": current_level},
            name=f"powertrain-rank{rank}",
            daemon=True,
        )
    engine = ParallelEngine(
        config, checkpoint, layout, listener, processes=processes, silence_timeout_s=config.parallel.silence_timeout_s
    )
    weakref.finalize(engine, shutil.rmtree, rendezvous, True)
    for process in processes.values():
        process.start()
    log.info("started workers", world_size=layout.world_size, pids=[p.pid for p in processes.values()])
    return _ready(engine, config)


def _secret(torchrun: TorchrunRank) -> bytes:
    secret = os.environ.get(SECRET_ENV)
    if secret:
        return secret.encode()
    if torchrun.world_size > torchrun.local_world_size:
        raise ParallelLayoutError(
            f"several machines: set {SECRET_ENV} to the same secret on every node, so that only "
            "your workers can reach the front end"
        )
    # one machine: the front end listens on 127.0.0.1 only
    return hashlib.sha256(f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}:{torchrun.master_port}".encode()).digest()


def _start_under_torchrun(
    config: EngineConfig, plugins: PluginManager | None, layout: ParallelLayout, torchrun: TorchrunRank
) -> ParallelEngine:
    if torchrun.world_size != layout.world_size:
        raise ParallelLayoutError(
            f"torchrun started {torchrun.world_size} processes, but data_parallel={layout.data_parallel}, "
            f"expert_parallel={layout.expert_parallel} need {layout.world_size}; match --nnodes × --nproc-per-node"
        )
    authkey = _secret(torchrun)
    placement = RankPlacement(layout=layout, rank=torchrun.rank, init_method="env://", local_rank=torchrun.local_rank)
    visible_devices = _platform(config, plugins).visible_devices_env
    several_machines = torchrun.world_size > torchrun.local_world_size
    frontend_host = torchrun.master_addr if several_machines else "127.0.0.1"
    worker_kwargs = {"visible_devices": visible_devices, "log_level": current_level}
    if torchrun.rank != 0:
        port = config.parallel.frontend_port or _announced_port(torchrun)
        run_worker(config, placement, (frontend_host, port), authkey, **worker_kwargs)
        # Rank 0's front end stopped this worker and its process group is destroyed: the
        # command ends here.
        leave(0)

    checkpoint = load_checkpoint(config.model.path)
    store = None if config.parallel.frontend_port else _torchrun_store(torchrun)
    # Announced: any free port. MASTER_PORT + 1, the old default, was at times another
    # socket's (a connection's local port): "Address already in use" in 1 of 52 runs.
    port = config.parallel.frontend_port or (0 if store is not None else torchrun.master_port + 1)
    listener = Listener(("0.0.0.0" if several_machines else "127.0.0.1", port), authkey=authkey)  # noqa: S104
    if store is not None:
        store.set(FRONTEND_PORT_KEY, str(listener.address[1]))
    engine = ParallelEngine(config, checkpoint, layout, listener, silence_timeout_s=config.parallel.silence_timeout_s)
    worker_args = (config, placement, (frontend_host, listener.address[1]), authkey)
    own = threading.Thread(target=run_worker, args=worker_args, kwargs=worker_kwargs, name="powertrain-rank0")
    own.daemon = True
    engine.own_worker = own
    own.start()
    return _ready(engine, config)


def _torchrun_store(torchrun: TorchrunRank) -> Any:
    """torchrun's own store (its agent serves it at ``MASTER_ADDR:MASTER_PORT``, one per
    attempt), as a client; None where the launcher serves none there."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from torch.distributed import TCPStore

    timeout = datetime.timedelta(seconds=ANNOUNCE_TIMEOUT_S)
    return TCPStore(torchrun.master_addr, torchrun.master_port, is_master=False, timeout=timeout)


def _announced_port(torchrun: TorchrunRank) -> int:
    """The port rank 0's front end announced (``MASTER_PORT + 1`` without torchrun's store)."""
    store = _torchrun_store(torchrun)
    if store is None:
        return torchrun.master_port + 1
    try:
        return int(store.get(FRONTEND_PORT_KEY))
    except RuntimeError:  # torch's DistStoreError: not announced in time
        raise ConnectionError(
            f"rank 0 did not announce its front end's port in torchrun's store at {torchrun.master_addr}:"
            f"{torchrun.master_port} within {ANNOUNCE_TIMEOUT_S:.0f} s; check that rank 0 is running, "
            "or set [parallel] frontend_port on every node"
        ) from None


def _ready(engine: ParallelEngine, config: EngineConfig) -> ParallelEngine:
    """The engine once every worker is ready; nothing left running if one is not."""
    try:
        engine.wait_ready(config.parallel.startup_timeout_s)
    except BaseException:
        engine.shutdown()
        raise
    return engine
