"""How a model's attention sees its keys, shared by the sampler and the learner: the one attention function (`dispatch`),
its kernels, the rollout's evicting attention (`evicting`) and fixed-capacity KV cache (`kv_cache`) with its 8-bit
codes (`kv_quant`), the eviction policy interface (`policy`), and the shadow mask's encoding and replay (`shadow`)."""
