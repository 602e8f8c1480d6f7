"""``python -m mambaserve.operator`` / ``mambaserve-operator``.

Subcommands besides running: ``adapter-rules`` prints the prometheus-adapter rules the HPA engine
needs; ``render -f FILE`` prints the objects InferenceSessions and CacheTiers become (render.py);
``release-finalizers`` stops the operator and removes its finalizers (the chart's uninstall hook). The operator runs as a single replica (a ``Recreate`` Deployment) in standalone mode: no
Kopf peering, so two operators never fight over the same objects and there are no peering CRDs.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

import kopf
import yaml

from mambaserve.operator.builders import adapter_rules
from mambaserve.operator.handlers import build_registry
from mambaserve.operator import names, watches
from mambaserve.operator.kube import SESSION_CHILD_KINDS, Kube
from mambaserve.operator.metrics import OperatorMetrics
from mambaserve.operator.settings import OperatorSettings, parse_settings


# What the reconciler reads, from watch streams: its own kinds whole, and the children and pods it made
# (every one carries this label). A session at rest then costs the API server no request.
WATCHED = {"InferenceSession": None, "CacheTier": None,
           **{kind: {names.MANAGED_BY_LABEL: names.MANAGER} for kind in (*SESSION_CHILD_KINDS, "Pod")}}


async def run(settings: OperatorSettings, *, stop_flag: asyncio.Event | None = None,
              metrics: OperatorMetrics | None = None) -> None:
    """Run the operator until cancelled (or until ``stop_flag`` is set)."""
    metrics = metrics or OperatorMetrics()
    kube = Kube(timeout=settings.request_timeout)
    kube.watch(WATCHED, settings.namespaces, watches.Timeouts(settings.watch_server_timeout,
                                                              settings.watch_client_timeout))
    registry = build_registry(settings, kube, metrics)
    liveness = f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None
    try:
        await kopf.operator(
            registry=registry,
            standalone=True,
            clusterwide=settings.clusterwide,
            namespaces=list(settings.namespaces),
            liveness_endpoint=liveness,
            stop_flag=stop_flag,
        )
    finally:
        await kube.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["adapter-rules"]:
        yaml.safe_dump(adapter_rules(), sys.stdout, sort_keys=False, width=200)
        return 0
    if args[:1] == ["render"]:
        from mambaserve.operator import render  # offline: no Kopf, no API connection
        return render.main(args[1:])
    if args[:1] == ["release-finalizers"]:
        from mambaserve.operator import uninstall  # the chart's pre-delete hook
        return uninstall.main(args[1:])
    if args[:1] == ["run"]:
        args = args[1:]
    settings = parse_settings(args)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    metrics = OperatorMetrics()
    if settings.metrics_port:
        metrics.serve(settings.metrics_port)
    asyncio.run(run(settings, metrics=metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
