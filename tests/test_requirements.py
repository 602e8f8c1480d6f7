"""The pinned requirement files match pyproject.toml (docs/operations.md, "Images").

requirements-server.txt pins exactly the package's dependencies (what `pip install .` and the server
image install); requirements-operator.txt pins the `operator` extra less the Kubernetes client
library, and nothing of the engine; requirements.txt takes both by reference, so each pin has one home.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
ENGINE = {"torch", "triton", "transformers", "tokenizers", "safetensors"}


def pins(name: str) -> dict[str, str]:
    """``name==version`` lines of a requirements file (comments and ``-r`` lines skipped)."""
    out = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-r "):
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==", f"{name}: {line} is not pinned"
        out[canonicalize_name(req.name)] = spec.version
    return out


def ranges(requirements: list[str]) -> dict[str, Requirement]:
    return {canonicalize_name(Requirement(r).name): Requirement(r) for r in requirements}


def test_server_pins_are_exactly_the_package_dependencies() -> None:
    declared, pinned = ranges(PYPROJECT["dependencies"]), pins("requirements-server.txt")
    assert set(pinned) == set(declared)
    for name, version in pinned.items():
        assert declared[name].specifier.contains(version), f"{name}=={version} outside {declared[name]}"


def test_operator_pins_are_the_operator_extra_without_the_engine() -> None:
    declared, pinned = ranges(PYPROJECT["optional-dependencies"]["operator"]), pins("requirements-operator.txt")
    # The official client only widens the kubeconfigs an operator outside the cluster can read.
    assert set(declared) - set(pinned) == {"kubernetes"} and set(pinned) <= set(declared)
    assert not set(pinned) & ENGINE
    for name, version in pinned.items():
        assert declared[name].specifier.contains(version), f"{name}=={version} outside {declared[name]}"


def test_development_requirements_reference_the_image_files_and_repeat_no_pin() -> None:
    text = (ROOT / "requirements.txt").read_text()
    assert "-r requirements-server.txt" in text and "-r requirements-operator.txt" in text
    dev = pins("requirements.txt")
    for shared in ("requirements-server.txt", "requirements-operator.txt"):
        assert not set(dev) & set(pins(shared)), f"requirements.txt repeats pins of {shared}"
    server, operator = pins("requirements-server.txt"), pins("requirements-operator.txt")
    assert all(server[n] == operator[n] for n in set(server) & set(operator))  # prometheus-client


def locked(name: str) -> dict[str, tuple[str, int]]:
    """``name==version`` of a lock file (scripts/lock_requirements.sh) with how many hashes each has."""
    out, current = {}, None
    for line in (ROOT / name).read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            spec = line.rstrip(" \\")
            req = Requirement(spec.split(";")[0])
            (pin,) = req.specifier
            assert pin.operator == "==", f"{name}: {spec} is not pinned"
            current = canonicalize_name(req.name)
            out[current] = (pin.version, 0)
        elif "--hash=sha256:" in line and current is not None:
            out[current] = (out[current][0], out[current][1] + 1)
    return out


def test_image_locks_hold_every_direct_pin_and_hash_every_dependency() -> None:
    """The images install the .lock files with pip --require-hashes: indirect dependencies cannot move."""
    for lock, direct in (("requirements-server.lock", "requirements-server.txt"),
                         ("requirements-operator.lock", "requirements-operator.txt")):
        have = locked(lock)
        assert all(hashes >= 1 for _, hashes in have.values()), lock
        wanted = {k: v for k, v in pins(direct).items() if k != "torch"}  # torch: the server image's base
        assert {k: have[k][0] for k in wanted if k in have} == wanted, f"{lock} is stale: run scripts/lock_requirements.sh"
        assert set(wanted) <= set(have)
        assert "torch" not in have and len(have) > len(wanted)  # the indirect ones are there too
