#!/usr/bin/env bash
# The comparison experiment of docs/experiments.md: every method of the harness on one
# Fashion-MNIST population, FEAST and the strongest baseline with two seeds, then the report.
#
#   bash bench/compare_methods.sh [RUNS_DIR]          (default runs/compare)
#
# Two queues run side by side, one torch thread each (the machine has 2 cores); a queue
# resumes a run it finds unfinished (--resume), so the script can be started again after
# an interruption. Settings shared by every run are in COMMON; change ROUNDS etc. there.
set -euo pipefail
RUNS=${1:-runs/compare}
ROUNDS=${ROUNDS:-20}
COMMON=(--preset fmnist-small --clients 10 --per-round 5 --rounds "$ROUNDS" --train-limit 8000
        --gamma 1 --zipf-s 1.2 --eval-every 5 --test-limit 5000 --device cpu)
export OMP_NUM_THREADS=1
mkdir -p "$RUNS"

run() {  # run NAME SEED METHOD [extra options]
  local name=$1 seed=$2 method=$3; shift 3
  local out="$RUNS/$name"
  if [ -f "$out/results.json" ]; then echo "$name: done"; return; fi
  local resume=()
  [ -f "$out/checkpoint.safetensors" ] && resume=(--resume)
  echo "$(date +%T) $name: start"
  feast-edge simulate --out "$out" --method "$method" --seed "$seed" "${COMMON[@]}" "${resume[@]}" "$@" > "$RUNS/$name.log" 2>&1
  echo "$(date +%T) $name: $(grep -o 'population accuracy[^%]*%' "$RUNS/$name.log" | tail -1)"
}

# Two queues of about equal cost (docs/benchmarks.md: seconds per round per method).
# Seed 1 for FEAST and the strongest baselines of seed 0 (DeepFedNAS and HeteroFL in docs/experiments.md).
( run feast-s0 0 feast; run fiarse-s0 0 fiarse; run heterofl-s0 0 heterofl; run sfn-s0 0 sfn; run heterofl-s1 1 heterofl ) &
( run centralized-s0 0 centralized; run feast-s1 1 feast; run scalefl-s0 0 scalefl; run dfn-s0 0 dfn; run dfn-s1 1 dfn ) &
wait
feast-edge report "$RUNS"/*-s[01] --out "$RUNS/report"
