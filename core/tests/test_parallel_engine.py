"""Data-parallel attention + expert-parallel MoE across real processes (gloo on CPU).

The oracle is the one-process engine on the same tiny random DeepSeek-V3 checkpoint:
every layout must produce the same greedy tokens for the same prompts. The workers are
real spawned processes joined by torch.distributed; nothing is mocked.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from powertrain import LLM, SamplingParams
from powertrain.deploy.frontend import ParallelEngine, _Rank
from powertrain.interfaces import AttentionBackendContext, CommunicatorContext, ModelContext, MoEBackendContext
from powertrain.interfaces.engine import Engine, EngineTokenizer
from powertrain.interfaces.errors import EngineDeadError, InvalidRequestError
from powertrain.interfaces.moe import RoutingConfig
from powertrain.layers.moe import MoE
from powertrain.loader import load_checkpoint
from powertrain.models.deepseek_v3 import DeepseekV3ForCausalLM
from powertrain.parallel.expert import AllToAllDispatcher
from powertrain.parallel.layout import ParallelLayout
from powertrain.plugins import PluginManager
from powertrain.testing.base import find_component
from powertrain.testing.checkpoints import write_tiny_deepseek

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SETTINGS = {"memory_gib": 0.05, "dtype": "float32"}


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_deepseek(tmp_path_factory.mktemp("tiny-v3-parallel"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """16 prompts of varied lengths, two pairs sharing a long prefix (prefix routing)."""
    rng = random.Random(0)
    shared = [rng.randrange(3, 400) for _ in range(40)]
    result = [[rng.randrange(3, 400) for _ in range(rng.randint(4, 60))] for _ in range(12)]
    result += [shared + [rng.randrange(3, 400) for _ in range(5)] for _ in range(4)]
    return result


@pytest.fixture(scope="module")
def reference(tiny_v3: Path, prompts: list[list[int]]) -> list[list[int]]:
    with LLM(str(tiny_v3), **SETTINGS) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def dp2_ep2(tiny_v3: Path):
    llm = LLM(str(tiny_v3), data_parallel=2, expert_parallel=2, **SETTINGS)
    yield llm
    llm.shutdown()


def test_dp2_ep2_matches_one_process(dp2_ep2: LLM, prompts: list[list[int]], reference: list[list[int]]) -> None:
    outputs = dp2_ep2.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    engine = dp2_ep2.engine
    assert isinstance(engine, ParallelEngine) and isinstance(engine, Engine)  # the front ends' one contract
    assert isinstance(engine.tokenizer, EngineTokenizer)
    assert [w.experts for w in engine.workers] == [(0, 4), (4, 4)]  # each rank loaded its half
    assert all(n > 0 for n in engine.requests_per_rank().values()), engine.requests_per_rank()
    counters = engine.counters()
    assert all(c["rounds"] > c["busy_rounds"] > 0 for c in counters.values()), counters


def test_one_busy_rank_keeps_its_idle_peer_in_step(
    dp2_ep2: LLM, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """One request: one rank computes, the other serves its experts with empty steps."""
    before = dp2_ep2.engine.counters()
    output = dp2_ep2.generate([prompts[3]], GREEDY)[0]
    assert output.outputs[0].token_ids == reference[3]
    after = dp2_ep2.engine.counters()
    busy = [after[r]["busy_rounds"] - before[r]["busy_rounds"] for r in (0, 1)]
    assert sorted(busy)[0] == 0 and sorted(busy)[1] >= GREEDY.max_tokens, busy


def test_front_end_refuses_bad_input_and_keeps_serving(dp2_ep2: LLM, prompts: list[list[int]]) -> None:
    with pytest.raises(InvalidRequestError, match=r"prompt token ids must be ints in \[0, 512\)"):
        dp2_ep2.generate([[1, 2, 10**6]], GREEDY)
    with pytest.raises(InvalidRequestError, match="shorten the prompt"):
        dp2_ep2.generate([[5] * 5000], GREEDY)
    assert dp2_ep2.generate([prompts[0]], GREEDY)[0].outputs[0].finish_reason == "length"


def test_a_shared_prefix_is_routed_to_the_rank_that_cached_it(dp2_ep2: LLM, prompts: list[list[int]]) -> None:
    engine = dp2_ep2.engine
    engine.add_request(prompts[12], GREEDY, request_id="first")
    rank = engine.rank_of("first")
    engine.add_request(prompts[13], GREEDY, request_id="second")
    assert engine.rank_of("second") == rank
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize(("dp", "ep"), [(1, 4), (2, 1)])
def test_other_layouts_match_one_process(
    tiny_v3: Path, prompts: list[list[int]], reference: list[list[int]], dp: int, ep: int
) -> None:
    with LLM(str(tiny_v3), data_parallel=dp, expert_parallel=ep, **SETTINGS) as llm:
        outputs = llm.generate(prompts, GREEDY)
        workers = llm.engine.workers
    assert [o.outputs[0].token_ids for o in outputs] == reference
    expected = [(2 * r, 2) for r in range(4)] if ep == 4 else [(0, 8)] * 2
    assert [w.experts for w in workers] == expected
    assert [w.holds_requests for w in workers] == ([True, False, False, False] if ep == 4 else [True, True])


def test_a_killed_worker_ends_the_run_with_a_clear_error(tiny_v3: Path) -> None:
    llm = LLM(str(tiny_v3), data_parallel=2, expert_parallel=2, **SETTINGS)
    victim = llm.engine.workers[1].pid

    def kill_when_busy() -> None:
        while not llm.engine.has_unfinished_requests():
            time.sleep(0.01)
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    started = time.monotonic()
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    with pytest.raises(EngineDeadError, match=rf"rank 1 \(pid {victim} .*exited with code -9"):
        llm.generate([[5, 6, 7, 8]] * 4, long)
    elapsed = time.monotonic() - started
    killer.join()
    assert elapsed < 60, f"the failure took {elapsed:.0f} s to surface"
    with pytest.raises(EngineDeadError, match="rank 1"):  # and stays dead, saying why
        llm.generate([[5, 6, 7]], GREEDY)
    llm.shutdown()
    for worker in llm.engine.workers:  # nothing is left running
        with pytest.raises(ProcessLookupError):
            os.kill(worker.pid, 0)


def test_torchrun_ranks_run_the_same_command(tiny_v3: Path, reference: list[list[int]], tmp_path: Path) -> None:
    """The multi-machine path on one machine: torchrun starts every rank with the same
    `powertrain generate`; rank 0 is the front end and prints, rank 1 only works."""
    torchrun = Path(sys.executable).parent / "torchrun"
    config = tmp_path / "engine.toml"
    config.write_text(f'[model]\npath = "{tiny_v3}"\ndtype = "float32"\n[cache]\nmemory_gib = 0.05\n')
    prompt = " ".join(str(t) for t in range(3, 20))
    command = [
        str(torchrun),
        "--standalone",
        "--nproc-per-node=2",
        "--no-python",
        str(Path(sys.executable).parent / "powertrain"),
        "generate",
        "--config",
        str(config),
        "--data-parallel=2",
        "--expert-parallel=2",
        "--no-chat",
        "--max-tokens=6",
        "--json",
        prompt,
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with LLM(str(tiny_v3), **SETTINGS) as llm:
        expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout  # only rank 0 prints
    assert json.loads(lines[0])["text"] == expected


def test_rank0_announces_its_front_end_port_in_torchruns_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers learn rank 0's port from torchrun's store (a free port, not MASTER_PORT + 1,
    which a connection's local port had taken in 1 of 52 runs), and a port never announced
    ends in a clear error."""
    from torch.distributed import TCPStore

    from powertrain.deploy import launch

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    torchrun = launch.TorchrunRank(
        rank=1, world_size=2, local_rank=1, local_world_size=2, master_addr="127.0.0.1", master_port=server.port
    )
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setattr(launch, "ANNOUNCE_TIMEOUT_S", 0.5)
    with pytest.raises(ConnectionError, match="did not announce its front end's port.*frontend_port"):
        launch._announced_port(torchrun)
    port = random.randrange(20000, 60000)
    launch._torchrun_store(torchrun).set(launch.FRONTEND_PORT_KEY, str(port))
    assert launch._announced_port(torchrun) == port
    # A launcher that serves no store there: the fixed default.
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    assert launch._announced_port(torchrun) == server.port + 1


@pytest.mark.parametrize(("args", "code"), [(["--version"], 0), (["generate", "hello"], 1)])
def test_a_torchrun_rank_keeps_its_exit_code_and_output(args: list[str], code: int) -> None:
    """Under torchrun the command leaves without the interpreter's teardown (where a native
    thread aborted ranks): what it printed and its exit code survive."""
    env = {**os.environ, "LOCAL_RANK": "0"}  # torchrun's, without the rest: a clear error for generate
    done = subprocess.run(
        [str(Path(sys.executable).parent / "powertrain"), *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == code, done.stderr
    if code == 0:
        assert done.stdout.startswith("powertrain, version")
    else:
        assert "torchrun-style environment without 'RANK'" in done.stderr


@pytest.mark.parametrize("torchrun", [True, False], ids=["under-torchrun", "plain"])
def test_only_a_torchrun_rank_skips_the_interpreters_teardown(torchrun: bool) -> None:
    """An exit handler is the interpreter's teardown: it runs after a plain command, and
    not after one a torchrun rank runs (there ``cli.run`` leaves with ``os._exit``)."""
    script = (
        "import atexit, sys; atexit.register(lambda: print('teardown ran'));"
        "sys.argv = ['powertrain', '--version']; from powertrain.cli import run; run()"
    )
    env = {key: value for key, value in os.environ.items() if key not in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    if torchrun:
        env["TORCHELASTIC_RUN_ID"] = "test"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("powertrain, version")
    assert ("teardown ran" in done.stdout) is not torchrun, done.stdout


# --------------------------------------------------------------------------- in one process


def _backends(manager: PluginManager) -> tuple[object, object]:
    cpu = manager.platforms()["cpu"]
    attention = find_component(manager, "attention", "torch-reference").record.factory(
        AttentionBackendContext(platform=cpu, device=torch.device("cpu"), dtype=torch.float32, block_size=16)
    )
    moe = find_component(manager, "moe", "torch-grouped").record.factory(
        MoEBackendContext(platform=cpu, device=torch.device("cpu"), dtype=torch.float32)
    )
    return attention, moe


def _moe_layer(dispatcher: object, seed: int) -> MoE:
    routing = RoutingConfig(
        num_experts=8,
        top_k=3,
        scoring="sigmoid",
        topk_method="noaux_tc",
        n_group=2,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    _, backend = _backends(PluginManager.load())
    layer = MoE(routing, 16, 12, backend, torch.float32, "cpu", dispatcher=dispatcher)
    g = torch.Generator().manual_seed(seed)
    layer.load_weight("gate.weight", torch.randn(8, 16, generator=g))
    layer.load_weight("gate.e_score_correction_bias", 0.1 * torch.randn(8, generator=g))
    layer.load_weight("experts.gate_up_proj", torch.randn(8, 24, 16, generator=g) / 4)
    layer.load_weight("experts.down_proj", torch.randn(8, 16, 12, generator=g) / 4)
    layer.finish_loading()
    return layer


def test_the_dispatch_path_equals_the_local_path_in_one_process() -> None:
    """Routing -> dispatch -> grouped experts -> combine, at world size 1, against the
    backend's own ``forward``: the exchange must not change a token's result."""
    manager = PluginManager.load()
    record = find_component(manager, "communication", "single-process").record
    comm = record.factory(CommunicatorContext(platform=manager.platforms()["cpu"], device=torch.device("cpu")))
    local, exchanged = _moe_layer(None, seed=3), _moe_layer(AllToAllDispatcher(comm), seed=3)
    hidden = torch.randn(11, 16, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(exchanged(hidden), local(hidden), rtol=1e-5, atol=1e-6)
    assert exchanged(hidden[:0]).shape == (0, 16)  # an idle rank's empty pass


def test_a_rank_reads_only_its_own_experts(tiny_v3: Path) -> None:
    checkpoint = load_checkpoint(tiny_v3)
    attention, moe = _backends(PluginManager.load())
    context = ModelContext(
        config=checkpoint.config,
        dtype=torch.float32,
        device=torch.device("cpu"),
        attention=attention,
        moe=moe,
        expert_parallel_rank=1,
        expert_parallel_size=2,
    )
    model = DeepseekV3ForCausalLM(context)
    read: list[str] = []

    def wanted(name: str) -> bool:
        keep = model.wants_weight(name)
        if keep:
            read.append(name)
        return keep

    model.load_weights(checkpoint.tensors(wanted=wanted))  # complete: nothing missing
    experts_read = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".mlp.experts." in n}
    assert experts_read == {4, 5, 6, 7}


def test_a_frozen_worker_is_declared_dead_after_the_silence_timeout(tiny_v3: Path) -> None:
    """A worker that stops answering (SIGSTOP: no exit, no closed socket) is caught by
    its silence, not waited on forever."""
    llm = LLM(str(tiny_v3), data_parallel=2, expert_parallel=2, silence_timeout_s=3, **SETTINGS)
    frozen = llm.engine.workers[1].pid
    os.kill(frozen, signal.SIGSTOP)
    started = time.monotonic()
    try:
        # Its peer, waiting for it in a collective, may fall silent first: every rank is named.
        named_frozen = rf"no word for over 3 s from rank \d .*quiet: .*rank 1 \(pid {frozen} "
        with pytest.raises(EngineDeadError, match=named_frozen):
            llm.generate([[5, 6, 7, 8]] * 4, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        assert time.monotonic() - started < 30
    finally:
        llm.shutdown()  # kills the stopped process
    with pytest.raises(ProcessLookupError):
        os.kill(frozen, 0)


@pytest.mark.parametrize("expert_parallel", [1, 2])
def test_a_silence_names_the_peer_that_spoke_last_under_expert_parallelism(expert_parallel: int) -> None:
    """Under load a rank waiting in a collective for a slow peer goes quiet first, and the
    peer may report a moment before it freezes: the longest silent rank is then not the
    stuck one. With expert parallelism (lockstep) the error names every rank; without it
    the ranks are independent and only the silent ones are named."""
    engine = ParallelEngine.__new__(ParallelEngine)  # the silence rule alone: no processes
    engine.layout = ParallelLayout(data_parallel=2, expert_parallel=expert_parallel)
    engine.silence_timeout_s = 3.0
    now = time.monotonic()
    engine._ranks = {
        0: _Rank(0, pid=100, last_heard=now - 3.5),  # blocked in a collective since then
        1: _Rank(1, pid=101, last_heard=now - 1.5),  # reported, then froze
    }
    lost: list[tuple[int, str]] = []
    engine._lose = lambda entry, what: lost.append((entry.rank, what))
    engine._check_silence()
    [(rank, what)] = lost
    assert rank == 0 and what.startswith("no word for over 3 s from rank 0 (pid 100 ")
    assert ("rank 1 (pid 101 " in what) == (expert_parallel > 1), what
    engine._ranks[0].last_heard = now - 2.5  # under the timeout: nothing happens
    lost.clear()
    engine._check_silence()
    assert lost == []


ORPHAN_SCRIPT = """
import os, sys
from powertrain import LLM
from powertrain.log_setup import configure_logging
if __name__ == "__main__":
    configure_logging("warning")  # the application's choice (LLM leaves logging alone): stdout stays the pids
    llm = LLM(sys.argv[1], data_parallel=2, expert_parallel=2, memory_gib=0.05, dtype="float32")
    print(" ".join(str(w.pid) for w in llm.engine.workers), flush=True)
    os._exit(0)  # the front end vanishes without shutting anything down
"""


def test_workers_leave_when_the_front_end_vanishes(tiny_v3: Path, tmp_path: Path) -> None:
    script = tmp_path / "vanish.py"
    script.write_text(ORPHAN_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tiny_v3)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    pids = [int(p) for p in done.stdout.split()]
    deadline = time.monotonic() + 30
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [pid for pid in pids if _running(pid)]
    assert not alive, f"workers {alive} outlived their front end"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited
        return stat.read().split(")")[-1].split()[0] != "Z"
