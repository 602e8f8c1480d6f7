#!/usr/bin/env bash
# The hybrid models' benchmarks on one GPU (random weights at nemotron-h-8b and granite-4.0-h-tiny shape, bf16):
#   e2e.py: transformers (decode step at batch 1 / 64 / 256, one prefill forward), then the engine on the same
#     checkpoint (decode tok/s against the bandwidth bound, prefill 8 x 2048, TTFT of 2,048 tokens): one table
#     with the ratios;
#   multiturn.py: 8 chats x 4 rounds through HTTP, per-round hit rate and TTFT, with the radix cache and with
#     --disable-radix-cache (a mode the server refuses is reported as refused), then with 12 state slots and
#     with 12 slots + an 8 GiB host tier (the Mamba snapshots go there, the KV stays on the GPU); servers run 8
#     requests at most and capture decode graphs up to batch 8 only (a shorter start).
# Each checkpoint is built once (in $CKPTS, default /tmp) and reused by the later runs and calls.
# Usage (GPU machine, repo root, wheels for fastapi/uvicorn/pydantic in .whl/): bash benchmarks/hybrid_session.sh [SHAPES]
# SHAPES: any of nemotron-h-8b granite-4.0-h-tiny (default: both). Results: $OUT (default /tmp/out).
# MULTITURN=0 skips the multi-turn runs; E2E_ARGS / MT_ARGS add flags to each script.
set -uo pipefail
SHAPES=${*:-nemotron-h-8b granite-4.0-h-tiny}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CKPTS=${CKPTS:-/tmp}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
cd benchmarks
for shape in $SHAPES; do
  start=$SECONDS
  echo "== $shape: e2e"
  python3 e2e.py --size "$shape" --checkpoint "$CKPTS/$shape" --batches 1,64,256 --decode-tokens 32 --hf-tokens 8 \
    --prefill 8x2048 --ttft 2048 --json "$OUT/e2e_$shape.json" ${E2E_ARGS:-} 2>&1 | grep -v -i "falling back\|Writing model"
  if [ "${MULTITURN:-1}" = 1 ]; then
    echo "== $shape: multi-turn"
    python3 multiturn.py --model "$CKPTS/$shape" --compare --clients 8 --rounds 4 --request-length 1024 \
      --question-length 64 --output-length 16 --round-barrier --out "$OUT/multiturn_$shape.json" \
      --server-args "--max-running-requests 8 --cuda-graph-max-bs 8" ${MT_ARGS:-} 2>&1 \
      | grep -v -i "falling back"
    for v in "12" "12 --host-cache-size 8GiB"; do
      echo "== $shape: multi-turn, --mamba-cache-size $v"
      python3 multiturn.py --model "$CKPTS/$shape" --clients 8 --rounds 4 --request-length 1024 \
        --question-length 64 --output-length 16 --round-barrier --out "$OUT/multiturn_${shape}_slots_${v// /_}.json" \
        --server-args "--max-running-requests 8 --cuda-graph-max-bs 8 --mamba-cache-size $v" ${MT_ARGS:-} 2>&1 \
        | grep -v -i "falling back"
    done
  fi
  echo "== $shape: $((SECONDS - start)) s"
done
