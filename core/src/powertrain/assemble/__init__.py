"""Config + plugins -> chosen components -> a ready engine. The only hook-heavy package.

* ``planning``: which implementation each component kind gets here, and why (``plan``,
  what ``powertrain config check`` prints); builds nothing;
* ``building``: a plan's choices -> the Protocol objects the hot path calls directly;
* ``loading``: the model, its weights and its KV cache, on the device thread;
* ``engine``: ``build_engine``, those steps in order.

Above it sits ``powertrain.deploy`` (one process, spawned workers, torchrun); below it,
everything it wires (engine, models, layers, parallel mechanisms, plugins' objects).
"""

from powertrain.assemble.building import build_attention, build_communicator, build_moe
from powertrain.assemble.engine import build_engine, describe_kv_cache
from powertrain.assemble.loading import model_length, resolve_dtype
from powertrain.assemble.planning import AssemblyError, Plan, Resolution, plan

__all__ = [
    "AssemblyError",
    "Plan",
    "Resolution",
    "build_attention",
    "build_communicator",
    "build_engine",
    "build_moe",
    "describe_kv_cache",
    "model_length",
    "plan",
    "resolve_dtype",
]
