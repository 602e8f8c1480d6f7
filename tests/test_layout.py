"""Packaging and layout guards (docs/design.md §2, §8): the three source roots map into mambaserve.*,
operator/ never shadows the standard library, and imports only point down: between the roots, and
between the parts of the server (api → engine → {cache, sessions, model} → kernels)."""

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


# The server's parts, by rank: a module may import its own part or a part of lower rank, never one of
# the same rank (across) or higher (up). config is the frozen configuration every layer may read; cli is the edge.
SERVER_RANKS = {"__main__": 6, "cli": 5, "api": 4, "engine": 3, "cache": 2, "sessions": 2, "model": 2,
                "kernels": 1, "config": 0}


def _part(dotted: str) -> str | None:
    """The part of a mambaserve module name: 'mambaserve.server.engine.scheduler' -> 'engine'."""
    parts = dotted.split(".")
    if parts[:2] == ["mambaserve", "kernels"]:
        return "kernels"
    if parts[:2] == ["mambaserve", "server"] and len(parts) > 2:
        return parts[2]
    return None


def layering_violations(modules: dict[str, str]) -> list[str]:
    """``modules``: dotted module name -> source. Every import that points up or across the parts."""
    bad = []
    for name, source in modules.items():
        src = _part(name)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names
                                           if node.module == "mambaserve.server"]
            else:
                continue
            for target in targets:
                dst = _part(target)
                if dst is None or dst == src:
                    continue
                if dst not in SERVER_RANKS or SERVER_RANKS[dst] >= SERVER_RANKS[src]:
                    bad.append(f"{name} imports {target} ({src} -> {dst})")
    return bad


def _server_modules() -> dict[str, str]:
    out = {}
    for path in (ROOT / "server").rglob("*.py"):
        dotted = "mambaserve." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[dotted] = path.read_text()
    return out


def test_every_server_module_belongs_to_a_part():
    for name in _server_modules():
        part = _part(name)
        assert name == "mambaserve.server.__init__" or part in SERVER_RANKS, f"{name}: not in a part of the server"


def test_server_imports_point_down():
    assert layering_violations(_server_modules()) == []


def test_layering_check_catches_up_and_across_imports():
    bad = layering_violations({
        "mambaserve.server.model.mamba2": "from mambaserve.server.engine.batch import ForwardMode",  # up
        "mambaserve.server.cache.prefix_cache": "import mambaserve.server.sessions.table",  # across
        "mambaserve.server.sessions.manager": "from mambaserve.server import engine",  # up, package form
        "mambaserve.server.engine.scheduler": "from mambaserve.server.cache.slots import SlotAllocator",  # down: fine
        "mambaserve.server.config": "from mambaserve.server.engine.request import Req",  # config is a leaf
    })
    assert len(bad) == 4 and not any("scheduler" in b for b in bad), bad
