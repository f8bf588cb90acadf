"""The builtin "auto" rule, registered trylast so any plugin may override a choice."""

from __future__ import annotations

from powertrain import hookimpl
from powertrain.selection import Candidate, Selection, choose

POWERTRAIN_HOOK_API = 1


@hookimpl(trylast=True)
def powertrain_select_component(kind: str, requested: str, candidates: list[Candidate]) -> Selection:
    return choose(kind, requested, candidates)
