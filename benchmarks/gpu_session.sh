#!/usr/bin/env bash
# One GPU-machine session: GPU tests, decode-step profile, end-to-end benchmark, multi-turn cache benchmark.
# Usage (on the GPU machine, repo root, wheels for fastapi/uvicorn/pydantic in .whl/):
#   bash benchmarks/gpu_session.sh 130m      # or 2.7b (e2e only); BOTH=1 adds the 2.7b e2e to a 130m run
#   MULTITURN=0 skips the multi-turn benchmark, TESTS=0 the GPU tests
set -uo pipefail
SIZE=${1:-130m}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
cd /tmp  # the repo's top-level kernels/ must not shadow anything when run from the root
python3 -c "import mambaserve.server.engine.engine, fastapi, triton, torch; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
cd - >/dev/null
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
if [ "${TESTS:-1}" = 1 ]; then
  # every kernel test (the Triton ones run compiled on the GPU) and the GPU engine tests
  python3 -m pytest -q -p no:cacheprovider tests/kernels tests/server/test_gpu_engine.py \
    2>&1 | grep -v -i "falling back" | tail -30
fi
if [ "$SIZE" = "130m" ]; then
  python3 benchmarks/decode_step.py --size 130m --profile 2>&1 | tail -40
  python3 benchmarks/e2e.py --size 130m --json "$OUT/e2e_130m.json" --keep-checkpoint /tmp/m130
  if [ "${MULTITURN:-1}" = 1 ]; then
    (cd benchmarks && python3 multiturn.py --model /tmp/m130 --compare --clients 16 --rounds 5 \
       --request-length 1024 --question-length 128 --output-length 64 \
       --server-args "--tokenizer ../models/mamba2-tiny-pystdlib" --out "$OUT/multiturn_130m.json")
  fi
fi
if [ "$SIZE" = "2.7b" ] || [ "${BOTH:-0}" = 1 ]; then
  python3 benchmarks/decode_step.py --size 2.7b --profile 2>&1 | tail -40
  python3 benchmarks/e2e.py --size 2.7b --json "$OUT/e2e_2.7b.json" --hf-batches 1 --hf-tokens 16 --decode-tokens 64
fi
