#!/usr/bin/env bash
# GPU call: TorchEngine's idle graph capture on a GPU (tests), then engine_bench --via-proxy with it off
# and on, alternating (off, on, off, on), 128 agents in 4 processes, 4 proxy workers. Results under $OUT.
# Carry .gg/whl (cp312 wheels the image lacks) and .gpucache (the SmolLM2 tokenizer).
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gg/whl/*.whl || exit 1
source benchmarks/gpu/env.sh
echo "card: $(card)" | tee "$OUT/card.txt"
AGENTLOOP_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/engine/test_idle_capture.py 2>&1 | tee "$OUT/idle_capture_tests_gpu.txt" | tail -4
reps=${REPS:-9}
for run in ${RUNS:-off on off on}; do
  flag=""; [ "$run" = off ] && flag="--no-idle-capture"
  n=$(ls "$OUT" | grep -c "^proxy_idle_$run") 
  timeout 170 python3 benchmarks/engine_bench.py --via-proxy --backend torch --device cuda --proxy-workers 4 \
    --random-config qwen2-0.5b-smol-vocab --prompts 128 --new-tokens 128 --reps "$reps" --temperature 1.0 \
    --top-p 1.0 $flag --out "$OUT/proxy_idle_${run}_$n.json" > "$OUT/proxy_idle_${run}_$n.log" 2>&1
  echo "$run $n exit $?"
  python3 - "$OUT/proxy_idle_${run}_$n.json" <<'PY' || tail -5 "$OUT/proxy_idle_${run}_$n.log"
import json, sys
d = json.load(open(sys.argv[1]))
w = d["engine_work_in_timed_rounds"]
print(d["proxy_loss"], d["direct_tokens_per_s"], d["proxy_tokens_per_s"], d["direct_round_ms_median"],
      d["proxied_round_critical_path_ms"], {k: (v.get("graph_captures"), v.get("prefill_batches")) for k, v in w.items()})
PY
done
