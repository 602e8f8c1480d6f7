"""The effective server configuration, as a ConfigMap people can read with kubectl."""

from __future__ import annotations

import json
from typing import Any

from mambaserve.operator import names
from mambaserve.operator.builders.common import session_metadata
from mambaserve.operator.builders.server import memory_footprint, model_path, problems, rollout, server_args
from mambaserve.operator.spec import CacheTier, InferenceSession


def effective_config(session: InferenceSession, tier: CacheTier | None) -> dict[str, Any]:
    return {
        "model": {"source": session.model.source, "path": model_path(session),
                  "servedName": session.model.served_name},
        "device": "cuda" if session.resources.gpus > 0 else "cpu",
        "server": {
            "maxRunningRequests": session.server.max_running_requests,
            "chunkedPrefillSize": session.server.chunked_prefill_size,
            "contextLength": session.server.context_length,
            "pageSize": session.server.page_size,
            "cacheStrategy": session.server.cache_strategy,
            "trackInterval": session.server.track_interval,
            "dtype": session.server.dtype,
            "stateDtype": session.server.state_dtype,
            "disableRadixCache": session.server.disable_radix_cache,
        },
        "sessions": {"streaming": session.sessions.streaming, "timeoutSeconds": session.sessions.timeout_seconds,
                     "maxSessions": session.sessions.max_sessions, "persist": session.sessions.persist},
        "cacheTier": None if tier is None else {
            "name": tier.name,
            "gpuStateSlots": tier.gpu_state_slots,
            "gpuMemoryFraction": tier.gpu_memory_fraction,
            "hostSizeGb": tier.host_size_gb,
            "storage": {"enabled": tier.storage.enabled, "path": tier.storage.path, "size": tier.storage.size,
                        "claim": tier.claim_name or ("per-pod" if tier.storage.per_pod else None)},
            "writePolicy": tier.write_policy,
            "prefetchPolicy": tier.prefetch_policy,
        },
        "memory": memory_footprint(session, tier).describe(),
        "rollout": dict(zip(("strategy", "surgePods"), rollout(session))),
        "notHonoured": [p.message for p in problems(session, tier)],
    }


def build_config_map(session: InferenceSession, tier: CacheTier | None) -> dict[str, Any]:
    obj = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": session_metadata(session, names.config_map(session.name), "server"),
        "data": {
            "server-args": "\n".join(server_args(session, tier)) + "\n",
            "effective-config.json": json.dumps(effective_config(session, tier), indent=2, sort_keys=True) + "\n",
        },
    }
    return names.stamp(obj)
