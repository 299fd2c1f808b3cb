#!/usr/bin/env bash
# GPU-host call (no GPU work): client_floor.py with 4 and 8 agent processes, then one more engine_bench
# --via-proxy pair (idle capture on, then off). Carry .gg/whl and .gpucache. Results under $OUT.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gg/whl/*.whl || exit 1
source benchmarks/gpu/env.sh
echo "card: $(card)" | tee "$OUT/card.txt"
for p in 4 8; do
  timeout 120 python3 benchmarks/client_floor.py --agents 128 --agent-procs $p --server-procs 4 --reps 9 \
    --out "$OUT/client_floor_p$p.json" > "$OUT/client_floor_p$p.log" 2>&1; echo "floor p$p exit $?"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['median_ms'], d['rounds_ms'])" "$OUT/client_floor_p$p.json"
done
[ -n "$NO_PAIR" ] && exit 0
SKIP_TESTS=1 RUNS="on off" bash benchmarks/gpu/run_proxy_idle_capture.sh
