"""The project's images built and run here with Debian's buildah, without a registry.

No registry base image can be pulled here, so the two bases the Dockerfiles start from are made
locally and kept between runs in CACHE (MAMBASERVE_IMAGE_CACHE, default /var/tmp/mambaserve-image-test):

- ``python``: Debian bookworm from debootstrap (python3 3.11, venv, CA certificates), imported with
  ``buildah from scratch``; it stands in for docker.io/library/python:3.11-slim-bookworm.
- ``torch``: ``python`` plus a virtual environment on PATH holding the torch release
  requirements-server.txt pins (the CPU build); it stands in for the PyTorch CUDA image.

The project's images are then built by scripts/build_images.sh from the real Dockerfiles, with
only BASE_IMAGE swapped and pip reading this machine's package-index configuration. Storage is
vfs (no overlay here) and every command runs with chroot isolation, the host's network shared:
a server started in a container answers on loopback.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("MAMBASERVE_IMAGE_CACHE", "/var/tmp/mambaserve-image-test"))
SUITE = "bookworm"  # Python 3.11, as the operator image's default base and this machine's wheels
DEBOOTSTRAP = ["--variant=minbase", "--include=python3,python3-venv,ca-certificates", SUITE]
# pip options that name where packages come from; local paths among their values are mounted read-only.
PIP_KEYS = ("index-url", "extra-index-url", "find-links", "cert", "trusted-host", "default-timeout")


def why_not() -> str | None:
    """Why the image tests cannot run here, or None. They run only when asked (`make test-images`
    sets MAMBASERVE_IMAGE_TESTS=1): minutes of building is too long for every `make test`."""
    if os.environ.get("MAMBASERVE_IMAGE_TESTS") != "1":
        return "image builds take minutes: run `make test-images` (or set MAMBASERVE_IMAGE_TESTS=1)"
    if os.geteuid() != 0:
        return "building images with buildah (vfs storage, chroot isolation) and debootstrap needs root"
    missing = [tool for tool in ("buildah", "debootstrap") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (Debian: apt-get install buildah debootstrap)"
    return None


def _key(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def torch_pin() -> str:
    return re.search(r"^torch==(\S+)$", (ROOT / "requirements-server.txt").read_text(), re.M).group(1)


class Buildah:
    """buildah with this test's own storage (vfs under CACHE) and chroot isolation."""

    def __init__(self, cache: Path = CACHE) -> None:
        self.cache = cache
        self.logs = cache / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        conf = cache / "storage.conf"
        conf.write_text(f'[storage]\ndriver = "vfs"\ngraphroot = "{cache / "storage"}"\n'
                        f'runroot = "{cache / "run"}"\n')
        self.env = {**os.environ, "CONTAINERS_STORAGE_CONF": str(conf), "BUILDAH_ISOLATION": "chroot"}
        self.volumes = self._pip_volumes()

    # --- commands ---------------------------------------------------------------------------

    def __call__(self, *args: str, timeout: float = 900, log: str | None = None) -> str:
        """Run ``buildah ARGS``; its output, or an AssertionError with the end of it."""
        proc = subprocess.run(["buildah", *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if log:
            (self.logs / log).write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise AssertionError(f"buildah {' '.join(args[:3])} ... failed ({proc.returncode}):\n"
                                 + (proc.stdout + proc.stderr)[-4000:])
        return proc.stdout.strip()

    def exists(self, image: str) -> bool:
        return subprocess.run(["buildah", "inspect", "--type", "image", image], env=self.env,
                              capture_output=True).returncode == 0

    def config(self, image: str) -> dict[str, Any]:
        """The image's OCI config: User, Env, Entrypoint, Cmd, WorkingDir, ExposedPorts."""
        return json.loads(self("inspect", "--type", "image", image))["OCIv1"]["config"]

    # --- bases ----------------------------------------------------------------------------------

    def python_base(self) -> str:
        image = f"localhost/mambaserve-test-python:{SUITE}-{_key(*DEBOOTSTRAP)}"
        if self.exists(image):
            return image
        rootfs = self.cache / "rootfs"
        shutil.rmtree(rootfs, ignore_errors=True)
        boot = subprocess.run(["debootstrap", *DEBOOTSTRAP, str(rootfs)], capture_output=True, text=True, timeout=1200)
        (self.logs / "debootstrap.log").write_text(boot.stdout + boot.stderr)
        assert boot.returncode == 0, f"debootstrap failed:\n{(boot.stdout + boot.stderr)[-3000:]}"
        ctr = self("from", "scratch")
        try:
            mount = self("mount", ctr)
            subprocess.run(["cp", "-a", f"{rootfs}/.", mount], check=True)
            self("umount", ctr)
            self("config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                 "--cmd", "/bin/bash", ctr)
            self("commit", "-q", ctr, image)
        finally:
            self("rm", ctr)
            shutil.rmtree(rootfs, ignore_errors=True)
        return image

    def torch_base(self) -> str:
        python = self.python_base()
        version = torch_pin()
        image = f"localhost/mambaserve-test-torch:{version}-{_key(python, version)}"
        if self.exists(image):
            return image
        ctr = self("from", python)
        try:
            self("run", *self.volumes, ctr, "--", "sh", "-c",
                 f"python3 -m venv /opt/python && PIP_NO_CACHE_DIR=1 /opt/python/bin/pip install -q torch=={version}",
                 timeout=1800, log="torch-base.log")
            self("config", "--env", "PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                 ctr)
            self("commit", "-q", ctr, image)
        finally:
            self("rm", ctr)
        return image

    def _pip_volumes(self) -> list[str]:
        """``--volume`` arguments that give pip in a build this machine's package-index settings."""
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
        settings: dict[str, str] = {}
        for line in out.splitlines():  # "global.find-links='/opt/wheels'" or ":env:.cert='...'"
            name, _, value = line.partition("=")
            key = name.rpartition(".")[2]
            if key in PIP_KEYS:
                settings[key] = value.strip().strip("'\"")
        pip_dir = self.cache / "pip"
        pip_dir.mkdir(exist_ok=True)
        (pip_dir / "pip.conf").write_text("[global]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
        volumes = [f"{pip_dir / 'pip.conf'}:/etc/pip.conf:ro"]
        for key, value in settings.items():
            for word in value.split():
                path = Path(word.removeprefix("file://"))
                # a local index's pages link to files beside it (simple/NAME/ -> ../../files/...)
                path = path.parent if key.endswith("index-url") and path.name == "simple" else path
                if path.is_absolute() and path.exists() and not any(v.startswith(f"{path}:") for v in volumes):
                    volumes.append(f"{path}:{path}:ro")
        return [arg for v in volumes for arg in ("--volume", v)]

    # --- the project's images -------------------------------------------------------------------

    def build_project_images(self, repository: str, tag: str) -> tuple[str, str]:
        """Build both images with scripts/build_images.sh on the local bases: (server, operator)."""
        server, operator = f"{repository}/mambaserve-server:{tag}", f"{repository}/mambaserve-operator:{tag}"
        for old in (server, operator):  # vfs keeps every copy: drop the previous run's images first
            subprocess.run(["buildah", "rmi", "-f", old], env=self.env, capture_output=True)
        env = {**self.env, "CONTAINER_TOOL": "buildah", "ALLOW_UNPINNED_BASE": "1", "SERVER_BASE_IMAGE": self.torch_base(),
               "OPERATOR_BASE_IMAGE": self.python_base(), "BUILD_ARGS": " ".join(self.volumes)}
        proc = subprocess.run([str(ROOT / "scripts" / "build_images.sh"), "--tag", tag, repository], env=env,
                              capture_output=True, text=True, timeout=2400)
        (self.logs / "build_images.log").write_text(proc.stdout + proc.stderr)
        assert proc.returncode == 0, f"scripts/build_images.sh failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
        subprocess.run(["buildah", "rmi", "--prune"], env=self.env, capture_output=True)
        return server, operator

    # --- containers -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def container(self, image: str) -> Iterator[Container]:
        ctr = Container(self, self("from", image))
        try:
            yield ctr
        finally:
            ctr.stop()
            subprocess.run(["buildah", "rm", ctr.name], env=self.env, capture_output=True)


class Container:
    """A working container: commands run in it as the image's user, in its working directory, with
    its environment (``buildah run``), the host's network shared."""

    def __init__(self, buildah: Buildah, name: str) -> None:
        self.buildah, self.name = buildah, name
        self.started: list[subprocess.Popen[str]] = []

    def run(self, cmd: Sequence[str], *, volumes: Sequence[str] = (), timeout: float = 300
            ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self._argv(cmd, volumes), env=self.buildah.env, capture_output=True, text=True,
                              timeout=timeout)

    def start(self, cmd: Sequence[str], log: Path, *, volumes: Sequence[str] = ()) -> subprocess.Popen[str]:
        """Start ``cmd`` in the background, in a process group of its own (stop() ends that group)."""
        with log.open("w") as out:
            proc = subprocess.Popen(self._argv(cmd, volumes), env=self.buildah.env, stdout=out,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.started.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)

    def _argv(self, cmd: Sequence[str], volumes: Sequence[str]) -> list[str]:
        return ["buildah", "run", *(a for v in volumes for a in ("--volume", v)), self.name, "--", *cmd]
