"""What `smd STAGE ARGS` checks of its command line before Hydra runs anything or makes a folder.

- `overrides(args)`: every `KEY=VALUE` parsed as Hydra will parse it; one it cannot parse is a ConfigError naming it.
- `check_sweep`: every run of a `-m` sweep composed and checked by the stage's rules (`smd_cli.config.rules`), and for
  `smd ablate` every member of each of its sweeps (`smd_cli.runs.sweep.plan`), so that `-m lambda=abc,0.1` stops
  at once, naming the run, instead of after the runs before it.
- `unread_additions`: `+KEY=VALUE` adds a key the config does not have; one that no rule knows is read by no stage
  (`+sampling.topk=5`, a typo of `sampling.top_k`): a warning, naming the closest known key.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import re

from omegaconf import DictConfig, OmegaConf

from smd_cli.config.rules import PATTERNS, RULES, TASK_FIELDS, check_config, is_node, rule_for
from smd_cli.config.validation import ROOT, ConfigError, one_line


def arguments(args: list[str]) -> list[str]:
    """The overrides among a command line's arguments (not its flags such as `-m`, `--cfg job`)."""
    return [a for a in args if "=" in a and not a.startswith("-")]


def overrides(args: list[str]) -> list:
    """Hydra's parse of every override of `args`; one it cannot parse is a ConfigError naming it (before anything is
    made: Hydra would refuse it only after the run directory is checked)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser, parsed = OverridesParser.create(), []
    for arg in arguments(args):
        try:
            parsed.append(parser.parse_override(arg))
        except HydraException as err:  # OverrideParseException, or the grammar's own error wrapped
            key, _, value = arg.partition("=")
            why = str(err).strip().splitlines()[-1].strip() if str(err).strip() else type(err).__name__
            raise ConfigError(f"{key}={value!r} is not allowed: Hydra cannot parse it ({why}); quote a value that holds "
                              f"[ ] {{ }} ( ) = or spaces, e.g. {key}='{value}'") from None
    return parsed


def interpolation_problem(value: str) -> str | None:
    """Why OmegaConf cannot resolve the interpolations of `value` (a run directory's), or None: a syntax error, or
    a resolver it does not have (Hydra's `now` and `hydra` are registered here as Hydra will)."""
    from hydra.core.utils import setup_globals
    from omegaconf.errors import GrammarParseError
    from omegaconf.grammar_parser import parse

    setup_globals()
    try:
        parse(value)
    except GrammarParseError as err:
        return f"OmegaConf cannot parse its interpolation ({str(err).strip().splitlines()[0]})"
    unknown = [name for name in re.findall(r"\$\{\s*([\w.]+)\s*:", value) if not OmegaConf.has_resolver(name)]
    if unknown:
        return f"it uses ${{{unknown[0]}:...}}, a resolver OmegaConf does not have (e.g. ${{now:%H-%M-%S}}, ${{oc.env:VAR}})"
    return None


def value_of(arg: str):
    """The value of one override as Hydra reads it (quotes removed; a sweep `a,b` is not a string)."""
    return overrides([arg])[0].value()


@contextlib.contextmanager
def _composing():
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        yield


def _compose(config_name: str, combo: list[str], label: str) -> DictConfig:
    from hydra import compose

    try:
        return compose(config_name=config_name, overrides=combo, return_hydra_config=True)
    except Exception as err:  # Hydra's override and composition errors
        raise ConfigError(f"-m run {label}: {one_line(err)}" if label else one_line(err)) from None


def check_sweep(config_name: str, args: list[str]) -> None:
    """Every run of the `-m` sweep of `args` (stage `config_name`) by the stage's rules, before Hydra starts any."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    from smd_cli.runs.sweep import plan

    given = [o for o in overrides(args) if not o.key_or_group.startswith("hydra")]
    swept = {o.get_key_element() for o in given if o.is_sweep_override()}
    with _composing():
        for combo in BasicSweeper.split_arguments(given, None)[0]:
            label = ",".join(c for c in combo if c.partition("=")[0] in swept)
            cfg = _compose(config_name, combo, label)
            try:
                check_config(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), config_name)
                if config_name == "ablate":  # and each member of this run's own sweep of `smd train` runs
                    plan(cfg, [c for c in combo if not c.lstrip("+").startswith(("ablate.", "run_dir=", "overrides="))])
            except ConfigError as err:
                raise ConfigError(f"-m run {label}: {err}" if label else str(err)) from None


GROUPS = frozenset([p.name for p in (ROOT / "conf").iterdir() if p.is_dir()] + ["recipe"])


def known_keys(stage: str) -> list[str]:
    """Every dotted key the rules of `stage` name (the candidates of a suggestion)."""
    keys = [k.split(":", 1)[-1] for k in RULES if ":" not in k or k.startswith(f"{stage}:")]
    keys += [f"task.{k}" for k in TASK_FIELDS] + [k for k in PATTERNS if "*" not in k]
    return sorted(set(keys))


def _task_parameters() -> set[str]:
    """The constructor arguments of every task of conf/task/ (`+task.size=...` is read though it has no rule)."""
    names = set()
    for path in (ROOT / "conf" / "task").glob("*.yaml"):
        target = str(OmegaConf.load(path).get("_target_", ""))
        module, _, name = target.rpartition(".")
        with contextlib.suppress(Exception):
            for cls in inspect.getmro(getattr(importlib.import_module(module), name)):
                names |= set(inspect.signature(cls.__init__).parameters) - {"self", "args", "kwargs"}
    return names


def unread_additions(stage: str, args: list[str]) -> list[str]:
    """A warning for each `+KEY=VALUE` (or `++`) of `args` that adds a key no rule of `stage` knows: no stage reads
    it, and it is most often a typo of a key the config has, which the warning names."""
    warnings = []
    for arg in arguments(args):
        if not arg.startswith("+"):
            continue
        key = arg.lstrip("+").partition("=")[0]
        if key.startswith("hydra") or "/" in key or key in GROUPS or rule_for(key, stage) is not None or is_node(key, stage):
            continue
        if key.startswith("task.") and key.split(".")[1] in _task_parameters():
            continue
        close = difflib.get_close_matches(key, known_keys(stage), n=1, cutoff=0.6)
        warnings.append(f"{arg} sets a key no stage reads" + (f"; did you mean {close[0]}?" if close else ""))
    return warnings
