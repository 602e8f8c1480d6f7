#!/usr/bin/env bash
# Build, and with --push push, the two mambaserve images from this checkout (docs/operations.md, "Images"):
#
#   REPOSITORY/mambaserve-server:TAG     images/server.Dockerfile    CUDA + PyTorch base, `mambaserve serve`
#   REPOSITORY/mambaserve-operator:TAG   images/operator.Dockerfile  `mambaserve-operator`, no torch
#
# Usage: scripts/build_images.sh [--push] [--tag TAG] REPOSITORY
#   REPOSITORY  where the images go, e.g. registry.example.com/ml (log in first: docker/podman/buildah login)
#   --tag TAG   default: the package version in pyproject.toml, the tag the Helm chart pins
#   --push      push both images after building them
# Environment:
#   CONTAINER_TOOL       docker, podman or buildah (default: the first of them found)
#   SERVER_BASE_IMAGE    base of the server image (default: images/bases.lock's, the PyTorch image of the
#                        torch release requirements-server.txt pins, pinned by digest)
#   OPERATOR_BASE_IMAGE  base of the operator image (default: images/bases.lock's Python 3.11 slim image)
#   ALLOW_UNPINNED_BASE  1: build from a base without @sha256: (scripts/pin_base_images.sh pins them)
#   BUILD_ARGS           more arguments for the build command (e.g. --platform linux/amd64)
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }

push=0 tag="" repository=""
while [ $# -gt 0 ]; do
  case "$1" in
    --push) push=1 ;;
    --tag) tag="${2:?--tag needs a value}"; shift ;;
    --tag=*) tag="${1#--tag=}" ;;
    -h|--help) usage ;;
    -*) echo "unknown option: $1" >&2; usage 2 >&2 ;;
    *) [ -z "$repository" ] || { echo "one REPOSITORY only" >&2; exit 2; }; repository="${1%/}" ;;
  esac
  shift
done
[ -n "$repository" ] || { echo "REPOSITORY is required (e.g. registry.example.com/ml)" >&2; usage 2 >&2; }

tag="${tag:-$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)}"
case "$tag" in
  ""|latest) echo "tag '$tag' is not a release: the chart pins images to one (--tag X.Y.Z)" >&2; exit 2 ;;
esac

tool="${CONTAINER_TOOL:-}"
if [ -z "$tool" ]; then
  for candidate in docker podman buildah; do
    command -v "$candidate" >/dev/null || continue
    # a docker client without a reachable daemon cannot build
    if [ "$candidate" != docker ] || docker info >/dev/null 2>&1; then tool="$candidate"; break; fi
  done
fi
case "$tool" in
  docker|podman) build=("$tool" build) ;;
  buildah) build=(buildah bud) ;;
  *) echo "no container tool: install docker, podman or buildah, or set CONTAINER_TOOL" >&2; exit 2 ;;
esac

locked() { sed -n "s/^$1 //p" images/bases.lock; }
server_base="${SERVER_BASE_IMAGE:-$(locked server)}"
operator_base="${OPERATOR_BASE_IMAGE:-$(locked operator)}"
for base in "$server_base" "$operator_base"; do
  case "$base" in
    *@sha256:*) ;;
    *) [ "${ALLOW_UNPINNED_BASE:-0}" = 1 ] || {
         echo "base $base is not pinned by digest: run scripts/pin_base_images.sh (or ALLOW_UNPINNED_BASE=1)" >&2
         exit 2; } ;;
  esac
done
server="$repository/mambaserve-server:$tag"
operator="$repository/mambaserve-operator:$tag"
# shellcheck disable=SC2206  # BUILD_ARGS is a list of words on purpose
extra=(${BUILD_ARGS:-})

set -x
"${build[@]}" "${extra[@]}" -f images/server.Dockerfile --build-arg "BASE_IMAGE=$server_base" -t "$server" .
"${build[@]}" "${extra[@]}" -f images/operator.Dockerfile --build-arg "BASE_IMAGE=$operator_base" -t "$operator" .
pushed() {  # push IMAGE, print the digest the registry stored it under
  if [ "$tool" = docker ]; then
    docker push "$1" >&2 && docker inspect --format '{{index .RepoDigests 0}}' "$1" | sed 's/.*@//'
  else
    local file; file="$(mktemp)"; "$tool" push --digestfile "$file" "$1" >&2 && cat "$file"; rm -f "$file"
  fi
}
digests=""
if [ "$push" = 1 ]; then
  digests="--set server.image.digest=$(pushed "$server") --set operator.image.digest=$(pushed "$operator")"
fi
{ set +x; } 2>/dev/null
if [ "$push" = 1 ]; then echo "built and pushed: $server $operator"; else echo "built: $server $operator"; fi
echo "helm install ... --set server.image.repository=$repository/mambaserve-server --set server.image.tag=$tag" \
     "--set operator.image.repository=$repository/mambaserve-operator --set operator.image.tag=$tag $digests"
