"""Choosing one implementation per component kind.

The rule lives here so that the builtin selection plugin and plugins that want to
reuse it share one definition; it is reached through the
``powertrain_select_component`` hook, where the builtin registers it ``trylast``.
"""

from __future__ import annotations

from typing import Any

import attrs

from powertrain.components import Availability


class SelectionError(LookupError):
    """The config asks for a component that cannot be had here. Says what can."""


@attrs.frozen(kw_only=True)
class Candidate:
    """One registered implementation, with who provides it and whether it runs here."""

    record: Any
    plugin: str
    distribution: str
    availability: Availability
    #: Requirement tags this implementation lacks (empty = it meets them all).
    missing: frozenset[str] = frozenset()

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def usable(self) -> bool:
        return self.availability.available and not self.missing

    def describe(self) -> str:
        if not self.availability.available:
            return f"{self.name} ({self.availability.reason})"
        if self.missing:
            absent = getattr(self.record, "absent", {})
            why = "".join(f"; {tag}: {absent[tag]}" for tag in sorted(self.missing) if tag in absent)
            return f"{self.name} (lacks {', '.join(sorted(self.missing))}{why})"
        return self.name


@attrs.frozen(kw_only=True)
class Selection:
    """The chosen implementation's name and a sentence saying why."""

    name: str
    reason: str


def _priority(candidate: Candidate) -> int:
    return getattr(candidate.record, "priority", 0)


def choose(kind: str, requested: str, candidates: list[Candidate]) -> Selection:
    """The default rule: honour explicit names, else highest priority usable one."""
    usable = sorted((c for c in candidates if c.usable), key=lambda c: (-_priority(c), c.name))
    unusable = [c.describe() for c in candidates if not c.usable]
    available_text = ", ".join(c.name for c in usable) or "(none)"
    if requested != "auto":
        match = next((c for c in candidates if c.name == requested), None)
        if match is None:
            raise SelectionError(
                f"{kind} {requested!r} is not provided by any loaded plugin; "
                f"available here: {available_text}"
                + (f"; registered but unusable: {', '.join(unusable)}" if unusable else "")
            )
        if not match.usable:
            raise SelectionError(
                f"{kind} {requested!r} (plugin {match.plugin}) cannot be used here: "
                f"{match.describe()}; available here: {available_text}"
            )
        return Selection(name=match.name, reason=f"named in config; from plugin {match.plugin}")
    if not usable:
        raise SelectionError(
            f"no {kind} implementation is usable here"
            + (f"; registered: {', '.join(unusable)}" if unusable else "; none is registered")
        )
    best = usable[0]
    others = [f"{c.name} ({_priority(c)})" for c in usable[1:]]
    reason = f"auto: highest priority ({_priority(best)}) usable here; from plugin {best.plugin}"
    if others:
        reason += f"; also usable: {', '.join(others)}"
    if unusable:
        reason += f"; not usable: {', '.join(unusable)}"
    return Selection(name=best.name, reason=reason)
