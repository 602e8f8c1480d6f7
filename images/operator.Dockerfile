# The mambaserve operator: `mambaserve-operator` and nothing of the engine (no torch, no
# transformers), as a non-root user.
#
#   scripts/build_images.sh REGISTRY/PREFIX [TAG]      (docs/operations.md, "Images")
#   docker build -f images/operator.Dockerfile -t mambaserve-operator:0.1.0 .    (context: the repository root)
#
# The package is installed without its dependencies (those are the server's) and with
# requirements-operator.lock instead (every dependency pinned and hashed: pip --require-hashes), in a
# virtual environment: the same steps then work on
# the official Python image and on Debian's python3 (tests/images builds this file on one).
ARG BASE_IMAGE=docker.io/library/python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# USER: Kopf names itself after getpass.getuser(), which fails for a UID without a passwd entry
# unless the environment names the user (OpenShift runs pods under arbitrary UIDs).
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/mambaserve/bin:$PATH \
    USER=mambaserve

WORKDIR /opt/mambaserve/src
COPY pyproject.toml README.md requirements-operator.txt requirements-operator.lock ./
COPY server/ server/
COPY kernels/ kernels/
COPY operator/ operator/
COPY crds/ crds/

# The import check keeps the promise of this image: a dependency that drags torch in fails the build.
RUN set -eu; \
    python3 -m venv /opt/mambaserve; \
    pip install --require-hashes -r requirements-operator.lock; \
    pip install --no-deps .; \
    rm -rf build ./*.egg-info; \
    if python -c 'import torch' 2>/dev/null; then echo 'torch is in the operator image' >&2; exit 1; fi; \
    mambaserve-operator --help >/dev/null; \
    getent group 65532 >/dev/null || groupadd --gid 65532 mambaserve; \
    getent passwd 65532 >/dev/null || useradd --uid 65532 --gid 65532 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin mambaserve

# The chart's operator pod runs as 65532 too (runAsUser); runAsNonRoot needs it numeric.
USER 65532:65532
WORKDIR /
EXPOSE 8080 8081
ENTRYPOINT ["mambaserve-operator"]
