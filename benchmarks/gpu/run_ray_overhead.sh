#!/usr/bin/env bash
# GPU call 2 of 2 (call 1 copied .raykit/r1 to /tmp/raykit): where a Ray trainer update's time goes beyond
# the ranks' work. Carry .raykit/r2, .gg/lite and .gpucache. N ranks (default 2; RANKS=4 on 4 GPUs):
#   1. nccl_probe.py under torchrun (every GPU visible to every rank) and ray_nccl_probe.py (Ray actors shown
#      one GPU each, then all), with NCCL_DEBUG=INFO: bandwidth and NCCL's transports;
#   2. scale_bench --only-trainer --rank-times with scale_bench's trainer options: each rank times its own
#      update inside the Ray update. Arguments go to scale_bench.py (e.g. --rank-threads 0,1 --reps 6).
# Results under $OUT: probe_torchrun.json, probe_ray.jsonl, trainer.json, and the logs. SKIP_PROBE=1 skips 1.
# LAUNCH_PROBE=1 runs gpu/ray_launch_probe.py before 2 (launch_probe.json: per-op CPU cost and niceness in
# plain processes and Ray actors). E.g. the Ray ranks' niceness and preemption:
#   LAUNCH_PROBE=1 SKIP_PROBE=1 RANKS=4 bash benchmarks/gpu/run_ray_overhead.sh --rank-threads 0 --rank-nice 0 --reps 6
# On 2 x H200 part 1 took ~150 s (installs included) and part 2 needs ~260 s (each group compiles first).
set -o pipefail
RANKS=${RANKS:-2}
if [ ! -d /tmp/rsite/ray ]; then
  cp .raykit/r2/* /tmp/raykit/ && (cd /tmp/raykit && cat part* > kit.tar && tar xf kit.tar && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/rsite w/*.whl) || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gg/lite/*.whl || exit 1
source benchmarks/gpu/env.sh
export PYTHONPATH=/tmp/rsite:/tmp/site:$PWD
echo "card: $(card) x $(nvidia-smi -L | wc -l); $(date +%T)"
if [ -z "${SKIP_PROBE:-}" ]; then
NCCL_DEBUG=INFO timeout 60 python3 -m torch.distributed.run --standalone --nproc_per_node "$RANKS" \
  benchmarks/gpu/nccl_probe.py --mib 64 1884 > $OUT/probe_torchrun.log 2>&1
grep '^{' $OUT/probe_torchrun.log > $OUT/probe_torchrun.json; grep -o ' via .*' $OUT/probe_torchrun.log | sort | uniq -c | head
NCCL_DEBUG=INFO timeout 120 python3 benchmarks/gpu/ray_nccl_probe.py --ranks "$RANKS" --mib 64 1884 > $OUT/probe_ray.jsonl 2> $OUT/probe_ray.log
python3 - "$OUT" <<'PY'
import json, sys
for line in open(sys.argv[1] + "/probe_torchrun.json"):
    d = json.loads(line); print("torchrun", [(r["collective"], r["dtype"], r["mib"], r["busbw_gb_s"]) for r in d["rows"] if r["collective"] == "all_reduce"])
for line in open(sys.argv[1] + "/probe_ray.jsonl"):
    d = json.loads(line); print("ray all_visible" if d["all_visible"] else "ray one GPU", d["via"][:4], [(r["collective"], r["dtype"], r["mib"], r["busbw_gb_s"]) for r in d["rank0"]["rows"] if r["collective"] == "all_reduce"])
PY
fi
export RAY_AUTH_MODE=disabled
if [ -n "${LAUNCH_PROBE:-}" ]; then  # the same CPU-bound work in plain processes and in Ray actors (~30 s)
  timeout 120 python3 benchmarks/gpu/ray_launch_probe.py "$RANKS" > $OUT/launch_probe.json 2> $OUT/launch_probe.log
  python3 - "$OUT" <<'PY'
import json, sys
d = json.load(open(sys.argv[1] + "/launch_probe.json"))
for k in ("plain_all", "plain_one", "ray_all", "ray_one"):
    print(k, [(r["add_us"], r["mm_us"], r["py_loop_us"], "nice", r["nice"]) for r in d[k]])
print("env plain vs ray", d["env_plain_vs_ray"])
PY
fi
timeout ${TRAINER_TIMEOUT_S:-400} python3 benchmarks/scale_bench.py --device cuda --gpus "$RANKS" --only-trainer --rank-times \
  --no-reshard --grad-sync-per-mini-batch --fsdp-size 1 --reduce-dtype bf16 "$@" --out $OUT/trainer.json > $OUT/trainer.log 2>&1
python3 - "$OUT" <<'PY'
import json, sys
d = json.load(open(sys.argv[1] + "/trainer.json"))["trainer"]
for k in [k for k in d if isinstance(d[k], dict)]:
    print(k, "update_s", round(d[k]["update_s"], 4), "rank_times", json.dumps(d[k].get("rank_times")))
    for leg in d[k].get("thread_sweep", []):
        print(k, "threads", leg["threads"], "gc frozen", leg["gc_frozen"], "ray", leg["ray_update_s"],
              "in rank (slowest)", leg["in_rank_slowest_s_median"], "gen2", [[c[2] for c in r] for r in leg["in_rank_gc_collections"]],
              "nice", leg.get("nice"), "set", leg.get("nice_set"), "main cpu_s", leg.get("in_rank_main_cpu_s"),
              "involuntary", leg.get("in_rank_involuntary_switches"))
print("speedup", d.get("speedup"))
PY
echo "done $(date +%T)"
