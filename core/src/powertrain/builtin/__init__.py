"""The reference plugins that ship with the core.

Each module here is a plugin exactly like an external one (it declares
``POWERTRAIN_HOOK_API`` and registers through ``powertrain.plugins.BUILTIN_PLUGINS``);
engine code never imports them, so any could move to its own distribution unchanged.
"""
