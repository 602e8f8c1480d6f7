"""The chart's pre-delete hook: valid, restricted, and its RBAC is exactly enough for what it runs.
The hook Job's command (the real CLI) runs against the API emulator under the hook's rendered RBAC
(403 for anything else) and frees objects that carry the operator's finalizer."""

from __future__ import annotations

import subprocess
import threading
import time
from typing import Any

import pytest

from mambaserve.operator.uninstall import FINALIZER
from tests.charts.conftest import NAMESPACE, Rendered, render
from tests.charts.live_stack import BIN, Emulator
from tests.charts.rbac import Authorizer
from tests.operator.kube_versions import SUPPORTED
from tests.operator.pod_security import restricted_violations, writable_root_filesystems

HOOK_KINDS = {"clusterwide": ["ClusterRole", "ClusterRoleBinding", "Job", "Role", "RoleBinding", "ServiceAccount"],
              "namespaced": ["Job", "Role", "Role", "Role", "RoleBinding", "RoleBinding", "RoleBinding",
                             "ServiceAccount"]}
VALUES = {"clusterwide": {"operator": {"clusterWide": True}},
          "namespaced": {"operator": {"watchNamespaces": ["llm", "batch"]}}}


@pytest.fixture(scope="module")
def hooks() -> dict[str, Rendered]:
    return {name: render(values) for name, values in VALUES.items()}


@pytest.mark.parametrize("name", sorted(VALUES))
def test_hook_objects_are_valid_restricted_and_run_before_deletion(hooks: dict[str, Rendered], name: str) -> None:
    import kubernetes_validate

    out = hooks[name]
    assert sorted(o["kind"] for o in out.hooks_of("pre-delete")) == HOOK_KINDS[name]
    for obj in out.hooks_of("pre-delete"):
        annotations = obj["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-delete"
        assert "hook-succeeded" in annotations["helm.sh/hook-delete-policy"]
        # The account and its rights exist before the Job runs.
        assert int(annotations["helm.sh/hook-weight"]) < 0 or obj["kind"] == "Job"
        for version in SUPPORTED:
            kubernetes_validate.validate(obj, version, strict=True)
    job = next(o for o in out.hooks_of("pre-delete") if o["kind"] == "Job")
    assert restricted_violations(job) == [] and writable_root_filesystems(job) == []
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["mambaserve-operator", "release-finalizers"]
    assert container["image"] == out.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]


def test_hook_and_finalizers_follow_the_values() -> None:
    out = render({"operator": {"finalizers": False, "uninstallHook": {"enabled": False}}})
    assert out.hooks_of("pre-delete") == []
    assert "--no-finalizers" in out.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    long_release = "r" * 30 + "-" + "x" * 22
    for obj in render(name=long_release).hooks:  # every hook's, the CRD upgrade's too
        assert len(obj["metadata"]["name"]) <= 63


def _simulate_deployment_controller(em: Emulator, name: str, stop: threading.Event) -> None:
    """Scaled to zero, the operator's pod goes, and the Deployment's status says so."""
    while not stop.is_set():
        dep = em.get("Deployment", name, NAMESPACE) or {}
        if (dep.get("spec") or {}).get("replicas") == 0:
            em.call(em.cluster.patch("Deployment", name, {"status": {"replicas": 0}}, NAMESPACE, sub="status"))
            return
        time.sleep(0.1)


@pytest.mark.parametrize("name", sorted(VALUES))
def test_hook_command_under_the_hook_rbac_frees_every_object(hooks: dict[str, Rendered], name: str) -> None:
    from tests.operator.conftest import sample

    out = hooks[name]
    job = next(o for o in out.hooks_of("pre-delete") if o["kind"] == "Job")
    account = job["spec"]["template"]["spec"]["serviceAccountName"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    operator = out.one("Deployment")["metadata"]["name"]
    em = Emulator()
    stop = threading.Event()
    try:
        em.enforce(Authorizer(out.hooks_of("pre-delete"), account, NAMESPACE))
        objects: list[tuple[str, str, str]] = []
        for kind, body, ns in (("CacheTier", sample("cachetier-shared"), "llm"),
                               ("InferenceSession", sample("inferencesession-minimal"), "llm"),
                               ("InferenceSession", sample("inferencesession-minimal"), "other")):
            body["metadata"].update({"namespace": ns, "finalizers": [FINALIZER]})
            em.call(em.cluster.create(body))
            objects.append((kind, body["metadata"]["name"], ns))
        em.call(em.cluster.create({"apiVersion": "apps/v1", "kind": "Deployment",
                                   "metadata": {"name": operator, "namespace": NAMESPACE},
                                   "spec": {"replicas": 1}, "status": {"replicas": 1}}))
        controller = threading.Thread(target=_simulate_deployment_controller, args=(em, operator, stop))
        controller.start()
        result = subprocess.run([str(BIN / container["command"][0]), *container["command"][1:], *container["args"],
                                 f"--api-server={em.url}"], capture_output=True, text=True, timeout=60)
        stop.set()
        controller.join(5)
        assert result.returncode == 0, result.stdout + result.stderr
        assert em.denied == []
        left = {(kind, n, ns): (em.get(kind, n, ns) or {})["metadata"].get("finalizers") for kind, n, ns in objects}
    finally:
        stop.set()
        em.close()
    watched = {"llm", "other"} if name == "clusterwide" else {"llm"}
    for (kind, n, ns), fins in left.items():
        assert (FINALIZER in (fins or [])) == (ns not in watched), (kind, n, ns, fins)
    assert "released InferenceSession llm/tiny" in result.stderr
