"""The operator installs and runs without the engine, the way its image installs it: a fresh virtual
environment with requirements-operator.txt and the package built as a wheel (``--no-deps``) runs
``mambaserve-operator --help`` and ``render`` (CRDs from the wheel, not the checkout) and cannot
import torch. Slow: about a minute, most of it pip fetching the operator's ~25 packages; skipped
when the package index cannot be reached."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.operator.conftest import ROOT, SAMPLES

# What a wheel is built from (pyproject.toml's package-dir); copied so the build leaves the checkout alone.
SOURCES = ("pyproject.toml", "README.md", "server", "kernels", "operator", "crds")
OFFLINE = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
           "Network is unreachable", "ConnectTimeoutError", "ProxyError")


def _run(*cmd: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_operator_installs_and_runs_without_the_engine(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    built = _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", ".",
                 "-w", tmp_path / "dist", cwd=src)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("mambaserve-*.whl")

    venv = tmp_path / "venv"
    assert _run(sys.executable, "-m", "venv", venv, cwd=tmp_path).returncode == 0
    python, operator = venv / "bin" / "python", venv / "bin" / "mambaserve-operator"
    deps = _run(python, "-m", "pip", "install", "-q", "-r", ROOT / "requirements-operator.txt", cwd=tmp_path)
    if deps.returncode != 0 and any(s in deps.stdout + deps.stderr for s in OFFLINE):
        pytest.skip("the package index cannot be reached: " + deps.stderr.strip().splitlines()[-1])
    assert deps.returncode == 0, deps.stderr
    package = _run(python, "-m", "pip", "install", "-q", "--no-deps", wheel, cwd=tmp_path)
    assert package.returncode == 0, package.stderr

    for module in ("torch", "transformers", "triton"):
        probe = _run(python, "-c", f"import {module}", cwd=tmp_path)
        assert probe.returncode != 0 and f"No module named '{module}'" in probe.stderr, module

    helped = _run(operator, "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "--server-image" in helped.stdout, helped.stderr

    rendered = _run(operator, "render", "-f", SAMPLES / "inferencesession-minimal.yaml",
                    "--server-image", "registry.example/mambaserve-server:9.9.9", cwd=tmp_path)
    assert rendered.returncode == 0, rendered.stderr
    objects = [o for o in yaml.safe_load_all(rendered.stdout) if o]
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == \
        "registry.example/mambaserve-server:9.9.9"
    # render validated against the CRDs the wheel carries: an invalid session is refused.
    bad = tmp_path / "bad.yaml"
    bad.write_text((SAMPLES / "inferencesession-minimal.yaml").read_text() + "  replicas: -1\n")
    refused = _run(operator, "render", "-f", bad, cwd=tmp_path)
    assert refused.returncode == 1 and "replicas" in refused.stderr, refused.stderr
