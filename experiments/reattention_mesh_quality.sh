#!/usr/bin/env bash
# Mesh ReAttention's quality past the window (issue 26): passkey and niah single with the cache
# split over the GPUs, chat template, 20 samples over 5 depths; RESA over it (`resa_mesh`) on the
# same samples at the first length.
#   PROCESSES=4 experiments/reattention_mesh_quality.sh MODEL OUT     (one process per GPU)
#   experiments/reattention_mesh_quality.sh MODEL OUT                 (one process, every GPU)
# WINDOW (default 32768, the bundled Qwen models'): the paper's split of it (half local, spans
# of 32 after 32 global tokens). LENGTHS (default 256k,512k,1m: 8x-32x a 32K window),
# RESA_LENGTHS (default 256k), TASKS, SAMPLES, DTYPE; SHARD_BLOCK (default 0, contiguous shards;
# 2048 deals 2048-token blocks to the GPUs in turn: the same scopes, a faster prefill); results
# resume (OUT/TASK).
set -euo pipefail
source "$(dirname "$0")/common.sh"
model=${1:?model}
out=${2:?output directory}
window=${WINDOW:-32768}
n_local=$(( window / 2 ))
clip=$(( (window - 32 - n_local) / 32 ))
block=${SHARD_BLOCK:-0}
for task in ${TASKS:-passkey niah_single}; do
  eval_cli=(python -m jax_longctx eval --model "$model" --chat --task "$task"
            --samples "${SAMPLES:-20}" ${DTYPE:+--dtype "$DTYPE"} --out "$out/$task")
  on_processes "${PROCESSES:-1}" "${eval_cli[@]}" --methods reattention_mesh \
    --method-arg "reattention_mesh.n_local=$n_local" --method-arg "reattention_mesh.clip=$clip" \
    --method-arg "reattention_mesh.shard_block=$block" --lengths "${LENGTHS:-256k,512k,1m}"
  on_processes "${PROCESSES:-1}" "${eval_cli[@]}" --methods resa_mesh \
    --method-arg "resa_mesh.base_args=(('n_local',$n_local),('clip',$clip))" \
    --method-arg "resa_mesh.shard_block=$block" --lengths "${RESA_LENGTHS:-256k}"
done
