"""Fixtures of the chart tests: the real Helm engine (helm-python-sdk binds Helm's Go SDK) and one
live stack (server + operator + Prometheus) shared by the monitoring tests."""

from __future__ import annotations

import copy
import os
import pathlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.charts.live_stack import LiveStack, free_port
from tests.charts.rbac import Authorizer

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "mambaserve"
DATA = pathlib.Path(__file__).resolve().parent / "data"
RELEASE = "mambaserve"
NAMESPACE = "mambaserve-system"

# Monitoring on: everything the chart can render.
MONITORING_ON: dict[str, Any] = {
    "monitoring": {"operatorServiceMonitor": {"enabled": True}, "serverPodMonitor": {"enabled": True},
                   "prometheusRule": {"enabled": True}},
    "prometheusAdapter": {"rules": {"enabled": True}},
}


def helm() -> Any:
    return pytest.importorskip("helm_python", reason="helm-python-sdk is in requirements.txt")


class Rendered:
    """A rendered release: its objects by (kind, name, namespace) and the NOTES text."""

    def __init__(self, manifests: dict[str, str]) -> None:
        self.manifests = manifests
        self.notes = next((v for k, v in manifests.items() if k.endswith("NOTES.txt")), "")
        self.objects: list[dict[str, Any]] = []
        # Hooks (helm.sh/hook) run at their event and are not part of the release's resources, as
        # Helm treats them: kept apart so that the operator's objects are counted as installed.
        self.hooks: list[dict[str, Any]] = []
        for path, text in manifests.items():
            if path.endswith(".txt"):
                continue
            for doc in yaml.safe_load_all(text):
                if doc:
                    doc.setdefault("metadata", {})
                    hook = "helm.sh/hook" in (doc["metadata"].get("annotations") or {})
                    (self.hooks if hook else self.objects).append(doc)

    def hooks_of(self, event: str) -> list[dict[str, Any]]:
        """The hooks Helm runs at ``event`` (pre-delete, pre-upgrade)."""
        return [h for h in self.hooks if h["metadata"]["annotations"]["helm.sh/hook"] == event]

    def kinds(self) -> list[str]:
        return sorted(o["kind"] for o in self.objects)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str) -> dict[str, Any]:
        found = self.of(kind)
        assert len(found) == 1, f"expected one {kind}, found {len(found)}"
        return found[0]


def render(values: dict[str, Any] | None = None, *, name: str = RELEASE, namespace: str = NAMESPACE) -> Rendered:
    chart = helm().Chart.load(str(CHART))
    # Helm validates values against values.schema.json on install/upgrade; do the same here.
    chart.validate_schema(copy.deepcopy(values or {}))
    return Rendered(chart.render(copy.deepcopy(values or {}), name=name, namespace=namespace, is_install=True))


@pytest.fixture(scope="session")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: `make tools` installs Debian's prometheus package")
    return path


def operator_job() -> str:
    """The `job` label prometheus-operator gives the operator's ServiceMonitor targets: the Service name."""
    return render(MONITORING_ON).one("Service")["metadata"]["name"]


def live_values() -> dict[str, Any]:
    """The chart values the live stack's operator runs with: ServiceMonitors on (so that path runs
    too), free loopback ports, and a fast status refresh for a short test."""
    return {"operator": {"clusterWide": True, "serviceMonitors": True, "metricsPort": free_port(),
                         "healthPort": free_port(), "statusInterval": 1, "metricsTimeout": 0.5},
            "networkPolicy": {"enabled": True, "metricsNamespaces": ["monitoring"]},
            "monitoring": {"operatorServiceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}}


def authorizer(rendered: Rendered) -> Authorizer:
    account = rendered.one("ServiceAccount")["metadata"]
    return Authorizer(rendered.objects, account["name"], account["namespace"])


@pytest.fixture(scope="session")
def live() -> Iterator[LiveStack]:
    # MAMBASERVE_LIVE_LOAD_SECONDS lengthens the load (e.g. for scripts/plot_dashboards.py).
    seconds = float(os.environ.get("MAMBASERVE_LIVE_LOAD_SECONDS", "25"))
    rendered = render(live_values())
    rules = rendered.one("PrometheusRule")["spec"]["groups"]
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="mambaserve-live-"))
    stack = LiveStack(workdir, rendered.one("Deployment"), operator_job(), rules, authorizer(rendered), seconds)
    try:
        yield stack
        plot_dir = os.environ.get("MAMBASERVE_PLOT_DASHBOARDS")
        if plot_dir:  # opt-in: draw the dashboards from this Prometheus before it stops
            subprocess.run([str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "scripts" / "plot_dashboards.py"),
                            "--prometheus", stack.prometheus.url, "--start", str(stack.load_started - 5),
                            "--end", str(stack.traffic_ended), "--out", plot_dir], check=True)
    finally:
        stack.close()
        shutil.rmtree(workdir, ignore_errors=True)
