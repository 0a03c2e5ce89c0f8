#!/usr/bin/env bash
# The papers' experiments on a bundled 32K-window Qwen2.5-Coder model (issue 24), as run on one
# GPU after `benchmarks/carry_model.py join` put the model in $JAX_LONGCTX_CACHE (docs/MODELS.md):
#   experiments/qwen_claims.sh MODEL OUT PART...
# PART: reattention | resa_error | resa | citrus768 | citrus2048 | refreshkv | star and mesh (on
# a 4-GPU machine, one process per GPU; mesh: issue 26's mesh ReAttention at 256K-1M). Each runs the
# method's own script with the settings for a 32K window; results go to OUT/<method>/MODEL/
# (OUT=docs/results: where they are recorded) and resume,
# so a PART cut off by a time limit continues where it stopped when run again.
# bf16 throughout (DTYPE overrides), 20 samples over 5 depths (SAMPLES overrides).
set -euo pipefail
here=$(dirname "$0")
model=${1:?model}
out=${2:?output directory}
shift 2
export DTYPE=${DTYPE:-bfloat16}
for part in "$@"; do
  case $part in
    reattention)  # 2x, 4x, 8x the window; the paper's split of 32K and a quarter local
      WINDOW=32768 PASSKEY_LENGTHS=${PASSKEY_LENGTHS:-64k,128k,256k} \
        NIAH_LENGTHS=${NIAH_LENGTHS:-64k,128k,256k} \
        "$here/reattention_quality.sh" "$model" "$out/reattention/$model" ;;
    resa_error)  # relative attention-output error, Quest and ideal top-k at 2.5/5/10%
      for length in 8k 16k 32k; do
        python "$here/resa_error.py" --model "$model" --length "$length" --samples 2 \
          --steps 16 --out "$out/resa/$model/errors_$length"
      done ;;
    resa)  # task scores at 5% of the context
      LENGTHS=16k,32k "$here/resa_quality.sh" "$model" "$out/resa/$model" ;;
    citrus768|citrus2048)  # k = 768 and 2048; full attention at every length (inside 32K)
      K=${part#citrus} PASSKEY_LENGTHS=8k,16k,32k NIAH_LENGTHS=16k,32k \
        FULL_PASSKEY_LENGTHS=8k,16k,32k FULL_NIAH_LENGTHS=16k,32k TASKS="passkey niah_multikey" \
        "$here/citrus_quality.sh" "$model" "$out/citrus/$model/k${part#citrus}" ;;
    refreshkv)  # K = L/8, threshold 0.85; ppl at 16K and 32K, tasks at 16K (calibrated:
                # experiments/refreshkv_calibrated.sh)
      PPL_LENGTHS=16k,32k TASK_LENGTHS=16k PPL_NAME=ppl_threshold0.85 \
        "$here/refreshkv_quality.sh" "$model" \
        "$out/refreshkv/$model" ;;
    star)  # 4 blocks (a quarter of the context each) on 4 GPUs, one process per GPU
      LENGTHS=16k,32k PROCESSES=${PROCESSES:-4} "$here/star_quality.sh" "$model" \
        "$out/star/$model" ;;
    mesh)  # mesh ReAttention at 8x-32x the window, RESA over it at 8x; one process per GPU
      PROCESSES=${PROCESSES:-4} "$here/reattention_mesh_quality.sh" "$model" \
        "$out/reattention_mesh/$model" ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
