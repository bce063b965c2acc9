#!/usr/bin/env bash
# Runs the GPU checks and benchmarks by name on the GPU machine, each with its log under $OUT, and
# prints a summary table last. From the repository root:
#
#   tests/gpu/run.sh NAME [ARGS...] [NAME [ARGS...]]...
#
# NAME is a key of CMD below; the arguments after it (up to the next NAME) are passed to its command,
# e.g. `tests/gpu/run.sh gpu_tests -k optim train_step --recipes=bf16 --batch=32 --seq=2048`. Write
# options as --flag=value when a value could be taken for a NAME. The same NAME may run twice (its
# logs are NAME.log, NAME_2.log, ...). RUN_TIMEOUT (default 300) bounds each run in seconds, so one
# slow run cannot use up the machine's time before the others and the summary are printed (all of
# gpu_tests may need more: raise RUN_TIMEOUT, or split it into several runs with -k).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
declare -A CMD=(
  [gpu_tests]="env FP4JAX_GPU_TESTS=1 python3 -m pytest -v -s -rfE --durations=25 -m gpu tests/gpu"
  [quantize]="python3 -m benchmarks.quantize"
  [optim_update]="python3 -m benchmarks.optim_update"
  [cross_entropy]="python3 -m benchmarks.cross_entropy"
  [attention]="python3 -m benchmarks.attention"
  [gemm]="python3 -m benchmarks.gemm"
  [compile_time]="python3 -m benchmarks.compile_time"
  [train_step]="python3 -m benchmarks.train_step"
  [profile_step]="python3 -m benchmarks.profile_step"
  [study]="python3 -m experiments.study"
)

if [ $# -eq 0 ] || [ -z "${CMD[$1]+x}" ]; then
  echo "usage: tests/gpu/run.sh NAME [ARGS...] [NAME [ARGS...]]...; NAME one of: ${!CMD[*]}" >&2
  exit 2
fi

# Split the arguments into runs: a known NAME starts one, anything else belongs to the current one.
names=() args=()
for a in "$@"; do
  if [ -n "${CMD[$a]+x}" ]; then
    names+=("$a"); args+=("")
  else
    args[-1]+="$(printf '%q ' "$a")"
  fi
done

summary=""
for i in "${!names[@]}"; do
  name=${names[$i]}
  log="$OUT/$name.log"; n=1
  while [ -e "$log" ]; do n=$((n + 1)); log="$OUT/${name}_$n.log"; done
  eval "extra=(${args[$i]})"
  read -r -a cmd <<< "${CMD[$name]}"
  echo "===== $name: ${cmd[*]} ${extra[*]}"
  start=$(date +%s)
  timeout "${RUN_TIMEOUT:-300}" "${cmd[@]}" "${extra[@]}" > "$log" 2>&1
  rc=$?
  summary+="| $name ${extra[*]} | $rc | $(( $(date +%s) - start )) s | $(basename "$log") |\n"
  echo "===== $name (rc=$rc)"; tail -n 25 "$log"
done
printf "\n| run | rc | wall | log |\n|---|---|---|---|\n%b" "$summary"
