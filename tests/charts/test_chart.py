"""The chart rendered by the real Helm engine: value sets, lint, official Kubernetes schemas, the
schema rejecting bad values, names, the operator Deployment, golden RBAC and args, CRD identity."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest
import yaml

from tests.charts.conftest import CHART, DATA, MONITORING_ON, NAMESPACE, ROOT, Rendered, authorizer, helm, render
from tests.charts.rbac import Access
from tests.operator.kube_versions import NEWEST, OLDEST, SUPPORTED
from tests.operator.pod_security import pod_templates, restricted_violations, writable_root_filesystems

# What the operator pod's environment holds (the downward API's POD_NAME and POD_NAMESPACE).
POD_ENV = {"POD_NAME": "mambaserve-operator-7c9d-x2x7k", "POD_NAMESPACE": NAMESPACE}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},  # namespaced: the release namespace only
    "clusterwide": {"operator": {"clusterWide": True}},
    "namespaced": {"operator": {"watchNamespaces": ["llm", "batch"]}},
    "clusterwide-monitoring-on": {**MONITORING_ON, "operator": {"clusterWide": True}},
    "namespaced-monitoring-on": {**MONITORING_ON, "operator": {"watchNamespaces": ["llm"]}},
    "operator-servicemonitors": {"operator": {"serviceMonitors": True},
                                 "monitoring": {"prometheusRule": {"enabled": True}}},
    "dashboards-off": {"dashboards": {"enabled": False}},
    "network-policies": {"networkPolicy": {"enabled": True, "metricsNamespaces": ["monitoring", "obs"]}},
    "autoscaling": {"autoscaling": {"enabled": True}, "operator": {"watchNamespaces": ["llm"]}},
    "bring-your-own-rbac": {"rbac": {"create": False},
                            "serviceAccount": {"create": False, "name": "platform-operator"}},
    "everything-customised": {
        "commonLabels": {"team": "ml-platform"},
        "server": {"image": {"repository": "registry.example/mambaserve-server", "tag": "0.1.1"}},
        "operator": {"image": {"repository": "registry.example/mambaserve-operator", "tag": "0.1.1"},
                     "imagePullSecrets": ["regcred"],
                     "routerImage": "lmsysorg/sglang:v0.5", "prometheusUrl": "http://prom.monitoring:9090",
                     "logLevel": "debug", "extraArgs": ["--request-timeout=30"],
                     "extraEnv": [{"name": "TZ", "value": "UTC"}], "priorityClassName": "system-cluster-critical",
                     "tolerations": [{"key": "infra", "operator": "Exists"}], "nodeSelector": {"pool": "infra"}},
        "monitoring": {"labels": {"release": "kube-prometheus-stack"},
                       "prometheusRule": {"enabled": True, "ttftHigh": {"thresholdSeconds": 0.5, "for": "5m"},
                                          "serverDown": {"enabled": False}}},
        "dashboards": {"namespace": "grafana", "annotations": {"grafana_folder": "mambaserve"}},
    },
}

KINDS = {
    # the cluster-scoped part is read-only (CRDs, namespaces); the Roles: the watched namespace's and the Lease's
    "default": ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "ConfigMap", "ConfigMap", "ConfigMap",
                "ConfigMap", "Deployment", "Role", "Role", "RoleBinding", "RoleBinding", "Service", "ServiceAccount"],
    "clusterwide": ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "ConfigMap", "ConfigMap", "ConfigMap",
                    "ConfigMap", "Deployment", "Role", "RoleBinding", "Service", "ServiceAccount"],
    "namespaced": ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "ConfigMap", "ConfigMap", "ConfigMap",
                   "ConfigMap", "Deployment", "Role", "Role", "Role", "RoleBinding", "RoleBinding", "RoleBinding",
                   "Service", "ServiceAccount"],
    "dashboards-off": ["ClusterRole", "ClusterRoleBinding", "Deployment", "Role", "Role", "RoleBinding",
                       "RoleBinding", "Service", "ServiceAccount"],
    "bring-your-own-rbac": ["ConfigMap"] * 5 + ["Deployment", "Service"],
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, Rendered]:
    return {name: render(values) for name, values in VALUE_SETS.items()}


@pytest.mark.parametrize("version", SUPPORTED)
def test_lint_passes_for_every_value_set(version: str) -> None:
    for name, values in VALUE_SETS.items():
        report = helm().lint(str(CHART), values, strict=True, namespace=NAMESPACE, kube_version=f"v{version}")
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        assert problems == [], f"{name}: {problems}"


def test_kube_version_claim_is_what_is_tested() -> None:
    import kubernetes_validate

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == f">={OLDEST}-0"
    # NEWEST is the newest schema the pinned kubernetes-validate ships: bumping it moves NEWEST.
    assert kubernetes_validate.latest_version() == NEWEST


@pytest.mark.parametrize("name", sorted(KINDS))
def test_value_sets_render_the_expected_objects(rendered: dict[str, Rendered], name: str) -> None:
    assert rendered[name].kinds() == sorted(KINDS[name])


def test_monitoring_objects_appear_only_when_enabled(rendered: dict[str, Rendered]) -> None:
    monitoring = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    assert monitoring.isdisjoint(rendered["default"].kinds())
    on = rendered["clusterwide-monitoring-on"]
    assert monitoring <= set(on.kinds())
    assert "rules.yaml" in next(c for c in on.of("ConfigMap") if c["metadata"]["name"].endswith("adapter-rules"))["data"]
    assert set(rendered["operator-servicemonitors"].kinds()) & monitoring == {"PrometheusRule"}


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_object_is_valid_against_the_official_schemas(rendered: dict[str, Rendered], name: str) -> None:
    import kubernetes_validate

    for obj in rendered[name].objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            _check_monitoring_object(obj)  # not a Kubernetes kind: no official schema
            continue
        for version in SUPPORTED:
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_pod_is_admitted_by_pod_security_restricted(rendered: dict[str, Rendered], name: str) -> None:
    pods = [o for o in rendered[name].objects if list(pod_templates(o))]
    assert pods
    for obj in pods:
        assert restricted_violations(obj) == [] and writable_root_filesystems(obj) == []


def _check_monitoring_object(obj: dict[str, Any]) -> None:
    spec = obj["spec"]
    if obj["kind"] == "PrometheusRule":
        for group in spec["groups"]:
            assert group["name"] and group["rules"]
            for rule in group["rules"]:
                assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}
                assert re.fullmatch(r"([0-9]+(ms|s|m|h|d|w|y))+", rule["for"])
    else:
        endpoints = spec.get("endpoints") or spec.get("podMetricsEndpoints")
        assert endpoints and all(e["port"] and e["path"] == "/metrics" for e in endpoints)
        assert spec["selector"]["matchLabels"]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_names_and_labels_are_valid(rendered: dict[str, Rendered], name: str) -> None:
    for obj in rendered[name].objects:
        meta = obj["metadata"]
        assert len(meta["name"]) <= 63 and DNS_LABEL.match(meta["name"]), meta["name"]
        labels = meta["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/part-of"] == "mambaserve"
        for value in labels.values():
            assert len(value) <= 63


def test_names_stay_within_63_characters_for_long_release_names() -> None:
    # Helm allows release names of up to 53 characters.
    long_release = "r" * 30 + "-" + "x" * 22
    for values in ({}, {"nameOverride": "n" * 40}, {"fullnameOverride": "f" * 63}, MONITORING_ON,
                   {"operator": {"watchNamespaces": ["llm"]}}):
        out = render({**values, **({"monitoring": MONITORING_ON["monitoring"]} if "monitoring" not in values else {})},
                     name=long_release)
        names = {o["kind"] + "/" + o["metadata"]["name"] for o in out.objects}
        for obj in out.objects:
            n = obj["metadata"]["name"]
            assert len(n) <= 63 and DNS_LABEL.match(n), n
        # Suffixes survive the cut, so objects stay distinct and recognisable.
        assert any(n.endswith("-operator") for n in names)
        assert len(names) == len(out.objects)


def test_operator_deployment_is_two_replicas_electing_a_leader_probed_and_locked_down(
        rendered: dict[str, Rendered]) -> None:
    for name in ("default", "namespaced", "everything-customised"):
        dep = rendered[name].one("Deployment")
        spec, pod = dep["spec"], dep["spec"]["template"]["spec"]
        # Two replicas, one Lease: a standby takes over (tests/operator/test_leader_election.py).
        assert spec["replicas"] == 2 and spec["strategy"]["type"] == "RollingUpdate"
        args = pod["containers"][0]["args"]
        assert "--leader-election" in args and f"--leader-election-name={dep['metadata']['name']}" in args
        env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in pod["containers"][0]["env"]}
        assert env["POD_NAME"] == "metadata.name" and env["POD_NAMESPACE"] == "metadata.namespace"
        assert pod["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
        lease = Access("patch", "coordination.k8s.io", "leases", NAMESPACE, dep["metadata"]["name"])
        assert name == "bring-your-own-rbac" or authorizer(rendered[name]).allows(lease)
        assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
        (container,) = pod["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
        assert f"--health-port={ports['health']}" in container["args"]
        assert f"--metrics-port={ports['metrics']}" in container["args"]
        sec, pod_sec = container["securityContext"], pod["securityContext"]
        assert sec["allowPrivilegeEscalation"] is False and sec["readOnlyRootFilesystem"] is True
        assert sec["capabilities"]["drop"] == ["ALL"] and sec["runAsNonRoot"] and pod_sec["runAsNonRoot"]
        assert pod_sec["seccompProfile"]["type"] == "RuntimeDefault"
        assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
        sa = rendered[name].one("ServiceAccount")["metadata"]["name"]
        assert pod["serviceAccountName"] == sa
    service = rendered["default"].one("Service")
    assert service["spec"]["selector"].items() <= rendered["default"].one("Deployment")["spec"]["template"][
        "metadata"]["labels"].items()


def test_bring_your_own_rbac_uses_the_named_account(rendered: dict[str, Rendered]) -> None:
    pod = rendered["bring-your-own-rbac"].one("Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "platform-operator"


def _golden(name: str) -> Any:
    return yaml.safe_load((DATA / "golden" / name).read_text())


def test_golden_operator_args(rendered: dict[str, Rendered]) -> None:
    got = {name: rendered[name].one("Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
           for name in ("default", "namespaced", "operator-servicemonitors", "everything-customised")}
    assert got == _golden("operator-args.yaml")


def test_golden_rbac(rendered: dict[str, Rendered]) -> None:
    def rbac(r: Rendered) -> list[dict[str, Any]]:
        out = []
        for o in r.objects:
            if o["kind"] in ("ClusterRole", "Role"):
                out.append({"kind": o["kind"], "name": o["metadata"]["name"],
                            "namespace": o["metadata"].get("namespace"), "rules": o["rules"]})
            elif o["kind"] in ("ClusterRoleBinding", "RoleBinding"):
                out.append({"kind": o["kind"], "name": o["metadata"]["name"],
                            "namespace": o["metadata"].get("namespace"), "roleRef": o["roleRef"],
                            "subjects": o["subjects"]})
        return sorted(out, key=lambda o: (o["kind"], o["namespace"] or "", o["name"]))

    assert {"clusterwide": rbac(rendered["clusterwide"]), "namespaced": rbac(rendered["namespaced"])} \
        == _golden("rbac.yaml")


def test_images_are_two_pinned_to_the_release_and_the_server_one_reaches_the_pods(
        rendered: dict[str, Rendered]) -> None:
    """The operator runs the operator image and gives server pods the server image (until 0.2.0
    it gave them its own image, which has no engine); both default to this release's tags."""
    import tomllib

    from mambaserve.operator import builders
    from mambaserve.operator.settings import OperatorSettings, parse_settings
    from mambaserve.operator.spec import parse_session
    from tests.operator.conftest import sample

    release = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"] == release
    assert values["operator"]["image"]["tag"] == values["server"]["image"]["tag"] == release
    assert OperatorSettings().server_image == f"{values['server']['image']['repository']}:{release}"

    container = rendered["default"].one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == f"mambaserve-operator:{release}"
    settings = parse_settings(container["args"], environ=POD_ENV)
    assert settings.server_image == f"mambaserve-server:{release}" != container["image"]
    children = builders.build_session_children(parse_session(sample("inferencesession-minimal")), None, settings)
    (server,) = [o for o in children if o["kind"] == "Deployment"]
    assert server["spec"]["template"]["spec"]["containers"][0]["image"] == f"mambaserve-server:{release}"


def test_images_pinned_by_digest_render_valid_references() -> None:
    """A digest (image.digest, or a repository that ends in one) reaches the pods as a valid reference; it
    used to render "repo@sha256:...:0.1.0", which no runtime pulls."""
    import kubernetes_validate

    from mambaserve.operator.settings import parse_settings

    digest = "sha256:" + "ab" * 32
    reference = re.compile(r"^[a-z0-9][-a-z0-9._/:]*(:[\w][\w.-]{0,127})?(@sha256:[a-f0-9]{64})?$")
    for values, server, operator in [
        ({"server": {"image": {"digest": digest}}, "operator": {"image": {"digest": digest}}},
         f"mambaserve-server:0.1.0@{digest}", f"mambaserve-operator:0.1.0@{digest}"),
        ({"server": {"image": {"repository": f"registry.example:5000/ml/mambaserve-server@{digest}"}},
          "operator": {"image": {"repository": f"registry.example:5000/ml/mambaserve-operator@{digest}"}}},
         f"registry.example:5000/ml/mambaserve-server@{digest}", f"registry.example:5000/ml/mambaserve-operator@{digest}"),
    ]:
        out = render(values)
        dep = out.one("Deployment")
        container = dep["spec"]["template"]["spec"]["containers"][0]
        assert container["image"] == operator and reference.match(container["image"])
        assert parse_settings(container["args"], environ=POD_ENV).server_image == server and reference.match(server)
        kubernetes_validate.validate(dep, NEWEST, strict=True)
    with pytest.raises(helm().errors.HelmValuesError):
        render({"server": {"image": {"digest": "sha256:short"}}})


def test_rendered_args_are_accepted_by_the_operator_cli(rendered: dict[str, Rendered]) -> None:
    from mambaserve.operator.settings import parse_settings

    args = rendered["namespaced"].one("Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    settings = parse_settings(args, environ=POD_ENV)
    assert settings.namespaces == ("llm", "batch") and not settings.clusterwide
    assert (settings.metrics_port, settings.health_port, settings.service_monitors) == (8080, 8081, False)
    assert settings.server_image == "mambaserve-server:0.1.0"
    custom = rendered["everything-customised"].one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    settings = parse_settings(custom["args"], environ=POD_ENV)
    assert custom["image"] == "registry.example/mambaserve-operator:0.1.1"
    assert settings.server_image == "registry.example/mambaserve-server:0.1.1"
    assert settings.namespaces == (NAMESPACE,) and settings.request_timeout == 30.0 and settings.log_level == "debug"
    assert settings.router_image == "lmsysorg/sglang:v0.5"
    assert settings.prometheus_url == "http://prom.monitoring:9090"


BAD_VALUES = [
    ({"operator": {"logLevel": "verbose"}}, "/operator/logLevel"),
    ({"operator": {"watchNamespaces": ["team-*"]}}, "/operator/watchNamespaces/0"),
    ({"operator": {"watchNamespaces": ["llm", "llm"]}}, "/operator/watchNamespaces"),
    ({"operator": {"metricsPort": 70000}}, "/operator/metricsPort"),
    ({"operator": {"statusInterval": 0}}, "/operator/statusInterval"),
    ({"operator": {"image": {"pullPolicy": "Sometimes"}}}, "/operator/image/pullPolicy"),
    ({"operator": {"image": {"tag": "latest"}}}, "/operator/image/tag"),
    ({"server": {"image": {"tag": ""}}}, "/server/image/tag"),
    ({"server": {"image": {"tag": "latest"}}}, "/server/image/tag"),
    ({"server": {"image": {"repository": ""}}}, "/server/image/repository"),
    ({"operator": {"serverImage": "mambaserve:0.1.0"}}, "serverImage"),  # before 0.2.0: now server.image
    ({"operator": {"securityContext": {"allowPrivilegeEscalation": True, "readOnlyRootFilesystem": True}}},
     "/operator/securityContext/allowPrivilegeEscalation"),
    ({"operator": {"podSecurityContext": {"runAsNonRoot": False}}}, "/operator/podSecurityContext/runAsNonRoot"),
    ({"operator": {"replicas": 0}}, "/operator/replicas"),
    ({"monitoring": {"prometheusRule": {"cacheHitRateLow": {"threshold": 1.5}}}},
     "/monitoring/prometheusRule/cacheHitRateLow/threshold"),
    ({"monitoring": {"prometheusRule": {"ttftHigh": {"for": "ten minutes"}}}},
     "/monitoring/prometheusRule/ttftHigh/for"),
    ({"monitoring": {"prometheusRule": {"serverDown": {"severity": "page"}}}},
     "/monitoring/prometheusRule/serverDown/severity"),
    ({"monitoring": {"serverPodMonitor": {"enabled": "yes"}}}, "/monitoring/serverPodMonitor/enabled"),
    ({"dashboards": {"enable": True}}, "enable"),
    ({"fullnameOverride": "Not_A_Name"}, "/fullnameOverride"),
]


@pytest.mark.parametrize("values,where", BAD_VALUES, ids=[w for _, w in BAD_VALUES])
def test_invalid_values_are_rejected_with_the_offending_key(values: dict[str, Any], where: str) -> None:
    h = helm()
    with pytest.raises(h.HelmValuesError) as err:
        h.Chart.load(str(CHART)).render(values, name="mambaserve", namespace=NAMESPACE)
    assert where in str(err.value)


@pytest.mark.parametrize("values,message", [
    ({"operator": {"metricsPort": 9000, "healthPort": 9000}}, "must differ"),
    ({"operator": {"serviceMonitors": True}, "monitoring": {"serverPodMonitor": {"enabled": True}}},
     "counted twice"),
    ({"serviceAccount": {"create": False}}, "serviceAccount.name is required"),
])
def test_inconsistent_values_fail_with_a_clear_message(values: dict[str, Any], message: str) -> None:
    h = helm()
    with pytest.raises(h.HelmRenderError) as err:
        h.Chart.load(str(CHART)).render(values, name="mambaserve", namespace=NAMESPACE)
    assert message in str(err.value)


def _value_paths(node: Any, prefix: str = "") -> dict[str, Any]:
    out = {}
    if isinstance(node, dict):
        for k, v in node.items():
            path = f"{prefix}.{k}" if prefix else k
            out[path] = v
            out.update(_value_paths(v, path))
    return out


def _schema_paths(schema: dict[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    out = {}
    for k, sub in (schema.get("properties") or {}).items():
        path = f"{prefix}.{k}" if prefix else k
        out[path] = sub
        out.update(_schema_paths(sub, path))
    return out


def _open_objects(s_paths: dict[str, dict[str, Any]]) -> set[str]:
    return {p for p, sub in s_paths.items() if sub.get("type") == "object" and sub.get("additionalProperties") is not False}


def test_values_schema_matches_values_yaml() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    v_paths, s_paths = _value_paths(values), _schema_paths(schema)
    s_paths.pop("global")  # Helm's own
    # Fixed-shape objects (additionalProperties: false) list exactly the keys values.yaml has;
    # inside open objects (resources, security contexts, label maps) only the schema's checks apply.
    opened = _open_objects(s_paths)
    inside = lambda p: any(p.startswith(f + ".") for f in opened)  # noqa: E731
    only_values = {p for p in v_paths if not inside(p)} - set(s_paths)
    only_schema = {p for p in s_paths if not inside(p)} - set(v_paths)
    assert (only_values, only_schema) == (set(), set())
    types = {"string": str, "boolean": bool, "integer": int, "number": (int, float), "array": list, "object": dict}
    for path, sub in s_paths.items():
        assert sub.get("description"), f"{path} has no description in the schema"
        if "type" in sub and path in v_paths:
            assert isinstance(v_paths[path], types[sub["type"]]), f"{path}: default does not match type {sub['type']}"
    helm().Chart.load(str(CHART)).validate_schema({})  # the defaults pass their own schema


def test_every_value_has_a_comment() -> None:
    """Every leaf value (and every free-form map) in values.yaml has a comment right above it."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    schema_paths = _schema_paths(json.loads((CHART / "values.schema.json").read_text()))
    opened = _open_objects(schema_paths)
    stack: list[tuple[int, str]] = []
    missing = []
    for i, line in enumerate(lines):
        m = re.match(r"^( *)([A-Za-z][A-Za-z0-9_]*):(.*)$", line)
        if not m:
            continue
        indent, key = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k in stack] + [key])
        stack.append((indent, key))
        if path not in schema_paths or any(path.startswith(f + ".") for f in opened):
            continue  # inside a free-form default (e.g. resources.requests)
        is_leaf = "properties" not in schema_paths[path] or path in opened
        prev = lines[i - 1].strip() if i else ""
        if is_leaf and not prev.startswith("#"):
            missing.append(path)
    assert missing == []


def test_chart_crds_are_identical_to_the_source_of_truth() -> None:
    source = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    shipped = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*")}
    assert source and shipped == source, "run scripts/sync_chart_crds.sh"
    # And Helm loads exactly those as the chart's CRDs.
    crds = helm().Chart.load(str(CHART)).crds
    assert sorted(c["filename"].split("/")[-1] for c in crds) == sorted(source)


def test_adapter_rules_are_what_the_operator_generates() -> None:
    from mambaserve.operator.builders import adapter_rules

    shipped = yaml.safe_load((CHART / "files" / "prometheus-adapter-rules.yaml").read_text())
    assert shipped == adapter_rules(), "run scripts/sync_chart_crds.sh"
    on = render(MONITORING_ON)
    cm = next(c for c in on.of("ConfigMap") if c["metadata"]["name"].endswith("adapter-rules"))
    assert yaml.safe_load(cm["data"]["rules.yaml"]) == adapter_rules()


def test_dashboards_are_built_from_the_script_and_shipped_with_the_sidecar_label(
        rendered: dict[str, Rendered]) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_dashboards.py"), "--check"], check=True)
    files = {p.name: json.loads(p.read_text()) for p in (CHART / "dashboards").glob("*.json")}
    assert sorted(files) == ["autoscaling.json", "cache.json", "operator.json", "overview.json", "sessions.json"]
    maps = [c for c in rendered["everything-customised"].of("ConfigMap")
            if c["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert len(maps) == 5
    for cm in maps:
        assert cm["metadata"]["namespace"] == "grafana"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "mambaserve"}
        ((key, text),) = cm["data"].items()
        assert json.loads(text) == files[key]
    for name, dash in files.items():
        _check_dashboard(name, dash)


def _check_dashboard(name: str, dash: dict[str, Any]) -> None:
    assert dash["uid"].startswith("mambaserve-") and dash["title"].startswith("mambaserve / ")
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert "datasource" in variables
    ids, cells = set(), set()
    for panel in dash["panels"]:
        assert panel["id"] not in ids
        ids.add(panel["id"])
        assert panel["title"] and panel["description"], f"{name}: panel without title or description"
        assert panel["datasource"]["uid"] == "${datasource}"
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{name}: panel {panel['title']!r} overlaps another"
                cells.add((x, y))
        assert panel["targets"] and all(t["expr"] for t in panel["targets"])
        for t in panel["targets"]:
            for var in re.findall(r"\$([a-z_]+)", t["expr"]):
                assert var in variables or var == "__rate_interval", f"{name}: unknown variable ${var}"


def test_network_policies_are_optional_and_reach_the_operator(rendered: dict[str, Rendered]) -> None:
    from mambaserve.operator.settings import parse_settings

    assert rendered["default"].of("NetworkPolicy") == []
    on = rendered["network-policies"]
    policy = on.one("NetworkPolicy")["spec"]
    ports = {p["name"]: p["containerPort"] for p in on.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert [p["port"] for p in policy["ingress"][0]["ports"]] == [ports["metrics"], ports["health"]]
    assert policy["podSelector"]["matchLabels"].items() <= on.one("Deployment")["spec"]["template"]["metadata"]["labels"].items()
    settings = parse_settings(on.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["args"], environ=POD_ENV)
    assert settings.network_policies and settings.metrics_namespaces == ("monitoring", "obs")
    assert settings.operator_namespace == NAMESPACE


def test_autoscaling_turns_scraping_on_and_tells_the_operator() -> None:
    """Autoscalers read the servers' series: with autoscaling.enabled the chart scrapes the server pods and
    names its PodMonitor to the operator, which renders autoscalers only where a scrape exists."""
    from mambaserve.operator.settings import parse_settings

    def args(r: Rendered) -> list[str]:
        return r.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]

    on = render({"autoscaling": {"enabled": True}})
    monitor = on.one("PodMonitor")
    named = parse_settings(args(on), environ=POD_ENV).server_pod_monitor
    assert named == f"{monitor['metadata']['namespace']}/{monitor['metadata']['name']}"
    assert any(c["metadata"]["name"].endswith("adapter-rules") for c in on.of("ConfigMap"))
    assert "MetricsMissing" not in on.notes
    # ... which the operator may read, and nothing else of its kind.
    ns, name = named.split("/")
    assert authorizer(on).allows(Access("get", "monitoring.coreos.com", "podmonitors", ns, name))
    assert not authorizer(on).allows(Access("get", "monitoring.coreos.com", "podmonitors", ns, "other"))
    # The operator's ServiceMonitors already scrape every session: no second scrape, no flag.
    per_session = render({"autoscaling": {"enabled": True}, "operator": {"serviceMonitors": True}})
    assert per_session.of("PodMonitor") == [] and not any(a.startswith("--server-pod-monitor") for a in args(per_session))
    off = render()
    assert off.of("PodMonitor") == [] and "MetricsMissing" in off.notes


def test_notes_give_the_next_commands(rendered: dict[str, Rendered]) -> None:
    notes = rendered["default"].notes
    assert f"kubectl -n {NAMESPACE} rollout status deployment/mambaserve-operator" in notes
    assert "kubectl get inferencesessions -A" in notes
    assert "kubectl apply --server-side --force-conflicts -f mambaserve/crds/" in notes
    assert "monitoring.serverPodMonitor.enabled=true" in notes  # nothing scrapes the servers yet
    namespaced = rendered["namespaced"].notes
    assert "watching llm, batch" in namespaced and "kubectl -n llm apply" in namespaced
    on = rendered["clusterwide-monitoring-on"].notes
    assert "serverPodMonitor.enabled=true" not in on and "mambaserve_cache_capacity_miss_ratio" in on


def test_readme_documents_the_crd_upgrade_path_and_every_alert() -> None:
    readme = (CHART / "README.md").read_text()
    assert "kubectl apply --server-side --force-conflicts -f" in readme
    rules = render({"monitoring": {"prometheusRule": {"enabled": True}, "operatorServiceMonitor": {"enabled": True}}})
    alerts = [r["alert"] for g in rules.one("PrometheusRule")["spec"]["groups"] for r in g["rules"]]
    assert "MambaserveStorageEntriesRejected" in alerts
    assert [a for a in alerts if f"| {a} |" not in readme] == []


def test_monitor_labels_reach_the_chart_monitors_and_the_operator() -> None:
    from mambaserve.operator.settings import parse_settings

    def operator_labels(r: Rendered) -> tuple[tuple[str, str], ...]:
        args = r.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
        return parse_settings(args, environ=POD_ENV).monitor_labels

    # By default what a kube-prometheus-stack release named kube-prometheus-stack selects, everywhere.
    on = render(MONITORING_ON)
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        assert on.one(kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack", kind
    assert operator_labels(on) == (("release", "kube-prometheus-stack"),)
    custom = render({**MONITORING_ON, "monitoring": {**MONITORING_ON["monitoring"],
                                                     "labels": {"release": "prom", "team": "ml"}}})
    assert custom.one("PodMonitor")["metadata"]["labels"]["team"] == "ml"
    assert operator_labels(custom) == (("release", "prom"), ("team", "ml"))
    # null removes the default (Helm's rule for maps): no labels at all.
    assert operator_labels(render({"monitoring": {"labels": {"release": None}}})) == ()
