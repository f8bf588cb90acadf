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

Every suite compares your implementation with the builtin reference on fresh
random inputs and skips, with your record's reason, what cannot run here.
"""

from __future__ import annotations

import pytest

from powertrain.plugins import PluginManager
from powertrain.testing.attention import AttentionBackendSuite
from powertrain.testing.base import ComponentSuite, fresh_seed
from powertrain.testing.communicator import CommunicatorSuite
from powertrain.testing.contract import PluginContract

__all__ = [
    "AttentionBackendSuite",
    "CommunicatorSuite",
    "ComponentSuite",
    "PluginContract",
    "fresh_seed",
]


@pytest.fixture(scope="session")
def powertrain_plugins() -> PluginManager:
    """The plugins of this environment, loaded exactly as the engine loads them."""
    return PluginManager.load()
