"""Packaging guards (DESIGN §8): the three source roots map into mambaserve.*, operator/ never
shadows the standard library, and the dependency rules between them hold."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_operator_folder_is_not_a_top_level_package():
    assert not (ROOT / "operator" / "__init__.py").exists()
    out = subprocess.run([sys.executable, "-c", "import collections, operator; print(operator.__file__)"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert not out.startswith(str(ROOT)), out


def test_every_source_root_is_mapped_in_pyproject():
    text = (ROOT / "pyproject.toml").read_text()
    for folder in ("server", "kernels", "operator"):
        assert f'"mambaserve.{folder}" = "{folder}"' in text


def test_every_package_folder_is_listed_for_wheels():
    """Editable installs find subfolders anyway; a wheel (the operator's image) only ships listed ones."""
    text = (ROOT / "pyproject.toml").read_text()
    for root in ("server", "kernels", "operator"):
        for folder in [ROOT / root, *(p for p in (ROOT / root).rglob("*") if p.is_dir())]:
            if folder.name == "__pycache__" or not any(folder.glob("*.py")):
                continue
            dotted = "mambaserve." + ".".join(folder.relative_to(ROOT).parts)
            assert f'"{dotted}"' in text, f"{dotted} missing from [tool.setuptools] packages"


def _imports(folder: str):
    for path in (ROOT / folder).rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                yield path, [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                yield path, [node.module]


def test_dependency_direction():
    for path, names in _imports("kernels"):
        assert not any(n.startswith(("mambaserve.server", "mambaserve.operator")) for n in names), path
    for path, names in _imports("operator"):
        assert not any(n.split(".")[0] in ("torch", "triton") or n.startswith(("mambaserve.server", "mambaserve.kernels"))
                       for n in names), path
    for folder in ("server", "kernels", "operator"):
        for path, names in _imports(folder):
            # absolute mambaserve.* imports only: a second copy of a module breaks Prometheus collectors
            assert not any(n.split(".")[0] in ("server", "kernels", "tests", "benchmarks") for n in names), path
