"""Conformance suite for communicators: real process groups, exact oracles.

Subclass it with your record's name::

    class TestMyComm(CommunicatorSuite):
        component = "my-communicator"

For each world size in ``world_sizes`` (those above the record's
``max_world_size`` are skipped, saying so) the suite spawns one process per rank,
once per class and world size, because starting Python and importing torch costs
seconds and every check is cheap. Each rank loads the plugins itself (registration
repeats in every worker process), builds the communicator through the record's
factory with a ``file://`` init method, then runs every named check in order and
reports each check's outcome separately, so a failure names its check and every
rank's error. Ranks meet on a side barrier (not the communicator under test) after
each check, so one rank's failure cannot shift the collectives of the next check;
a hang is cut off by a hard timeout and reported as a failure of the check that
was running.

Oracle: every rank draws its inputs from ``(seed, check, rank)``, so every rank can
regenerate every other rank's inputs and compute the exact expected result locally.
The seed is fresh per run (never zeros as inputs) and printed with every failure;
set ``fixed_seed`` on your class to replay one.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_module
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
import pytest
import torch

from powertrain.components import PlatformInfo
from powertrain.interfaces import Communicator, CommunicatorContext
from powertrain.parallel.expert import build_dispatcher
from powertrain.plugins import PluginManager, Provided
from powertrain.testing.base import ComponentSuite, find_component, fresh_seed, usable_platform

# --------------------------------------------------------------------------- what a group run is


@attrs.frozen(kw_only=True)
class GroupSpec:
    """Everything a spawned rank needs to build its communicator (picklable)."""

    component: str
    platform: str
    world_size: int
    init_method: str
    seed: int
    check_timeout_s: float
    #: Test the record's own expert dispatcher (False: the core's AllToAllDispatcher
    #: over the communicator, for a dispatcher whose vendor ops are absent here).
    record_dispatcher: bool = True


@attrs.frozen(kw_only=True)
class CheckEnv:
    """What a check knows about its rank."""

    seed: int
    rank: int
    world_size: int
    device: torch.device
    #: Builds the expert dispatcher under test on the communicator: the record's own, or
    #: the core's ``AllToAllDispatcher`` (when the record declares none, or the suite says).
    make_dispatcher: Callable[[], Any] | None = None

    def rng(self, check: str, who: int | None = None) -> torch.Generator:
        """Inputs of rank ``who`` for ``check`` (``None``: values all ranks share)."""
        mixed = self.seed * 0x9E3779B1 + zlib.crc32(check.encode()) * 1_000_003 + (0 if who is None else who + 1)
        return torch.Generator().manual_seed(mixed % (2**63 - 1))

    def randint(self, check: str, low: int, high: int) -> int:
        """A shared random int in [low, high), the same on every rank."""
        return int(torch.randint(low, high, (1,), generator=self.rng(check)).item())


# --------------------------------------------------------------------------- checks (run in each rank)


class Problems:
    """A check's findings, raised together once all its collectives are done.

    A rank that raised halfway through a check would leave its peers waiting in the
    check's remaining collectives; collecting first keeps every rank's sequence of
    collectives the same whatever it finds.
    """

    def __init__(self) -> None:
        self.found: list[str] = []

    def tensor(self, what: str, got: object, expected: torch.Tensor, env: CheckEnv, *, exact: bool = True) -> None:
        """Note the first mismatch and the largest error, not just 'not equal'."""
        if not isinstance(got, torch.Tensor):
            self.found.append(f"{what}: returned {type(got).__name__}, expected a torch.Tensor")
            return
        if got.device != env.device:
            self.found.append(f"{what}: result is on {got.device}, expected the communicator's device {env.device}")
            return
        if got.dtype != expected.dtype or tuple(got.shape) != tuple(expected.shape):
            self.found.append(
                f"{what}: result is {got.dtype} {tuple(got.shape)}, expected {expected.dtype} {tuple(expected.shape)}"
            )
            return
        actual = got.detach().cpu()
        if exact:
            bad = (actual != expected).nonzero()
        else:
            bad = (~torch.isclose(actual, expected, rtol=1e-5, atol=1e-5)).nonzero()
        if len(bad) == 0:
            return
        first = tuple(bad[0].tolist())
        diff = (actual.double() - expected.double()).abs()
        self.found.append(
            f"{what}: {len(bad)} of {expected.numel()} elements differ "
            f"({'exact' if exact else 'rtol=atol=1e-5'}); max abs error {diff.max().item():.6g}; "
            f"first at index {first}: got {actual[first].item()}, expected {expected[first].item()}"
        )

    def value_error(self, argument: str, call: Callable[[], object], description: str) -> None:
        """The call must raise ValueError naming the offending argument, on this rank, at once."""
        try:
            call()
        except ValueError as exc:
            if argument not in str(exc):
                self.found.append(
                    f"{description}: raised ValueError, but its message does not name {argument!r}: {exc}"
                )
            return
        except Exception as exc:
            self.found.append(f"{description}: expected ValueError, got {type(exc).__name__}: {exc}")
            return
        self.found.append(f"{description}: returned normally; expected ValueError")

    def add(self, message: str) -> None:
        self.found.append(message)

    def raise_any(self) -> None:
        if self.found:
            raise AssertionError("\n".join(self.found))


def check_protocol(comm: Any, env: CheckEnv) -> None:
    """The object satisfies the Communicator Protocol and knows its place."""
    if not isinstance(comm, Communicator):
        members = ("rank", "world_size", "all_reduce", "all_gather", "all_to_all", "broadcast", "barrier", "close")
        missing = [m for m in members if not hasattr(comm, m)]
        raise AssertionError(f"{type(comm).__name__} does not satisfy interfaces.Communicator; missing {missing}")
    if (comm.rank, comm.world_size) != (env.rank, env.world_size):
        raise AssertionError(
            f"communicator says rank {comm.rank} of {comm.world_size}, "
            f"but was built as rank {env.rank} of {env.world_size}"
        )


def check_all_reduce_float32(comm: Any, env: CheckEnv) -> None:
    name = "all_reduce_float32"
    shape = (env.randint(name + ":rows", 1, 6), 17, 33)
    inputs = [torch.randn(shape, generator=env.rng(name, r)) for r in range(env.world_size)]
    expected = inputs[0].clone()
    for x in inputs[1:]:
        expected += x
    got = comm.all_reduce(inputs[env.rank].clone().to(env.device))
    problems = Problems()
    problems.tensor(f"all_reduce of float32 {shape}", got, expected, env, exact=False)
    problems.raise_any()


def check_all_reduce_int64(comm: Any, env: CheckEnv) -> None:
    name = "all_reduce_int64"
    shape = (env.randint(name + ":rows", 1, 6), 7)
    inputs = [
        torch.randint(-(10**12), 10**12, shape, dtype=torch.int64, generator=env.rng(name, r))
        for r in range(env.world_size)
    ]
    expected = torch.stack(inputs).sum(dim=0)
    got = comm.all_reduce(inputs[env.rank].clone().to(env.device))
    problems = Problems()
    problems.tensor(f"all_reduce of int64 {shape}", got, expected, env, exact=True)
    problems.raise_any()


def check_all_gather(comm: Any, env: CheckEnv) -> None:
    name = "all_gather"
    shape = (env.randint(name + ":rows", 1, 5), 3, 2)
    inputs = [torch.randn(shape, generator=env.rng(name, r)) for r in range(env.world_size)]
    expected = torch.cat(inputs, dim=0)
    got = comm.all_gather(inputs[env.rank].clone().to(env.device))
    problems = Problems()
    problems.tensor(f"all_gather of {shape} per rank", got, expected, env)
    problems.raise_any()


def _counts_matrix(env: CheckEnv, key: str, kind: str) -> torch.Tensor:
    """Rows sent from rank ``i`` (row) to rank ``j`` (column), the same on every rank.

    ``sparse``: one rank sends nothing at all and some rank sends nothing to a peer;
    ``dense``: everyone sends everyone something; ``random``: zeros wherever they fall.
    """
    ws = env.world_size
    g = env.rng(f"{key}:{kind}:counts")
    if kind == "dense":
        return torch.randint(1, 5, (ws, ws), generator=g)
    counts = torch.randint(0, 4, (ws, ws), generator=g)
    if kind == "sparse":
        silent = int(torch.randint(ws, (1,), generator=g).item())
        counts[silent, :] = 0
        if ws > 1:
            other = (silent + 1) % ws
            counts[other, silent] = 0
            counts[other, other] = max(int(counts[other, other]), 1)
    return counts


def _check_all_to_all(comm: Any, env: CheckEnv, name: str, give_recv_counts: bool) -> None:
    problems = Problems()
    for kind in ("sparse", "dense", "random"):
        counts = _counts_matrix(env, name, kind)
        trailing = (3, 5)
        inputs = [
            torch.randn((int(counts[r].sum()), *trailing), generator=env.rng(f"{name}:{kind}", r))
            for r in range(env.world_size)
        ]
        pieces = []
        for src in range(env.world_size):
            start = int(counts[src, : env.rank].sum())
            pieces.append(inputs[src][start : start + int(counts[src, env.rank])])
        expected = torch.cat(pieces, dim=0)
        send = [int(c) for c in counts[env.rank]]
        recv = [int(c) for c in counts[:, env.rank]]
        if give_recv_counts:
            got = comm.all_to_all(inputs[env.rank].clone().to(env.device), send, recv)
        else:
            got = comm.all_to_all(inputs[env.rank].clone().to(env.device), send)
        problems.tensor(
            f"all_to_all ({kind} counts, row = sender: {counts.tolist()}; send_counts={send}, "
            f"recv_counts={recv if give_recv_counts else 'omitted'})",
            got,
            expected,
            env,
        )
    problems.raise_any()


def check_all_to_all_recv_counts_given(comm: Any, env: CheckEnv) -> None:
    _check_all_to_all(comm, env, "all_to_all_recv_counts_given", True)


def check_all_to_all_recv_counts_omitted(comm: Any, env: CheckEnv) -> None:
    _check_all_to_all(comm, env, "all_to_all_recv_counts_omitted", False)


def check_broadcast(comm: Any, env: CheckEnv) -> None:
    name = "broadcast"
    src = 0 if env.world_size == 1 else env.randint(name + ":src", 1, env.world_size)
    shape = (env.randint(name + ":rows", 1, 5), 6)
    inputs = [torch.randn(shape, generator=env.rng(name, r)) for r in range(env.world_size)]
    got = comm.broadcast(inputs[env.rank].clone().to(env.device), src=src)
    problems = Problems()
    problems.tensor(f"broadcast of {shape} from src={src}", got, inputs[src], env)
    problems.raise_any()


def check_barrier(comm: Any, env: CheckEnv) -> None:
    """Rank 0 arrives late; nobody may leave the barrier before it arrived.

    Rank 0's arrival time (host wall clock: all ranks share one host here) reaches the
    others through an all_reduce after the barrier, so the check does not depend on
    how promptly each process was scheduled.
    """
    if env.rank == 0:
        time.sleep(0.3)
    arrived = time.time()
    comm.barrier()
    left = time.time()
    contribution = torch.tensor([arrived if env.rank == 0 else 0.0], dtype=torch.float64, device=env.device)
    rank0_arrived = float(comm.all_reduce(contribution).item())
    comm.barrier()
    got = comm.all_reduce(torch.ones(4, dtype=torch.int64, device=env.device))
    problems = Problems()
    if left < rank0_arrived - 0.005:
        problems.add(f"rank {env.rank} left the barrier {rank0_arrived - left:.3f} s before rank 0 entered it")
    problems.tensor("all_reduce after barrier", got, torch.full((4,), env.world_size, dtype=torch.int64), env)
    problems.raise_any()


def check_validation(comm: Any, env: CheckEnv) -> None:
    """Every rank makes the same invalid calls; each raises at once, and the group survives."""
    ws, rank = env.world_size, env.rank
    inputs = [torch.randn((ws, 3), generator=env.rng("validation", r)) for r in range(ws)]
    x = inputs[rank].to(env.device)
    good = [1] * ws
    problems = Problems()
    problems.value_error(
        "send_counts",
        lambda: comm.all_to_all(x, good + [0]),
        f"all_to_all with {ws + 1} send_counts at world size {ws}",
    )
    too_many = [1] * (ws - 1) + [2]
    problems.value_error(
        "send_counts",
        lambda: comm.all_to_all(x, too_many),
        f"all_to_all of {ws} rows with send_counts={too_many} (sums to {ws + 1})",
    )
    negative = [-1] + [1] * (ws - 1)
    if ws > 1:
        negative[-1] += 2  # sums to the rows, so only the sign is wrong
    problems.value_error(
        "send_counts", lambda: comm.all_to_all(x, negative), f"all_to_all with negative send_counts={negative}"
    )
    problems.value_error(
        "recv_counts",
        lambda: comm.all_to_all(x, good, [1] * (ws + 1)),
        f"all_to_all with {ws + 1} recv_counts at world size {ws}",
    )
    problems.value_error(
        "src", lambda: comm.broadcast(x.clone(), src=ws), f"broadcast from src={ws} at world size {ws}"
    )
    # The group is still usable after the rejected calls.
    got = comm.all_to_all(x.clone(), good, good)
    expected = torch.cat([inputs[src][rank : rank + 1] for src in range(ws)], dim=0)
    problems.tensor("all_to_all after rejected calls", got, expected, env)
    total = comm.all_reduce(x.clone())
    problems.tensor("all_reduce after rejected calls", total, torch.stack(inputs).sum(dim=0), env, exact=False)
    problems.raise_any()


def _routing(env: CheckEnv, name: str, who: int, num_experts: int, top_k: int, cold: int) -> tuple[torch.Tensor, ...]:
    """Rank ``who``'s tokens and routing: hidden [T, 8], distinct ids [T, top_k] avoiding the
    ``cold`` rank's experts, weights [T, top_k] summing to 1 per token. One rank sends nothing."""
    g = env.rng(name, who)
    silent = env.randint(name + ":silent", 0, env.world_size)
    tokens = 0 if who == silent and env.world_size > 1 else int(torch.randint(1, 7, (1,), generator=g).item())
    local = num_experts // env.world_size
    allowed = [e for e in range(num_experts) if env.world_size == 1 or e // local != cold]
    choices = torch.tensor(allowed)
    picks = [choices[torch.randperm(len(allowed), generator=g)[:top_k]] for _ in range(tokens)]
    ids = torch.stack(picks) if picks else torch.empty(0, top_k, dtype=torch.int64)
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    hidden = torch.randn(tokens, 8, generator=g)
    return hidden, ids, weights / weights.sum(dim=1, keepdim=True)


def _expert_fn(rows: torch.Tensor, expert: int) -> torch.Tensor:
    """A different affine map per expert, so rows sent to the wrong expert show."""
    return rows * (expert + 1) + 0.5 * expert


def check_dispatch_combine(comm: Any, env: CheckEnv) -> None:
    """Dispatch groups every (token, expert) row at the expert's rank; combine returns
    sum_k w_k f_e(x): identity experts give back the input (weights sum to 1).

    Skewed routing: one rank's experts are chosen by nobody (it receives no rows) and one
    rank sends no tokens; both still take part in every collective.
    """
    name = "dispatch_combine"
    ws, rank = env.world_size, env.rank
    local = env.randint(name + ":local", 1, 4)
    num_experts = local * ws
    allowed_count = num_experts - (local if ws > 1 else 0)
    top_k = env.randint(name + ":top_k", 1, min(3, allowed_count) + 1)
    cold = env.randint(name + ":cold", 0, ws)
    inputs = [_routing(env, name, r, num_experts, top_k, cold) for r in range(ws)]
    hidden, ids, weights = inputs[rank]
    assert env.make_dispatcher is not None
    dispatcher = env.make_dispatcher()  # a failure here happens on every rank, before any collective
    problems = Problems()
    for label, apply in (("identity experts", False), ("a different affine map per expert", True)):
        rows, counts, scales, handle = dispatcher.dispatch(
            hidden.to(env.device), ids.to(env.device), weights.to(env.device), num_experts
        )
        rows = rows.float() * scales.float().unsqueeze(1) if scales is not None else rows.float()
        expected_counts = torch.zeros(local, dtype=torch.int64)
        expected_rows: list[list[torch.Tensor]] = [[] for _ in range(local)]
        for src_hidden, src_ids, _ in inputs:
            for t in range(src_ids.shape[0]):
                for e in src_ids[t].tolist():
                    if e // local == rank:
                        expected_counts[e - rank * local] += 1
                        expected_rows[e - rank * local].append(src_hidden[t])
        problems.tensor(f"{label}: tokens per local expert", counts.to(torch.int64), expected_counts, env)
        outputs = []
        start = 0
        for e, count in enumerate(counts.tolist()):
            group = rows[start : start + count].cpu()
            want = torch.stack(expected_rows[e]) if expected_rows[e] else torch.empty(0, 8)
            if group.shape == want.shape and not torch.allclose(_sorted_rows(group), _sorted_rows(want), atol=1e-2):
                problems.add(f"{label}: rows grouped at local expert {e} are not the rows routed to it")
            outputs.append(_expert_fn(group, rank * local + e) if apply else group)
            start += count
        expert_output = torch.cat(outputs) if outputs else rows.cpu()
        got = dispatcher.combine(expert_output.to(env.device).to(hidden.dtype), handle)
        want = torch.zeros_like(hidden, dtype=torch.float64)
        for k in range(top_k):
            mapped = (
                torch.stack(
                    [
                        _expert_fn(hidden[t].double(), int(ids[t, k])) if apply else hidden[t].double()
                        for t in range(len(ids))
                    ]
                )
                if len(ids)
                else want
            )
            want += weights[:, k].double().unsqueeze(1) * mapped
        problems.tensor(
            f"{label}: combine of {len(ids)} tokens, top_k={top_k}, {num_experts} experts",
            got,
            want.float(),
            env,
            exact=False,
        )
    problems.raise_any()


def _sorted_rows(rows: torch.Tensor) -> torch.Tensor:
    """Rows in a canonical order (the order within an expert's group is the dispatcher's)."""
    if rows.shape[0] == 0:
        return rows
    keys = rows[:, 0] * 1e3 + rows[:, 1]
    return rows[torch.argsort(keys)]


def check_close(comm: Any, env: CheckEnv) -> None:
    comm.close()


#: Checks in the order every rank runs them; ``close`` must stay last.
CHECKS: dict[str, Callable[[Any, CheckEnv], None]] = {
    "protocol": check_protocol,
    "all_reduce_float32": check_all_reduce_float32,
    "all_reduce_int64": check_all_reduce_int64,
    "all_gather": check_all_gather,
    "all_to_all_recv_counts_given": check_all_to_all_recv_counts_given,
    "all_to_all_recv_counts_omitted": check_all_to_all_recv_counts_omitted,
    "broadcast": check_broadcast,
    "barrier": check_barrier,
    "validation": check_validation,
    "dispatch_combine": check_dispatch_combine,
    "close": check_close,
}


# --------------------------------------------------------------------------- the spawned rank


def device_for(platform: PlatformInfo, rank: int) -> torch.device:
    """One device per rank where the platform has one per rank; else all ranks share its one (the host)."""
    if not platform.device_per_rank:
        return torch.device(platform.device_type)
    return torch.device(platform.device_type, rank % max(platform.device_count, 1))


def _worker(spec: GroupSpec, rank: int, results: Any, side_barrier: Any) -> None:
    """One rank: load plugins, build the communicator, run every check, report each."""
    torch.set_num_threads(1)  # ranks share the host's cores
    try:
        manager = PluginManager.load()
        provided = find_component(manager, "communication", spec.component)
        platform = manager.platforms()[spec.platform]
        device = device_for(platform, rank)
        ctx = CommunicatorContext(
            platform=platform, device=device, rank=rank, world_size=spec.world_size, init_method=spec.init_method
        )
        comm = provided.record.factory(ctx)
    except BaseException:
        results.put(("fatal", rank, traceback.format_exc()))
        return
    record = provided.record if spec.record_dispatcher else None
    env = CheckEnv(
        seed=spec.seed,
        rank=rank,
        world_size=spec.world_size,
        device=device,
        make_dispatcher=lambda: build_dispatcher(record, comm),
    )
    for name, check in CHECKS.items():
        results.put(("start", rank, name))
        try:
            check(comm, env)
            error = None
        except BaseException:
            error = traceback.format_exc()
        results.put(("result", rank, name, error))
        try:
            side_barrier.wait(timeout=spec.check_timeout_s)
        except threading.BrokenBarrierError:
            results.put(
                (
                    "abort",
                    rank,
                    f"rank {rank} finished check {name!r}, but a peer did not within {spec.check_timeout_s:.0f} s",
                )
            )
            return
    results.put(("done", rank))


# --------------------------------------------------------------------------- the parent


@attrs.define
class GroupRun:
    """Outcome of one spawned group: per check, per rank, the error text or None."""

    spec: GroupSpec
    results: dict[str, dict[int, str | None]] = attrs.field(factory=dict)
    last_started: dict[int, str] = attrs.field(factory=dict)
    fatal: dict[int, str] = attrs.field(factory=dict)
    #: Why a rank stopped early (peer hung, killed at the timeout, crashed).
    notes: dict[int, str] = attrs.field(factory=dict)
    wall_s: float = 0.0

    def failure(self, check: str) -> str | None:
        """The message naming every rank's problem with ``check``, or None if all passed."""
        outcome = self.results.get(check, {})
        problems = []
        for rank in range(self.spec.world_size):
            note = self.notes.get(rank, "")
            if rank in outcome:
                if outcome[rank] is not None:
                    problems.append(f"--- rank {rank}: failed ---\n{outcome[rank]}")
            elif rank in self.fatal:
                problems.append(f"--- rank {rank}: setup failed (plugin loading or factory) ---\n{self.fatal[rank]}")
            elif self.last_started.get(rank) == check:
                problems.append(f"--- rank {rank}: started this check and never finished it: {note} ---")
            else:
                stopped = self.last_started.get(rank, "setup (plugin loading or factory)")
                problems.append(f"--- rank {rank}: never ran this check; it stopped at {stopped}: {note} ---")
        if not problems:
            return None
        passed = [r for r in range(self.spec.world_size) if r in outcome and outcome[r] is None]
        header = (
            f"communicator {self.spec.component!r} failed check {check!r} at world size "
            f"{self.spec.world_size} on platform {self.spec.platform} (seed {self.spec.seed}; "
            f"set fixed_seed = {self.spec.seed} on the suite class to replay it)"
        )
        if passed:
            header += f"; ranks {passed} passed it"
        return "\n".join([header, *problems])

    def expect(self, check: str) -> None:
        message = self.failure(check)
        if message is not None:
            pytest.fail(message, pytrace=False)


def run_group(spec: GroupSpec, timeout_s: float, grace_s: float = 10.0) -> GroupRun:
    """Spawn one process per rank, collect every check's outcome, kill what hangs."""
    mp = multiprocessing.get_context("spawn")
    results = mp.Queue()
    side_barrier = mp.Barrier(spec.world_size)
    procs = [
        mp.Process(
            target=_worker,
            args=(spec, rank, results, side_barrier),
            name=f"powertrain-{spec.component}-rank{rank}",
            daemon=True,
        )
        for rank in range(spec.world_size)
    ]
    run = GroupRun(spec=spec)
    start = time.monotonic()
    deadline = start + timeout_s
    finished: set[int] = set()
    dead_since: dict[int, float] = {}

    def handle(message: tuple[Any, ...]) -> None:
        nonlocal deadline
        kind, rank = message[0], message[1]
        if kind == "start":
            run.last_started[rank] = message[2]
        elif kind == "result":
            run.results.setdefault(message[2], {})[rank] = message[3]
        elif kind == "done":
            finished.add(rank)
        elif kind in ("fatal", "abort"):
            finished.add(rank)
            if kind == "fatal":
                run.fatal[rank] = message[2]
            else:
                run.notes[rank] = message[2]
            # Peers of a rank that gave up are likely stuck waiting for it.
            deadline = min(deadline, time.monotonic() + grace_s)

    for proc in procs:
        proc.start()
    try:
        while len(finished) < spec.world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                handle(results.get(timeout=min(0.2, deadline - now)))
            except queue_module.Empty:
                for rank, proc in enumerate(procs):
                    if rank in finished or proc.is_alive():
                        continue
                    # Give its last messages time to arrive before calling it a crash.
                    if now - dead_since.setdefault(rank, now) > 2.0:
                        finished.add(rank)
                        run.notes[rank] = f"the process exited with code {proc.exitcode} without finishing"
        while True:  # anything still in flight from live processes
            try:
                handle(results.get(timeout=0.05))
            except queue_module.Empty:
                break
    finally:
        elapsed = time.monotonic() - start
        for rank, proc in enumerate(procs):
            proc.join(timeout=5.0 if rank in finished else 0.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
                if rank not in finished:
                    run.notes[rank] = (
                        f"rank {rank} was still running after {elapsed:.0f} s (hard timeout {timeout_s:.0f} s) "
                        "and was killed"
                    )
        results.close()
        results.cancel_join_thread()
        run.wall_s = time.monotonic() - start
    return run


# --------------------------------------------------------------------------- the suite


class CommunicatorSuite(ComponentSuite):
    """Collectives against exact oracles, over real spawned ranks.

    Class settings: ``world_sizes`` to run (filtered by the record's
    ``max_world_size``), ``platform`` to force one (default: the first available one
    the record runs on), ``timeout_s`` for a whole group, ``check_timeout_s`` for one
    rank waiting on its peers after a check, ``fixed_seed`` to replay a failure,
    ``record_dispatcher`` to choose which expert dispatcher ``dispatch_combine`` tests.
    """

    kind: ClassVar[str] = "communication"
    world_sizes: ClassVar[tuple[int, ...]] = (1, 2)
    platform: ClassVar[str | None] = None
    timeout_s: ClassVar[float] = 120.0
    check_timeout_s: ClassVar[float] = 60.0
    fixed_seed: ClassVar[int | None] = None
    #: False: test dispatch/combine with the core's AllToAllDispatcher over this
    #: communicator instead of the record's own dispatcher (whose ops may be absent here).
    record_dispatcher: ClassVar[bool] = True

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """One spawned group per world size, shared by the class's tests."""
        if "world_size" in metafunc.fixturenames:
            sizes: Sequence[int] = list(self.world_sizes)
            metafunc.parametrize("world_size", sizes, ids=[f"world{n}" for n in sizes], scope="class")

    @classmethod
    def _platform_for(cls, manager: PluginManager, provided: Provided) -> PlatformInfo:
        if cls.platform is None:
            return usable_platform(manager, provided)
        info = manager.platforms().get(cls.platform)
        # A suite pinned to a platform this machine lacks reports why instead of failing.
        if info is None:
            pytest.skip(f"platform {cls.platform!r} is not registered here")
        availability = provided.record.availability(info)
        if not availability.available:
            pytest.skip(f"{provided.record.name} cannot run on {cls.platform}: {availability.reason}")
        return info

    @pytest.fixture(scope="class")
    @classmethod
    def communicator_group(
        cls, powertrain_plugins: PluginManager, world_size: int, tmp_path_factory: pytest.TempPathFactory
    ) -> GroupRun:
        provided = find_component(powertrain_plugins, cls.kind, cls.component)
        limit = provided.record.max_world_size
        # Group sizes the record (or this machine's device count) cannot serve do not apply.
        if limit is not None and world_size > limit:
            pytest.skip(f"{cls.component} declares max_world_size={limit}, so world size {world_size} is not for it")
        platform = cls._platform_for(powertrain_plugins, provided)
        if platform.device_per_rank and world_size > platform.device_count:
            pytest.skip(
                f"world size {world_size} needs {world_size} {platform.name} devices; {platform.device_count} here"
            )
        seed = cls.fixed_seed if cls.fixed_seed is not None else fresh_seed()
        init_file = tmp_path_factory.mktemp(f"{cls.component}-world{world_size}") / "init"
        spec = GroupSpec(
            component=cls.component,
            platform=platform.name,
            world_size=world_size,
            init_method=f"file://{init_file}",
            seed=seed,
            check_timeout_s=cls.check_timeout_s,
            record_dispatcher=cls.record_dispatcher,
        )
        return run_group(spec, cls.timeout_s)

    @pytest.fixture
    def communicator_run(self, request: pytest.FixtureRequest, communicator_group: GroupRun) -> GroupRun:
        request.node.user_properties.append(("seed", communicator_group.spec.seed))
        return communicator_group

    def test_protocol(self, communicator_run: GroupRun) -> None:
        """The factory builds a Communicator that knows its rank and world size."""
        communicator_run.expect("protocol")

    def test_all_reduce_float32(self, communicator_run: GroupRun) -> None:
        communicator_run.expect("all_reduce_float32")

    def test_all_reduce_int64(self, communicator_run: GroupRun) -> None:
        communicator_run.expect("all_reduce_int64")

    def test_all_gather(self, communicator_run: GroupRun) -> None:
        communicator_run.expect("all_gather")

    def test_all_to_all_recv_counts_given(self, communicator_run: GroupRun) -> None:
        """Uneven splits with zeros (a silent rank, an unvisited peer), trailing dims (3, 5)."""
        communicator_run.expect("all_to_all_recv_counts_given")

    def test_all_to_all_recv_counts_omitted(self, communicator_run: GroupRun) -> None:
        """As above, with the communicator exchanging the counts itself."""
        communicator_run.expect("all_to_all_recv_counts_omitted")

    def test_broadcast(self, communicator_run: GroupRun) -> None:
        """From a non-zero source whenever there is more than one rank."""
        communicator_run.expect("broadcast")

    def test_barrier(self, communicator_run: GroupRun) -> None:
        communicator_run.expect("barrier")

    def test_validation(self, communicator_run: GroupRun) -> None:
        """Bad counts or src raise ValueError on the calling rank; the group stays usable."""
        communicator_run.expect("validation")

    def test_dispatch_combine(self, communicator_run: GroupRun) -> None:
        """Expert-parallel exchange: rows reach their experts' ranks grouped by expert, and
        combine returns each token's weighted sum (identity experts: the input), with a
        rank that sends nothing and one that receives nothing."""
        communicator_run.expect("dispatch_combine")

    def test_close(self, communicator_run: GroupRun) -> None:
        communicator_run.expect("close")
