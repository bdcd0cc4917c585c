"""One optimisation step on a batch of rollouts (`step`): the forward under each view (`forward`), GRPO's pure
functions (`losses`), the physical-eviction learner (`physical`), the sampler's agreement with the dense policy
(`agreement`) and the tiny scale's supervised warm start (`warmstart`). Rollout corrections: `smd_cli.corrections`."""
