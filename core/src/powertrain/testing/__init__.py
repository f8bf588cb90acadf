"""The conformance kit: a pytest plugin for plugin authors.

Enable it in your plugin's ``conftest.py`` (it is not auto-loaded)::

    pytest_plugins = ["powertrain.testing"]

then subclass the suites that fit what your plugin provides::

    from powertrain.testing import AttentionBackendSuite, PluginContract

    class TestContract(PluginContract):
        plugin = "my-plugin"            # the entry-point name
        vendor_modules = ("triton",)    # SDKs that must not load at import time

    class TestAttention(AttentionBackendSuite):
        component = "my-attention"

    class TestMoE(MoEBackendSuite):
        component = "my-moe"

    class TestQuantizedLinear(QuantizedLinearSuite):
        component = "my-quantized-linear"

    class TestStore(KVStoreSuite):
        component = "my-kv-store"

Every suite compares your implementation with the builtin reference on fresh
random inputs and skips, with your record's reason, what cannot run here.

Testing checkpoints: no model hub is needed to test code that loads or runs a
DeepSeek model. ``write_tiny_deepseek(folder)`` writes a tiny random DeepSeek-V3
(or ``variant="v2-lite"``) checkpoint with HF transformers, MTP layer and tokenizer
included, in well under a second; ``quantize_checkpoint_fp8(folder, fp8_folder)``
turns it into DeepSeek-V3's FP8 block-scaled layout; ``write_tiny_deepseek_v32(folder)``
writes a tiny DeepSeek-V3.2 (Lightning Indexer in every attention layer) and
``write_tiny_deepseek_v4(folder)`` a tiny DeepSeek-V4 (every attention layer type, hash
routing, mHC; FP4 experts optional) and ``write_tiny_deepseek_v41(folder)`` a tiny
DeepSeek-V4.1-Flash in its release's own layout (every block type, Engram, DSpark, FP8/FP4).
``write_tiny_qwen3(folder)`` and ``write_tiny_qwen3_moe(folder)`` write a tiny Qwen3 and
Qwen3-MoE, ``write_tiny_gemma4(folder)`` a tiny Gemma 4 text model, and
``write_tiny_deepspec_drafter(folder, target)`` a tiny DSpark block drafter for such a Qwen3
in the layout of DeepSeek's DeepSpec. All are deterministic per seed;
cache them with a session-scoped fixture over ``tmp_path_factory`` (see
``powertrain.testing.checkpoints``).
"""

from __future__ import annotations

import pytest

from powertrain.plugins import PluginManager
from powertrain.testing.attention import AttentionBackendSuite, check_sparse_mla, check_sparse_mla_refuses
from powertrain.testing.base import ComponentSuite, fresh_seed
from powertrain.testing.checkpoints import (
    quantize_checkpoint_fp8,
    write_tiny_deepseek,
    write_tiny_deepseek_v4,
    write_tiny_deepseek_v32,
    write_tiny_gemma4,
    write_tiny_qwen3,
    write_tiny_qwen3_moe,
)
from powertrain.testing.communicator import CommunicatorSuite
from powertrain.testing.contract import PluginContract
from powertrain.testing.deepseek_v41 import write_tiny_deepseek_v41
from powertrain.testing.drafters import write_tiny_deepspec_drafter
from powertrain.testing.kv_store import KVStoreSuite
from powertrain.testing.moe import MoEBackendSuite
from powertrain.testing.quantized_linear import QuantizedLinearSuite

#: Every test's seeds come from one run seed (POWERTRAIN_TEST_SEED): see powertrain.testing.seeds.
pytest_plugins = ["powertrain.testing.seeds"]

__all__ = [
    "AttentionBackendSuite",
    "CommunicatorSuite",
    "ComponentSuite",
    "KVStoreSuite",
    "MoEBackendSuite",
    "PluginContract",
    "QuantizedLinearSuite",
    "check_sparse_mla",
    "check_sparse_mla_refuses",
    "fresh_seed",
    "quantize_checkpoint_fp8",
    "write_tiny_deepseek",
    "write_tiny_deepseek_v4",
    "write_tiny_deepseek_v32",
    "write_tiny_deepseek_v41",
    "write_tiny_deepspec_drafter",
    "write_tiny_gemma4",
    "write_tiny_qwen3",
    "write_tiny_qwen3_moe",
]


@pytest.fixture(scope="session")
def powertrain_plugins() -> PluginManager:
    """The plugins of this environment, loaded exactly as the engine loads them."""
    return PluginManager.load()
