"""The quality sweeps' Python helpers: a package so tests import them by name (test_bundled reads
gguf_vs_transformers.STRINGS)."""
