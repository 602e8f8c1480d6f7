"""How the model reaches the server pods.

- ``pvc://claim[/path]``: a pre-populated claim, mounted read-only.
- an absolute path: inside the image, nothing to do.
- ``hf://org/name[@rev]`` with ``model.cache.enabled``: a claim owned by the session that a Job
  fills once (only the files the server loads); every pod mounts it read-only and an init container
  waits for the download's completion marker. A new revision downloads into its own directory, so
  running pods keep reading the old one until they are replaced.
- ``hf://`` without the cache: each pod downloads into an emptyDir in an init container (no shared
  storage needed, but every pod start downloads again).

Downloads run ``python -m mambaserve.server.model.download`` from the server image: restricted
security context, bounded resources, a Hugging Face token from a Secret when given.
"""

from __future__ import annotations

from typing import Any

from mambaserve.operator import names
from mambaserve.operator.builders import pod
from mambaserve.operator.builders.common import session_metadata
from mambaserve.operator.builders.storage import session_claim
from mambaserve.operator.spec import InferenceSession

MODEL_DIR = "/models"
# Written last by mambaserve.server.model.download (its MARKER); a test keeps the two equal.
DOWNLOAD_MARKER = ".mambaserve-download-complete"
HOME_DIR = "/var/lib/mambaserve/home"
# The download is network- and disk-bound: one core; memory for huggingface_hub's buffers and
# hashing, with a limit so a runaway download cannot take the node's memory.
DOWNLOAD_REQUESTS = {"cpu": "1", "memory": "1Gi"}
DOWNLOAD_LIMITS = {"memory": "4Gi"}
WAIT_RESOURCES = {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}}
JOB_BACKOFF_LIMIT = 6


def model_dir(session: InferenceSession) -> str:
    """Where the checkpoint is inside the server container (the server's --model)."""
    model = session.model
    if model.scheme == "hf":
        if model.cache.enabled:
            # One directory per repository and revision on the shared claim.
            return f"{MODEL_DIR}/{model.hf_repo.replace('/', '--')}/{model.hf_revision.replace('/', '--')}"
        return f"{MODEL_DIR}/{model.hf_repo.split('/')[-1]}"
    if model.scheme == "pvc":
        return f"{MODEL_DIR}/{model.pvc_path}".rstrip("/") if model.pvc_path else MODEL_DIR
    return model.source


def uses_cache(session: InferenceSession) -> bool:
    return session.model.scheme == "hf" and session.model.cache.enabled


def _env(session: InferenceSession) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": HOME_DIR},
        {"name": "TMPDIR", "value": pod.TMP_DIR},
        {"name": "HF_HOME", "value": f"{HOME_DIR}/.cache/huggingface"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
    ]
    if session.model.token_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {
            "secretKeyRef": {"name": session.model.token_secret, "key": session.model.token_key}}})
    return env


def _download_resources(session: InferenceSession) -> dict[str, Any]:
    d = session.model.download
    requests = {**DOWNLOAD_REQUESTS, **{k: str(v) for k, v in d.requests.items()}}
    limits = {**DOWNLOAD_LIMITS, **{k: str(v) for k, v in d.limits.items()}}
    return {"requests": requests, "limits": limits}


def _scratch() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return ([pod.empty_dir("dl-tmp", "1Gi"), pod.empty_dir("dl-home", "1Gi")],
            [pod.mount("dl-tmp", pod.TMP_DIR), pod.mount("dl-home", HOME_DIR)])


def download_container(session: InferenceSession, image: str, volume: str) -> dict[str, Any]:
    model = session.model
    command = ["python3", "-m", "mambaserve.server.model.download", model.hf_repo, model.hf_revision,
               model_dir(session)]
    for pattern in model.download.allow_patterns:
        command += ["--allow", pattern]
    return {
        "name": "model-download",
        "image": image,
        "imagePullPolicy": session.image_pull_policy,
        "command": command,
        "env": _env(session),
        "resources": _download_resources(session),
        "volumeMounts": [pod.mount(volume, MODEL_DIR), *_scratch()[1]],
        "securityContext": pod.container_security_context(),
    }


def _wait_container(session: InferenceSession, image: str) -> dict[str, Any]:
    marker = f"{model_dir(session)}/{DOWNLOAD_MARKER}"
    return {
        "name": "model-wait",
        "image": image,
        "imagePullPolicy": session.image_pull_policy,
        # The Job may still be downloading (or retrying): hold the server until the marker is there.
        "command": ["python3", "-c",
                    "import os, sys, time\n"
                    "while not os.path.exists(sys.argv[1]):\n"
                    "    print('waiting for the model download:', sys.argv[1], flush=True); time.sleep(10)",
                    marker],
        "resources": WAIT_RESOURCES,
        "volumeMounts": [pod.mount("model", MODEL_DIR, read_only=True)],
        "securityContext": pod.container_security_context(),
    }


def model_volumes(session: InferenceSession, image: str) -> tuple[list[dict], list[dict], list[dict]]:
    """Volumes, server mounts and init containers that put the model at model_dir()."""
    model = session.model
    read_only = [pod.mount("model", MODEL_DIR, read_only=True)]
    if model.scheme == "pvc":
        return [{"name": "model", "persistentVolumeClaim": {"claimName": model.pvc_claim, "readOnly": True}}], \
            read_only, []
    if model.scheme == "hf" and model.cache.enabled:
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": names.model_claim(session.name),
                                                             "readOnly": True}}
        return [volume], read_only, [_wait_container(session, image)]
    if model.scheme == "hf":
        volumes = [pod.empty_dir("model", model.download_size_limit), *_scratch()[0]]
        return volumes, read_only, [download_container(session, image, "model")]
    return [], [], []


def build_model_claim(session: InferenceSession) -> dict[str, Any]:
    cache = session.model.cache
    return session_claim(session, names.model_claim(session.name), "model-cache", cache.size or "",
                         cache.access_mode, cache.storage_class_name)


def build_model_job(session: InferenceSession, image: str) -> dict[str, Any]:
    """The one download into the model claim. A Job's pod template cannot change: a new revision or
    image makes a new Job (the immutable hash), which downloads into the new revision's directory."""
    scratch_volumes, _ = _scratch()
    template = {
        "metadata": {"labels": names.session_labels(session.name, "model-download")},
        "spec": {
            "restartPolicy": "OnFailure",
            "containers": [download_container(session, image, "model")],
            "volumes": [{"name": "model", "persistentVolumeClaim": {"claimName": names.model_claim(session.name)}},
                        *scratch_volumes],
            "securityContext": pod.pod_security_context(),
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            **({"imagePullSecrets": [{"name": s} for s in session.image_pull_secrets]}
               if session.image_pull_secrets else {}),
        },
    }
    spec = {"backoffLimit": JOB_BACKOFF_LIMIT, "template": template}
    obj = {"apiVersion": "batch/v1", "kind": "Job",
           "metadata": session_metadata(session, names.model_job(session.name), "model-download"), "spec": spec}
    return names.stamp(obj, immutable=spec)
