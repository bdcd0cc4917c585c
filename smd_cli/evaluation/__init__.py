"""Held-out evaluation: which prompts a run evaluates (`heldout`), a batch of them generated and scored by the
task's metric with the answer-bearing KV kept (`batch`), and the cache of finished evaluations (`cache`)."""
