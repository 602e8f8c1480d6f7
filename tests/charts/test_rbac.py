"""Least privilege, proven by running the real operator (with the args the chart renders) under the
rendered RBAC: the emulated API server answers 403 to anything the rules do not allow. The operator
must still do all its work, and every rule it is granted must be one it uses (or be listed below
with the reason it is granted anyway)."""

from __future__ import annotations

import pathlib
import time
from typing import Any

from tests.charts.conftest import NAMESPACE, authorizer, render
from tests.charts.live_stack import Emulator, LiveStack, Operator, free_port, wait_http
from tests.charts.rbac import Access, Authorizer, access_of

# Granted, but not exercised by the live scenario; each with the reason.
GRANTED_UNUSED = {
    ("", "pods", "get"): "escalation prevention: the router Role the operator creates grants it",
}


def operator_accesses(requests: list[dict[str, Any]]) -> list[Access]:
    out = []
    for r in requests:
        if r["agent"].startswith("kmock/"):
            continue  # the test's own writes (kubectl's role)
        access = access_of(r["method"], r["path"], r["params"])
        if access is not None:
            out.append(access)
    return out


def test_clusterwide_operator_works_under_the_rendered_rbac_and_uses_every_grant(live: LiveStack) -> None:
    assert live.scenario.error is None, (f"the operator did not finish its scenario: {live.scenario.error}; "
                                         f"denied: {sorted(set(live.emulator.denied))}\n"
                                         f"{live.operator.log.read_text()[-6000:]}")
    assert live.emulator.denied == []
    accesses = operator_accesses(live.emulator.requests())
    used = {(a.group, a.resource, a.verb) for a in accesses}
    rendered = render({"operator": {"clusterWide": True}})
    granted = authorizer(rendered).granted()
    assert used <= granted
    assert granted - used == set(GRANTED_UNUSED), "a grant nobody uses, or a stale entry in GRANTED_UNUSED"
    assert all(grant in granted for grant in GRANTED_UNUSED)
    # The CRD watch that lets Kopf see CRDs upgraded with kubectl is one of the used grants.
    assert ("apiextensions.k8s.io", "customresourcedefinitions", "watch") in used


def test_namespaced_operator_stays_in_its_namespaces(tmp_path: pathlib.Path) -> None:
    values = {"operator": {"watchNamespaces": ["llm"], "metricsPort": free_port(), "healthPort": free_port(),
                           "statusInterval": 1}}
    rendered = render(values)
    auth = authorizer(rendered)
    emulator = Emulator()
    operator = None
    try:
        emulator.enforce(auth)
        operator = Operator(rendered.one("Deployment"), emulator.url, tmp_path / "operator.log")
        wait_http(f"http://127.0.0.1:{values['operator']['healthPort']}/healthz", 60, operator.proc)
        from tests.operator.conftest import sample
        chat = sample("inferencesession-autoscaled")
        chat["spec"]["model"].pop("tokenSecretRef", None)
        elsewhere = sample("inferencesession-minimal")
        elsewhere["metadata"]["namespace"] = "other"
        for obj in (sample("cachetier-shared"), chat, elsewhere):
            emulator.call(emulator.cluster.create(obj))
        try:
            emulator.eventually(lambda: emulator.get("Deployment", "chat") and emulator.get("Deployment", "chat-router")
                                and (emulator.get("InferenceSession", "chat") or {}).get("status", {}).get("phase"),
                                "reconcile chat in its watched namespace")
        except TimeoutError as e:
            raise AssertionError(f"{e}; denied: {sorted(set(emulator.denied))}\n"
                                 f"{(tmp_path / 'operator.log').read_text()[-4000:]}") from None
        time.sleep(1.5)  # a status tick or two: the session in "other" would be handled by now
        accesses = operator_accesses(emulator.requests())
        ignored = emulator.get("Deployment", "tiny", "other")
    finally:
        if operator is not None:
            operator.stop()
        emulator.close()
    log = (tmp_path / "operator.log").read_text()
    # No handler failed (the emulator's 409s on repeated event names are its own limitation).
    assert "failed with an exception" not in log and "Forbidden" not in log, log[-3000:]
    assert emulator.denied == []
    assert ignored is None
    assert {a.namespace for a in accesses} <= {"llm", NAMESPACE, None}
    # In its own namespace the operator touches its leader-election Lease, nothing else.
    assert {(a.group, a.resource) for a in accesses if a.namespace == NAMESPACE} == {("coordination.k8s.io", "leases")}
    cluster_scoped = {str(a) for a in accesses if a.namespace is None}
    assert cluster_scoped <= {"list apiextensions.k8s.io/customresourcedefinitions (cluster)",
                              "watch apiextensions.k8s.io/customresourcedefinitions (cluster)",
                              "list core/namespaces (cluster)", "watch core/namespaces (cluster)"}
    # The only cluster-scoped grants in this mode are reads of CRDs and namespaces.
    cluster_grants = Authorizer([o for o in rendered.objects if o["kind"].startswith("Cluster")],
                                rendered.one("ServiceAccount")["metadata"]["name"], NAMESPACE).granted()
    assert cluster_grants == {("apiextensions.k8s.io", "customresourcedefinitions", "list"),
                              ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
                              ("", "namespaces", "list"), ("", "namespaces", "watch")}
    assert {"list core/namespaces (cluster)", "watch core/namespaces (cluster)"} <= cluster_scoped


def test_authorizer_refuses_what_the_rules_do_not_name() -> None:
    """The enforcement above is only as good as this check, so check that it can say no."""
    rendered = render({"operator": {"watchNamespaces": ["llm"]}})
    auth = authorizer(rendered)
    allowed = access_of("PATCH", "/apis/apps/v1/namespaces/llm/deployments/chat", {})
    assert auth.allows(allowed)
    for method, path, params in [
        ("PATCH", "/apis/apps/v1/namespaces/other/deployments/chat", {}),  # not a watched namespace
        ("GET", "/api/v1/namespaces/llm/secrets/hf-token", {}),  # secrets are never granted
        ("PUT", "/apis/apps/v1/namespaces/llm/deployments/chat", {}),  # update is not used
        ("GET", "/api/v1/pods", {"watch": "true"}),  # cluster-wide watch from a namespaced Role
        ("PATCH", "/apis/apps/v1/namespaces/llm/deployments/chat/scale", {}),  # subresource
        ("DELETE", "/api/v1/namespaces/llm/configmaps", {}),  # deletecollection
        ("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", {}),
    ]:
        assert not auth.allows(access_of(method, path, params)), (method, path)
    assert access_of("GET", "/apis/mambaserve.io/v1alpha1", {}) is None  # discovery


def test_owner_references_pass_owner_reference_permission_enforcement() -> None:
    """OpenShift refuses an owner reference with blockOwnerDeletion unless the writer may update the
    owner's finalizers. The operator's children carry such references (its owner references block
    foreground deletion until they are gone), so the chart grants exactly that update; without the
    grant the emulated plugin refuses the write (the live test above runs the operator under it)."""
    from mambaserve.operator import names
    from tests.charts.rbac import owner_reference_accesses

    child = {"metadata": {"ownerReferences": [names.owner_reference("InferenceSession", "chat", "u1")]}}
    [access] = owner_reference_accesses(child, "llm")
    assert str(access) == "update mambaserve.io/inferencesessions/finalizers in llm"
    claim = {"metadata": {"ownerReferences": [names.owner_reference("CacheTier", "shared", "u2")]}}
    patch = [{"op": "add", "path": "/metadata/ownerReferences", "value": claim["metadata"]["ownerReferences"]}]
    assert str(owner_reference_accesses(patch, "llm")[0]) == "update mambaserve.io/cachetiers/finalizers in llm"
    rendered = render({"operator": {"clusterWide": True}})
    assert authorizer(rendered).allows(access)
    without = [{**o, "rules": [r for r in o["rules"] if not any(x.endswith("/finalizers") for x in r["resources"])]}
               if o["kind"] == "ClusterRole" else o for o in rendered.objects]
    account = rendered.one("ServiceAccount")["metadata"]
    assert not Authorizer(without, account["name"], account["namespace"]).allows(access)
