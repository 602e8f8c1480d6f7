python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
t=$(date +%s)
OUT=$OUT/hs timeout 370 bash benchmarks/hybrid_session.sh nemotron-h-8b > $OUT/hs.txt 2>&1
echo "hs rc=$? $(( $(date +%s) - t )) s"; rm -rf $OUT/hs/kernel-cache-*; tail -16 $OUT/hs.txt
