#!/usr/bin/env bash
# Serving benchmarks at the mamba2-2.7b shape on one GPU (random weights, bf16), each through HTTP:
#   ttft.py (short prompts cold/hit, streamed/whole, 1 and 10 clients, stage shares, device floor),
#   multiturn.py (10 chats x 8 rounds, 2,048-token first prompt + 128-token questions, round barrier)
#     with 320 slots, 12 slots, 12 slots + a 16 GiB host tier, and --disable-radix-cache,
#   burst.py (8/64/256 requests at once, 256 and 1,024 new tokens, HTTP against in-process).
# Usage (GPU machine, repo root, wheels for fastapi/uvicorn/pydantic in .whl/): bash benchmarks/serving_session.sh [PARTS]
# PARTS: any of ttft multiturn burst (default: all). Results: $OUT (default /tmp/out).
set -uo pipefail
PARTS=${*:-ttft multiturn burst}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
cd benchmarks
CKPT=${CKPT:-/tmp/m27}
[ -d "$CKPT" ] || python3 -c "
import torch; from pathlib import Path; from e2e import build_checkpoint
build_checkpoint('2.7b', Path('$CKPT'), 'cuda', torch.bfloat16)" 2>&1 | grep -v Writing
FLAGS=${FLAGS:-}
for part in $PARTS; do
  case $part in
    ttft) python3 ttft.py --model "$CKPT" --flags "$FLAGS" --json "$OUT/ttft.json" 2>&1 | grep -v "falling back" ;;
    multiturn)
      for v in "320" "12" "12 --host-cache-size 16GiB" "320 --disable-radix-cache"; do
        echo "== --mamba-cache-size $v"
        python3 multiturn.py --model "$CKPT" --clients 10 --rounds 8 --request-length 2048 --question-length 128 \
          --output-length 64 --round-barrier --server-args "$FLAGS --max-running-requests 10 --mamba-cache-size $v" \
          --out "$OUT/multiturn_${v// /_}.json" 2>&1 | tail -21
      done ;;
    burst) python3 burst.py --model "$CKPT" --flags "$FLAGS" --json "$OUT/burst.json" 2>&1 | grep -v "falling back" ;;
  esac
done
