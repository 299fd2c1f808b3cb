#!/usr/bin/env bash
# GPU call: benchmarks/async_bench.py (sync vs fully-async training of a long-tailed multi-turn agent on a
# random-weight Qwen2-0.5B shape) on the GPU machine, which lacks Ray and agentloop's runtime deps.
# The device calls, back to back on one warm machine (a carried folder does not survive a call; /tmp does):
#   1. carry [".raykit/r1"]:               mkdir -p /tmp/raykit && cp .raykit/r1/* /tmp/raykit/
#   2. carry [".raykit/r2", ".gpucache"]:  bash benchmarks/gpu/run_async_bench.sh install
#   3. carry [".gg/whl"]:                  bash benchmarks/gpu/run_async_bench.sh sync [bench options]
#   4. (nothing):                          bash benchmarks/gpu/run_async_bench.sh async [bench options]
# Each leg writes $OUT/async_bench.json (a leg adds itself to the earlier leg's /tmp copy, if there is one).
# Run the legs in both orders on one warm machine and report the two ratios side by side: the leg that
# runs first pays the cold torch.compile/inductor compiles (2026-11-27, H100: step 2's update took 20.8 s
# in the sync leg run first, 3.9 s in the async leg run second; results/async_bench_gpu.json). After
# calls 3 and 4 (sync, async), the second order is two more calls on the same machine:
#   5. (nothing):  rm -f /tmp/async_bench.json && bash benchmarks/gpu/run_async_bench.sh async [options]
#   6. (nothing):  bash benchmarks/gpu/run_async_bench.sh sync [options]
# Steps/hour count after --warmup-steps (default 2) in both.
set -u
T0=$SECONDS
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:?install, sync or async}; shift

if [ ! -f /tmp/rsite/ray/__init__.py ]; then  # Ray 2.60 (+ jsonschema, referencing, rpds-py) -> /tmp/rsite
  mkdir -p /tmp/raykit
  for r in .raykit/r1 .raykit/r2; do [ -d "$r" ] && cp "$r"/* /tmp/raykit/; done
  if [ ! -f /tmp/raykit/partaa ] || [ ! -f /tmp/raykit/partab ]; then
    echo "ray kit incomplete in /tmp/raykit: $(ls /tmp/raykit)"; exit 2
  fi
  (cd /tmp/raykit && cat partaa partab > kit.tar && tar xf kit.tar && python3 -m pip install -q --no-index \
    --no-deps --no-compile --target /tmp/rsite w/*.whl) 2>&1 | grep -v WARNING | tail -2
fi
if [ -d .gpucache ]; then mkdir -p /tmp/gpucache && cp -r .gpucache/* /tmp/gpucache/; fi
if [ ! -f /tmp/site/.async_bench_ok ] && ls .gg/whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gg/whl/*.whl \
    2>&1 | grep -v WARNING | tail -3
  touch /tmp/site/.async_bench_ok
fi
echo "installs: $((SECONDS - T0)) s"
[ "$what" = install ] && { ls /tmp/rsite | head -3; ls /tmp/gpucache/models; exit 0; }

source benchmarks/gpu/env.sh
export PYTHONPATH=/tmp/rsite:/tmp/site:$PWD RAY_AUTH_MODE=disabled AGENTLOOP_CACHE_DIR=/tmp/gpucache
echo "card: $(card)" | tee "$OUT/card.txt"
prev=(); [ -f /tmp/async_bench.json ] && prev=(--previous /tmp/async_bench.json)  # the leg before, either order
timeout -k 15 $((580 - (SECONDS - T0))) python3 benchmarks/async_bench.py --device cuda --legs "$what" \
  --out /tmp/async_bench.json "${prev[@]}" "$@" > "$OUT/$what.log" 2>&1
rc=$?
echo "== $what exit: $rc after $((SECONDS - T0)) s"; tail -40 "$OUT/$what.log"
cp /tmp/async_bench.json "$OUT/" 2>/dev/null
if [ $rc -ne 0 ]; then
  python3 -c "import sys; from ray.scripts.scripts import main; sys.argv = ['ray', 'stop', '--force']; main()" \
    > /dev/null 2>&1
fi
exit $rc
