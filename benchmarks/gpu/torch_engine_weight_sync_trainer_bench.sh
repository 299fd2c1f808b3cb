#!/usr/bin/env bash
# GPU call (formerly run_b.sh; the warm machine of vllm_contract_and_engine_bench.sh): TorchEngine vs HF generate, weight sync, trainer_bench.
source benchmarks/gpu/env.sh
echo "card: $(card)"
timeout 150 python3 benchmarks/weight_sync_bench.py --random-config qwen2-0.5b --model-dir /tmp/qwen05 \
  --out "$OUT/weight_sync_gpu.json" > "$OUT/weight_sync.log" 2>&1
echo "weight_sync exit: $?"; tail -25 "$OUT/weight_sync.log"
timeout 240 python3 benchmarks/engine_bench.py --backend torch --random-config qwen2-0.5b --model-dir /tmp/qwen05 \
  --device cuda --prompts 128 --new-tokens 128 --out "$OUT/engine_bench_torch_gpu.json" > "$OUT/engine_bench_torch.log" 2>&1
echo "engine_bench torch exit: $?"; tail -12 "$OUT/engine_bench_torch.log"
if [ -f benchmarks/trainer_bench.py ]; then
  timeout 150 python3 benchmarks/trainer_bench.py --device cuda --random-config qwen2-0.5b > "$OUT/trainer_bench_gpu.txt" 2>&1
  echo "trainer_bench exit: $?"; tail -25 "$OUT/trainer_bench_gpu.txt"
fi
