"""Model delivery: a model cache claim filled once by a Job and mounted read-only by every pod, the
per-pod download without it, and the downloader's file selection (the formats the server loads)."""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import kubernetes_validate
import pytest

from mambaserve.operator import names
from mambaserve.operator.builders import build_session_children
from mambaserve.operator.builders.model import DOWNLOAD_MARKER
from mambaserve.operator.crd_schema import admit
from mambaserve.operator.settings import OperatorSettings
from mambaserve.operator.spec import parse_session, session_problems
from mambaserve.server.model import download as model_download
from tests.operator.conftest import Cluster, eventually, load_crd, sample
from tests.operator.kube_versions import SUPPORTED
from tests.operator.pod_security import restricted_violations, writable_root_filesystems

SETTINGS = OperatorSettings(server_image="registry.local/mambaserve:1")


def cached_body(**cache: Any) -> dict[str, Any]:
    body = sample("inferencesession-minimal")
    body["metadata"].update({"uid": "uid-s", "generation": 1})
    body["spec"]["model"] = {"source": "hf://state-spaces/mamba2-130m@r1", "tokenSecretRef": {"name": "hf"},
                             "cache": {"enabled": True, "size": "20Gi", **cache}}
    return body


def children(body: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    stored, errors = admit(load_crd("inferencesessions"), body)
    assert errors == []
    return {(c["kind"], c["metadata"]["name"]): c for c in build_session_children(parse_session(stored), None,
                                                                                    SETTINGS)}


def test_model_cache_is_one_claim_one_download_job_and_read_only_pods() -> None:
    objs = children(cached_body())
    claim, job = objs["PersistentVolumeClaim", "tiny-model"], objs["Job", "tiny-model-download"]
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "20Gi"}}}
    assert claim["metadata"]["ownerReferences"][0]["kind"] == "InferenceSession"
    # The Job downloads only what the server loads, with bounded resources and the token from its Secret.
    (download,) = job["spec"]["template"]["spec"]["containers"]
    assert download["command"] == ["python3", "-m", "mambaserve.server.model.download", "state-spaces/mamba2-130m",
                                   "r1", "/models/state-spaces--mamba2-130m/r1"]
    assert download["resources"] == {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in download["env"]
    assert {"name": "model", "mountPath": "/models"} in download["volumeMounts"]
    # Server pods: the claim read-only, an init container that waits for the download's marker.
    pod = objs["Deployment", "tiny"]["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "tiny-model", "readOnly": True}} in pod["volumes"]
    server = pod["containers"][0]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in server["volumeMounts"]
    assert server["args"][server["args"].index("--model") + 1] == "/models/state-spaces--mamba2-130m/r1"
    (wait,) = pod["initContainers"]
    assert wait["name"] == "model-wait" and wait["command"][-1].endswith(f"/r1/{DOWNLOAD_MARKER}")
    assert all(m.get("readOnly") for m in wait["volumeMounts"])
    # Objects the API servers of the oldest and newest supported Kubernetes accept, pods restricted.
    for obj in objs.values():
        for version in SUPPORTED:
            kubernetes_validate.validate(obj, version, strict=True)
        assert restricted_violations(obj) == [] and writable_root_filesystems(obj) == []


def test_download_settings_and_the_per_pod_download() -> None:
    body = cached_body()
    body["spec"]["model"]["download"] = {"allowPatterns": ["config.json", "*.safetensors", "tokenizer.json"],
                                         "resources": {"requests": {"cpu": "2"}, "limits": {"memory": "8Gi"}}}
    job = children(body)["Job", "tiny-model-download"]
    (download,) = job["spec"]["template"]["spec"]["containers"]
    assert download["command"][-6:] == ["--allow", "config.json", "--allow", "*.safetensors",
                                        "--allow", "tokenizer.json"]
    assert download["resources"] == {"requests": {"cpu": "2", "memory": "1Gi"}, "limits": {"memory": "8Gi"}}
    # Without the cache: each pod downloads into its own emptyDir, with the same container.
    body["spec"]["model"].pop("cache")
    objs = children(body)
    assert not any(kind in ("Job", "PersistentVolumeClaim") for kind, _ in objs)
    pod = objs["Deployment", "tiny"]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"][:3] == ["python3", "-m", "mambaserve.server.model.download"]
    assert init["resources"]["limits"] == {"memory": "8Gi"}
    assert {"name": "model", "emptyDir": {"sizeLimit": "64Gi"}} in pod["volumes"]
    for version in SUPPORTED:
        kubernetes_validate.validate(objs["Deployment", "tiny"], version, strict=True)
    assert restricted_violations(objs["Deployment", "tiny"]) == []


def test_cel_keeps_the_cache_to_hf_sources_with_a_size() -> None:
    crd = load_crd("inferencesessions")
    bad = cached_body()
    bad["spec"]["model"]["source"] = "pvc://weights/m"
    assert any("model.cache applies to hf://" in e for e in admit(crd, bad)[1])
    bad = cached_body()
    del bad["spec"]["model"]["cache"]["size"]
    assert any("needs model.cache.size" in e for e in admit(crd, bad)[1])
    old, new = cached_body(), cached_body(size="40Gi")
    assert any("model.cache.size is immutable" in e for e in admit(crd, new, old=old)[1])


def test_single_node_model_cache_with_replicas_is_reported() -> None:
    body = cached_body(accessMode="ReadWriteOnce")
    body["spec"]["replicas"] = 3
    [problem] = session_problems(parse_session(admit(load_crd("inferencesessions"), body)[0]), None)
    assert problem.reason == "ModelCacheSingleNode" and "ReadWriteOnce" in problem.message


# --- the downloader --------------------------------------------------------------------------

HF_MAMBA2 = ["config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "README.md", "flax_model.msgpack", "onnx/model.onnx", ".gitattributes"]
SHARDED = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
           "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]
MAMBA_SSM = ["config.json", "pytorch_model.bin", "README.md"]


def test_downloader_fetches_what_the_server_loads_and_prefers_safetensors() -> None:
    assert model_download.select(HF_MAMBA2) == ["config.json", "model.safetensors", "special_tokens_map.json",
                                                "tokenizer.json", "tokenizer_config.json"]
    assert model_download.select(SHARDED) == sorted(SHARDED)
    assert model_download.select(MAMBA_SSM) == ["config.json", "pytorch_model.bin"]
    assert model_download.MARKER == DOWNLOAD_MARKER  # what the server pods' init container waits for


def test_downloader_marks_completion_and_skips_a_complete_directory(tmp_path: pathlib.Path) -> None:
    fetched: list[list[str]] = []

    def fetch(repo: str, rev: str, dest: str, files: list[str]) -> None:
        fetched.append(files)
        for f in files:
            (pathlib.Path(dest) / f).write_text("x")

    dest = str(tmp_path / "m" / "r1")
    assert model_download.download("o/m", "r1", dest, list_files=lambda r, v: MAMBA_SSM, fetch=fetch) \
        == ["config.json", "pytorch_model.bin"]
    assert (tmp_path / "m" / "r1" / DOWNLOAD_MARKER).read_text() == "o/m@r1\n"
    assert model_download.download("o/m", "r1", dest, list_files=lambda r, v: MAMBA_SSM, fetch=fetch) == []
    assert len(fetched) == 1  # the second run found the marker
    with pytest.raises(SystemExit, match="no checkpoint the server loads"):
        model_download.download("o/readme", "main", str(tmp_path / "x"), list_files=lambda r, v: ["README.md"],
                                fetch=fetch)
    assert not (tmp_path / "x" / DOWNLOAD_MARKER).exists()


# --- through the operator ----------------------------------------------------------------------

@pytest.mark.asyncio
async def test_operator_creates_replaces_and_prunes_the_model_download(cluster: Cluster, start_operator: Any) -> None:
    await start_operator()
    body = cached_body()
    body["metadata"].pop("uid")
    session = await cluster.create(body)
    uid = session["metadata"]["uid"]
    job = await eventually(lambda: cluster.get("Job", "tiny-model-download"))
    claim = await eventually(lambda: cluster.get("PersistentVolumeClaim", "tiny-model"))
    assert claim["metadata"]["ownerReferences"][0]["uid"] == uid
    first = job["metadata"]["annotations"][names.IMMUTABLE_HASH]

    # A new revision: a new Job (a Job's template is immutable) downloading into its own directory.
    model = copy.deepcopy(body["spec"]["model"])
    model["source"] = "hf://state-spaces/mamba2-130m@r2"
    await cluster.update_spec("InferenceSession", "tiny", {"model": model})
    job = await eventually(lambda: (j := cluster.get("Job", "tiny-model-download"))
                           and j["metadata"]["annotations"][names.IMMUTABLE_HASH] != first and j)
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][-1] == "/models/state-spaces--mamba2-130m/r2"
    args = lambda: cluster.get("Deployment", "tiny")["spec"]["template"]["spec"]["containers"][0]["args"]  # noqa: E731
    await eventually(lambda: "/models/state-spaces--mamba2-130m/r2" in args())

    # Cache off: the Job and the claim are pruned, pods download for themselves again.
    model["cache"] = {"enabled": False}
    await cluster.update_spec("InferenceSession", "tiny", {"model": model})
    await eventually(lambda: cluster.get("Job", "tiny-model-download") is None
                     and cluster.get("PersistentVolumeClaim", "tiny-model") is None)
    await eventually(lambda: cluster.get("Deployment", "tiny")["spec"]["template"]["spec"]["initContainers"][0][
        "name"] == "model-download")


@pytest.mark.asyncio
async def test_model_download_progress_and_failures_reach_the_conditions(cluster: Cluster,
                                                                        start_operator: Any) -> None:
    await start_operator()
    body = cached_body()
    body["metadata"].pop("uid")
    await cluster.create(body)
    await eventually(lambda: cluster.get("Job", "tiny-model-download"))
    model = await eventually(lambda: cluster.condition("InferenceSession", "tiny", "ModelReady"))
    assert (model["status"], model["reason"]) == ("False", "Downloading")
    ready = cluster.condition("InferenceSession", "tiny", "Ready")
    assert ready["reason"] == "WaitingForModel" and "downloading hf://state-spaces/mamba2-130m@r1" in ready["message"]
    # The downloader's pod cannot pull its image: that is what the session says.
    await cluster.create({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "tiny-model-download-x7k2p", "labels": names.session_labels("tiny", "model-download")},
        "spec": {"containers": [{"name": "model-download", "image": "registry.local/mambaserve:1"}]},
        "status": {"containerStatuses": [{"name": "model-download", "image": "registry.local/mambaserve:1",
                                          "state": {"waiting": {"reason": "ImagePullBackOff",
                                                                "message": "unauthorized"}}}]}})
    await eventually(lambda: cluster.condition("InferenceSession", "tiny", "Ready")["reason"] == "ImagePullFailed")
    # The Job gives up: ModelReady says why; then a successful retry makes it True.
    await cluster.patch("Job", "tiny-model-download", {"status": {"failed": 7, "conditions": [
        {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
         "message": "Job has reached the specified backoff limit"}]}}, sub="status")
    failed = await eventually(lambda: (c := cluster.condition("InferenceSession", "tiny", "ModelReady"))
                              and c["reason"] == "DownloadFailed" and c)
    assert "BackoffLimitExceeded" in failed["message"]
    await cluster.patch("Job", "tiny-model-download", {"status": {"succeeded": 1, "conditions": []}}, sub="status")
    await eventually(lambda: cluster.condition("InferenceSession", "tiny", "ModelReady")["status"] == "True")
    assert admit(load_crd("inferencesessions"), cluster.get("InferenceSession", "tiny"))[1] == []
