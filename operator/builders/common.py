"""Metadata shared by every object an InferenceSession owns."""

from __future__ import annotations

from typing import Any

from mambaserve.operator import names
from mambaserve.operator.spec import InferenceSession


def session_metadata(session: InferenceSession, name: str, component: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": session.namespace,
        "labels": names.session_labels(session.name, component),
        "ownerReferences": [names.owner_reference("InferenceSession", session.name, session.uid)],
    }
