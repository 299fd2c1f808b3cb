# GPU call 2 of 2 on a warm 4-GPU machine (call 1 copied .raykit/r1 to /tmp/raykit); carry .raykit/r2,
# .gg/whl and .gpucache (not all of .gg: with the SmolLM2 wheel's parts it passes the 64 MiB carry limit;
# if r2 + .gg/whl + .gpucache do too, install Ray in a call of its own first, as the 2026-11-28 session did:
# cp .raykit/r2/* /tmp/raykit/, cat the parts, untar, pip install --target /tmp/rsite w/*.whl). Extra
# arguments go to scale_bench.py (e.g. --fsdp-size 1 --reduce-dtype bf16 --no-split-sync). A later call on
# the same warm machine finds Ray installed in /tmp/rsite and needs only .gg/whl and .gpucache.
set -o pipefail
if [ ! -d /tmp/rsite/ray ]; then
  cp .raykit/r2/* /tmp/raykit/ && (cd /tmp/raykit && cat part* > kit.tar && tar xf kit.tar && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/rsite w/*.whl) || exit 1
fi
# .gg/whl, or .gg/lite (its wheels less matplotlib, pillow, fonttools, contourpy, kiwisolver, cycler, pyparsing
# and gguf: what scale_bench does not import; with r2 and .gpucache under 64 MiB), or an earlier call's install
WHEELS=; for d in .gg/whl .gg/lite; do [ -z "$WHEELS" ] && [ -d "$d" ] && WHEELS=$d; done
if [ -n "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS/*.whl || exit 1
elif [ ! -d /tmp/site/pydantic ]; then echo "carry .gg/whl or .gg/lite (not installed in /tmp/site yet)"; exit 1; fi
source benchmarks/gpu/env.sh
export PYTHONPATH=/tmp/rsite:/tmp/site:$PWD
echo "card: $(card) x $(nvidia-smi -L | wc -l); NUMA nodes: $(ls -d /sys/devices/system/node/node* 2>/dev/null | wc -l); $(date +%T)"
timeout 560 python3 benchmarks/scale_bench.py --device cuda --gpus 4 --no-reshard --grad-sync-per-mini-batch "$@" \
  --out $OUT/scale_bench_4gpu.json 2>&1 | tee $OUT/scale.log | grep -v "^(.*pid=" | tail -40
echo "done $(date +%T)"
