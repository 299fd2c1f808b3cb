#!/usr/bin/env bash
# GPU call (4 GPUs, one host; no Ray): the trainer update before and after a change, on the same cards in
# one call. benchmarks/gpu/dp_phases.py under torchrun with scale_bench's trainer options (replicated,
# no reshard, one gradient sync a mini-batch, bf16 all-reduce, compiled), 128 rows of 256-512 + 256-512
# tokens, 16k-token micro-batches; legs in this order while time is left: new 4 ranks, old 4 ranks, new 1
# rank, old 1 rank, then new 4 and old 4 again (AB_BUDGET_S, default 500 s: a leg needs 70 s left to
# start). On 4 x H200 the first leg took 184 s (compiles), the next two 129 s and 111 s: the first four
# legs need ~560 s, so give the call AB_BUDGET_S=560 and its whole 600 s. "old" is this tree with
# trainer/ from .ab_old/trainer (put there with: mkdir -p .ab_old && git archive BASE trainer | tar x -C
# .ab_old). Each leg also reports its phases (dp_phases' timed update).
#   carry .gg/whl, .gpucache and .ab_old; results under $OUT: ab.jsonl (every rank's dp_phases JSON and its leg),
#   summary.txt (a row a leg), legs.log.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gg/whl/*.whl || exit 1
source benchmarks/gpu/env.sh
[ -d .ab_old/trainer ] || { echo "no .ab_old/trainer: see the header"; exit 1; }
OLD=/tmp/oldtree; rm -rf $OLD; mkdir -p $OLD
tar cf - --exclude=.ab_old --exclude=.gg . | tar xf - -C $OLD && rm -rf $OLD/trainer && cp -r .ab_old/trainer $OLD/trainer
NEW=$PWD; T0=$SECONDS; BUDGET=${AB_BUDGET_S:-500}
: > "$OUT/ab.jsonl"; : > "$OUT/legs.log"
echo "card: $(card) x $(nvidia-smi -L | wc -l); $(date +%T)" | tee "$OUT/summary.txt"
FLAGS=(--rows 128 --reps 3 --fsdp-size 1 --no-reshard --grad-sync-per-mini-batch --bf16-reduce)
leg() {  # name tree nproc
  local name=$1 tree=$2 n=$3 left=$((BUDGET - (SECONDS - T0)))
  if [ "$left" -lt 70 ]; then echo "== $name skipped at $((SECONDS - T0)) s" | tee -a "$OUT/legs.log"; return; fi
  local t=$SECONDS
  (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout "$left" python3 -m torch.distributed.run --standalone \
    --nproc_per_node "$n" benchmarks/gpu/dp_phases.py "${FLAGS[@]}") \
    > /tmp/$name.out 2> /tmp/$name.err
  echo "== $name: exit $? after $((SECONDS - t)) s" | tee -a "$OUT/legs.log"
  grep -E "^\[rank[0-9]+\]:|Error" /tmp/$name.err | grep -v "NCCL INFO" | tail -20 >> "$OUT/legs.log"
  grep '^{' /tmp/$name.out | python3 -c "
import json, sys
for line in sys.stdin:
    print(json.dumps({'leg': sys.argv[1], **json.loads(line)}))" "$name" >> "$OUT/ab.jsonl"
}
leg new_w4 $NEW 4; leg old_w4 $OLD 4; leg new_w1 $NEW 1; leg old_w1 $OLD 1; leg new_w4b $NEW 4; leg old_w4b $OLD 4
python3 - "$OUT/ab.jsonl" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
legs = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    legs.setdefault(r["leg"], []).append(r)
for name, ranks in legs.items():
    slowest = max(r["update_s_median"] for r in ranks)
    prof = [r.get("profiled_update") or {} for r in sorted(ranks, key=lambda r: r["rank"])]
    idle = [round(p.get("wall_s", 0) - p.get("gpu_busy_s", 0), 3) for p in prof]
    print(f"{name:10s} ranks {len(ranks)} update_s {slowest:.4f} all {[r['update_s_all'] for r in ranks][0]} "
          f"profiled wall {[p.get('wall_s') for p in prof]} gpu idle {idle}")
for v in ("new", "old"):
    for s in ("", "b"):
        one, four = legs.get(f"{v}_w1"), legs.get(f"{v}_w4{s}")
        if one and four:
            t1 = max(r["update_s_median"] for r in one); t4 = max(r["update_s_median"] for r in four)
            print(f"{v}{s}: 1 rank {t1:.4f} s, 4 ranks {t4:.4f} s, speedup {t1 / t4:.3f}")
PY
echo "total $((SECONDS - T0)) s"
