#!/usr/bin/env bash
# The paper's further experiments of docs/experiments.md on one Fashion-MNIST population:
#   1. γ-allocation (the paper's Figure 1): FEAST, HeteroFL, ScaleFL and FIARSE at γ = 0 and γ = 1;
#   2. post-hoc extraction: uncached variants of the FEAST γ = 1 run against its cached curve;
#   3. matched training compute: HeteroFL, ScaleFL and FIARSE given the rounds that spend the FEAST γ = 1
#      run's training compute (--match-compute);
# then one report over all of them.
#
#   bash bench/paper_experiments.sh [RUNS_DIR] [PARTS]      (default runs/paper, PARTS "gamma extraction matched")
#
# Two queues run side by side, one torch thread each (the machine has 2 cores); a queue resumes a run it
# finds unfinished (--resume), so the script can be started again after an interruption. Settings shared
# by every run are in COMMON; ROUNDS, TRAIN_LIMIT, SEED and SERVER_OPT come from the environment.
set -euo pipefail
RUNS=${1:-runs/paper}
PARTS=${2:-gamma extraction matched}
ROUNDS=${ROUNDS:-20}
TRAIN_LIMIT=${TRAIN_LIMIT:-4000}
SEED=${SEED:-0}
COMMON=(--preset fmnist-small --clients 10 --per-round 5 --train-limit "$TRAIN_LIMIT" --zipf-s 1.2
        --eval-every 5 --val-samples 1000 --calib-samples 200 --test-limit 2000 --device cpu --threads 1
        --seed "$SEED" --server-opt "${SERVER_OPT:-avg}")
export OMP_NUM_THREADS=1
mkdir -p "$RUNS"

run() {  # run NAME METHOD [extra options]
  local name=$1 method=$2; shift 2
  local out="$RUNS/$name"
  if [ -f "$out/results.json" ]; then echo "$name: done"; return; fi
  local resume=()
  [ -f "$out/checkpoint.safetensors" ] && resume=(--resume)
  echo "$(date +%T) $name: start"
  local began=$SECONDS
  feast-edge simulate --out "$out" --method "$method" "${COMMON[@]}" "${resume[@]}" "$@" > "$RUNS/$name.log" 2>&1
  echo "$(date +%T) $name: $(grep -o 'population accuracy[^%]*%' "$RUNS/$name.log" | tail -1) ($((SECONDS - began)) s)"
}

if [[ $PARTS == *gamma* ]]; then
  # Queues of about equal cost: FEAST trains three variants a batch, the baselines one network.
  ( run feast-g1 feast --gamma 1 --rounds "$ROUNDS"; run heterofl-g1 heterofl --gamma 1 --rounds "$ROUNDS"
    run scalefl-g0 scalefl --gamma 0 --rounds "$ROUNDS"; run fiarse-g1 fiarse --gamma 1 --rounds "$ROUNDS" ) &
  ( run feast-g0 feast --gamma 0 --rounds "$ROUNDS"; run heterofl-g0 heterofl --gamma 0 --rounds "$ROUNDS"
    run scalefl-g1 scalefl --gamma 1 --rounds "$ROUNDS"; run fiarse-g0 fiarse --gamma 0 --rounds "$ROUNDS" ) &
  wait
fi
if [[ $PARTS == *extraction* && -f $RUNS/feast-g1/results.json ]]; then
  began=$SECONDS
  feast-edge extraction-gap "$RUNS/feast-g1" --points "${POINTS:-14}" > "$RUNS/extraction.log" 2>&1
  echo "extraction: $(grep -o 'mean |gap|.*' "$RUNS/extraction.log") ($((SECONDS - began)) s)"
fi
if [[ $PARTS == *matched* && -f $RUNS/feast-g1/results.json ]]; then
  ( run heterofl-g1-matched heterofl --gamma 1 --match-compute "$RUNS/feast-g1"
    run fiarse-g1-matched fiarse --gamma 1 --match-compute "$RUNS/feast-g1" ) &
  ( run scalefl-g1-matched scalefl --gamma 1 --match-compute "$RUNS/feast-g1" ) &
  wait
fi
mapfile -t finished < <(for f in "$RUNS"/*/results.json; do dirname "$f"; done)
feast-edge report "${finished[@]}" --out "$RUNS/report"
