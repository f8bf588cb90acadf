"""One rank of test_dispatch's expert-parallel exchange: ``python dispatch_worker.py RANK WORLD INIT OUT``.

Each rank holds ``num_experts / world`` experts, sends its tokens through
AscendDispatcher (dispatch -> AscendMoE.forward_grouped -> combine) over the
stand-in ops on gloo, and also computes the same tokens with the single-process
AscendMoE.forward over all experts and with the float64 oracle. Everything goes
to ``OUT/rank{RANK}.pt`` for the test to compare.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from powertrain.components import Availability, PlatformInfo
from powertrain.distributed import TorchDistributedCommunicator
from powertrain.interfaces import CommunicatorContext, ExpertWeights, MoEBackendContext
from powertrain.testing.moe import reference_moe
from powertrain_cann_ascend import dispatch
from powertrain_cann_ascend.moe import AscendMoE
from powertrain_cann_ascend.testing.standins import MoEOpsStandIn

NUM_EXPERTS, HIDDEN, INTERMEDIATE = 8, 64, 32
GROUP_NAME = "stand-in-ep"
PLATFORM = PlatformInfo(name="npu", device_type="cpu", availability=Availability.yes("stand-in"), dist_backend="gloo")


def distinct_ids(gen: torch.Generator, tokens: int, top_k: int, pool: torch.Tensor) -> torch.Tensor:
    picks = torch.multinomial(torch.ones(len(pool)).expand(tokens, -1), top_k, generator=gen)
    return pool[picks].to(torch.int32).reshape(tokens, top_k)


def cases(rank: int, world: int) -> dict[str, dict]:
    """Per case: this rank's token count, top_k, expert pool and whether rows go as int8."""
    local = NUM_EXPERTS // world
    everyone = torch.arange(NUM_EXPERTS)
    return {
        # Every token of every rank goes to rank 0's experts: the other ranks receive nothing.
        "skewed": {"tokens": 5 + 2 * rank, "top_k": 2, "pool": torch.arange(local), "quantize": False},
        "balanced": {"tokens": 6 + 3 * rank, "top_k": 3, "pool": everyone, "quantize": False},
        # The last rank has no tokens this step but must still take part (it sends a padding token).
        "last-rank-empty": {"tokens": 0 if rank == world - 1 else 4, "top_k": 3, "pool": everyone, "quantize": False},
        "int8-rows": {"tokens": 7, "top_k": 2, "pool": everyone, "quantize": True},
    }


def main(rank: int, world: int, init_method: str, out: Path) -> None:
    context = CommunicatorContext(
        platform=PLATFORM, device=torch.device("cpu"), rank=rank, world_size=world, init_method=init_method
    )
    communicator = TorchDistributedCommunicator(context)
    # powertrain_cann_ascend.communicator.hccl_group_name (HCCL's comm name) is replaced:
    # the stand-in ops find their gloo group by this name instead.
    dispatch.ep_group_name = lambda _communicator: GROUP_NAME
    ops = MoEOpsStandIn(group=communicator.group, group_name=GROUP_NAME)
    backend = AscendMoE(MoEBackendContext(platform=PLATFORM, device=torch.device("cpu"), dtype=torch.bfloat16), ops)

    shared = torch.Generator().manual_seed(20240607)  # same experts on every rank
    w13 = (torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=shared) / HIDDEN**0.5).bfloat16()
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=shared) / INTERMEDIATE**0.5).bfloat16()
    local = NUM_EXPERTS // world
    mine = slice(rank * local, (rank + 1) * local)
    all_experts = backend.prepare(ExpertWeights(w13=w13, w2=w2, num_experts=NUM_EXPERTS))
    my_experts = backend.prepare(
        ExpertWeights(w13=w13[mine], w2=w2[mine], num_experts=NUM_EXPERTS, first_expert=rank * local)
    )

    results = {}
    for index, (name, case) in enumerate(cases(rank, world).items()):
        gen = torch.Generator().manual_seed(1000 * index + rank)
        tokens, top_k = case["tokens"], case["top_k"]
        hidden = torch.randn(tokens, HIDDEN, generator=gen).bfloat16()
        topk_ids = distinct_ids(gen, tokens, top_k, case["pool"])
        topk_weights = 0.1 + 2.4 * torch.rand(tokens, top_k, generator=gen)
        dispatcher = dispatch.AscendDispatcher(communicator, ops, max_tokens_per_rank=16, quantize=case["quantize"])
        rows, counts, scales, handle = dispatcher.dispatch(hidden, topk_ids, topk_weights, NUM_EXPERTS)
        expert_output = backend.forward_grouped(rows, counts, my_experts, scales)
        got = dispatcher.combine(expert_output, handle)
        single = backend.forward(hidden, topk_ids, topk_weights, all_experts) if tokens else hidden.clone()
        results[name] = {
            "got": got,
            "single_process": single,
            "oracle": reference_moe(hidden, topk_ids, topk_weights, w13, w2),
            "received_rows": rows.shape[0],
            "counts": counts.tolist(),
            "scales": None if scales is None else scales.shape,
        }
    torch.save(results, out / f"rank{rank}.pt")
    communicator.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
