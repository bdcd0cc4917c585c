"""A stage's Hydra config turned into plain objects and checked at the edge: the rule of every key (`rules`), the
config error and the checks every stage shares (`validation`), the builders of policies, algorithms and optimizers (`factories`) and of tasks and
prompts (`prompts`). With `runs`, `stages` and `cli`, the only code that sees Hydra."""
