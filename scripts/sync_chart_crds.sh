#!/usr/bin/env bash
# Re-copies the CRDs (crds/*.yaml, the single source of truth; not crds/samples/) into the Helm chart,
# and regenerates the chart's prometheus-adapter rules from the operator. tests/charts fails until
# both are in step. Run from anywhere: scripts/sync_chart_crds.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
chart="$root/charts/mambaserve"

rm -f "$chart"/crds/*.yaml
cp "$root"/crds/*.yaml "$chart/crds/"

python="$root/.venv/bin/python"
[ -x "$python" ] || python=python3
"$python" -m mambaserve.operator adapter-rules > "$chart/files/prometheus-adapter-rules.yaml"

echo "chart CRDs: $(cd "$chart/crds" && ls | tr '\n' ' ')"
echo "adapter rules: charts/mambaserve/files/prometheus-adapter-rules.yaml"
