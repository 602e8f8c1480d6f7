# The mambaserve server: `mambaserve serve` on a CUDA + PyTorch base, as a non-root user.
#
#   scripts/build_images.sh REGISTRY/PREFIX [TAG]      (docs/operations.md, "Images")
#   docker build -f images/server.Dockerfile -t mambaserve-server:0.1.0 .    (context: the repository root)
#
# The base brings Python, CUDA and the PyTorch release requirements-server.txt pins (a CUDA build,
# with the Triton it was built with); this file adds the server's other dependencies, every one pinned
# and hashed (requirements-server.lock, pip --require-hashes), the package and the bundled model.
# scripts/build_images.sh builds from the base pinned by digest in images/bases.lock;
# scripts/check_server_image.sh checks a built image imports CUDA torch and compiles a Triton kernel. Any BASE_IMAGE with python3, pip and that torch on PATH works:
# tests/images builds this file on a Debian base with the CPU torch.
ARG BASE_IMAGE=docker.io/pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

# USER: getpass.getuser() (torch's and Triton's cache paths) fails for a UID without a passwd
# entry unless the environment names the user (OpenShift runs pods under arbitrary UIDs).
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/var/lib/mambaserve/home \
    USER=mambaserve

WORKDIR /opt/mambaserve/src
COPY pyproject.toml README.md requirements-server.txt requirements-server.lock ./
COPY server/ server/
COPY kernels/ kernels/
COPY operator/ operator/
COPY crds/ crds/
# Baked in where InferenceSessions name in-image models: spec.model.source /models/mamba2-tiny-pystdlib.
COPY models/mamba2-tiny-pystdlib/ /models/mamba2-tiny-pystdlib/

# torch is checked, not installed: a mismatched base would make pip pull a second multi-GB torch.
# UID 65532 is the identity the operator's pods run as (runAsUser); runAsNonRoot needs it numeric.
# HOME matches the operator's writable scratch volume (operator/builders/server.py, HOME_DIR).
# Triton compiles a small C launcher for each kernel the first time it runs: a C compiler is part of the
# runtime (PyTorch's -runtime images have none). scripts/check_server_image.sh checks it on a GPU node.
RUN set -eu; \
    if ! command -v cc >/dev/null; then \
        apt-get update; apt-get install -y --no-install-recommends gcc libc6-dev; rm -rf /var/lib/apt/lists/*; \
    fi; \
    pinned="$(sed -n 's/^torch==//p' requirements-server.txt)"; \
    python3 -c 'import sys, torch; have = torch.__version__.split("+")[0]; \
sys.exit(None if have == sys.argv[1] else f"the base image has torch {have}, requirements-server.txt pins {sys.argv[1]}: choose a BASE_IMAGE with it")' "$pinned"; \
    python3 -m pip install --require-hashes -r requirements-server.lock; \
    python3 -m pip install --no-deps .; \
    rm -rf build ./*.egg-info; \
    getent group 65532 >/dev/null || groupadd --gid 65532 mambaserve; \
    getent passwd 65532 >/dev/null || useradd --uid 65532 --gid 65532 --no-create-home \
        --home-dir /var/lib/mambaserve/home --shell /usr/sbin/nologin mambaserve; \
    install -d -o 65532 -g 65532 /var/lib/mambaserve /var/lib/mambaserve/home; \
    mambaserve serve --help >/dev/null

USER 65532:65532
WORKDIR /var/lib/mambaserve
EXPOSE 30000
ENTRYPOINT ["mambaserve", "serve"]
CMD ["--model", "/models/mamba2-tiny-pystdlib", "--host", "0.0.0.0", "--port", "30000"]
