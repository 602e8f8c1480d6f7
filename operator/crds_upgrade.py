"""``mambaserve-operator apply-crds``: what the chart's pre-upgrade hook runs on ``helm upgrade``.

Helm installs a chart's ``crds/`` on the first install only and never upgrades them, so a new chart's
schema (new fields, new defaults, new rules) would never reach the cluster and its operator would meet
objects the API server had pruned. The hook runs this command from the new chart's operator image, which
carries the new CRDs in the package (``mambaserve/operator/crds/``, the same files as the chart's): each is
server-side applied with its own field manager, before Helm upgrades the operator.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
from collections.abc import Sequence

import yaml

from mambaserve.operator.kube import Kube, command_line_credentials
from mambaserve.operator.render import SOURCE_CRDS

FIELD_MANAGER = "mambaserve-crds"
log = logging.getLogger("mambaserve.operator.crds_upgrade")


def crds(directory: pathlib.Path) -> list[dict]:
    found = [yaml.safe_load(p.read_text()) for p in sorted(directory.glob("*.yaml"))]
    return [c for c in found if isinstance(c, dict) and c.get("kind") == "CustomResourceDefinition"]


async def apply_crds(kube: Kube, directory: pathlib.Path) -> list[str]:
    applied = []
    for crd in crds(directory):
        await kube.server_side_apply(crd, manager=FIELD_MANAGER)
        applied.append(crd["metadata"]["name"])
    return applied


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="mambaserve-operator apply-crds",
                                     description="Server-side apply the CRDs this package carries (helm upgrade hook).")
    parser.add_argument("--crds", type=pathlib.Path, default=SOURCE_CRDS, metavar="DIR",
                        help="folder with the CRDs (default: those the package ships)")
    parser.add_argument("--api-server", help="API server URL without credentials (development only)")
    args = parser.parse_args(list(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not crds(args.crds):
        parser.error(f"no CustomResourceDefinition in {args.crds}")

    async def run() -> None:
        kube = Kube(command_line_credentials(args.api_server, log), agent=FIELD_MANAGER)
        try:
            for name in await apply_crds(kube, args.crds):
                log.info("applied CustomResourceDefinition %s", name)
        finally:
            await kube.close()

    asyncio.run(run())
    return 0
