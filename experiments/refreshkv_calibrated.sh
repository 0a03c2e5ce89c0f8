#!/usr/bin/env bash
# RefreshKV with the threshold calibrated for the model (issue 39), as run on one H200:
#   experiments/refreshkv_calibrated.sh STAGE...      STAGE: calibrate | sweep | decode | tradeoff
# calibrate  the paper's A.4 sweep on held-out text (thresholds x queries before / after RoPE, QC
#            CAL_QC), into OUT/calibration; the JSON also goes beside the checkpoint and, SHIP=1
#            (default), to jax_longctx/app/calibrations/<model>.json, where later runs (a fresh
#            machine too) find it.
# sweep      ppl at LENGTHS (default 16k,32k; last 256 tokens, K = L/8 of an L + 512 cache),
#            TEXTS per cell (default 100, as the paper): full, the paper's SnapKV (window 1, kernel
#            7, fixed size), today's SnapKV (window 32, keeps generated tokens), RefreshKV QC 5 and
#            10 at the calibrated threshold, and Table 4's ablations at QC 5 (no refresh: C_p stays
#            SnapKV's, full attention at due steps; no full attention: refresh, then attend C_p).
#            One eval process per label (PARALLEL at once, sharing the GPU), each into
#            OUT/ppl/LENGTH/parts/LABEL, merged into OUT/ppl/LENGTH/results.jsonl + summary.md +
#            plots (ppl_ratio_by_position.png: the paper's Figure 3). Workers stop at DEADLINE
#            seconds (default 540, under a 10-minute command); run it again to resume.
# decode     benchmarks/decode.py on the Llama-3.1-8B shape at 128K (random weights, so every
#            comparison refreshes: stride = QC stride, the worst case) at the calibrated
#            threshold, plus fixed strides at the effective strides the sweep measured at the
#            longest length (what the calibrated threshold costs on the real model).
# tradeoff   OUT/tradeoff.md: effective stride, pooled ppl, gap closed and ms/token in one table
#            (the paper's Table 9).
# MODEL (default qwen2.5-coder-1.5b), OUT (default docs/results/refreshkv/MODEL), DTYPE (default
# bfloat16), CAL_TEXTS (24), CAL_LENGTHS (16k), CAL_QC (5), CAL_THRESHOLDS (the CLI's default),
# PARALLEL (7 eval processes), MEM_FRACTION (0.12 of the GPU each), DECODE_OUT, DECODE_METHODS,
# DECODE_MODEL / DECODE_CONTEXT (a small shape for a CPU check of the stage).
set -euo pipefail
here=$(dirname "$0")
source "$here/common.sh"
model=${MODEL:-qwen2.5-coder-1.5b}
out=${OUT:-docs/results/refreshkv/$model}
texts=${TEXTS:-100}
lengths=${LENGTHS:-16k,32k}
dtype=(--dtype "${DTYPE:-bfloat16}")
deadline=$(( SECONDS + ${DEADLINE:-540} ))
decode_out=${DECODE_OUT:-benchmarks/results/decode_refreshkv_calibrated_128k.jsonl}

# label -> method and its args (budget K = L/8 everywhere).
declare -A entry=(
  [full]="full"
  [snapkv_paper]="snapkv_paper:snapkv budget=0.125 window=1 pool_kernel=7 keep_size=True"
  [snapkv]="snapkv budget=0.125"
  [rkv5]="rkv5:refreshkv budget=0.125 qc_stride=5"
  [rkv10]="rkv10:refreshkv budget=0.125 qc_stride=10"
  [rkv5_norefresh]="rkv5_norefresh:refreshkv budget=0.125 qc_stride=5 refresh=False"
  [rkv5_nofull]="rkv5_nofull:refreshkv budget=0.125 qc_stride=5 full_attention=False"
)
labels=(full snapkv_paper snapkv rkv5 rkv10 rkv5_norefresh rkv5_nofull)

calibrate() {
  local cal=(python -m jax_longctx calibrate refreshkv --model "$model" "${dtype[@]}"
             --lengths "${CAL_LENGTHS:-16k}" --texts "${CAL_TEXTS:-24}"
             --qc-strides "${CAL_QC:-5}" --out "$out/calibration")
  [ -n "${CAL_THRESHOLDS:-}" ] && cal+=(--thresholds "$CAL_THRESHOLDS")
  "${cal[@]}"
  if [ "${SHIP:-1}" = 1 ]; then
    local id
    id=$(python -c "import json, sys; print(json.load(open(sys.argv[1]))['model'])" \
         "$out/calibration/refreshkv_calibration.json")
    cp "$out/calibration/refreshkv_calibration.json" "jax_longctx/app/calibrations/$id.json"
    echo "shipped: jax_longctx/app/calibrations/$id.json"
  fi
}

# The threshold refreshkv resolves to for this model; fails when the model has no calibration
# (a sweep at the fallback would not measure what it is for).
calibrated_threshold() {
  python - "$model" <<'EOF'
import sys
from jax_longctx.app import calibration_store
from jax_longctx.app.api import load
from jax_longctx.methods import get
lm = load(sys.argv[1])
calib, where = calibration_store.find(lm.path, lm.model_id, lm.config)
if calib is None:
  sys.exit(f"no RefreshKV calibration for {sys.argv[1]} ({where}): run the calibrate stage first")
m = lm.resolve_method(get("refreshkv"))
print(f"{m.threshold} {m.similarity_after_rope} {where}")
EOF
}

worker() {  # label length dir: one eval process, stopped at the deadline (SIGINT: whole lines)
  local label=$1 length=$2 dir=$3 spec args=() a
  read -r spec rest <<< "${entry[$label]}"
  for a in ${rest:-}; do args+=(--method-arg "$label.$a"); done
  python "$here/sweep_parts.py" seed "$dir" "$label"
  local left=$(( deadline - SECONDS ))
  (( left > 30 )) || return 0
  XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.12} timeout -s INT -k 30 "$left" \
    python -m jax_longctx eval --model "$model" "${dtype[@]}" --task ppl --methods "$spec" \
      "${args[@]}" --lengths "$length" --samples "$texts" \
      --cache-len $(( $(tokens "$length") + 512 )) --out "$dir/parts/$label" \
      > "$dir/parts/$label.log" 2>&1 || echo "$label at $length stopped (rc $?; see its log)"
}

sweep() {
  echo "refreshkv for $model: threshold, after RoPE, from: $(calibrated_threshold)"
  local length dir label running
  for length in ${lengths//,/ }; do
    dir=$out/ppl/$length
    mkdir -p "$dir/parts"
    running=0
    for label in "${labels[@]}"; do
      worker "$label" "$length" "$dir" &
      running=$(( running + 1 ))
      if (( running >= ${PARALLEL:-7} )); then wait -n || true; running=$(( running - 1 )); fi
    done
    wait
    python "$here/sweep_parts.py" merge "$dir" "$texts" --baseline snapkv_paper --baseline snapkv
    (( deadline - SECONDS > 60 )) || { echo "deadline reached: run the sweep again"; return; }
  done
}

measured_stride() {  # dir label: the label's effective stride there, rounded (0: none)
  python - "$1" "$2" <<'EOF'
import json, os, sys
from jax_longctx.app.report import effective_stride, stride_counts
path = os.path.join(sys.argv[1], "results.jsonl")
recs = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
counts = [v for (t, m, n), v in stride_counts(recs).items() if m == sys.argv[2]]
print(round(effective_stride(*counts[0])) if counts else 0)
EOF
}

decode() {
  local thr after stride longest
  read -r thr after _ <<< "$(calibrated_threshold)"
  longest=$out/ppl/${lengths##*,}
  local methods=full,snapkv_paper:snapkv,rkv5:refreshkv,rkv10:refreshkv
  local args=(--method-arg snapkv_paper.budget=0.125 --method-arg snapkv_paper.window=1
              --method-arg snapkv_paper.keep_size=True)
  for label in rkv5 rkv10; do  # decode.py has no model to resolve a calibration with
    args+=(--method-arg "$label.qc_stride=${label#rkv}" --method-arg "$label.threshold=$thr"
           --method-arg "$label.similarity_after_rope=$after" --method-arg "$label.budget=0.125")
  done
  for label in rkv5 rkv10; do  # the measured stride, as a fixed stride in every layer
    stride=$(measured_stride "$longest" "$label")
    if (( stride > 0 )); then
      methods+=",${label}_fixed:refreshkv"
      args+=(--method-arg "${label}_fixed.fixed_stride=$stride"
             --method-arg "${label}_fixed.budget=0.125")
    fi
  done
  python benchmarks/decode.py --model "${DECODE_MODEL:-llama-3.1-8b}" \
    --contexts "${DECODE_CONTEXT:-131072}" --batches 1 --impls jax \
    --methods "${DECODE_METHODS:-$methods}" "${args[@]}" --out "$decode_out"
}

tradeoff() {
  python "$here/refreshkv_tradeoff.py" --sweep "$out/ppl" --lengths "$lengths" \
    --decode "$decode_out" --out "$out/tradeoff.md"
}

for stage in "$@"; do
  case $stage in
    calibrate|sweep|decode|tradeoff) "$stage" ;;
    *) echo "unknown stage $stage (calibrate | sweep | decode | tradeoff)" >&2; exit 2 ;;
  esac
done
