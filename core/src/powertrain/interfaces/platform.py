"""The platform records every component context carries.

They are defined in ``powertrain.components`` (platform hooks return them) and named
here too, so a kernel pack finds its whole contract under ``powertrain.interfaces``.
"""

from __future__ import annotations

from powertrain.components import Availability, PlatformInfo

__all__ = ["Availability", "PlatformInfo"]
