#!/usr/bin/env bash
# GPU calls: the tool verifiers environment (examples/verifiers_envs/vf_calc.py, calc_job.yaml) trained unchanged
# by `agentloop train` on the GPU machine, measured by benchmarks/verifiers_bench.py into
# $OUT/verifiers_calc_gpu.json. The machine has Python 3.12, torch and transformers, but no Ray, none of
# agentloop's or verifiers' other deps, no uv, no SmolLM2 and no internet; here, first:
#   bash benchmarks/gpu/build_carried.sh verifiers     # .vfkit/k1..kN: the wheels, 57 MiB a part
#   mkdir -p .vfcode && git archive -o .vfcode/code.tar HEAD && git rev-parse HEAD > .vfcode/commit
# (.vfcode: the committed code, since the working tree that travels may hold others' unfinished changes; both
# folders git-ignored through .git/info/exclude). Then one device call per part, back to back on one warm
# machine (a carried folder does not survive into the next call, /tmp does):
#   carry [".vfkit/k1"]: bash benchmarks/gpu/run_verifiers_calc.sh        (stashes the part in /tmp/vfkit)
#   ...
#   carry [".vfkit/kN", ".vfcode"], timeout_s 600: bash benchmarks/gpu/run_verifiers_calc.sh [--set KEY=VALUE ...]
# Each call stashes what it carries; once every part is there (the last one names their number) it joins and
# checks them, installs the wheels into /tmp/site (skipped when done), unpacks the code into /tmp/vfcode and
# runs the benchmark from there. A reply with warm: false before the last call means /tmp is gone: start over.
# uv (verifiers' null harness prepares its chat program with `uv sync --script`) resolves offline from the
# same wheels: UV_OFFLINE (through a shim), UV_FIND_LINKS. LIMIT: seconds for the benchmark (default: 570 less the setup).
# Results under $OUT: verifiers_calc_gpu.json, bench.log, card.txt, and the run folder's metrics.jsonl,
# report.md, summary.json.
set -u
T0=$SECONDS
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/vfkit
for part in .vfkit/k*/*; do [ -f "$part" ] && cp "$part" /tmp/vfkit/; done
ls -l /tmp/vfkit
if [ ! -f /tmp/site/.verifiers_ok ]; then
  parts=$(cat /tmp/vfkit/count 2>/dev/null || echo 0)
  have=$(ls /tmp/vfkit/part[0-9]* 2>/dev/null | wc -l)
  if [ "$parts" = 0 ] || [ "$have" -lt "$parts" ]; then
    echo "kit: $have part(s) stashed in /tmp/vfkit, ${parts/#0/an unknown number} needed: carry the next one"
    exit 0
  fi
  cat /tmp/vfkit/part[0-9]* > /tmp/vfkit/kit.tar
  if [ "$(sha256sum /tmp/vfkit/kit.tar | cut -d' ' -f1)" != "$(cat /tmp/vfkit/kit.sha256)" ]; then
    echo "kit checksum mismatch: rebuild .vfkit and start over"; exit 2
  fi
  (cd /tmp/vfkit && tar xf kit.tar && rm kit.tar)
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site /tmp/vfkit/vf/*.whl \
    2>&1 | grep -v WARNING | tail -3
  PYTHONPATH=/tmp/site python3 -c "import verifiers.v1, ray, mcp, openai" && touch /tmp/site/.verifiers_ok
fi
[ -f /tmp/site/.verifiers_ok ] || { echo "the wheels did not install"; exit 2; }
if [ ! -f .vfcode/code.tar ]; then echo "kit installed; carry .vfcode (the code) to run"; exit 0; fi
rm -rf /tmp/vfcode && mkdir -p /tmp/vfcode && tar xf .vfcode/code.tar -C /tmp/vfcode
export AGENTLOOP_BENCH_COMMIT=$(cat .vfcode/commit)
echo "setup: $((SECONDS - T0)) s"

cd /tmp/vfcode || exit 2
source benchmarks/gpu/env.sh
export PYTHONPATH=/tmp/site:/tmp/vfcode PATH=/tmp/site/bin:$PATH RAY_AUTH_MODE=disabled
export AGENTLOOP_CACHE_DIR=/tmp/agentloop_cache  # the converted model survives into the next warm call
# the chat program's environment from these wheels alone, on this python (it sees /tmp/site first, cp312).
# verifiers runs `uv sync --script` with UV_OFFLINE=false and uv 0.13.9 ignores UV_NO_INDEX there, so it
# asked PyPI (no network here: every episode failed): a `uv` first on PATH runs the real one offline.
mkdir -p /tmp/uvshim
printf '#!/bin/sh\nUV_OFFLINE=true exec /tmp/site/bin/uv "$@"\n' > /tmp/uvshim/uv && chmod +x /tmp/uvshim/uv
export PATH=/tmp/uvshim:$PATH
export UV_FIND_LINKS=/tmp/vfkit/vf UV_PYTHON_DOWNLOADS=never UV_PYTHON=$(command -v python3)
echo "card: $(card)" | tee "$OUT/card.txt"
budget=${LIMIT:-$((570 - (SECONDS - T0)))}
echo "bench: calc_job.yaml on cuda $* (limit $budget s)"
timeout -k 20 "$budget" python3 benchmarks/verifiers_bench.py --job examples/verifiers_envs/calc_job.yaml \
  --set trainer.device=cuda --time-limit $((budget - 40)) "$@" --out "$OUT/verifiers_calc_gpu.json" \
  > "$OUT/bench.log" 2>&1
rc=$?
echo "== bench exit: $rc after $((SECONDS - T0)) s"
tail -40 "$OUT/bench.log"
if [ $rc -ne 0 ]; then  # a killed driver can leave Ray's processes behind on the warm machine
  python3 -c "import sys; from ray.scripts.scripts import main; sys.argv = ['ray', 'stop', '--force']; main()" \
    > /dev/null 2>&1
fi
run_dir=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['run_dir'])" \
  "$OUT/verifiers_calc_gpu.json" 2>/dev/null || ls -d /tmp/verifiers-bench-*/run 2>/dev/null | tail -1)
for f in metrics.jsonl report.md summary.json; do [ -f "$run_dir/$f" ] && cp "$run_dir/$f" "$OUT/"; done
exit $rc
