"""Where the operator (and the uninstall hook) get Kubernetes credentials: the official client where
installed, else Kopf's own readers (the operator image has no client library)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import yaml

from mambaserve.operator.kube import credentials

LOG = logging.getLogger("test")


@pytest.fixture
def kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://203.0.113.7:6443", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u", "namespace": "llm"}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(path))
    return path


@pytest.mark.parametrize("client_library", [True, False], ids=["kubernetes-client", "without-client"])
def test_credentials_from_a_kubeconfig_with_or_without_the_client_library(
        kubeconfig: Path, monkeypatch: pytest.MonkeyPatch, client_library: bool) -> None:
    if client_library:
        import kubernetes.config.kube_config as kube_config
        # the client reads KUBECONFIG once, when it is first imported
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    else:
        for name in [m for m in sys.modules if m == "kubernetes" or m.startswith("kubernetes.")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setitem(sys.modules, "kubernetes", None)  # import kubernetes -> ImportError
    if Path("/var/run/secrets/kubernetes.io/serviceaccount/token").exists():
        pytest.skip("running in a pod: the ServiceAccount comes first")
    info = credentials(LOG)
    assert info is not None
    assert info.server.rstrip("/") == "https://203.0.113.7:6443" and info.token == "t0ken"
