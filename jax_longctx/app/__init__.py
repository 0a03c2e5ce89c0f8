"""The application: load() and LM, evaluation sweeps and their reports, tasks, the bundled and
default models, the tokenizer, the command line."""
