#!/usr/bin/env bash
# GPU call (4 GPUs, one host; no Ray, no internet): FSDP2 options A/B for the 4-rank trainer update,
# benchmarks/gpu/dp_phases.py under torchrun on scale_bench's batch (--rows 128, prompts and responses
# 256-512 tokens, token budget 16384, one mini-batch: as in results/trainer_dp_phases_4gpu.json), all legs
# with --no-compile, one after the other on the same cards:
#   1 rank (baseline); 4 ranks: default | --no-reshard --bf16-params | the same + --grad-sync-per-mini-batch
#   | the same + NCCL_PROTO=Simple | the last but one again under NCCL_DEBUG=INFO (INIT,GRAPH; --reps 1).
#   bash benchmarks/gpu/run_dp_ab.sh        (the caller's PYTHONPATH holds torch, transformers, pydantic...)
# DP_AB_SET=fsdp_size runs other legs instead, for fsdp_config.fsdp_size: 1 rank; 4 ranks FSDP (-1) with
#   --no-reshard --grad-sync-per-mini-batch | replicated (--fsdp-size 1) with --grad-sync-per-mini-batch
#   | the same + --no-reshard | HSDP, 2 groups of 2 (--fsdp-size 2) with --no-reshard --grad-sync-per-mini-batch.
# DP_AB_SET=mixed_precision: 1 rank; 4 ranks replicated (--fsdp-size 1 --no-reshard --grad-sync-per-mini-batch)
#   with fp32 | bf16 gradient all-reduces (--bf16-reduce); FSDP with bf16 all-gathers and reduce-scatters.
# DP_AB_SET=profile: 1 rank; 4 ranks replicated (--fsdp-size 1 --no-reshard --grad-sync-per-mini-batch), each
#   with one more update under torch.profiler (every rank's GPU busy time against the update's wall time;
#   kernel tables kernels_world{1,4}.rank{r} under $OUT).
# DP_COMPILE=1 keeps torch.compile on (the trainer's default; each leg then compiles first).
# About 3-4 minutes (a leg: ~30 s of start-up and model load, then 5 updates); a leg that would start after
# DP_AB_BUDGET_S (default 290) seconds is skipped and named in summary.txt.
# Results under $OUT (6 files): summary.txt (cards, versions, one row a leg: update seconds, speedup over
# 1 rank, the collectives one update issued), dp.jsonl (every rank's dp_phases JSON with its leg),
# nccl_info.txt (NCCL's transport, channel and protocol lines), legs.log (each leg's last stderr lines, and
# the ranks' tracebacks of a leg that failed), nccl_debug.log.gz (that leg's whole NCCL log),
# legs_stderr.tgz (every leg's whole stderr).
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # as benchmarks/gpu/env.sh
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${DP_AB_BUDGET_S:-290}
# the random model takes SmolLM2's tokenizer from AGENTLOOP_CACHE_DIR (carry .gpucache; benchmarks/gpu/env.sh)
python3 -c "from agentloop.engine.models import smollm2_tokenizer_dir; smollm2_tokenizer_dir()" \
  || { echo "no SmolLM2 tokenizer under AGENTLOOP_CACHE_DIR=${AGENTLOOP_CACHE_DIR:-unset}: carry .gpucache"; exit 1; }
T0=$SECONDS
WORK=$(mktemp -d)
: > "$OUT/dp.jsonl"; : > "$OUT/legs.log"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, sys; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'python', sys.version.split()[0])"
} > "$WORK/card.txt" 2>&1

leg() {  # name nproc timeout_s [VAR=value ...] -- dp_phases flags...
  local name=$1 n=$2 limit=$3; shift 3
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  local left=$((BUDGET - (SECONDS - T0)))
  if [ "$left" -lt 40 ]; then
    echo "== $name: skipped, $((SECONDS - T0)) s of the ${BUDGET} s budget spent" | tee -a "$OUT/legs.log"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t=$SECONDS
  env "${envs[@]}" timeout "$limit" python3 -m torch.distributed.run --standalone --nproc_per_node "$n" \
    benchmarks/gpu/dp_phases.py --rows 128 --reps 3 "${COMPILE[@]}" "$@" > "$WORK/$name.out" 2> "$WORK/$name.err"
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t)) s: ${envs[*]} dp_phases.py $*" | tee -a "$OUT/legs.log"
  grep -vE "NCCL INFO|Loading weights|OMP_NUM_THREADS|^\*+$|^$" "$WORK/$name.err" | tail -15 >> "$OUT/legs.log"
  if [ "$rc" -ne 0 ]; then  # the ranks' own tracebacks (torchrun prefixes their lines with [rankN]:)
    grep -E "^\[rank[0-9]+\]:" "$WORK/$name.err" | grep -v "NCCL INFO" | head -80 >> "$OUT/legs.log"
  fi
  grep '^{' "$WORK/$name.out" | python3 -c "
import json, sys
for line in sys.stdin:
    print(json.dumps({'leg': sys.argv[1], **json.loads(line)}))" "$name" >> "$OUT/dp.jsonl"
}

COMPILE=(--no-compile); [ "${DP_COMPILE:-0}" = 1 ] && COMPILE=()
if [ "${DP_AB_SET:-}" = fsdp_size ]; then
  leg world1 1 170 --
  leg world4_fsdp_noreshard_gradsync 4 130 -- --no-reshard --grad-sync-per-mini-batch
  leg world4_replicated_gradsync 4 130 -- --grad-sync-per-mini-batch --fsdp-size 1
  leg world4_replicated_noreshard_gradsync 4 130 -- --no-reshard --grad-sync-per-mini-batch --fsdp-size 1
  leg world4_hsdp2_noreshard_gradsync 4 130 -- --no-reshard --grad-sync-per-mini-batch --fsdp-size 2
elif [ "${DP_AB_SET:-}" = mixed_precision ]; then
  ONE=(--no-reshard --grad-sync-per-mini-batch --fsdp-size 1)
  leg world1 1 170 --
  leg world4_replicated 4 130 -- "${ONE[@]}"
  leg world4_replicated_bf16_reduce 4 130 -- "${ONE[@]}" --bf16-reduce
  leg world4_fsdp_bf16_params_reduce 4 130 -- --no-reshard --grad-sync-per-mini-batch --bf16-params --bf16-reduce
elif [ "${DP_AB_SET:-}" = profile ]; then  # with DP_COMPILE=1: scale_bench's trainer, one update profiled
  ONE=(--no-reshard --grad-sync-per-mini-batch --fsdp-size 1)
  leg world1 1 170 -- --profile "$OUT/kernels_world1"
  leg world4_replicated 4 130 -- "${ONE[@]}" --profile "$OUT/kernels_world4"
else
  BEST=(--no-reshard --bf16-params --grad-sync-per-mini-batch)
  leg world1 1 110 --
  leg world4 4 75 --
  leg world4_noreshard_bf16 4 75 -- --no-reshard --bf16-params
  leg world4_noreshard_bf16_gradsync 4 75 -- "${BEST[@]}"
  leg world4_noreshard_bf16_gradsync_simple 4 75 NCCL_PROTO=Simple -- "${BEST[@]}"
  leg world4_nccl_debug 4 60 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH -- "${BEST[@]}" --reps 1
fi

if [ -f "$WORK/world4_nccl_debug.out" ]; then  # NCCL logs to stdout unless NCCL_DEBUG_FILE is set
  cat "$WORK"/world4_nccl_debug.{out,err} | grep "NCCL INFO" > "$WORK/nccl.log"
  gzip -c "$WORK/nccl.log" > "$OUT/nccl_debug.log.gz"
  # transport (P2P / SHM / NET, NVLink), channels, rings and trees, protocol thresholds, version
  cat "$WORK/nccl.log" \
    | grep -E "NCCL version|via |[Pp]roto|threadThresholds|Channel [0-9]+/[0-9]+ :|nRanks|NVLS|P2P|SHM|CollNet|Trees|Pattern|Enabled|Connected" \
    | sed -E 's/^[^ ]*:[0-9]+:[0-9]+ //' | sort | uniq -c | sort -rn | head -200 > "$OUT/nccl_info.txt"
fi

{
  cat "$WORK/card.txt"
  echo "total $((SECONDS - T0)) s"
  python3 - "$OUT/dp.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
legs = {}
for r in rows:
    legs.setdefault(r["leg"], []).append(r)
base = legs.get("world1", [{}])[0].get("update_s_median")
print(f"{'leg':40s} {'ranks':>5s} {'update_s':>9s} {'slowest':>8s} {'speedup':>8s}  collectives in one update (rank 0)")
for name, ranks in legs.items():
    r0 = min(ranks, key=lambda r: r["rank"])
    med = r0["update_s_median"]
    slowest = max(r["update_s_median"] for r in ranks)
    speedup = f"{base / med:.3f}" if base and med else "-"
    print(f"{name:40s} {r0['world']:5d} {med:9.4f} {slowest:8.4f} {speedup:>8s}  {r0.get('collective_calls')}")
    print(f"{'':40s} phases {r0['phase_s']} steps {r0.get('optimizer_steps')} env {r0['options']['env']}")
    for r in sorted(ranks, key=lambda r: r["rank"]):
        if r.get("profiled_update"):
            print(f"{'':40s} rank {r['rank']} profiled {r['profiled_update']}")
EOF
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
tar czf "$OUT/legs_stderr.tgz" -C "$WORK" $(cd "$WORK" && ls *.err)  # every leg's whole stderr
rm -rf "$WORK"
