"""The Pod Security Standards' ``restricted`` profile (which includes ``baseline``) as a checker.

Written from the control tables of the Kubernetes documentation ("Pod Security Standards",
kubernetes.io/docs/concepts/security/pod-security-standards/), policy version ``latest``: what the
Pod Security admission controller enforces on a namespace labelled
``pod-security.kubernetes.io/enforce: restricted``. Each violation names the control and the field.
Workloads are checked through their pod template, as the admission controller's warnings on
Deployments and StatefulSets do.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
RESTRICTED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                           "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
_APPARMOR_PREFIX = "container.apparmor.security.beta.kubernetes.io/"

_POD_KINDS = {"Pod"}
_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "ReplicationController"}


def pod_templates(obj: Mapping[str, Any]) -> Iterator[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """(metadata, spec) of every pod an object describes: a Pod, a workload's template, a CronJob's."""
    kind = obj.get("kind")
    if kind in _POD_KINDS:
        yield obj.get("metadata") or {}, obj["spec"]
    elif kind in _TEMPLATE_KINDS:
        template = obj["spec"]["template"]
        yield template.get("metadata") or {}, template["spec"]
    elif kind == "CronJob":
        template = obj["spec"]["jobTemplate"]["spec"]["template"]
        yield template.get("metadata") or {}, template["spec"]


def _containers(spec: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for c in spec.get(field) or ():
            yield f"{field}[{c.get('name')}]", c


def _seccomp_ok(profile: Mapping[str, Any] | None) -> bool | None:
    """True/False for a set profile, None when unset."""
    if not profile:
        return None
    return profile.get("type") in ("RuntimeDefault", "Localhost")


def _apparmor_ok(profile: Mapping[str, Any] | None) -> bool:
    return not profile or profile.get("type") in ("RuntimeDefault", "Localhost")


def violations(metadata: Mapping[str, Any], spec: Mapping[str, Any]) -> list[str]:
    """Every way this pod breaks the restricted profile (empty: admitted)."""
    out: list[str] = []
    pod_sc = spec.get("securityContext") or {}
    containers = list(_containers(spec))

    # --- baseline ---
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("HostProcess: securityContext.windowsOptions.hostProcess")
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            out.append(f"Host Namespaces: {field}")
    for where, c in containers:
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"Privileged Containers: {where}.securityContext.privileged")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"HostProcess: {where}.securityContext.windowsOptions.hostProcess")
        added = set((sc.get("capabilities") or {}).get("add") or ())
        if added - BASELINE_CAPABILITIES:
            out.append(f"Capabilities: {where} adds {sorted(added - BASELINE_CAPABILITIES)}")
        for port in c.get("ports") or ():
            if port.get("hostPort"):
                out.append(f"Host Ports: {where} hostPort {port['hostPort']}")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"/proc Mount Type: {where}.securityContext.procMount")
        if not _apparmor_ok(sc.get("appArmorProfile")):
            out.append(f"AppArmor: {where}.securityContext.appArmorProfile")
        se = sc.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"SELinux: {where}.securityContext.seLinuxOptions")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"Seccomp: {where}.securityContext.seccompProfile Unconfined")
    for volume in spec.get("volumes") or ():
        if "hostPath" in volume:
            out.append(f"HostPath Volumes: volume {volume.get('name')}")
    if not _apparmor_ok(pod_sc.get("appArmorProfile")):
        out.append("AppArmor: securityContext.appArmorProfile")
    for key, value in (metadata.get("annotations") or {}).items():
        if key.startswith(_APPARMOR_PREFIX) and value != "runtime/default" and not value.startswith("localhost/"):
            out.append(f"AppArmor: annotation {key}={value}")
    se = pod_sc.get("seLinuxOptions") or {}
    if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
        out.append("SELinux: securityContext.seLinuxOptions")
    if (pod_sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        out.append("Seccomp: securityContext.seccompProfile Unconfined")
    for sysctl in pod_sc.get("sysctls") or ():
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"Sysctls: {sysctl.get('name')}")

    # --- restricted ---
    for volume in spec.get("volumes") or ():
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            out.append(f"Volume Types: volume {volume.get('name')} is {sorted(kinds - RESTRICTED_VOLUME_TYPES)}")
    pod_non_root = pod_sc.get("runAsNonRoot") is True
    pod_seccomp = _seccomp_ok(pod_sc.get("seccompProfile"))
    if pod_sc.get("runAsUser") == 0:
        out.append("Running as Non-root user: securityContext.runAsUser 0")
    for where, c in containers:
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"Privilege Escalation: {where}.securityContext.allowPrivilegeEscalation is not false")
        non_root = sc.get("runAsNonRoot")
        if non_root is False or (non_root is None and not pod_non_root):
            out.append(f"Running as Non-root: {where} does not set runAsNonRoot (nor does the pod)")
        if sc.get("runAsUser") == 0:
            out.append(f"Running as Non-root user: {where}.securityContext.runAsUser 0")
        seccomp = _seccomp_ok(sc.get("seccompProfile"))
        if seccomp is False or (seccomp is None and not pod_seccomp):
            out.append(f"Seccomp: {where} has no RuntimeDefault/Localhost profile (nor does the pod)")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or ()):
            out.append(f"Capabilities: {where} does not drop ALL")
        if set(caps.get("add") or ()) - {"NET_BIND_SERVICE"}:
            out.append(f"Capabilities: {where} adds more than NET_BIND_SERVICE")
    if pod_seccomp is False:
        out.append("Seccomp: securityContext.seccompProfile is neither RuntimeDefault nor Localhost")
    return out


def restricted_violations(obj: Mapping[str, Any]) -> list[str]:
    """Violations of every pod an object describes, prefixed with the object; [] for pod-less kinds."""
    name = f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
    return [f"{name}: {v}" for meta, spec in pod_templates(obj) for v in violations(meta, spec)]


def writable_root_filesystems(obj: Mapping[str, Any]) -> list[str]:
    """Containers whose root filesystem is writable (not a PSS control; this project's hardening)."""
    return [f"{obj['kind']}/{obj['metadata']['name']}: {where}" for _, spec in pod_templates(obj)
            for where, c in _containers(spec)
            if (c.get("securityContext") or {}).get("readOnlyRootFilesystem") is not True]
