"""Mechanisms of data-parallel attention with expert-parallel MoE, used inside an engine.

DeepSeek's serving layout, on torch.distributed through the platform's backend:

* ``layout``: which rank holds requests (a data-parallel *attention* rank, with its own
  scheduler and KV cache) and which routed experts each rank loads;
* ``expert``: the expert-parallel token exchange (``AllToAllDispatcher``) every MoE
  layer runs through the communicator: uneven all-to-all to the experts' ranks and back;
* ``lockstep``: keeps every rank's collectives in the same order, so a rank with
  nothing to do runs an empty MoE pass while its peers compute (no hangs).

Starting the processes, feeding them requests and balancing between them is
deployment, one layer up: ``powertrain.deploy``.
"""
