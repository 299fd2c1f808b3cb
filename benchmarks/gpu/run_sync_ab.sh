#!/usr/bin/env bash
# GPU call (no Ray): the trainer update before and after a change, on the same cards in one call.
# benchmarks/gpu/dp_phases.py under torchrun with scale_bench's trainer options (replicated, no reshard,
# one gradient sync a mini-batch, bf16 all-reduce, compiled), 128 rows of 256-512 + 256-512 tokens,
# 16k-token micro-batches. AB_LEGS names the legs, run in order while time is left (AB_BUDGET_S, default
# 500 s; a leg needs 70 s left to start): TREE_wN[SUFFIX] runs tree TREE on N ranks; tree "new" is this
# one, any other tree X is this tree with trainer/ from .ab_X/trainer (put there with: mkdir -p .ab_X &&
# git archive BASE trainer | tar x -C .ab_X; "old" reads .ab_old). Default legs (4 GPUs): new_w4 old_w4
# new_w1 old_w1 new_w4b old_w4b. AB_FLAGS_<leg> adds arguments to that leg's dp_phases.py, e.g.
#   AB_FLAGS_new_w1p="--override actor_rollout_ref.actor.on_policy_old_logprobs=false"
# On 4 x H200 the first leg took 184 s (compiles), the next two 129 s and 111 s: the first four legs
# need ~560 s, so give the call AB_BUDGET_S=560 and its whole 600 s. Each leg also reports its phases
# (dp_phases' timed update).
#   carry .gg/whl (or AB_WHEELS=.gg/lite), .gpucache and each .ab_X; results under $OUT: ab.jsonl (every
#   rank's dp_phases JSON and its leg), summary.txt (a row a leg), legs.log.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${AB_WHEELS:-.gg/whl}/*.whl || exit 1
source benchmarks/gpu/env.sh
LEGS=(${AB_LEGS:-new_w4 old_w4 new_w1 old_w1 new_w4b old_w4b})
tree_of() {  # TREE -> the folder to run it from (built once)
  local name=$1 dir=/tmp/tree_$1
  if [ "$name" = new ]; then echo "$PWD"; return; fi
  if [ ! -d "$dir" ]; then
    [ -d ".ab_$name/trainer" ] || { echo "no .ab_$name/trainer: see the header" >&2; return 1; }
    mkdir -p "$dir" && tar cf - --exclude='.ab_*' --exclude=.gg --exclude=.venv . | tar xf - -C "$dir" \
      && rm -rf "$dir/trainer" && cp -r ".ab_$name/trainer" "$dir/trainer" || return 1
  fi
  echo "$dir"
}
T0=$SECONDS; BUDGET=${AB_BUDGET_S:-500}
: > "$OUT/ab.jsonl"; : > "$OUT/legs.log"
echo "card: $(card) x $(nvidia-smi -L | wc -l); $(date +%T)" | tee "$OUT/summary.txt"
FLAGS=(--rows 128 --reps 3 --fsdp-size 1 --no-reshard --grad-sync-per-mini-batch --bf16-reduce)
leg() {  # name tree nproc
  local name=$1 tree=$2 n=$3 left=$((BUDGET - (SECONDS - T0)))
  if [ "$left" -lt 70 ]; then echo "== $name skipped at $((SECONDS - T0)) s" | tee -a "$OUT/legs.log"; return; fi
  local t=$SECONDS flags_var="AB_FLAGS_$1"
  local -a extra=(${!flags_var:-})
  (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout "$left" python3 -m torch.distributed.run --standalone \
    --nproc_per_node "$n" benchmarks/gpu/dp_phases.py "${FLAGS[@]}" "${extra[@]}") \
    > /tmp/$name.out 2> /tmp/$name.err
  echo "== $name: exit $? after $((SECONDS - t)) s" | tee -a "$OUT/legs.log"
  grep -E "^\[rank[0-9]+\]:|Error" /tmp/$name.err | grep -v "NCCL INFO" | tail -20 >> "$OUT/legs.log"
  grep '^{' /tmp/$name.out | python3 -c "
import json, sys
for line in sys.stdin:
    print(json.dumps({'leg': sys.argv[1], **json.loads(line)}))" "$name" >> "$OUT/ab.jsonl"
}
for name in "${LEGS[@]}"; do
  tree=$(tree_of "${name%%_w*}") || exit 1
  n=${name#*_w}; n=${n%%[!0-9]*}
  leg "$name" "$tree" "$n"
done
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
for v in sorted({name.split("_w")[0] for name in legs}):
    for s in ("", "b"):
        one, four = legs.get(f"{v}_w1"), legs.get(f"{v}_w4{s}")
        if one and four:
            t1 = max(r["update_s_median"] for r in one); t4 = max(r["update_s_median"] for r in four)
            print(f"{v}{s}: 1 rank {t1:.4f} s, 4 ranks {t4:.4f} s, speedup {t1 / t4:.3f}")
PY
echo "total $((SECONDS - T0)) s"
