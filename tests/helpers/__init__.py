"""Scripts and modules the tests use, none a test: the multi-device checks the tests start as
processes (`python -m tests.helpers.NAME`), fault-injection children, GGUF writers, transformers
references and the TPU export helpers."""
