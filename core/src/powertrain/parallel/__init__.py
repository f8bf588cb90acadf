"""Data-parallel attention with expert-parallel MoE, across processes and machines.

DeepSeek's serving layout, on torch.distributed (gloo on cpu, nccl on cuda, hccl on npu):

* ``layout``: which rank holds requests (a data-parallel *attention* rank, with its own
  scheduler and KV cache) and which routed experts each rank loads;
* ``expert``: the expert-parallel token exchange (``AllToAllDispatcher``) every MoE
  layer runs through the communicator: uneven all-to-all to the experts' ranks and back;
* ``lockstep``: keeps every rank's collectives in the same order, so a rank with
  nothing to do runs an empty MoE pass while its peers compute (no hangs);
* ``balance``: the front end's choice of data-parallel rank (longest cached prefix,
  then least loaded);
* ``worker`` / ``frontend``: the worker process loop and the engine-shaped front end
  that feeds every rank (``LLM``, ``powertrain generate`` and ``serve`` use it as an engine);
* ``launch``: local worker processes, or ``torchrun`` for several machines.
"""
