#!/usr/bin/env bash
# Independent commands side by side, command i alone on GPU i (CUDA_VISIBLE_DEVICES=i), each cut
# off after LIMIT seconds (a sweep's records are kept as it goes and resume), its output in
# LOGS/gpu<i>.log; waits for all and exits non-zero if any failed other than by the cut-off.
#   experiments/one_per_gpu.sh LIMIT LOGS "cmd0" "cmd1" ...
# e.g. four parts of a sweep at once: FIRST=6 ... experiments/kv_quant_quality.sh ... on each.
set -uo pipefail
limit=$1 logs=$2
shift 2
mkdir -p "$logs"
pids=()
for i in $(seq 0 $(($# - 1))); do
  cmd=${*:$((i + 1)):1}
  CUDA_VISIBLE_DEVICES=$i timeout "$limit" bash -c "$cmd" >"$logs/gpu$i.log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"
  rc=$?
  echo "gpu$i: exit $rc$( ((rc == 124)) && echo ' (cut off at the limit)')"
  ((rc != 0 && rc != 124)) && failed=1
done
exit $failed
