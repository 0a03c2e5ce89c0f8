"""RefreshKV continued pretraining: `jax-longctx train-cpt --config FILE`.

config.py (settings), data.py (text files -> packed rows), pattern.py (the attention pattern),
loss.py (the NLL, its cross-entropy in chunks), state.py (the model, its rows and the sharded
training state, or their shapes), sharding.py (mesh), evaluate.py (held-out perplexity),
loop.py (the job).
"""

from train_cpt.config import TrainConfig, TrainConfigError, load_config
from train_cpt.loop import read_log, train

__all__ = ["TrainConfig", "TrainConfigError", "load_config", "read_log", "train"]
