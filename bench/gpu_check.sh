#!/usr/bin/env bash
# The CUDA checks of feast-edge, as one prepared run on a machine with an NVIDIA GPU (about 10 minutes).
#
#   bash bench/gpu_check.sh [OUT_DIR]          (default OUT_DIR: $OUT when set, else build/gpu_check)
#
# 1. the CUDA tests (tests marked "needs a CUDA device" must run, not skip): AMP, pinned copies,
#    augmentation on the GPU, deterministic kernels, CUDA training vs the CPU, profiling on the GPU;
# 2. the co-training step on paper-cifar100 at batch 128, float32 vs AMP (bench/bench_cotrain.py --amp auto);
# 3. `feast-agent profile --device cuda` with PyTorch and (when onnxruntime-gpu is installed) the CUDA provider;
# 4. a short `feast-edge simulate` on the GPU, --amp off and --amp auto (needs Fashion-MNIST: $FMNIST,
#    default /usr/share/datasets/fashion-mnist; skipped with a note when absent);
# 5. personalization on the GPU: bench/bench_personalize.py --device cuda, 20 clients of Dirichlet(0.1) shards
#    (every method side by side, own held-out accuracy and device seconds; needs Fashion-MNIST too).
#
# STEPS (default "tests cotrain profile simulate personalize") runs a subset, e.g. STEPS="tests personalize".
#
# It needs a Python with a CUDA build of PyTorch ($PYTHON, default: .venv/bin/python if present, else python3)
# and installs this checkout into it without touching its dependencies when `feast_edge` is not importable.
# Every step writes its log to OUT_DIR; summary.txt collects the figures for docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-build/gpu_check}}
mkdir -p "$OUT_DIR"
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
FMNIST=${FMNIST:-/usr/share/datasets/fashion-mnist}
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"
status=0
say() { echo "$*" | tee -a "$SUMMARY"; }
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to OUT_DIR/NAME.log, record the outcome
    local name=$1 limit=$2; shift 2
    local began=$SECONDS
    timeout "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    local rc=$?
    say "== $name: exit $rc in $((SECONDS - began)) s"
    [ $rc -eq 0 ] || status=1
    return $rc
}

if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    say "no CUDA device visible to $PYTHON (torch.cuda.is_available() is False): nothing to check"
    exit 2
fi
"$PYTHON" -c 'import feast_edge' 2>/dev/null || "$PYTHON" -m pip install --no-deps --no-build-isolation -q -e . >"$OUT_DIR/install.log" 2>&1
BIN=$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')")
export PATH="$BIN:$PATH"
"$PYTHON" - <<'PY' | tee -a "$SUMMARY"
import torch
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {p.name}, {p.total_memory / 2**30:.0f} GiB, "
      f"compute {p.major}.{p.minor}, bf16 {torch.cuda.is_bf16_supported()}")
PY
nvidia-smi --query-gpu=name,driver_version,memory.used,utilization.gpu --format=csv,noheader >>"$SUMMARY" 2>/dev/null

STEPS=${STEPS:-tests cotrain profile simulate personalize}
wants() { [[ " $STEPS " == *" $1 "* ]]; }
have_fmnist() { [ -f "$FMNIST/train-images-idx3-ubyte" ] || [ -f "$FMNIST/train-images-idx3-ubyte.gz" ]; }

# 1. CUDA tests: none of them may skip for want of a GPU.
wants tests && step cuda-tests 300 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/core/test_accel.py tests/federation/test_cuda_agent.py \
    tests/core/test_train.py::test_runs_on_cuda_and_matches_cpu_closely tests/core/test_train.py::test_a_restricted_softmax_stops_pushing_down_the_classes_a_client_never_saw tests/core/test_runtime.py tests/federation/test_profiling.py::test_profile_device_on_cuda \
    tests/core/test_personalize.py::test_personalization_on_the_gpu_computes_what_it_computes_on_the_cpu
if wants tests; then
    grep -E "passed|failed" "$OUT_DIR/cuda-tests.log" | tail -1 | tee -a "$SUMMARY"
    if grep -q "needs a CUDA device" "$OUT_DIR/cuda-tests.log"; then say "!! CUDA tests skipped on a CUDA machine"; status=1; fi
fi

# 2. Co-training step, paper-cifar100, batch 128: float32 vs AMP (auto: bf16 where the GPU has it).
wants cotrain && step cotrain-amp 240 "$PYTHON" bench/bench_cotrain.py --preset paper-cifar100 --batch 128 --repeats 20 --device cuda --amp auto
wants cotrain && grep -E "^(preset|co-train|sum|ratio)" "$OUT_DIR/cotrain-amp.log" | tee -a "$SUMMARY"

# 3. Profiling on the GPU: PyTorch eager, and ONNX Runtime's CUDA provider when installed.
wants profile && step profile-torch 180 feast-agent profile --device cuda --runtime torch --preset paper-cifar100 --variants 6 --repeats 20 --out "$OUT_DIR/profile-torch.json"
if ! wants profile; then
    :
elif "$PYTHON" -c 'import onnxruntime as o, sys; sys.exit(0 if "CUDAExecutionProvider" in o.get_available_providers() else 1)' 2>/dev/null; then
    step profile-ort 180 feast-agent profile --device cuda --provider cuda --preset paper-cifar100 --variants 6 --repeats 20 --out "$OUT_DIR/profile-ort.json"
else
    say "== profile-ort: skipped (onnxruntime has no CUDAExecutionProvider here; pip install onnxruntime-gpu)"
fi
for f in "$OUT_DIR"/profile-*.json; do
    [ -f "$f" ] && "$PYTHON" -c 'import json,sys; p=json.load(open(sys.argv[1])); print(sys.argv[1].rsplit("/",1)[-1], p.get("runtime"), "budget", p.get("budget_macs"), "a_ms", p.get("latency_a_ms"), "b_ms_per_mmac", p.get("latency_b_ms_per_mmac"), "holdout", p.get("holdout"))' "$f" | tee -a "$SUMMARY"
done

# 4. A short simulation on the GPU, float32 and AMP.
if ! wants simulate; then
    :
elif have_fmnist; then
    for amp in off auto; do
        step "simulate-$amp" 300 feast-edge simulate --data "$FMNIST" --device cuda --amp "$amp" --clients 10 --per-round 5 --rounds 3 \
            --train-limit 5000 --eval-every 3 --test-limit 2000 --out "$OUT_DIR/simulate-$amp"
        "$PYTHON" -c 'import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], "seconds", round(r["seconds_total"],1), "population accuracy", round(r["population_accuracy"],4))' \
            "$OUT_DIR/simulate-$amp/results.json" "simulate --amp $amp" 2>/dev/null | tee -a "$SUMMARY"
    done
else
    say "== simulate: skipped (no Fashion-MNIST in $FMNIST; set FMNIST=DIR)"
fi
# 5. Personalization on the GPU: every method side by side on a 20-client Dirichlet(0.1) fleet.
if ! wants personalize; then
    :
elif have_fmnist; then
    step personalize 420 env PYTHONPATH=".:${PYTHONPATH:-}" "$PYTHON" bench/bench_personalize.py --data "$FMNIST" --device cuda \
        --clients 20 --per-round 10 --rounds 8 --alpha 0.1 --train-limit 20000 --json "$OUT_DIR/personalize.json"
    sed -n '/^20 clients/,$p' "$OUT_DIR/personalize.log" | tee -a "$SUMMARY"
else
    say "== personalize: skipped (no Fashion-MNIST in $FMNIST; set FMNIST=DIR)"
fi
say "== gpu_check: $([ $status -eq 0 ] && echo OK || echo FAILED) (logs in $OUT_DIR)"
exit $status
