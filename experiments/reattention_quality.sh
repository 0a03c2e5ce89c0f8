#!/usr/bin/env bash
# The ReAttention quality sweep (issues 6 and 24; docs/results/reattention/), as run on one GPU.
#   experiments/reattention_quality.sh [MODEL] [OUT]
# Passkey and niah single / multi-key, 20 samples over 5 depths, chat template. Into OUT/TASK:
# ReAttention with the paper's split of the model's window (WINDOW, default 8192 = the default
# model's; `ReAttention.for_window(WINDOW)`: half local, 8192 gives the paper's defaults), full
# attention, and StreamingLLM with the same scope (budget WINDOW). Into OUT/localNk/TASK:
# ReAttention with a quarter of the window local (`for_window(WINDOW, local_fraction=0.25)`),
# the setting found by trying on the default model (local 2048, clip 191). The cache is sized
# per length: one cache of the longest length would make the short samples pay for it (the
# top-k kernel splits the key axis over the whole cache).
#   WINDOW=32768 PASSKEY_LENGTHS=64k,128k,256k NIAH_LENGTHS=64k,128k for a 32K-window model;
#   TASKS="passkey niah_single" runs a subset, SAMPLES=N another sample count, DTYPE=bfloat16;
#   results resume.
set -euo pipefail
model=${1:-default}
out=${2:-docs/results/reattention}
tasks=${TASKS:-passkey niah_single niah_multikey}
window=${WINDOW:-8192}
passkey_lengths=${PASSKEY_LENGTHS:-8k,16k,32k,64k}
niah_lengths=${NIAH_LENGTHS:-16k,32k}
n_global=32 span=32
split() {  # split LOCAL: method args of for_window(window, local_fraction = LOCAL / window)
  echo "--method-arg reattention.n_local=$1 --method-arg reattention.clip=$(( (window - n_global - $1) / span ))"
}
cli=(python -m jax_longctx eval --model "$model" --chat --samples "${SAMPLES:-20}")
[ -n "${DTYPE:-}" ] && cli+=(--dtype "$DTYPE")
paper=(--methods reattention,full,streaming_llm --method-arg "streaming_llm.budget=$window"
       $(split $(( window / 2 ))))
local_part=$(( window / 4 ))
local_quarter=(--methods reattention $(split $local_part))

run() {  # run TASK DIR METHOD-ARGS...
  local task=$1 dir=$2 lengths=$niah_lengths
  shift 2
  [ "$task" = passkey ] && lengths=$passkey_lengths
  "${cli[@]}" "$@" --task "$task" --lengths "$lengths" --out "$dir"
}

for task in $tasks; do
  run "$task" "$out/$task" "${paper[@]}"
  run "$task" "$out/local$(( local_part / 1024 ))k/$task" "${local_quarter[@]}"
done
