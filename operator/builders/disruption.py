"""PodDisruptionBudget of the server pods."""

from __future__ import annotations

from typing import Any

from mambaserve.operator import names
from mambaserve.operator.builders.common import session_metadata
from mambaserve.operator.spec import InferenceSession


def build_pdb(session: InferenceSession) -> dict[str, Any]:
    # One pod at a time: voluntary disruptions (node drains, upgrades) never take the whole model
    # away, yet a single-replica session can still be drained instead of blocking the node forever.
    obj = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": session_metadata(session, session.name, "server"),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": names.server_selector(session.name)},
            # A pod that never became ready holds no cache worth protecting.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
    return names.stamp(obj)
