"""The restricted-profile checker itself: a compliant pod passes, each control's violation is caught."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from tests.operator.pod_security import restricted_violations


def compliant() -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{"name": "c", "image": "i", "securityContext": {
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}}],
        "volumes": [{"name": "v", "emptyDir": {}}, {"name": "s", "secret": {"secretName": "x"}}],
    }}


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["spec"]["containers"][0]


MUTATIONS: list[tuple[str, Callable[[dict[str, Any]], Any], str]] = [
    ("host network", lambda p: p["spec"].update(hostNetwork=True), "Host Namespaces"),
    ("host pid", lambda p: p["spec"].update(hostPID=True), "Host Namespaces"),
    ("privileged", lambda p: _container(p)["securityContext"].update(privileged=True), "Privileged"),
    ("host port", lambda p: _container(p).update(ports=[{"containerPort": 80, "hostPort": 80}]), "Host Ports"),
    ("host path", lambda p: p["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "HostPath"),
    ("nfs volume", lambda p: p["spec"]["volumes"].append({"name": "n", "nfs": {"server": "s", "path": "/"}}),
     "Volume Types"),
    ("escalation unset", lambda p: _container(p)["securityContext"].pop("allowPrivilegeEscalation"),
     "Privilege Escalation"),
    ("root allowed", lambda p: p["spec"]["securityContext"].pop("runAsNonRoot"), "Running as Non-root"),
    ("container as root", lambda p: _container(p)["securityContext"].update(runAsNonRoot=False), "Non-root"),
    ("uid 0", lambda p: p["spec"]["securityContext"].update(runAsUser=0), "Non-root user"),
    ("no seccomp", lambda p: p["spec"]["securityContext"].pop("seccompProfile"), "Seccomp"),
    ("unconfined", lambda p: _container(p)["securityContext"].update(seccompProfile={"type": "Unconfined"}),
     "Seccomp"),
    ("caps kept", lambda p: _container(p)["securityContext"]["capabilities"].update(drop=[]), "drop ALL"),
    ("cap added", lambda p: _container(p)["securityContext"]["capabilities"].update(add=["NET_ADMIN"]),
     "Capabilities"),
    ("unsafe sysctl", lambda p: p["spec"]["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
     "Sysctls"),
    ("selinux user", lambda p: p["spec"]["securityContext"].update(seLinuxOptions={"user": "root"}), "SELinux"),
    ("proc mount", lambda p: _container(p)["securityContext"].update(procMount="Unmasked"), "/proc"),
    ("apparmor off", lambda p: p["metadata"].update(annotations={
        "container.apparmor.security.beta.kubernetes.io/c": "unconfined"}), "AppArmor"),
    ("init container", lambda p: p["spec"].update(initContainers=[{"name": "i", "image": "i"}]),
     "initContainers[i]"),
]


def test_a_compliant_pod_passes() -> None:
    assert restricted_violations(compliant()) == []
    # Container-level settings can stand in for the pod's.
    pod = compliant()
    del pod["spec"]["securityContext"]
    _container(pod)["securityContext"].update(runAsNonRoot=True, seccompProfile={"type": "Localhost",
                                                                                 "localhostProfile": "p.json"})
    assert restricted_violations(pod) == []


@pytest.mark.parametrize("name,mutate,control", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_each_control_is_enforced(name: str, mutate: Callable[[dict[str, Any]], Any], control: str) -> None:
    pod = copy.deepcopy(compliant())
    mutate(pod)
    found = restricted_violations(pod)
    assert any(control in v for v in found), found


def test_workloads_are_checked_through_their_template() -> None:
    pod = compliant()
    pod["spec"]["hostIPC"] = True
    deployment = {"kind": "Deployment", "metadata": {"name": "d"},
                  "spec": {"template": {"metadata": {}, "spec": pod["spec"]}}}
    assert restricted_violations(deployment) == ["Deployment/d: Host Namespaces: hostIPC"]
    assert restricted_violations({"kind": "Service", "metadata": {"name": "s"}, "spec": {}}) == []
