#!/usr/bin/env bash
# GPU call (after the vLLM kit is installed; formerly run_a.sh): the engine contract suite on both engines, then
# engine_bench --backend vllm. Results under $OUT.
source benchmarks/gpu/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gg/whl/*.whl 2>&1 | tail -2
echo "card: $(card)" | tee "$OUT/card.txt"
{ echo "# card: $(card)"; echo "# $(date -u +%FT%TZ) pytest tests/engine/test_contract.py tests/engine/test_vllm_engine.py"
  timeout 330 python3 -m pytest -q -rs -p no:cacheprovider tests/engine/test_contract.py tests/engine/test_vllm_engine.py 2>&1
  echo "# exit: $?"; } > "$OUT/vllm_contract_gpu.txt"
tail -40 "$OUT/vllm_contract_gpu.txt"
timeout 330 python3 benchmarks/engine_bench.py --backend vllm --reps 5 --random-config qwen2-0.5b --model-dir /tmp/qwen05 \
  --prompts 128 --new-tokens 128 --out "$OUT/engine_bench_vllm_gpu.json" > "$OUT/engine_bench_vllm.log" 2>&1
echo "engine_bench vllm exit: $?"; tail -30 "$OUT/engine_bench_vllm.log"
