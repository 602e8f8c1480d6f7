"""Status conditions (metav1.Condition shape) and the events their transitions deserve."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str = ""


@dataclasses.dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge(previous: Sequence[Mapping[str, Any]] | None, updates: Iterable[Condition],
          generation: int | None, timestamp: str | None = None) -> list[dict[str, Any]]:
    """The new conditions list; lastTransitionTime only moves when a condition's status changes."""
    old = {c.get("type"): c for c in previous or ()}
    stamp = timestamp or now()
    result = []
    for cond in updates:
        before = old.get(cond.type)
        changed = before is None or before.get("status") != cond.status
        entry: dict[str, Any] = {
            "type": cond.type,
            "status": cond.status,
            "reason": cond.reason,
            "message": cond.message,
            "lastTransitionTime": stamp if changed else before.get("lastTransitionTime", stamp),
        }
        if generation is not None:
            entry["observedGeneration"] = generation
        result.append(entry)
    return result


# (condition type, status) transitions worth an event, with the event type.
_NOTEWORTHY = {
    ("Ready", "True"): "Normal",
    ("Ready", "False"): "Warning",
    ("Degraded", "True"): "Warning",
    ("Degraded", "False"): "Normal",
    ("CacheTierBound", "True"): "Normal",
    ("CacheTierBound", "False"): "Warning",
    ("RouterReady", "True"): "Normal",
    ("Autoscaling", "True"): "Normal",
    ("Autoscaling", "False"): "Warning",
    ("InUse", "True"): "Normal",
    ("ModelReady", "True"): "Normal",
}


def transitions(previous: Sequence[Mapping[str, Any]] | None, current: Sequence[Mapping[str, Any]]) -> list[Event]:
    old = {c.get("type"): c for c in previous or ()}
    events = []
    for cond in current:
        before = old.get(cond["type"])
        if before is not None and before.get("status") == cond["status"]:
            continue
        if before is None and cond["status"] != "True" and cond["type"] != "Degraded":
            continue  # an initial False/Unknown is the starting point, not news
        if before is None and cond["type"] == "Degraded" and cond["status"] == "False":
            continue
        kind = _NOTEWORTHY.get((cond["type"], cond["status"]))
        if kind is not None and cond.get("reason") not in ("Disabled", "NotRequested"):
            events.append(Event(kind, f"{cond['type']}{cond['status']}", f"{cond['reason']}: {cond['message']}"))
    return events


def find(conditions: Sequence[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any] | None:
    for cond in conditions or ():
        if cond.get("type") == type_:
            return cond
    return None
