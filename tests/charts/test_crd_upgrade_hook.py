"""The CRD upgrade path: on helm upgrade a pre-upgrade hook runs `mambaserve-operator apply-crds` from the new
operator image, under an account that may patch only the two mambaserve CRDs. Here the rendered command runs
under the rendered hook RBAC against the emulated API server, whose CRDs are the previous release's."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

from tests.charts.conftest import NAMESPACE, render
from tests.charts.live_stack import Emulator
from tests.charts.rbac import Access, Authorizer
from tests.operator.conftest import load_crd
from tests.operator.kube_versions import SUPPORTED
from tests.operator.pod_security import restricted_violations, writable_root_filesystems

BIN = Path(sys.executable).parent


def test_the_upgrade_hook_applies_the_new_crds_and_nothing_else() -> None:
    import kubernetes_validate

    out = render()
    hooks = out.hooks_of("pre-upgrade")
    assert sorted(h["kind"] for h in hooks) == ["ClusterRole", "ClusterRoleBinding", "Job", "ServiceAccount"]
    for obj in hooks:
        for version in SUPPORTED:
            kubernetes_validate.validate(obj, version, strict=True)
    job = next(h for h in hooks if h["kind"] == "Job")
    assert restricted_violations(job) == [] and writable_root_filesystems(job) == []
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == out.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    account = job["spec"]["template"]["spec"]["serviceAccountName"]
    rbac = Authorizer(hooks, account, NAMESPACE)
    assert not rbac.allows(Access("patch", "apiextensions.k8s.io", "customresourcedefinitions", None,
                                  "certificates.cert-manager.io"))
    assert render({"crds": {"upgradeHook": {"enabled": False}}}).hooks_of("pre-upgrade") == []

    em = Emulator()
    try:
        em.enforce(rbac)
        # The cluster has the previous release's CRDs: one without a field this release added.
        old = {name: load_crd(name) for name in ("inferencesessions", "cachetiers")}
        older = copy.deepcopy(old["inferencesessions"])
        spec = older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        del spec["rollout"]
        for crd in (older, old["cachetiers"]):
            em.call(em.cluster.create_cluster_scoped(crd))
        result = subprocess.run([str(BIN / container["command"][0]), *container["command"][1:],
                                 f"--api-server={em.url}"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
        assert em.denied == []
        upgraded = em.get("CustomResourceDefinition", "inferencesessions.mambaserve.io", None)
    finally:
        em.close()
    assert upgraded["spec"] == old["inferencesessions"]["spec"]
    assert {e["manager"] for e in upgraded["metadata"]["managedFields"] if e["operation"] == "Apply"} == \
        {"mambaserve-crds"}
    assert "applied CustomResourceDefinition inferencesessions.mambaserve.io" in result.stderr
