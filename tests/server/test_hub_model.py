"""``--model org/name[@revision]`` through a Hugging Face hub cache laid out on disk, offline
(HF_HUB_OFFLINE=1): the snapshot of the revision is served under the repository's name; a repository or
revision the cache lacks is a clear error."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.tiny_models import make_checkpoint

# one process (the environment is read when huggingface_hub is imported): an engine, then the other names
SCRIPT = """
import json, sys
from mambaserve.server.config import ServerConfig
from mambaserve.server.engine.engine import Engine
from mambaserve.server.model.config import ModelLoadError
from mambaserve.server.model.hub import resolve
e = Engine(ServerConfig(model=sys.argv[1], device="cpu", context_length=64, mamba_cache_size=4, max_running_requests=2))
out = {"engine": {"name": e.model_name, "path": e.cfg.model}}
for name in sys.argv[2:]:
    try:
        out[name] = str(resolve(name))
    except ModelLoadError as err:
        out[name] = "error: " + str(err)
print(json.dumps(out))
"""


def _hub_cache(root: Path) -> tuple[Path, dict[str, Path]]:
    """A hub cache (``models--org--name/{refs,snapshots}``) holding two revisions of one tiny checkpoint."""
    repo = root / "models--acme--tiny-mamba"
    snaps = {}
    for commit, ref in (("a" * 40, "main"), ("b" * 40, "v1")):
        snaps[ref] = make_checkpoint(repo / "snapshots" / commit, "h6_g1", seed=len(snaps))
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return root, snaps


def test_hub_ids_resolve_through_the_cache_offline(tmp_path):
    cache, snaps = _hub_cache(tmp_path / "hub")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home")}
    names = ["acme/tiny-mamba@v1", "acme/tiny-mamba@" + "b" * 40, "acme/other", "acme/tiny-mamba@v2"]
    run = subprocess.run([sys.executable, "-c", SCRIPT, "acme/tiny-mamba", *names], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["engine"] == {"name": "acme/tiny-mamba", "path": str(snaps["main"])}
    assert out[names[0]] == out[names[1]] == str(snaps["v1"])
    for missing in names[2:]:
        assert "not in the Hugging Face cache" in out[missing] and "HF_HUB_OFFLINE" in out[missing], out[missing]


UNREACHABLE = """
import huggingface_hub

class ConnectError(Exception):  # as huggingface_hub's HTTP client raises without a network: not an OSError
    pass

def list_repo_files(self, *args, **kwargs):
    raise ConnectError("[Errno -2] Name or service not known")

huggingface_hub.HfApi.list_repo_files = list_repo_files
""" + SCRIPT


MID_DOWNLOAD = """
import huggingface_hub

class ReadError(Exception):  # the HTTP client's own error when the connection drops: not an OSError
    pass

download = huggingface_hub.snapshot_download

def snapshot_download(*args, local_files_only=False, **kwargs):
    if not local_files_only:
        raise ReadError("connection reset while reading model.safetensors")
    return download(*args, local_files_only=True, **kwargs)

huggingface_hub.HfApi.list_repo_files = lambda self, *a, **kw: ["config.json", "model.safetensors"]
huggingface_hub.snapshot_download = snapshot_download
""" + SCRIPT


@pytest.mark.parametrize("script,error", [
    (UNREACHABLE, "ConnectError: [Errno -2] Name or service not known"),
    (MID_DOWNLOAD, "ReadError: connection reset while reading model.safetensors")], ids=["unreachable", "cut-short"])
def test_a_hub_out_of_reach_falls_back_to_the_cache_and_says_why_otherwise(tmp_path, script, error):
    """Online mode (no HF_HUB_OFFLINE), the hub out of reach, or the connection dropping while the files download
    (after the hub listed them): a cached repository is served, one that is not cached is a clear ModelLoadError
    naming the error, not a traceback."""
    cache, snaps = _hub_cache(tmp_path / "hub")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_HUB_CACHE=str(cache), HF_HOME=str(tmp_path / "home"))
    run = subprocess.run([sys.executable, "-c", script, "acme/tiny-mamba", "acme/other"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["engine"] == {"name": "acme/tiny-mamba", "path": str(snaps["main"])}
    assert "not in the Hugging Face cache" in out["acme/other"], out["acme/other"]
    assert error in out["acme/other"], out["acme/other"]
