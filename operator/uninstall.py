"""``mambaserve-operator release-finalizers``: what the chart's pre-delete hook runs on ``helm uninstall``.

Kopf's finalizer on InferenceSessions and CacheTiers lets the operator clean up before an object
goes. Once the operator is uninstalled nothing removes it, and every later ``kubectl delete`` of
those objects hangs (Helm keeps the CRDs and the objects). So the hook, before Helm deletes the
operator: scales the operator to zero and waits until no operator pod runs (a running operator
would add the finalizer back on the next event), then removes the finalizer from every object it
can see. Children are not deleted: their owner references let the garbage collector remove them
when their owner goes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence

from mambaserve.operator.kube import ApiError, Kube, command_line_credentials
from mambaserve.operator.settings import GROUP

FINALIZER = f"{GROUP}/finalizer"
log = logging.getLogger("mambaserve.operator.uninstall")


async def stop_operator(kube: Kube, namespace: str, deployment: str, timeout: float = 120.0,
                        interval: float = 1.0) -> bool:
    """Scale the operator's Deployment to zero and wait for its pods to be gone; False if it is absent."""
    if await kube.get("Deployment", namespace, deployment) is None:
        return False
    await kube.merge_patch("Deployment", namespace, deployment, {"spec": {"replicas": 0}})
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        live = await kube.get("Deployment", namespace, deployment)
        if live is None or int((live.get("status") or {}).get("replicas") or 0) == 0:
            return True
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"the operator Deployment {namespace}/{deployment} still has pods after {timeout:.0f}s")
        await asyncio.sleep(interval)


async def release_finalizers(kube: Kube, namespaces: Sequence[str] = ()) -> list[str]:
    """Remove the operator's finalizer from every InferenceSession and CacheTier (in ``namespaces``,
    or in all namespaces); returns ``Kind namespace/name`` of each object released."""
    released = []
    for kind in ("InferenceSession", "CacheTier"):
        items = [i for ns in namespaces for i in await kube.list(kind, ns)] if namespaces \
            else await kube.list(kind, None)
        for item in items:
            meta = item["metadata"]
            finalizers = list(meta.get("finalizers") or ())
            if FINALIZER not in finalizers:
                continue
            keep = [f for f in finalizers if f != FINALIZER]
            # The test op makes this a compare-and-swap: another writer's change is not overwritten.
            ops = [{"op": "test", "path": "/metadata/finalizers", "value": finalizers},
                   {"op": "replace", "path": "/metadata/finalizers", "value": keep}]
            try:
                await kube.json_patch(kind, meta["namespace"], meta["name"], ops)
            except ApiError as e:
                if e.status == 404:
                    continue  # gone meanwhile
                raise
            released.append(f"{kind} {meta['namespace']}/{meta['name']}")
    return released


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="mambaserve-operator release-finalizers",
                                     description="Stop the operator and remove its finalizers (helm uninstall hook).")
    parser.add_argument("--operator-deployment", required=True, help="the operator's Deployment name")
    parser.add_argument("--operator-namespace", required=True, help="the operator's namespace")
    parser.add_argument("--namespace", action="append", dest="namespaces", default=[],
                        help="release objects in this namespace only (repeatable); default: all namespaces")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the operator to stop")
    parser.add_argument("--api-server", help="API server URL without credentials (development only)")
    args = parser.parse_args(list(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def run() -> None:
        kube = Kube(command_line_credentials(args.api_server, log))
        try:
            stopped = await stop_operator(kube, args.operator_namespace, args.operator_deployment, args.timeout)
            log.info("operator %s", "stopped" if stopped else "not found (already deleted)")
            for name in await release_finalizers(kube, args.namespaces):
                log.info("released %s", name)
        finally:
            await kube.close()

    asyncio.run(run())
    return 0
