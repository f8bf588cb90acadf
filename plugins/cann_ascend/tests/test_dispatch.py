"""AscendDispatcher: dispatch -> forward_grouped -> combine over two real processes.

What is mocked is the NPU and HCCL: the dispatch/combine stand-ins move the rows
between the two processes with torch.distributed all-to-all on gloo, and the
group name that ``powertrain_cann_ascend.communicator.hccl_group_name`` would give
is replaced (``dispatch.ep_group_name``). The result on each rank must equal the
single-process AscendMoE.forward over all experts and the float64 oracle.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from powertrain.interfaces import ExpertDispatcher
from powertrain.testing.moe import row_errors
from powertrain_cann_ascend import dispatch

WORKER = Path(__file__).with_name("dispatch_worker.py")
WORLD = 2
#: bf16 experts and exchange (a few bf16 roundings, as the kit's bf16 limit); int8
#: rows add ~1/254 relative rounding per element.
LIMITS = {"skewed": 3e-2, "balanced": 3e-2, "last-rank-empty": 3e-2, "int8-rows": 5e-2}


@pytest.fixture(scope="module")
def exchanged(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("ep")
    init = f"file://{out / 'rendezvous'}"
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), str(WORLD), init, str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in range(WORLD)
    ]
    logs = []
    for worker in workers:
        try:
            logs.append(worker.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for other in workers:
                other.kill()
            pytest.fail("the two expert-parallel workers did not finish in 120 s")
    runs = enumerate(zip(workers, logs, strict=True))
    failed = [f"rank {rank} (exit {w.returncode}):\n{log}" for rank, (w, log) in runs if w.returncode]
    # A rank's crash makes its peers fail too; the last one listed is usually the cause.
    assert not failed, "\n\n".join(failed)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LIMITS))
def test_round_trip_matches_single_process(exchanged: list[dict], case: str) -> None:
    for rank, results in enumerate(exchanged):
        result = results[case]
        got, single, oracle = result["got"], result["single_process"], result["oracle"]
        where = f"{case}, rank {rank}"
        assert got.shape == oracle.shape and got.dtype == torch.bfloat16, where
        assert torch.isfinite(got.float()).all(), where
        if got.shape[0] == 0:
            continue
        to_oracle = float(row_errors(got.double(), oracle).max())
        to_single = float(row_errors(got.double(), single.double()).max())
        assert to_oracle < LIMITS[case], f"{where}: off the float64 oracle by {to_oracle:.3g}"
        assert to_single < LIMITS[case], f"{where}: off single-process forward by {to_single:.3g}"


@pytest.mark.slow
def test_skewed_routing_leaves_a_rank_without_rows(exchanged: list[dict]) -> None:
    assert exchanged[0]["skewed"]["received_rows"] == (5 + 7) * 2
    assert exchanged[1]["skewed"]["received_rows"] == 0
    assert exchanged[1]["skewed"]["counts"] == [0, 0, 0, 0]


@pytest.mark.slow
def test_a_rank_without_tokens_gets_an_empty_result(exchanged: list[dict]) -> None:
    assert tuple(exchanged[WORLD - 1]["last-rank-empty"]["got"].shape) == (0, 64)


@pytest.mark.slow
def test_quantised_dispatch_hands_over_per_row_scales(exchanged: list[dict]) -> None:
    for results in exchanged:
        assert results["int8-rows"]["scales"] == (results["int8-rows"]["received_rows"],)


def _communicator(world_size: int) -> SimpleNamespace:
    return SimpleNamespace(rank=0, world_size=world_size, group=None)


def test_is_an_expert_dispatcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "ep_group_name", lambda _c: "ep")
    dispatcher = dispatch.AscendDispatcher(_communicator(2), ops=None)
    assert isinstance(dispatcher, ExpertDispatcher)
    assert (dispatcher.group_name, dispatcher.global_bs) == ("ep", 512)


def test_single_rank_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "ep_group_name", lambda _c: "ep")
    with pytest.raises(ValueError, match="at least 2 ranks"):
        dispatch.AscendDispatcher(_communicator(1), ops=None)


@pytest.mark.parametrize(
    ("tokens", "experts", "dtype", "message"),
    [
        (3, 9, torch.bfloat16, "not a multiple of 2"),
        (17, 8, torch.bfloat16, "exceeds max_tokens_per_rank = 16"),
        (3, 8, torch.float32, "bf16 or fp16"),
    ],
)
def test_local_mistakes_fail_before_the_collective(
    monkeypatch: pytest.MonkeyPatch, tokens: int, experts: int, dtype: torch.dtype, message: str
) -> None:
    monkeypatch.setattr(dispatch, "ep_group_name", lambda _c: "ep")
    dispatcher = dispatch.AscendDispatcher(_communicator(2), ops=None, max_tokens_per_rank=16)
    ids = torch.zeros(tokens, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        dispatcher.dispatch(torch.zeros(tokens, 64, dtype=dtype), ids, torch.zeros(tokens, 2), experts)
