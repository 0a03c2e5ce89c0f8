"""RefreshKV continued pretraining (data, attention masks, optax loop, orbax checkpoints).

Empty until the continued-pretraining work lands.
"""
