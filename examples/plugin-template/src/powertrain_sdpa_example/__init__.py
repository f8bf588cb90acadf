"""An example powertrain plugin: attention through torch's scaled_dot_product_attention.

The package holds two modules on purpose: ``plugin`` (registration, cheap to import,
what the entry point names) and ``backend`` (the implementation, imported only when
the engine builds the backend). A kernel pack keeps vendor SDK imports on the
``backend`` side so that importing the plugin never needs the hardware.
"""
