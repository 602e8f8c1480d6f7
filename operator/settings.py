"""Operator configuration: built once at the edge (flags, then environment) and passed down.

Nothing else in the operator reads the environment. Every flag has an environment variable of the
same name (``--server-image`` <-> ``MAMBASERVE_OPERATOR_SERVER_IMAGE``) so the Helm chart can set
either.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import kopf

GROUP = "mambaserve.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
FIELD_MANAGER = "mambaserve-operator"
# The server's single HTTP port (docs/server-interface.md): API, /health and /metrics.
SERVER_PORT = 30000
ROUTER_PORT = 30000
ROUTER_METRICS_PORT = 29000


@dataclasses.dataclass(frozen=True)
class OperatorSettings:
    namespaces: tuple[str, ...] = ()  # empty: all namespaces
    server_image: str = "mambaserve-server:0.1.0"  # images/server.Dockerfile, this release
    # The SGLang Model Gateway, pinned: a moving tag would change the router under running sessions.
    router_image: str = "lmsysorg/sgl-model-gateway:v0.3.2"
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"
    service_monitors: bool = False  # only when prometheus-operator's CRDs are installed
    # A NetworkPolicy per session: server pods reachable on their port only from their own namespace, the
    # operator's and the metrics namespaces (Prometheus).
    network_policies: bool = False
    metrics_namespaces: tuple[str, ...] = ("monitoring",)
    operator_namespace: str | None = None  # this pod's namespace (POD_NAMESPACE)
    server_pod_monitor: str | None = None  # NAMESPACE/NAME of a PodMonitor scraping every server pod (the chart's)
    # Kopf's finalizer on InferenceSessions and CacheTiers: deletion waits for the operator's cleanup
    # (children deleted at once, a CacheTier held while sessions use it). Off: deletions never wait
    # for the operator; owner references let the garbage collector remove the children, and a
    # CacheTier in use can be deleted (its sessions then report CacheTierBound=False, NotFound).
    finalizers: bool = True
    # Labels of the ServiceMonitors the operator creates. A kube-prometheus-stack Prometheus selects
    # monitors labelled `release: <its Helm release name>`; "kube-prometheus-stack" is the usual one.
    monitor_labels: tuple[tuple[str, str], ...] = (("release", "kube-prometheus-stack"),)
    status_interval: float = 15.0
    metrics_timeout: float = 2.0
    tier_retry_delay: float = 15.0
    metrics_port: int = 8080  # 0 disables the operator's own /metrics
    health_port: int = 8081  # 0 disables the liveness endpoint
    # Kopf watches can stall silently on half-open connections; bounded timeouts force a re-list.
    watch_server_timeout: float = 300.0
    watch_client_timeout: float = 330.0
    watch_connect_timeout: float = 30.0
    request_timeout: float = 60.0
    api_server: str | None = None  # development/tests: talk to this URL without credentials
    log_level: str = "info"
    # Leader election (leader.py): replicas share a Lease; only its holder reconciles.
    leader_election: bool = False
    leader_election_namespace: str | None = None  # default: this pod's namespace (POD_NAMESPACE)
    leader_election_name: str = "mambaserve-operator"
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0
    identity: str = ""  # this replica in the Lease: the pod name (POD_NAME), else host and pid

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces


_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("server-image", str, "default server image of InferenceSessions"),
    ("router-image", str, "default SGLang Model Gateway image"),
    ("prometheus-url", str, "Prometheus that KEDA triggers query, and that autoscaled sessions' series are "
                            "looked for in"),
    ("server-pod-monitor", str, "NAMESPACE/NAME of a PodMonitor that scrapes every server pod (autoscaling "
                                "counts on it)"),
    ("status-interval", float, "seconds between status refreshes"),
    ("metrics-timeout", float, "seconds to wait for a pod's /metrics"),
    ("tier-retry-delay", float, "seconds between retries of a blocked CacheTier deletion"),
    ("metrics-port", int, "port of the operator's /metrics (0: off)"),
    ("health-port", int, "port of the operator's /healthz (0: off)"),
    ("watch-server-timeout", float, "server-side watch timeout"),
    ("watch-client-timeout", float, "client-side watch timeout"),
    ("watch-connect-timeout", float, "watch connection timeout"),
    ("request-timeout", float, "API request timeout"),
    ("api-server", str, "API server URL without credentials (development only)"),
    ("leader-election-namespace", str, "namespace of the leader-election Lease (default: POD_NAMESPACE)"),
    ("leader-election-name", str, "name of the leader-election Lease"),
    ("lease-duration", float, "seconds a standby waits for a silent leader before taking the Lease"),
    ("renew-deadline", float, "seconds a leader keeps trying to renew before it stops reconciling"),
    ("retry-period", float, "seconds between Lease renewals and between a standby's looks"),
    ("log-level", str, "debug, info, warning or error"),
)


def _env_name(flag: str) -> str:
    return "MAMBASERVE_OPERATOR_" + flag.upper().replace("-", "_")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The operator's flags (also accepted by ``render``, so it renders what a configured operator would)."""
    parser.add_argument("--namespace", action="append", dest="namespaces", default=None,
                        help="watch only this namespace (repeatable); default: all namespaces")
    parser.add_argument("--service-monitors", action=argparse.BooleanOptionalAction, default=None,
                        help="create ServiceMonitors (needs prometheus-operator CRDs)")
    parser.add_argument("--finalizers", action=argparse.BooleanOptionalAction, default=None,
                        help="hold deletions of InferenceSessions and CacheTiers for the operator's cleanup "
                             "(default: on; the chart's uninstall hook removes them)")
    parser.add_argument("--network-policies", action=argparse.BooleanOptionalAction, default=None,
                        help="a NetworkPolicy per session: server pods reachable only from their namespace, the "
                             "operator's and --metrics-namespaces (default: off)")
    parser.add_argument("--metrics-namespaces", default=None, metavar="NS[,NS...]",
                        help="namespaces whose pods may scrape the server pods under --network-policies "
                             "(default: monitoring)")
    parser.add_argument("--leader-election", action=argparse.BooleanOptionalAction, default=None,
                        help="run as one of several replicas: only the holder of a Lease reconciles (default: off)")
    parser.add_argument("--monitor-labels", default=None, metavar="K=V[,K=V...]",
                        help="labels of the ServiceMonitors, for the Prometheus that selects them "
                             "(default: release=kube-prometheus-stack; empty: none)")
    for flag, kind, help_text in _FLAGS:
        parser.add_argument(f"--{flag}", type=kind, default=None, help=help_text)


def parse_settings(argv: Sequence[str] = (), environ: Mapping[str, str] | None = None) -> OperatorSettings:
    parser = argparse.ArgumentParser(prog="mambaserve-operator", description="Run the mambaserve operator.")
    add_arguments(parser)
    return settings_from(parser.parse_args(list(argv)), parser, environ)


def settings_from(args: argparse.Namespace, parser: argparse.ArgumentParser,
                  environ: Mapping[str, str] | None = None) -> OperatorSettings:
    """Settings from parsed flags, then the environment, then the defaults; bad values end in parser.error."""
    env = os.environ if environ is None else environ
    defaults = OperatorSettings()
    values: dict[str, Any] = {}
    for flag, kind, _ in _FLAGS:
        field = flag.replace("-", "_")
        value = getattr(args, field)
        if value is None and _env_name(flag) in env:
            value = kind(env[_env_name(flag)])
        if value is not None:
            values[field] = value

    namespaces = args.namespaces
    if namespaces is None and env.get(_env_name("namespaces")):
        namespaces = [ns.strip() for ns in env[_env_name("namespaces")].split(",") if ns.strip()]
    if namespaces:
        values["namespaces"] = tuple(namespaces)

    # On/off flags (--x / --no-x), else MAMBASERVE_OPERATOR_X=1|true|yes|on.
    for flag in ("service-monitors", "finalizers", "leader-election", "network-policies"):
        field = flag.replace("-", "_")
        value = getattr(args, field)
        if value is None and _env_name(flag) in env:
            value = env[_env_name(flag)].lower() in ("1", "true", "yes", "on")
        if value is not None:
            values[field] = value
    scrapers = args.metrics_namespaces if args.metrics_namespaces is not None else env.get(_env_name("metrics-namespaces"))
    if scrapers is not None:
        values["metrics_namespaces"] = tuple(ns.strip() for ns in scrapers.split(",") if ns.strip())
    values["operator_namespace"] = env.get("POD_NAMESPACE") or None
    values.setdefault("leader_election_namespace", env.get("POD_NAMESPACE") or None)
    values["identity"] = env.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"

    labels = args.monitor_labels
    if labels is None:
        labels = env.get(_env_name("monitor-labels"))
    if labels is not None:
        try:
            values["monitor_labels"] = parse_labels(labels)
        except ValueError as e:
            parser.error(f"--monitor-labels: {e}")

    settings = dataclasses.replace(defaults, **values)
    if settings.server_pod_monitor is not None and not re.fullmatch(r"[a-z0-9][-a-z0-9.]*/[a-z0-9][-a-z0-9.]*",
                                                                    settings.server_pod_monitor):
        parser.error(f"--server-pod-monitor must be NAMESPACE/NAME, not {settings.server_pod_monitor!r}")
    if settings.leader_election and not settings.leader_election_namespace:
        parser.error("--leader-election needs --leader-election-namespace (or POD_NAMESPACE)")
    if not 0 < settings.retry_period < settings.renew_deadline < settings.lease_duration:
        parser.error("leader election needs 0 < --retry-period < --renew-deadline < --lease-duration")
    if settings.log_level not in ("debug", "info", "warning", "error"):
        parser.error(f"--log-level must be debug, info, warning or error, not {settings.log_level!r}")
    return settings


_LABEL_NAME = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                         r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def parse_labels(text: str) -> tuple[tuple[str, str], ...]:
    """``"k=v,k2=v2"`` as label pairs, each checked against Kubernetes' label syntax."""
    pairs = []
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not _LABEL_NAME.match(key) or len(key.rpartition("/")[0]) > 253 \
                or not _LABEL_VALUE.match(value):
            raise ValueError(f"{item!r} is not a label KEY=VALUE")
        pairs.append((key, value))
    return tuple(pairs)


def configure_kopf(kopf_settings: kopf.OperatorSettings, settings: OperatorSettings) -> None:
    """Production settings for Kopf itself."""
    kopf_settings.watching.server_timeout = settings.watch_server_timeout
    kopf_settings.watching.client_timeout = settings.watch_client_timeout
    kopf_settings.watching.connect_timeout = settings.watch_connect_timeout
    kopf_settings.networking.request_timeout = settings.request_timeout
    # All of Kopf's bookkeeping lives in annotations under our group: the CRD schemas are
    # structural, so anything Kopf wrote into status would be pruned by the API server.
    kopf_settings.persistence.finalizer = f"{GROUP}/finalizer"
    kopf_settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    kopf_settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    kopf_settings.posting.level = logging.INFO
    # Kopf's own API calls retry transient failures with growing delays rather than a hot loop.
    kopf_settings.networking.error_backoffs = [1, 2, 5, 10, 20]
