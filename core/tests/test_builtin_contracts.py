"""The builtin plugins pass the same contract checks as external ones."""

from __future__ import annotations

from powertrain.testing import PluginContract


class TestPlatforms(PluginContract):
    plugin = "builtin-platforms"


class TestSelection(PluginContract):
    plugin = "builtin-selection"


class TestCommunicators(PluginContract):
    plugin = "builtin-communicators"


class TestAttention(PluginContract):
    plugin = "builtin-attention"


class TestMoE(PluginContract):
    plugin = "builtin-moe"
