"""The plugin as powertrain sees it: its record, through the conformance kit."""

from __future__ import annotations

from powertrain.testing import PluginContract, QuantizedLinearSuite


class TestContract(PluginContract):
    plugin = "cpu_kernels"


class TestNativeQuantizedLinear(QuantizedLinearSuite):
    component = "cpu-native"
