#!/usr/bin/env bash
# The hybrid models' benchmarks on one GPU, one run per shape (random bf16 weights at nemotron-h-8b and
# granite-4.0-h-tiny shape), then one table (hybrid_summary.py, issue 28's rows):
#   e2e.py: transformers (decode step at batch 1 and 64, one prefill forward; out of memory is reported as such, the
#     prefill measured in pieces that fit), its model freed, then the engine on the same checkpoint (decode at batch
#     1 / 64 / 256 against the bandwidth bound, prefill 8 x 2,048 against the bf16 peak, TTFT of 2,048 tokens);
#   multiturn.py, 8 chats x 4 rounds (1,024-token prompts, 64-token questions, 16-token answers, a barrier between
#     rounds): with the radix cache on a fresh server (an empty compile cache) and with --disable-radix-cache; with
#     --mamba-cache-size 12; then 8 rounds (a server started later: a warm compile cache; its first round against the
#     fresh server's, its slowest round against the median). Servers run 8 requests at most, decode graphs up to 8.
# Every server's kernel compiles after ready (mambaserve_kernel_compiles_total{phase="serving"}) go in the table:
# they should be 0.
# Each checkpoint is built once (in $CKPTS, default /tmp) and reused by the later runs and calls.
# Usage (GPU machine, repo root, wheels for fastapi/uvicorn/pydantic in .whl/): bash benchmarks/hybrid_session.sh [SHAPES]
# SHAPES: any of nemotron-h-8b granite-4.0-h-tiny (default: both). Results: $OUT (default /tmp/out).
# MULTITURN=0 skips the multi-turn runs, HOST_TIER=1 adds 12 slots + an 8 GiB host tier; E2E_ARGS / MT_ARGS add
# flags to each script (a later flag wins). A CPU smoke run of the whole script at a tiny shape (seconds):
#   DEVICE=cpu CKPTS=/tmp/smoke OUT=/tmp/smoke E2E_ARGS="--batches 1,4 --hf-batches 1 --prefill 2x64 --ttft 128" \
#     MT_ARGS="--request-length 64 --question-length 16 --output-length 4" bash benchmarks/hybrid_session.sh nemotron-tiny
set -uo pipefail
SHAPES=${*:-nemotron-h-8b granite-4.0-h-tiny}
OUT=$(realpath -m "${OUT:-/tmp/out}"); mkdir -p "$OUT"
CKPTS=$(realpath -m "${CKPTS:-/tmp}")
DEVICE=${DEVICE:-cuda}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
cd benchmarks
for shape in $SHAPES; do
  start=$SECONDS
  KC="$OUT/kernel-cache-$shape"  # the multi-turn servers' compile cache: empty for the first one
  rm -rf "$KC" "$OUT/kernel-cache-e2e-$shape"
  echo "== $shape: e2e"
  python3 e2e.py --size "$shape" --checkpoint "$CKPTS/$shape" --device "$DEVICE" --batches 1,64,256 --hf-batches 1,64 \
    --decode-tokens 32 --hf-tokens 8 --prefill 8x2048 --ttft 2048 --kernel-cache-dir "$OUT/kernel-cache-e2e-$shape" \
    --json "$OUT/e2e_$shape.json" ${E2E_ARGS:-} 2>&1 | grep -v -i "falling back\|Writing model"
  if [ "${MULTITURN:-1}" = 1 ]; then
    SERVER="--device $DEVICE --max-running-requests 8 --cuda-graph-max-bs 8 --kernel-cache-dir $KC"
    MT="--model $CKPTS/$shape --clients 8 --request-length 1024 --question-length 64 --output-length 16 --round-barrier"
    echo "== $shape: multi-turn, radix cache (a fresh server) and --disable-radix-cache"
    python3 multiturn.py $MT --compare --rounds 4 --out "$OUT/multiturn_$shape.json" --server-args "$SERVER" \
      ${MT_ARGS:-} 2>&1 | grep -v -i "falling back"
    slots=("12")
    [ "${HOST_TIER:-0}" = 1 ] && slots+=("12 --host-cache-size 8GiB")
    for v in "${slots[@]}"; do
      echo "== $shape: multi-turn, --mamba-cache-size $v"
      python3 multiturn.py $MT --rounds 4 --out "$OUT/multiturn_${shape}_slots_${v// /_}.json" \
        --server-args "$SERVER --mamba-cache-size $v" ${MT_ARGS:-} 2>&1 | grep -v -i "falling back"
    done
    echo "== $shape: multi-turn, 8 rounds (a warm compile cache)"
    python3 multiturn.py $MT --rounds 8 --out "$OUT/multiturn_${shape}_rounds_8.json" --server-args "$SERVER" \
      ${MT_ARGS:-} 2>&1 | grep -v -i "falling back"
  fi
  echo "== $shape: $((SECONDS - start)) s"
done
echo
python3 hybrid_summary.py --out "$OUT" $SHAPES
