#!/usr/bin/env bash
# ReAttention's top-k over an 8-bit cache on the 8-bit tensor cores (KernelOptions
# topk_eight_bit=products: the queries quantized per row) against the dequantize-first route
# (the default). One ROUTE and KV_DTYPE per call, so that parts run side by side on several GPUs
# (experiments/one_per_gpu.sh):
#   experiments/topk8_quality.sh MODEL OUT ROUTE KV_DTYPE LENGTHS PARTS
#     ROUTE: dequantize | products; PARTS: as kv_quant_quality.sh's ("ppl", "passkey", ...)
# writes OUT/ROUTE/KV_DTYPE-LENGTHS/<part> (commas in LENGTHS as _); then
#   python -m experiments.route_compare OUT/dequantize OUT/products
# e.g. ... OUT products int8 32k ppl;  ... OUT products float8_e4m3fn 128k "passkey niah_multikey"
# METHOD_ARGS (default: the paper's split of Qwen's 32K window, n_local 16384 and clip 511, so
# that the top-k picks keys only past 16K tokens; set it empty for ReAttention's defaults for
# MODEL's window); BATCH (4), SAMPLES: as kv_quant_quality.sh's.
set -euo pipefail
model=$1 out=$2 route=$3 dtype=$4 lengths=$5 parts=$6
case $route in dequantize|products) ;; *) echo "ROUTE: dequantize | products" >&2; exit 2 ;; esac
qwen_split="--method-arg reattention.n_local=16384 --method-arg reattention.clip=511"
KV_DTYPES=$dtype LENGTHS=$lengths METHOD=reattention BATCH=${BATCH:-4} \
  METHOD_ARGS=${METHOD_ARGS-$qwen_split} EVAL_ARGS="--kernel-option topk_eight_bit=$route" \
  "$(dirname "$0")/kv_quant_quality.sh" "$model" "$out/$route/$dtype-${lengths//,/_}" "$parts"
