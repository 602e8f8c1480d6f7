"""Layout and entry points of the operator package (docs/design.md §2, §8)."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys

import pytest
import yaml

from mambaserve.operator.__main__ import main
from mambaserve.operator.settings import OperatorSettings, parse_settings
from tests.operator.conftest import ROOT

OPERATOR = ROOT / "operator"
FORBIDDEN = ("torch", "triton", "mambaserve.server", "mambaserve.kernels", "server", "kernels")


def test_operator_folder_is_not_a_top_level_package() -> None:
    assert not (OPERATOR / "__init__.py").exists()
    out = subprocess.run([sys.executable, "-c", "import collections, operator; print(operator.__file__)"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert not out.startswith(str(OPERATOR)), out


def test_operator_imports_neither_torch_nor_the_server() -> None:
    for path in OPERATOR.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                assert node.level == 0, f"{path}: relative import"
                names = [node.module]
            for name in names:
                assert not any(name == f or name.startswith(f + ".") for f in FORBIDDEN), f"{path}: imports {name}"
        # Subfolders are regular packages; only the top level is an implicit namespace.
    for sub in [p for p in OPERATOR.iterdir() if p.is_dir() and p.name != "__pycache__"]:
        assert (sub / "__init__.py").exists(), sub


def test_settings_from_flags_and_environment() -> None:
    defaults = parse_settings([], environ={})
    assert dataclasses.replace(defaults, identity="") == OperatorSettings()
    assert defaults.identity.endswith(f"-{os.getpid()}")  # outside a pod: host and process
    pod = parse_settings(["--leader-election"], environ={"POD_NAME": "op-7c9d", "POD_NAMESPACE": "ops"})
    assert (pod.identity, pod.leader_election, pod.leader_election_namespace) == ("op-7c9d", True, "ops")
    with pytest.raises(SystemExit):
        parse_settings(["--leader-election"], environ={})  # no namespace for the Lease
    s = parse_settings(["--namespace", "a", "--namespace", "b", "--service-monitors", "--status-interval", "5"],
                       environ={"MAMBASERVE_OPERATOR_SERVER_IMAGE": "img:1"})
    assert s.namespaces == ("a", "b") and not s.clusterwide
    assert s.service_monitors and s.status_interval == 5.0 and s.server_image == "img:1"
    env = parse_settings([], environ={"MAMBASERVE_OPERATOR_NAMESPACES": "x, y",
                                      "MAMBASERVE_OPERATOR_SERVICE_MONITORS": "true",
                                      "MAMBASERVE_OPERATOR_WATCH_SERVER_TIMEOUT": "120"})
    assert env.namespaces == ("x", "y") and env.service_monitors and env.watch_server_timeout == 120.0
    # Flags win over the environment.
    assert parse_settings(["--server-image", "flag:1"],
                          environ={"MAMBASERVE_OPERATOR_SERVER_IMAGE": "env:1"}).server_image == "flag:1"
    # ServiceMonitor labels: kube-prometheus-stack's default selector unless told otherwise.
    assert OperatorSettings().monitor_labels == (("release", "kube-prometheus-stack"),)
    assert parse_settings(["--monitor-labels", "release=prom, team=ml"], environ={}).monitor_labels == \
        (("release", "prom"), ("team", "ml"))
    assert parse_settings([], environ={"MAMBASERVE_OPERATOR_MONITOR_LABELS": ""}).monitor_labels == ()


def test_bad_monitor_labels_are_refused(capsys) -> None:  # type: ignore[no-untyped-def]
    for bad in ("release", "has space=x", "k=" + "v" * 64, "-k=v"):
        with pytest.raises(SystemExit):
            parse_settings([f"--monitor-labels={bad}"], environ={})
        assert "is not a label KEY=VALUE" in capsys.readouterr().err


def test_adapter_rules_subcommand(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["adapter-rules"]) == 0
    rules = yaml.safe_load(capsys.readouterr().out)["rules"]
    assert {r["name"]["as"] for r in rules} == {"mambaserve_cache_capacity_miss_ratio", "mambaserve_num_waiting_requests"}


def test_module_entry_point_runs() -> None:
    result = subprocess.run([sys.executable, "-m", "mambaserve.operator", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--namespace" in result.stdout and "--server-image" in result.stdout
    result = subprocess.run([sys.executable, "-m", "mambaserve.operator", "render", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--filename" in result.stdout and "--monitor-labels" in result.stdout
