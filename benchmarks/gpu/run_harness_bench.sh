#!/usr/bin/env bash
# GPU call: benchmarks/harness_bench.py on a random-weight Qwen2-0.5B shape with 32k positions (bf16) against
# transformers' own forward in the same run. Carry [".gg/whl", ".gg/qwen05-32k"]: the wheels
# (benchmarks/gpu/build_wheels.sh) and the model's config + SmolLM2 tokenizer (weights are drawn there).
source benchmarks/gpu/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gg/whl/*.whl 2>&1 | tail -2
echo "card: $(card)"
# the CUDA chunked-prefill path against the dense mask, and the engine's long-context tests, first
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_attention.py tests/engine/test_long_context.py \
  2>&1 | tail -4 | tee "$OUT/harness_gpu_tests.txt"
timeout 480 python3 benchmarks/harness_bench.py --device cuda --models random --config-dir .gg/qwen05-32k \
  --lengths 2048,8192,16384,32768 --decode-tokens 64 --prefix --label "h200" --out "$OUT/harness_gpu_speed.json" \
  > "$OUT/harness_gpu.log" 2>&1
echo "exit: $?"; tail -c 3000 "$OUT/harness_gpu.log"
