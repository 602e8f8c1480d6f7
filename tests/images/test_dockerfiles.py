"""What the Dockerfiles promise, checked without building (fast; test_images.py builds them):
their identities, paths and ports match what the operator and the chart give the pods, the server's
default base carries the pinned torch, every copied path is in the build context, and the build
script refuses a tag that is not a release."""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess

import yaml

from mambaserve.operator.builders import pod
from mambaserve.operator.builders.server import HOME_DIR
from mambaserve.operator.settings import SERVER_PORT
from tests.images.buildah import ROOT, torch_pin

IMAGES = ROOT / "images"


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (IMAGES / name).read_text())
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def one(name: str, instruction: str) -> str:
    (value,) = [rest for word, rest in instructions(name) if word == instruction]
    return value


def test_both_images_run_as_the_uid_the_pods_ask_for() -> None:
    values = yaml.safe_load((ROOT / "charts" / "mambaserve" / "values.yaml").read_text())
    for name in ("server.Dockerfile", "operator.Dockerfile"):
        assert one(name, "USER") == f"{pod.RUN_AS}:{pod.RUN_AS}", name
    assert values["operator"]["podSecurityContext"]["runAsUser"] == pod.RUN_AS


def test_server_image_default_base_and_layout_match_the_pins_and_the_operator() -> None:
    (base,) = [r for w, r in instructions("server.Dockerfile") if w == "ARG" and r.startswith("BASE_IMAGE=")]
    assert f"pytorch/pytorch:{torch_pin()}-" in base
    locked = dict(line.split(" ", 1) for line in (IMAGES / "bases.lock").read_text().splitlines()
                  if line and not line.startswith("#"))
    # The build's bases are the Dockerfiles' defaults, pinned by digest once scripts/pin_base_images.sh ran.
    assert locked["server"].split("@")[0] == base.split("=", 1)[1].split("@")[0]
    (op_base,) = [r for w, r in instructions("operator.Dockerfile") if w == "ARG" and r.startswith("BASE_IMAGE=")]
    assert locked["operator"].split("@")[0] == op_base.split("=", 1)[1].split("@")[0]
    for ref in locked.values():
        assert re.fullmatch(r"[a-z0-9./-]+:[\w.-]+(@sha256:[0-9a-f]{64})?", ref), ref
    assert f"HOME={HOME_DIR}" in one("server.Dockerfile", "ENV").split()
    assert one("server.Dockerfile", "EXPOSE") == str(SERVER_PORT)
    assert one("server.Dockerfile", "ENTRYPOINT") == '["mambaserve", "serve"]'
    cmd = yaml.safe_load(one("server.Dockerfile", "CMD"))
    model = cmd[cmd.index("--model") + 1]
    copies = [r.split() for w, r in instructions("server.Dockerfile") if w == "COPY"]
    assert [f"models/{model.rsplit('/', 1)[1]}/", f"{model}/"] in copies
    assert (ROOT / "models" / model.rsplit("/", 1)[1] / "config.json").exists()


def test_each_image_installs_only_its_own_requirements() -> None:
    server, operator = (IMAGES / "server.Dockerfile").read_text(), (IMAGES / "operator.Dockerfile").read_text()
    # Every dependency pinned and hashed (scripts/lock_requirements.sh), installed in hash-checking mode.
    assert "pip install --require-hashes -r requirements-server.lock" in server and "operator.lock" not in server
    assert "pip install --require-hashes -r requirements-operator.lock" in operator and "server.lock" not in operator
    assert "--no-deps ." in server and "--no-deps ." in operator


def test_every_copied_path_is_in_the_build_context() -> None:
    """.dockerignore keeps the context small (a .venv is gigabytes): it must still let in every COPY source."""
    patterns = [p for p in (ROOT / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]

    def included(path: str) -> bool:
        keep = True
        for p in patterns:  # the last matching pattern decides, as in Docker
            negated, p = p.startswith("!"), p.lstrip("!")
            if fnmatch.fnmatch(path, p) or path.startswith(p.rstrip("/") + "/"):
                keep = negated
        return keep

    for name in ("server.Dockerfile", "operator.Dockerfile"):
        for word, rest in instructions(name):
            if word == "COPY":
                for source in rest.split()[:-1]:
                    assert included(source.rstrip("/")), f"{name}: {source} is excluded by .dockerignore"
                    assert (ROOT / source).exists(), f"{name}: {source} does not exist"
    assert not included(".venv") and not included(".git")


def test_build_script_refuses_a_tag_that_is_not_a_release() -> None:
    script = str(ROOT / "scripts" / "build_images.sh")
    proc = subprocess.run([script, "--tag", "latest", "registry.example/ml"], capture_output=True, text=True)
    assert proc.returncode == 2 and "is not a release" in proc.stderr, proc.stderr
    proc = subprocess.run([script], capture_output=True, text=True)
    assert proc.returncode == 2 and "REPOSITORY is required" in proc.stderr
    # A base by tag alone is refused (a re-pushed tag would change a rebuilt image).
    proc = subprocess.run([script, "registry.example/ml"], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], "CONTAINER_TOOL": "buildah",
                               "SERVER_BASE_IMAGE": "docker.io/pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime"})
    assert proc.returncode == 2 and "is not pinned by digest" in proc.stderr, proc.stderr
