"""Files, processes and devices: atomic writes and locks (`integrity`), the one reader and writer of a run's records
(`records`), provenance and seeds (`provenance`), checkpoints (`checkpoint`), torchrun and FSDP2 (`distributed`),
host offload (`offload`), child processes that die with their parent (`lifetime`) and the engine's failures
(`failures`). Nothing here imports torch at module level but what must."""
