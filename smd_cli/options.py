"""Option names and bounds that the engine and the config rules (`config/rules.py`) share, in a module without torch:
the processes that only launch or read runs (`smd ablate` and its launcher's workers) check configs without importing it."""

VIEWS = ("dense", "shadow")  # the attention the learner scores under: full context, or the rollout's shadow mask
MAX_SUPPORT = 512  # most tokens a step's recorded support holds (prime-rl caps top_k at 512)
KV_KINDS = ("none", "int8", "fp8_e4m3")  # the rollout's KV cache: as computed, or in 8 bits (`kv_quant`)
