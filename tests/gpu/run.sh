#!/usr/bin/env bash
# Runs named GPU checks/benchmarks on the device machine, each with its log under $OUT, and prints a
# summary table last. Usage (from the repo root, after the .whl prelude): tests/gpu/run.sh NAME...
# NAME: a key of CMD below. RUN_TIMEOUT (default 300) bounds each run in seconds.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
declare -A CMD=(
  [nvfp4]="python3 tests/gpu/check_nvfp4.py"
  [matmul]="python3 tests/gpu/check_matmul.py"
  [data]="python3 tests/gpu/check_data.py --archive data/shakespeare.tar.xz"
  [optim]="python3 tests/gpu/check_optim.py"
  [quantize]="python3 benchmarks/quantize.py"
  [train_step]="python3 benchmarks/train_step.py"
  [optim_update]="python3 benchmarks/optim_update.py --muon"
  [optim_adamw]="python3 benchmarks/optim_update.py"
  [optim_timing]="python3 benchmarks/optim_update.py --skip-equality"
  [optim_busy]="python3 benchmarks/optim_update.py --skip-equality --busy --runs=optax.adamw,adamw_nvfp4"
  [optim_busy_amax]="python3 benchmarks/optim_update.py --skip-equality --busy --runs='optax.adamw,adamw_nvfp4,adamw_nvfp4 (bound amax)'"
  [optim_busy_slots]="python3 benchmarks/optim_update.py --skip-equality --busy --atomic-slots=64 --runs='optax.adamw,adamw_nvfp4,adamw_nvfp4 (bound amax)'"
  [optim_busy_evict]="python3 benchmarks/optim_update.py --skip-equality --busy --iters=10 --runs=optax.adamw,adamw_nvfp4 --kernel-sweep=EVICT_HINTS=1,EVICT_HINTS=1+LAUNCH_GROUP=6,EVICT_HINTS=1+LAUNCH_GROUP=12"
  [optim_busy_slots_s9]="python3 benchmarks/optim_update.py --skip-equality --busy --iters=10 --runs=optax.adamw,adamw_nvfp4 --kernel-sweep=ATOMIC_SLOTS=1+EVICT_HINTS=0,ATOMIC_SLOTS=16,ATOMIC_SLOTS=256,STATS_BLOCK_ROWS=32,STATS_BLOCK_ROWS=128"
  [optim_busy_stats_s9]="python3 benchmarks/optim_update.py --skip-equality --busy --iters=10 --runs=optax.adamw,adamw_nvfp4 --kernel-sweep=STATS_BLOCK_ROWS=64,STATS_BLOCK_ROWS=256,STATS_NUM_WARPS=8,STATS_BLOCK_ROWS=256+STATS_NUM_WARPS=8,ATOMIC_SLOTS=256"
  [optim_loop]="python3 benchmarks/optim_update.py --skip-equality --busy --loop=20 --iters=10 --runs=optax.adamw,adamw_nvfp4"
  [optim_profile_top]="python3 benchmarks/optim_update.py --profile=adamw_nvfp4 --top=45"
  [optim_busy_group]="python3 benchmarks/optim_update.py --skip-equality --busy --iters=10 --runs=optax.adamw,adamw_nvfp4 --kernel-sweep=LAUNCH_GROUP=1,LAUNCH_GROUP=4,LAUNCH_GROUP=24"
  [optim_timing_stacked]="python3 benchmarks/optim_update.py --skip-equality --stacked"
  [optim_profile]="python3 benchmarks/optim_update.py --profile=adamw_nvfp4"
  [optim_variants]="python3 benchmarks/optim_update.py --variants"
  [train_bf16]="python3 benchmarks/train_step.py --recipes=bf16"
  [train_bf16_2048]="python3 benchmarks/train_step.py --recipes=bf16 --batch=32 --seq=2048"
  [train_bf16_xla_ce]="python3 benchmarks/train_step.py --recipes=bf16 --cross-entropy=xla"
  [ce_kernel]="python3 benchmarks/cross_entropy.py"
  [ce_kernel_50k]="python3 benchmarks/cross_entropy.py --vocab=50304"
  [train_scan]="python3 benchmarks/train_step.py --recipes=bf16 --scan"
  [fp4_scan]="python3 benchmarks/train_step.py --recipes=bf16,fp4_linear --scan --batch=16"
  [profile]="python3 benchmarks/profile_step.py --recipe=bf16 --top=40"
  [profile_hlo]="python3 benchmarks/profile_step.py --recipe=bf16 --top=60 --dump=/tmp/fp4jax_hlo"
  [optim_profiles]="python3 benchmarks/optim_update.py --profile=optax.adamw,adamw_nvfp4"
)
summary=""
for name in "$@"; do
  start=$(date +%s)
  # Each run gets at most $RUN_TIMEOUT seconds (rc 124 past it), so one slow run cannot use up a
  # device call's limit before the others and the summary are printed.
  # eval: a command may quote an argument with spaces (a row name).
  eval timeout "${RUN_TIMEOUT:-300}" "${CMD[$name]}" > "$OUT/$name.log" 2>&1
  rc=$?
  summary+="| $name | $rc | $(( $(date +%s) - start )) s |\n"
  echo "===== $name (rc=$rc)"; tail -n 25 "$OUT/$name.log"
done
printf "\n| run | rc | wall |\n|---|---|---|\n$summary"
