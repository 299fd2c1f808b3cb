#!/usr/bin/env bash
# GPU call: the trainer's shared-prompt forward A/B (benchmarks/trainer_bench.py --same-prompt --group 8,
# with and without --no-shared-prompt), one after the other on the same card. Needs the deps that
# run_tools_demo.sh installed into /tmp/rsite and /tmp/site on this warm machine.
# Results under $OUT: card.txt, shared.json / plain.json (the bench's JSON), shared.log / plain.log (stderr).
set -u
source benchmarks/gpu/env.sh
export PYTHONPATH=/tmp/rsite:/tmp/site:$PWD
echo "card: $(card)" | tee "$OUT/card.txt"
ARGS="--device cuda --random-config qwen2-0.5b --batch 64 --group 8 --same-prompt --prompt 512 --response 256 --token-budget 16384"
for leg in shared plain; do
  extra=""; [ $leg = plain ] && extra="--no-shared-prompt"
  t=$SECONDS
  python3 benchmarks/trainer_bench.py $ARGS $extra > "$OUT/$leg.json" 2> "$OUT/$leg.log"
  echo "== $leg: exit $? after $((SECONDS - t)) s"
  cat "$OUT/$leg.json"; grep -i "shared_prompt\|error\|Traceback" "$OUT/$leg.log" | tail -5
done
