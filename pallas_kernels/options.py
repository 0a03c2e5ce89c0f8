"""Which kernel a call runs where several compute the same thing: a run's choice, passed in.

A frozen (hashable) value, so it can be a static argument of a jitted step: two option sets
compile apart and none can leave a compiled step stale, as a module global read at trace time
could. The defaults are what was measured best (BENCHMARKS.md); the opt-in ones stay off until
a device measurement says otherwise (benchmarks/decode_profile.py times them as variants).
"""

from __future__ import annotations

import dataclasses

IMPLS = ("mosaic", "triton")
TOPK_SELECTIONS = ("exact", "max_only")
TOPK_FEW_ROWS = ("blocks", "blocks_jnp", "kernel")
TOPK_MANY_ROWS = ("segments", "columns", "kernel")
COLUMN_WINDOWS = (0, 32, 64, 128)
EIGHT_BIT_TOPK = ("auto", "products", "dequantize")


@dataclasses.dataclass(frozen=True)
class KernelOptions:
  # The GPU kernel for flash-attention calls the Mosaic GPU kernel can run, on a Hopper GPU
  # (`Tiling.impl` overrides it per call; off GPU only `Tiling.impl` picks Mosaic). On an H200
  # (benchmarks/mgpu_attention.py) the Mosaic kernel ran causal 16K / 32K at 1.05x / 1.04x one
  # cuDNN call and a 4096-query chunk at offset 28K at 1.10-1.14x `chunk_attention`'s two cuDNN
  # calls, so it is the default and goes before cuDNN; the Triton kernel ran at 0.56x.
  prefill_impl: str = "mosaic"
  # Whether "auto" gives cuDNN-expressible calls to the Mosaic kernel rather than to cuDNN.
  mosaic_before_cudnn: bool = True
  # The same choice for topk_scores' prefill chunks (decode rows: topk_few_rows below).
  topk_impl: str = "mosaic"
  # Whether a prefill chunk the Mosaic kernel does not serve runs as two cuDNN calls merged by
  # LSE (`chunk_attention`) rather than one flash-attention call with the offset (measured
  # faster on an H200; False is the benchmarks' "before").
  chunk_cudnn: bool = True
  # Decode on the GPU kernels (flash_attention, gathered_attention): merge their key splits in
  # one Pallas kernel (split_merge: one launch, real rows only) instead of jnp's merge and the
  # padding rows' slice (three small XLA kernels per call). With the next switch, ReAttention's
  # decode at 32K on an H200 took 5.992 against 5.993 ms without them; with RunOptions'
  # cache_write_backend and add_norm_backend, the 8B's tensor-parallel decode 3.9% faster: on.
  decode_merge_kernel: bool = True
  # Decode on the GPU kernels with fewer query rows per kv group than a row block (Llama-8B: 4
  # of 16): the kernel reads the real rows and repeats them to fill the block, instead of an XLA
  # pad kernel per call (above; flash decode: decode_profile variant `q_in_kernel`).
  decode_q_in_kernel: bool = True
  # The GPU (Triton) attention kernel over E4M3 K/V with bf16 queries: its products in fp16,
  # to which E4M3 converts in one step (to bf16 it goes through fp16). The 8B's decode step with
  # an E4M3 cache on an H200: 8.345 -> 7.185 ms at 128K, 5.482 -> 5.259 at 32K (BENCHMARKS.md
  # "Long contexts on one GPU"). Exact for the 8-bit values and for bf16 queries within fp16's
  # range (bf16's 8 significant bits fit fp16's 11; |q| past 65504 would overflow); the
  # probabilities round to fp16, finer than bf16.
  fp8_fp16_products: bool = True
  # The same for int8 K/V, converted by PTX (online_softmax.int8_as_float16_ptx: a xor, byte
  # permutes and packed fp16 subtracts instead of two conversions a value). Off: on an H200 it
  # was correct and no faster (the 8B step at 128K 7.408 against 7.383 ms; BENCHMARKS.md "int8
  # converted to fp16 by PTX"); an earlier form, 16-bit integer arithmetic, ran slower (removed).
  int8_fp16_products: bool = False
  # One-token decode (flash_attention) over int8 keys: q . k on the int8 matrix units, the
  # queries quantized per row as the keys are (int8 x int8 -> int32, exact; then the key's and
  # the row's scales), the values still converted tile by tile. The int8 decode kernel is bound
  # by its cores, not HBM (Nsight Compute on an H200: 65% SM busy, 67.5% of DRAM), and this
  # drops the keys' conversion. None (auto, the default): on where the GPU's Triton kernel runs
  # natively, off elsewhere (the reference, the TPU kernel: unmeasured; interpreted kernels), so
  # the CPU's numbers are the dequantize route's; True / False everywhere (the reference computes
  # the same products in jnp, reference.product_scores). On an H200 (BENCHMARKS.md "int8 decode
  # on the int8 products"): the 8B's step 7.586 -> 7.294 ms at 128K, 5.375 -> 5.426 at 32K; 14
  # sequences at 128K 51.3 -> 45.8 ms; Qwen2.5-Coder-1.5B pooled NLL +0.031% / +0.024% at 16K /
  # 32K against the dequantize route (100 texts).
  decode_int8_products: bool | None = None
  # One-token decode on the GPU kernel with fewer query rows a KV head than its row block (the
  # 8B: 4 of 16): the block holds copies of the rows, each over its own part of every key tile
  # (4 parts of 32 keys for the 8B), merged as more key splits, instead of one copy over the
  # whole tile beside discarded ones, so a score tile's softmax work (scales, exp, sums) runs
  # once a key per row rather than per block row. Off: on an H200 (BENCHMARKS.md "int8 decode:
  # the 8B's step profiled") it took the int8 products' attention 2.74 -> 2.64 ms a token in the
  # 8B's step at 128K (batch 1; level at 32K), but the 14-sequence step at 128K 45.7 -> 52.8 ms;
  # E4M3 (fp16 products) and bf16 calls ran level or slower (E4M3 at 128K 0.100 -> 0.108 ms).
  decode_row_groups: bool = False
  # One-token decode on the GPU kernel over int8 values: P V on the int8 matrix units too, as
  # FlashAttention-3's FP8 path puts P in 8 bits (arXiv 2407.08608): each row's p times the
  # values' scales, quantized per row and tile to 0..127 (one scale a row a tile, the tile's
  # largest to 127), multiplied by the int8 values as stored (int32, exact), then that scale;
  # no value converted in registers. The rounding of p moves the outputs (an entry below 1/254
  # of its row's largest in the tile becomes 0), by design. GPU kernel only (the reference and
  # the TPU kernel multiply converted values: this option does not act there). Off: on an H200
  # (BENCHMARKS.md "Key splits rounded down") SmolLM2's pooled NLL at 8K moved +0.008%, and the
  # kernel at 128K keys ran 7% faster at 14 sequences (3 key splits), level at one, but its
  # compile took 168-230 registers a thread depending on the shape (2 or 3 programs a core), so
  # it was level with the default under the split plan at 2 / 4 / 6 / 8 / 14 sequences.
  decode_int8_values: bool = False
  # One-token decode over an int8 cache on a Hopper GPU: "mosaic" runs attention/mgpu_decode.py
  # (TMA-fed tiles, the products turned around so a KV head's few query rows are WGMMA's N: the
  # keys multiply as stored, as decode_int8_products does, the values converted in SMEM by the
  # TMA warpgroup); "triton" the split-K kernel above. Off Hopper, interpreted (unless a call's
  # Tiling(impl="mosaic") asks), where mgpu_decode cannot take the call (E4M3, more than 16 query
  # heads a KV head) or the run asks for a Triton-only option above, "triton" runs. On an H200
  # (BENCHMARKS.md "int8 decode on a Mosaic GPU kernel"): the kernel 1.05-1.18x the Triton one
  # at 1-14 sequences and 32K-512K keys; the 8B's step 7.285 -> 7.074 ms at 128K, 5.557 -> 5.484
  # at 32K, 43.36 -> 40.92 ms with 14 sequences; the same products, so on.
  decode_impl: str = "mosaic"
  # What topk_scores' GPU / TPU kernels do with each score tile. "exact" keeps the running top-k.
  # "max_only" is a benchmark diagnostic whose results are meaningless: it keeps only each row's
  # running max (in its top slot; the indices are not kept), so it times the kernel without its
  # selection, the ceiling of its loop (benchmarks/kernel_sweep.py, benchmarks/mgpu_topk.py).
  topk_selection: str = "exact"
  # topk_scores on the GPU with at most topk_blocks.MAX_ROWS query rows per kv head (decode):
  # "blocks" stores the scores and selects from the k best blocks' maxima (topk_blocks.py), the
  # selection after XLA's block maxima in one Pallas kernel; "blocks_jnp" the same selection as
  # jnp (a sort, a gather and a CUB top-k: the decode step at 32K 6.34 against 5.99 ms on an
  # H200); "kernel" runs the fused Triton kernel's running set.
  topk_few_rows: str = "blocks"
  # topk_scores' prefill chunks on the Mosaic kernel, top_k > 1: "segments" keeps each row's k
  # best segments of 16 keys and scores their keys again (topk_segments.py); "columns" the same
  # for strided segments, k for each of a row's 8 columns, with no shuffles or warpgroup-wide
  # tests (mgpu_select._select_columns; "segments" where k > 8); "kernel" keeps the k best keys
  # in the kernel's running set (its selection rounds). top_k = 1 keeps its running argmax
  # either way.
  topk_many_rows: str = "columns"
  # "columns"' window of keys (a strided segment: its keys of one column mod 8): 0 picks by the
  # key axis (topk_segments.column_window: 64, 128 from COLUMN_LONG_KEYS keys); else 32, 64 or
  # 128 (one that does not divide the kernel's key tile runs as "segments").
  topk_column_window: int = 0
  # The Mosaic top-k kernel's compute warpgroups under "columns" (a top_k > 1 prefill chunk): 2
  # alternate as FlashAttention-3's, one selecting while the other's product runs; 3 issue
  # their products in turn and select at once (mgpu_topk.THREE_WARPGROUPS). 0: by the keys, 3
  # over bf16 / fp16 (1.09-1.21x faster on an H200), 2 over 8-bit (whose products take half the
  # time: 3 ran 1.0-1.15x slower) and in jax's interpreter. Other selections reduce across warps
  # through one scratch and run 2 whatever is asked here.
  topk_warpgroups: int = 0
  # topk_scores' prefill rows on the Mosaic kernel: key splits that share each sequence's
  # candidates' tiles equally, as many as fill the GPU's cores in whole waves
  # (gpu.wave_splits), rather than splits of the key axis within one wave. The kernel runs a
  # CTA a core: ReAttention's rows of the 3B shape (24 query / 8 KV heads, 512-token chunks)
  # are 96 CTAs, 73% of an H200's 132 cores in one wave; Qwen2.5-Coder-1.5B's (12 / 2) 48, 36%.
  topk_balanced_splits: bool = True
  # Those prefill rows' key splits, fixed (a benchmark's knob: the plan's cost against its
  # waves' fill, e.g. the 1.5B's 48 CTAs at 8 splits against 4-6); 0: the plan's own
  # (gpu.wave_splits when balanced, else one wave's). A call's Tiling.key_splits comes first.
  topk_key_splits: int = 0
  # topk_scores' rescoring of segments (topk_segments.best_keys) over keys of 2^31 elements or
  # more (ReAttention's int8 cache of the 3B shape at 2M tokens), which Triton's int32 offsets
  # cannot index: the Triton kernel over the keys as int32 words (int8 and bf16 keys; 4 / 2
  # times fewer elements) rather than XLA's gathers a KV head at a time: on an H200, 1,536 rows
  # of 256 candidates over 2M int8 keys of 8 heads in 0.23 ms against 0.84, the same result on
  # integer inputs; ReAttention's 2M prefill (3B shape, 4 layers) 1.09x. Off: XLA's gathers.
  topk_rescore_words: bool = True
  # A prefill chunk over an 8-bit cache on a GPU: the cache (this layer's, this device's share)
  # is dequantized to the queries' dtype and the chunk runs the bf16 route (Mosaic, else cuDNN)
  # when that copy takes at most this many bytes; else the 8-bit flash kernel reads the cache
  # (Triton: the Mosaic 8-bit path hung on an H200), which ran 4096-query chunks at 0.4-0.5x the
  # bf16 Mosaic kernel. The chunk's attention is compute-bound, so a pass over the cache is a
  # few percent of it; the cap bounds the transient copy (1 GiB: 256K tokens of 8 KV heads x 128).
  # 0: never.
  prefill_dequantize_bytes: int = 1 << 30
  # topk_scores with many query rows (ReAttention's prefill scoring) over 8-bit keys on a GPU:
  # scores a copy of the keys in the queries' dtype (the Mosaic kernel on Hopper), the whole
  # copy when it takes at most this many bytes, else a segment of keys at a time that does (as
  # prefill chunks do above); 0: never, the Triton kernel reads the 8-bit keys (0.42-0.48x the
  # bf16 kernel at 512 rows; ReAttention's int8 prefill ran ~1.9x slower than bf16's on an
  # H200, BENCHMARKS.md "Re-timed"). A prefill chunk's scoring is compute-bound, so the copy's
  # pass is a few percent of it. 4-bit keys (no kernel reads their tiles for top-k) take the
  # same cap on every variant, their segments never shorter than read.COPY_SEGMENT_MIN keys.
  topk_dequantize_bytes: int = 1 << 30
  # topk_scores over 8-bit keys: "products" multiplies them as they are stored on the 8-bit
  # matrix units, the queries quantized per row as the keys are (Hopper's tensor cores in the
  # Mosaic kernel for prefill chunks: s8 x s8 -> s32, e4m3 x e4m3 -> f32, mgpu_topk.py; the TPU
  # MXU's int8 x int8 -> int32; the reference variant computes the same products in jnp,
  # reference.product_scores); "dequantize" takes the route above (a bf16 copy within
  # topk_dequantize_bytes, else the keys converted tile by tile to the queries' dtype); "auto"
  # (the default) runs the products where Hopper's Mosaic kernel serves the call and the
  # dequantize route everywhere else (the reference, the TPU, the Triton kernel), so the CPU's
  # numbers are the dequantize route's and the products run only where they were measured.
  # On an H200, 512 queries x 128K / 1M keys: 0.98-1.10x / 1.05-1.24x the bf16 keys' kernel,
  # 1.14-1.22x / 1.21-1.40x "dequantize"; ReAttention's 1M-token int8 prefill 1.33x
  # "dequantize". Quality on an H200 (SmolLM2-135M, ReAttention at 4x / 8x its window): pooled
  # NLL +0.005% int8 / +0.004% E4M3 against "dequantize" over 100 texts, passkey the same,
  # niah_multikey within noise (BENCHMARKS.md; docs/CLAIMS.md). The quantized queries do pick
  # other keys among near-ties (20% of random rows' top-4 with E4M3).
  topk_eight_bit: str = "auto"
  # One-token decode (flash_attention) over a 4-bit cache on the GPU: the split-K kernel that
  # reads its 4-bit tiles (attention/int4_decode.py) instead of the bf16 kernel over a copy of
  # the layer's keys and values made first (read.four_bit_copies), which also needs that copy's
  # memory. The 8B's attention shape on an H100 (benchmarks/int4_kernels.py): 0.084 / 0.194 /
  # 1.301 ms at 32K / 128K / 1M keys against the copy route's 0.131 / 0.469 / 3.477 (bf16 K/V:
  # 0.076 / 0.197 / 1.425), so on.
  int4_decode_kernel: bool = True
  # A prefill chunk (flash_attention with many query rows, chunk_attention) over a 4-bit cache on
  # the GPU or the TPU: the kernel dequantizing its tiles as it reads them (attention/
  # int4_chunk.py, int4_chunk_tpu.py) instead of
  # a copy of the layer's keys and values in the queries' dtype made first, whose transient is
  # 2 bytes a channel and token (the 3B shape at 4M tokens: 17 GB a layer). Off: on an H200 it
  # ran a 4096-query chunk at ~100 TFLOP/s against the copy route's ~600 (5.7-5.9x slower; the
  # 8B's prefill 9,694 / 2,912 tok/s at 32K / 128K against 24,325 / 12,042; BENCHMARKS.md "The
  # 4-bit prefill chunk kernel"), so it serves only where the copy's memory is short.
  int4_chunk_kernel: bool = False
  # A decode step's top-k (few query rows: topk_blocks) over 4-bit keys on the GPU: their scores
  # from one kernel reading the codes as stored (topk/int4_scores.py) instead of a copy of the
  # keys in the queries' dtype made first (in segments past topk_dequantize_bytes), which writes
  # and reads back 2 bytes a channel and key where the codes hold half a byte.
  int4_topk_scores: bool = True

  def __post_init__(self):
    for field in ("prefill_impl", "topk_impl", "decode_impl"):
      if getattr(self, field) not in IMPLS:
        raise ValueError(f"{field}={getattr(self, field)!r} must be one of {IMPLS}")
    if self.topk_few_rows not in TOPK_FEW_ROWS:
      raise ValueError(f"topk_few_rows={self.topk_few_rows!r} must be one of {TOPK_FEW_ROWS}")
    if self.topk_many_rows not in TOPK_MANY_ROWS:
      raise ValueError(f"topk_many_rows={self.topk_many_rows!r} must be one of {TOPK_MANY_ROWS}")
    if self.topk_column_window not in COLUMN_WINDOWS:
      raise ValueError(f"topk_column_window={self.topk_column_window!r} must be one of "
                       f"{COLUMN_WINDOWS} (0: by the key axis)")
    if self.topk_warpgroups not in (0, 2, 3):
      raise ValueError(f"topk_warpgroups={self.topk_warpgroups!r} must be 0 (by the keys), 2 "
                       "or 3")
    if not isinstance(self.topk_key_splits, int) or self.topk_key_splits < 0:
      raise ValueError(f"topk_key_splits={self.topk_key_splits!r} must be a count >= 0 (0: the "
                       "plan's own)")
    for field in ("prefill_dequantize_bytes", "topk_dequantize_bytes"):
      value = getattr(self, field)
      if not isinstance(value, int) or value < 0:
        raise ValueError(f"{field}={value!r} must be a byte count >= 0 (0: never)")
    if self.topk_eight_bit not in EIGHT_BIT_TOPK:
      raise ValueError(f"topk_eight_bit={self.topk_eight_bit!r} must be one of {EIGHT_BIT_TOPK}")
    if self.topk_selection not in TOPK_SELECTIONS:
      raise ValueError(f"topk_selection={self.topk_selection!r} must be one of {TOPK_SELECTIONS}")


DEFAULT = KernelOptions()
