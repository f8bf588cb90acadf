"""The plugin as powertrain sees it: its record, through the conformance kit."""

from __future__ import annotations

import torch

from powertrain.testing import PluginContract, QuantizedLinearSuite


class TestContract(PluginContract):
    plugin = "cpu_kernels"


class TestNativeQuantizedLinear(QuantizedLinearSuite):
    component = "cpu-native"


class TestNativeQuantizedLinearFloat32(QuantizedLinearSuite):
    """The record that keeps activations float32: held to the kit's plain float32 tolerance."""

    component = "cpu-native-f32"

    def test_it_declares_float32_activations(self, subject) -> None:
        kernel = self.build(subject, torch.float32)
        assert kernel.activation_bits == 32
