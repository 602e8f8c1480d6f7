#!/usr/bin/env bash
# Check a built server image on a machine with an NVIDIA GPU and a container engine (the GPU nodes'
# runtime: the NVIDIA container toolkit): torch imports with CUDA and sees the GPU, and Triton compiles
# and runs a kernel (it builds a C launcher at run time, so the image needs a C compiler).
#
# Usage: scripts/check_server_image.sh IMAGE          e.g. registry.example.com/ml/mambaserve-server:0.1.0
# Environment: CONTAINER_TOOL  docker or podman (default: the first found)
# Prints torch/CUDA/Triton versions, the GPU and "OK"; exits non-zero otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
image="${1:?usage: scripts/check_server_image.sh IMAGE}"
tool="${CONTAINER_TOOL:-$(command -v docker >/dev/null && echo docker || echo podman)}"
case "$tool" in
  docker) gpus=(--gpus all) ;;
  podman) gpus=(--device nvidia.com/gpu=all) ;;  # CDI, as the NVIDIA container toolkit sets it up
  *) echo "CONTAINER_TOOL must be docker or podman" >&2; exit 2 ;;
esac
# As the pods run it: UID 65532, a read-only root filesystem, HOME and TMPDIR on writable scratch.
exec "$tool" run --rm "${gpus[@]}" --user 65532:65532 --read-only \
  --tmpfs /tmp --tmpfs /var/lib/mambaserve/home -e HOME=/var/lib/mambaserve/home -e TMPDIR=/tmp \
  -e TRITON_CACHE_DIR=/var/lib/mambaserve/home/.triton/cache \
  -v "$PWD/scripts/check_cuda_triton.py:/check.py:ro" --entrypoint python3 "$image" /check.py
