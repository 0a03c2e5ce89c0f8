#!/usr/bin/env bash
# The 8-bit KV cache's quality against the bf16 cache (issue 54) on MODEL, the cache in
# bfloat16, int8 and float8_e4m3fn in one sweep (labels "full bfloat16", "full int8", ...):
# perplexity of the last 256 tokens of SAMPLES (100) texts, and passkey / niah_multikey (20
# samples, chat template), at LENGTHS (16k,32k). One cache size for every length (one compile per
# dtype). Results resume; a cut-off part runs on where it stopped.
#   experiments/kv_quant_quality.sh MODEL OUT [PARTS]   PARTS: "ppl passkey" (default), niah_multikey,
#   ruler (RULER's 11 tasks, 50 samples a task: LENGTHS=4k KV_DTYPES=bfloat16,int4 ... ruler)
# KV_DTYPES (default bfloat16,int8,float8_e4m3fn; int4 the 4-bit cache): the cache dtypes; an
# 8-bit one loads the model with key smoothing (run/key_smoothing.py) unless SMOOTH=off. METHOD (full) and METHOD_ARGS (e.g.
# "--method-arg reattention.n_local=16384 --method-arg reattention.clip=511", the paper's split
# of Qwen's 32K window) pick the method; BATCH (1): samples a batch (eval --batch-size);
# FIRST (0): run samples FIRST.. only (eval --first-sample: a part of the sweep, e.g. on one GPU);
# EVAL_ARGS: more eval options (e.g. "--kernel-option topk_eight_bit=products").
#   ReAttention past the window: METHOD=reattention LENGTHS=128k,256k ... OUT passkey niah_multikey
set -euo pipefail
source "$(dirname "$0")/common.sh"
model=$1 out=$2 parts=${3:-ppl passkey}
lengths=${LENGTHS:-16k,32k}
# shellcheck disable=SC2206
cli=(python -m jax_longctx eval --model "$model" --dtype bfloat16 --methods "${METHOD:-full}"
     ${METHOD_ARGS:-} --kv-dtype "${KV_DTYPES:-bfloat16,int8,float8_e4m3fn}" --lengths "$lengths"
     --cache-len "$(cache_len "$lengths")" --batch-size "${BATCH:-1}" --first-sample "${FIRST:-0}"
     ${EVAL_ARGS:-})
[[ ${SMOOTH:-on} == off ]] && cli+=(--no-key-smoothing)
for part in $parts; do
  case $part in
    ppl) "${cli[@]}" --task ppl --samples "${SAMPLES:-100}" --task-arg n_scored=256 \
           --out "$out/ppl" ;;
    passkey|niah_multikey) "${cli[@]}" --task "$part" --chat --samples "${SAMPLES:-20}" \
           --out "$out/$part" ;;
    ruler) "${cli[@]}" --task ruler --chat --samples "${SAMPLES:-50}" --out "$out/ruler" ;;
    *) echo "unknown part $part (ppl | passkey | niah_multikey | ruler)" >&2; exit 2 ;;
  esac
done
