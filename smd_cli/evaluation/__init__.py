"""Held-out evaluation: which prompts a run evaluates (`heldout`), a batch of them generated and scored by the
task's metric with the answer-bearing KV kept (`batch`), several eviction policies over one prefill of the same
prompts (`policy_grid`), and the cache of finished evaluations (`cache`)."""
