"""Decode-step kernels around attention: small fused passes that replace several XLA kernels.

- split_merge.py: the merge of a decode call's key splits in one kernel (flash and gathered
  attention's GPU decode).
- add_rmsnorm.py, add_rms_norm: the residual add and the RMSNorm after it in one kernel.
- cache_write.py, write_one_token: a one-token K/V cache write in place.
"""

from pallas_kernels.decode import add_rmsnorm, cache_write, split_merge
from pallas_kernels.decode.add_rmsnorm import add_rms_norm
from pallas_kernels.decode.cache_write import write_one_token

__all__ = ["add_rms_norm", "write_one_token", "add_rmsnorm", "cache_write", "split_merge"]
