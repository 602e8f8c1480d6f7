"""``python -m mambaserve.operator`` / ``mambaserve-operator``.

Subcommands besides running: ``adapter-rules`` prints the prometheus-adapter rules the HPA engine
needs; ``render -f FILE`` prints the objects InferenceSessions and CacheTiers become (render.py);
``release-finalizers`` stops the operator and removes its finalizers (the chart's uninstall hook);
``apply-crds`` server-side applies the CRDs the package carries (the chart's pre-upgrade hook). Kopf runs
in standalone mode (no Kopf peering objects); with ``--leader-election`` several replicas run and only the
holder of a Lease reconciles (leader.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Callable, Sequence

import aiohttp.web
import kopf
import yaml

from mambaserve.operator.builders import adapter_rules
from mambaserve.operator import names, watches
from mambaserve.operator.handlers import build_registry, connection_info
from mambaserve.operator.kube import SESSION_CHILD_KINDS, Kube
from mambaserve.operator.leader import LeaderElection, LeadershipLost, Timing
from mambaserve.operator.metrics import OperatorMetrics
from mambaserve.operator.settings import OperatorSettings, parse_settings

log = logging.getLogger("mambaserve.operator")


# What the reconciler reads, from watch streams: its own kinds whole, and the children and pods it made
# (every one carries this label). A session at rest then costs the API server no request.
WATCHED = {"InferenceSession": None, "CacheTier": None,
           **{kind: {names.MANAGED_BY_LABEL: names.MANAGER} for kind in (*SESSION_CHILD_KINDS, "Pod")}}


async def run(settings: OperatorSettings, *, stop_flag: asyncio.Event | None = None,
              metrics: OperatorMetrics | None = None) -> None:
    """Run the operator until cancelled (or until ``stop_flag`` is set). With leader election, wait as a
    standby until this replica holds the Lease, reconcile while it does, and release it at a clean stop;
    LeadershipLost when renewals fail (the process exits and restarts as a standby)."""
    metrics = metrics or OperatorMetrics()
    kube = Kube(timeout=settings.request_timeout, agent=f"{names.MANAGER} ({settings.identity})")
    kube.watch(WATCHED, settings.namespaces, watches.Timeouts(settings.watch_server_timeout,
                                                              settings.watch_client_timeout))
    registry = build_registry(settings, kube, metrics)
    try:
        if not settings.leader_election:
            liveness = f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None
            await _kopf(settings, registry, stop_flag, liveness)
            return
        kube.login(connection_info(settings, log))  # the Lease is read before Kopf logs in
        election = LeaderElection(kube, settings.leader_election_namespace or "", settings.leader_election_name,
                                  settings.identity, Timing(settings.lease_duration, settings.renew_deadline,
                                                            settings.retry_period))
        reconciling: list[asyncio.Task[None]] = []
        async with health_endpoint(settings.health_port, lambda: not any(t.done() for t in reconciling)):
            await election.acquire()
            reconciling += [asyncio.create_task(_kopf(settings, registry, stop_flag, None), name="kopf"),
                            asyncio.create_task(election.hold(), name="lease")]
            try:
                done, _ = await asyncio.wait(reconciling, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # LeadershipLost, or Kopf's own end
            finally:
                for task in reconciling:
                    task.cancel()
                lost = await asyncio.gather(*reconciling, return_exceptions=True)
                if not any(isinstance(e, LeadershipLost) for e in lost):
                    await election.release()
    finally:
        await kube.close()


async def _kopf(settings: OperatorSettings, registry: kopf.OperatorRegistry, stop_flag: asyncio.Event | None,
                liveness: str | None) -> None:
    await kopf.operator(
        registry=registry,
        standalone=True,
        clusterwide=settings.clusterwide,
        namespaces=list(settings.namespaces),
        liveness_endpoint=liveness,
        stop_flag=stop_flag,
    )


@contextlib.asynccontextmanager
async def health_endpoint(port: int, healthy: Callable[[], bool]) -> AsyncIterator[None]:
    """``/healthz`` on ``port`` (0: none) for a replica that may be a standby, where Kopf's own endpoint
    does not run: 200 while the event loop answers and nothing it runs has ended."""
    if not port:
        yield
        return

    async def probe(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(text="ok") if healthy() else aiohttp.web.Response(status=503, text="stopped")

    app = aiohttp.web.Application()
    app.router.add_get("/healthz", probe)
    runner = aiohttp.web.AppRunner(app, access_log=None)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, "0.0.0.0", port).start()
    try:
        yield
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["adapter-rules"]:
        yaml.safe_dump(adapter_rules(), sys.stdout, sort_keys=False, width=200)
        return 0
    if args[:1] == ["render"]:
        from mambaserve.operator import render  # offline: no Kopf, no API connection
        return render.main(args[1:])
    if args[:1] == ["apply-crds"]:
        from mambaserve.operator import crds_upgrade  # the chart's pre-upgrade hook
        return crds_upgrade.main(args[1:])
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
    try:
        asyncio.run(run(settings, metrics=metrics))
    except LeadershipLost as e:
        log.error("%s; exiting so that this replica restarts as a standby", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
