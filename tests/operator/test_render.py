"""``mambaserve-operator render``: offline, the same objects the operator applies; bad input refused in one line."""

from __future__ import annotations

import io
import pathlib
import subprocess
import sys
from typing import Any

import kubernetes_validate
import pytest
import yaml

from mambaserve.operator import names
from mambaserve.operator.builders import build_session_children, build_tier_claim
from mambaserve.operator.render import main
from mambaserve.operator.settings import OperatorSettings
from mambaserve.operator.spec import parse_cache_tier, parse_session
from mambaserve.operator.crd_schema import admit
from tests.operator.conftest import ROOT, SAMPLES, load_crd, sample
from tests.operator.kube_versions import SUPPORTED
from tests.operator.pod_security import restricted_violations, writable_root_filesystems
from tests.operator.test_builders import THIRD_PARTY_CRDS


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mambaserve.operator", "render", *args], cwd=ROOT,
                          capture_output=True, text=True, input=stdin, timeout=120)


def documents(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def expected(session_name: str, tier_name: str | None, settings: OperatorSettings) -> list[dict[str, Any]]:
    """What the operator's builders produce for the same objects once the API server stored them."""
    tier = None
    out = []
    if tier_name:
        stored, _ = admit(load_crd("cachetiers"), sample(tier_name))
        tier = parse_cache_tier(stored)
        claim = build_tier_claim(tier)
        out += [claim] if claim else []
    stored, _ = admit(load_crd("inferencesessions"), sample(session_name))
    out += build_session_children(parse_session(stored), tier, settings)
    for obj in out:  # no uid in a file: no owner reference
        obj["metadata"].pop("ownerReferences", None)
        names.stamp(obj)
    return out


def test_renders_what_the_operator_builds_and_every_object_is_valid_and_restricted() -> None:
    result = run_cli("-f", str(SAMPLES / "inferencesession-autoscaled.yaml"), "-f", str(SAMPLES / "cachetier-shared.yaml"),
                     "--service-monitors", "--server-image", "registry.local/mambaserve:1")
    assert result.returncode == 0, result.stderr
    docs = documents(result.stdout)
    settings = OperatorSettings(service_monitors=True, server_image="registry.local/mambaserve:1")
    assert docs == expected("inferencesession-autoscaled", "cachetier-shared", settings)
    assert result.stdout.startswith("# Source: CacheTier llm/shared-tier\n")
    assert "# Source: InferenceSession llm/chat\n" in result.stdout
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("PodDisruptionBudget") == 2 and kinds.count("ServiceMonitor") == 2
    for obj in docs:
        assert "ownerReferences" not in obj["metadata"]
        assert restricted_violations(obj) == [] and writable_root_filesystems(obj) == []
        if obj["kind"] in THIRD_PARTY_CRDS:
            assert admit(THIRD_PARTY_CRDS[obj["kind"]], obj)[1] == []
        else:
            for version in SUPPORTED:
                kubernetes_validate.validate(obj, version, strict=True)
    # Every setting of the session and its tier is honoured: nothing to warn about.
    assert result.stderr == ""


def test_what_the_operator_cannot_honour_is_said_on_stderr() -> None:
    body = sample("inferencesession-minimal")
    body["spec"]["sessions"] = {"persist": True}  # persistence without a storage tier
    result = run_cli("-f", "-", stdin=yaml.safe_dump(body))
    assert result.returncode == 0, result.stderr
    assert "warning: InferenceSession llm/tiny: sessions.persist needs a cacheTierRef" in result.stderr
    assert "--session-persist" not in result.stdout


def test_a_cluster_copy_keeps_its_owner_references_and_stdin_lists_work() -> None:
    body = sample("inferencesession-minimal")
    body["metadata"]["uid"] = "0b6c0f5e-uid"
    listing = yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [body]})
    result = run_cli("-f", "-", "--monitor-labels", "release=prom", "--service-monitors", stdin=listing)
    assert result.returncode == 0, result.stderr
    docs = documents(result.stdout)
    assert all(d["metadata"]["ownerReferences"][0]["uid"] == "0b6c0f5e-uid" for d in docs)
    monitor = next(d for d in docs if d["kind"] == "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    # Exactly what the running operator would apply, spec hash included.
    stored, _ = admit(load_crd("inferencesessions"), body)
    settings = OperatorSettings(service_monitors=True, monitor_labels=(("release", "prom"),))
    assert docs == build_session_children(parse_session(stored), None, settings)


def test_invalid_input_fails_in_one_line_with_status_1(tmp_path: pathlib.Path) -> None:
    bad = sample("inferencesession-minimal")
    bad["spec"]["resources"] = {"gpus": 9}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    result = run_cli("-f", str(path))
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"mambaserve-operator render: error: {path}, document 1: "
                                    "InferenceSession llm/tiny is invalid: spec.resources.gpus: resources.gpus must be at most 8")


def _render(tmp_path: pathlib.Path, *texts: str, extra: tuple[str, ...] = ()) -> tuple[int, str, str]:
    args = []
    for i, text in enumerate(texts):
        path = tmp_path / f"in{i}.yaml"
        path.write_text(text)
        args += ["-f", str(path)]
    out, err = io.StringIO(), io.StringIO()
    code = main([*args, *extra], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


MINIMAL = (SAMPLES / "inferencesession-minimal.yaml").read_text()
BAD_INPUTS = [
    ("not yaml", ("kind: CacheTier\nspec: [unclosed\n",), "is not valid YAML (line 3): expected ',' or ']'"),
    ("a scalar", ("just text",), "document 1: not a Kubernetes object"),
    ("other kind", ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n",),
     "kind 'ConfigMap' is not an InferenceSession or a CacheTier"),
    ("old api version", (MINIMAL.replace("mambaserve.io/v1alpha1", "mambaserve.io/v1"),), "apiVersion must be"),
    ("no name", ("apiVersion: mambaserve.io/v1alpha1\nkind: InferenceSession\nspec: {model: {source: /m}}\n",),
     "metadata.name is required"),
    ("schema", (MINIMAL.replace("servedName: mamba2-130m", "servedName: 7"),), "servedName: 7 is not of type"),
    ("missing tier", (MINIMAL + "  cacheTierRef: {name: nowhere}\n",),
     "names CacheTier nowhere, which no -f file defines in namespace llm"),
    ("tier elsewhere", (MINIMAL + "  cacheTierRef: {name: shared-tier}\n",
                        (SAMPLES / "cachetier-shared.yaml").read_text().replace("namespace: llm", "namespace: other")),
     "names CacheTier shared-tier, which no -f file defines in namespace llm"),
    ("incompatible tier", (MINIMAL + "  cacheTierRef: {name: shared-tier}\n",
                           (SAMPLES / "cachetier-shared.yaml").read_text()),
     "holds states of model"),
    ("tier only", ((SAMPLES / "cachetier-shared.yaml").read_text(),), "no InferenceSession in the given files"),
]


@pytest.mark.parametrize("name,texts,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_named(tmp_path: pathlib.Path, name: str, texts: tuple[str, ...], message: str) -> None:
    code, out, err = _render(tmp_path, *texts)
    assert (code, out) == (1, "")
    assert err.count("\n") == 1 and message in err, err


def test_missing_file_and_missing_crds_are_named(tmp_path: pathlib.Path) -> None:
    code, _, err = _render(tmp_path, extra=("-f", str(tmp_path / "absent.yaml")))
    assert code == 1 and "cannot read" in err and "No such file or directory" in err
    code, _, err = _render(tmp_path, MINIMAL, extra=("--crds", str(tmp_path)))
    assert code == 1 and "pass --crds DIR" in err


def test_default_namespace_applies_to_objects_without_one(tmp_path: pathlib.Path) -> None:
    code, out, _ = _render(tmp_path, MINIMAL.replace("  namespace: llm\n", ""), extra=("-n", "team-a"))
    assert code == 0
    assert {d["metadata"]["namespace"] for d in documents(out)} == {"team-a"}
