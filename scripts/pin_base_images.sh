#!/usr/bin/env bash
# Pin the images' bases by digest: each tag in images/bases.lock resolved to the digest of the manifest
# (list) its registry serves now, written back as REFERENCE:TAG@sha256:DIGEST. Needs the registry and one
# of skopeo, crane or docker (buildx). Run before a release build, then commit images/bases.lock.
set -euo pipefail
cd "$(dirname "$0")/.."
digest() {
  if command -v skopeo >/dev/null; then skopeo inspect --raw "docker://$1" | sha256sum | sed 's/^/sha256:/; s/ .*//'
  elif command -v crane >/dev/null; then crane digest "$1"
  elif command -v docker >/dev/null; then docker buildx imagetools inspect "$1" --format '{{.Manifest.Digest}}'
  else echo "no skopeo, crane or docker to read the registry with" >&2; exit 2; fi
}
tmp="$(mktemp)"; trap 'rm -f "$tmp"' EXIT
while IFS= read -r line; do
  case "$line" in
    \#*|"") echo "$line" ;;
    *) name="${line%% *}"; ref="${line#* }"; ref="${ref%%@*}"
       sum="$(digest "$ref")"
       [[ "$sum" =~ ^sha256:[0-9a-f]{64}$ ]] || { echo "no digest for $ref: $sum" >&2; exit 1; }
       echo "$name $ref@$sum" ;;
  esac
done < images/bases.lock > "$tmp"
cp "$tmp" images/bases.lock
grep -v '^#' images/bases.lock
