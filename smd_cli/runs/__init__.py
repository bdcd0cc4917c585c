"""What a stage run needs around the engine: its folder and provenance (`run_dirs`), the console (`console`), the
model and tokenizer as a config names them (`model_loading`, `warm_cache`), whether a config's step fits this
machine's memory (`memory_fit`), the pre-flight check of a sweep (`preflight`), a training run's state, checkpoints and summary
(`train_state`, `train_summary`), the parity guard (`guard`) and the members of a sweep run as child processes
(`sweep`). Imported by the stages only."""
