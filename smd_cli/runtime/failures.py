"""The engine's failures that a stage reports and exits on (`smd_cli.cli`), in a module of their own so that the CLI
names them without importing the engine (torch and transformers) for stages that never train."""


class TrainingDiverged(RuntimeError):
    """A loss or gradient was NaN or infinite; the step was not applied."""


class ParityFailed(RuntimeError):
    """A learner view that must equal the sampler's log-probs does not, beyond the bound."""


class Interrupted(RuntimeError):
    """Ctrl-C (SIGINT) stopped a stage; the message says where (the step, the last checkpoint) and how to continue."""
