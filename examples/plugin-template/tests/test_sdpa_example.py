"""The template proves itself the way every plugin should: with the conformance kit."""

from powertrain.testing import AttentionBackendSuite, PluginContract


class TestContract(PluginContract):
    plugin = "sdpa-example"


class TestAttention(AttentionBackendSuite):
    component = "sdpa"
