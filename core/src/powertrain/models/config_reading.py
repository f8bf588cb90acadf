"""Reading a model's config.json the same way everywhere: a missing key names itself and the family."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def required_reader(config: Mapping[str, Any], family: str) -> Callable[[str], Any]:
    """``required(key)``: ``config[key]``, or a ValueError saying which key ``family`` needs."""

    def required(key: str) -> Any:
        if config.get(key) is None:
            raise ValueError(f"model config lacks {key!r}, which a {family} model needs")
        return config[key]

    return required
