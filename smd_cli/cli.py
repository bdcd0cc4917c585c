"""`smd STAGE [overrides]`: the only place that parses argv.

Each stage is a Hydra application composed from `conf/STAGE.yaml`, so the usual syntax works:
`key=value`, `group=option`, `+recipe=NAME`, `--cfg job`, `--help`, `-m` sweeps, `hydra.run.dir=DIR`.
Recipes live in `recipes/` and are registered as the config group `recipe`.
"""

from __future__ import annotations

import errno
import importlib
import os
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.markup import escape

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = ROOT / "conf"
RECIPES_DIR = ROOT / "recipes"

# verb -> (module under smd_cli.stages, primary config name, one-line help)
STAGES = {
    "prepare-data": ("prepare_data", "prepare_data", "materialise a task's prompts and references (jsonl) with length statistics"),
    "rollout": ("rollout", "rollout", "sample with an evicting KV cache; record shadow masks; parity and memory report"),
    "check-parity": ("check_parity", "check_parity", "the lr = 0 protocol: learner log-probs vs the sampler's, per policy and view"),
    "train": ("train", "train", "GRPO training: dense, naive_sparse, sparse_rl, tis, mis, icepop, trm or smd"),
    "eval": ("evaluate", "eval", "evaluate a checkpoint or base model on a task's test split"),
    "ablate": ("ablate", "ablate", "sweep train+eval over values, then one table and one plot"),
    "plan": ("plan", "plan", "predict each phase's peak memory of a train config; what fits a GPU"),
    "reproduce": ("reproduce", "reproduce", "the paper's tables and ablations (recipes), benchmarks, then REPORT.md"),
}


def register_recipes(recipes_dir: Path = RECIPES_DIR) -> list[str]:
    """Put every `recipes/*.yaml` in Hydra's config group `recipe` (package `_global_`)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    store = ConfigStore.instance()
    names = []
    for path in sorted(recipes_dir.glob("*.yaml")):
        store.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_", provider="smd")
        names.append(path.stem)
    return names


def sweep_arguments(args: list[str]) -> list[str]:
    """`smd ablate lambda=0.1,0.8 algo=smd` -> the swept `KEY=v1,v2` go to `ablate.command_line`, the rest stay."""
    swept, rest = [], []
    for arg in args:
        key, sep, value = arg.partition("=")
        is_sweep = sep and "," in value and not key.startswith(("hydra", "+", "~", "-", "ablate.")) and value[:1] not in "[{'\""
        (swept if is_sweep else rest).append(arg)
    if swept:
        rest.append("ablate.command_line=[" + ",".join(f"'{s}'" for s in swept) + "]")
    return rest


def run_dir_problem(path: Path) -> str | None:
    """Why `path` cannot be a run directory (None when it can): an existing file, a path under a file, a place
    where no directory can be made (/proc), or one that cannot be written (a read-only mount, no permission).
    Tried by writing a temporary file in it, or, when it does not exist yet, a temporary folder in its nearest existing
    ancestor: `path` itself is neither made nor removed here (Hydra makes it; under torchrun every rank does, and a
    rank that removed an empty `path` again once took it from under another rank's log file)."""
    if path.exists() and not path.is_dir():
        return "it is an existing file, not a directory"
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is a file, so nothing can be created under it"
    try:
        if ancestor == path:
            tempfile.TemporaryFile(dir=path).close()
        else:
            os.rmdir(tempfile.mkdtemp(dir=ancestor, prefix=".smd-probe-"))
    except OSError as err:
        return f"a run directory must be a folder smd can create and write to ({err.strerror or err})"
    return None


def owner_problem(path: Path, verb: str) -> str | None:
    """Why `path` cannot take a run of `smd VERB`: it holds another stage's run (its provenance.json names that stage, or
    its argv does), whose summary.json, config.json, provenance.json and .hydra/ this one would replace."""
    from smd_cli.runtime.records import Damaged, read_object

    try:
        provenance = read_object(path / "provenance.json", missing_ok=True)
    except (Damaged, OSError):
        return None
    argv = provenance.get("argv") if isinstance(provenance.get("argv"), list) else []
    typed = str(argv[0]) if argv else ""
    owner = provenance.get("stage") or (typed.removeprefix("smd ") if typed.startswith("smd ") else None)
    if owner is None or owner == verb:
        return None
    return (f"it holds a `smd {owner}` run, whose summary.json, config.json and provenance.json `smd {verb}` would replace; "
            f"write this one beside it, e.g. hydra.run.dir={path / verb.replace('-', '_')}")


def check_run_dir(args: list[str], multirun: bool = False, verb: str | None = None) -> None:
    """`hydra.run.dir=DIR` (`hydra.sweep.dir=DIR` with `-m`; the last one given, as Hydra reads it, up to its first
    interpolation) must be a folder smd can create and write to: said as a config error before Hydra would fail on
    it with a traceback (or write its .hydra/ there). Without one, the default's `runs/` (`multirun/`) under the
    current directory is checked. A named DIR that holds another stage's run (`owner_problem`) or a link where a file
    is written (`integrity.links_problem`) is refused too."""
    from smd_cli.runs.preflight import interpolation_problem, value_of

    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    given = [a for a in args if a.startswith(f"{key}=")]
    value = value_of(given[-1]) if given else ("multirun" if multirun else "runs")
    if not isinstance(value, str):  # a sweep of run directories: Hydra's to judge
        return
    fixed = value.split("${", 1)[0]
    problem = interpolation_problem(value)
    if not problem and fixed.strip():
        problem = run_dir_problem(Path(fixed) if "${" not in value or fixed.endswith("/") else Path(fixed).parent)
    if not problem and given and "${" not in value and not multirun and verb is not None:
        from smd_cli.runtime.integrity import links_problem

        problem = owner_problem(Path(value), verb) or links_problem(Path(value))
    if problem:
        report("config error", f"{key}={value!r} is not allowed: {problem}")
        raise SystemExit(2)


def report(label: str, message: str, colour: str = "red") -> None:
    """`label: message` in `colour` on stderr, the message as it is (a `[...]` in it is text, not rich markup)."""
    Console(stderr=True).print(f"[{colour}]{label}:[/{colour}] {escape(message)}", soft_wrap=True, highlight=False)


def usage() -> str:
    lines = ["usage: smd STAGE [key=value ...] [--help] [--cfg job]", "", "stages:"]
    lines += [f"  {verb:<13} {text}" for verb, (_, _, text) in STAGES.items()]
    lines += ["", "Run `smd STAGE --help` for a stage's config groups and options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """`smd STAGE ARGS`; Ctrl-C at any moment ends it with one line and exit status 130 (a stage that can continue says
    where it stopped and how: `smd train`, `smd ablate`, `smd reproduce`), never a traceback."""
    verb = ((sys.argv[1:] if argv is None else argv) or ["STAGE"])[0]
    try:
        _main(argv)
    except KeyboardInterrupt:
        report("interrupted", f"smd {verb} stopped by Ctrl-C", "yellow")
        raise SystemExit(130) from None


def _main(argv: list[str] | None = None) -> None:
    from smd_cli.runtime.lifetime import die_with_parent

    die_with_parent()  # started by `smd ablate` / `smd reproduce`: die with it (a no-op otherwise)
    argv = sys.argv[1:] if argv is None else argv
    console = Console(stderr=True)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return
    verb, rest = argv[0], argv[1:]
    if verb not in STAGES:
        console.print(f"[red]error:[/red] unknown stage {verb!r}; choose one of {', '.join(STAGES)}")
        raise SystemExit(2)
    module_name, config_name, _ = STAGES[verb]
    stage = importlib.import_module(f"smd_cli.stages.{module_name}")

    import hydra

    from smd_cli.config.validation import ConfigError
    from smd_cli.runtime.failures import Interrupted, ParityFailed, TrainingDiverged
    from smd_cli.runtime.integrity import FileTooLarge, Unwritable, WriteFailed, release_all
    from smd_cli.runtime.records import Damaged

    register_recipes()

    def task(cfg) -> None:
        try:
            stage.run(cfg)
        except ConfigError as err:
            report("config error", str(err))
            raise SystemExit(2) from None
        except TrainingDiverged as err:  # or its subclass PolicyCollapsed, whose label says so
            report(getattr(err, "label", "training diverged"), str(err))
            raise SystemExit(1) from None
        except ParityFailed as err:
            report("parity check failed", str(err))
            raise SystemExit(1) from None
        except (Interrupted, KeyboardInterrupt) as err:  # Ctrl-C: one line (a stage that can continue says how), no traceback
            report("interrupted", str(err) or f"smd {verb} stopped by Ctrl-C", "yellow")
            raise SystemExit(130) from None
        except (Unwritable, Damaged) as err:  # a link, a read-only place; a record that does not read back as written
            report("cannot write" if isinstance(err, Unwritable) else "damaged record", str(err))
            raise SystemExit(1) from None
        except OSError as err:
            named = {errno.ENOSPC: "disk full", errno.EFBIG: "file too large"}.get(err.errno)
            if named is None and not isinstance(err, (FileTooLarge, WriteFailed)):
                raise
            report(named or "write failed", err.strerror if err.filename is None and err.strerror else str(err))
            raise SystemExit(1) from None
        finally:
            release_all()

    from smd_cli.runs import preflight

    informational = any(a in ("--help", "-h", "--cfg", "-c", "--info", "--hydra-help") or a.startswith("--cfg") for a in rest)
    multirun = any(a in ("-m", "--multirun") for a in rest)
    try:
        preflight.overrides(rest)  # an override Hydra cannot parse: said before any folder is made
        if not informational:
            check_run_dir(rest, multirun, verb)
        if verb == "ablate":
            rest = sweep_arguments(rest)
        if multirun and not informational:
            preflight.check_sweep(config_name, rest)
    except ConfigError as err:
        report("config error", str(err))
        raise SystemExit(2) from None
    for warning in preflight.unread_additions(config_name, rest):
        report("warning", warning, "yellow")
    sys.argv = [f"smd {verb}", *rest]
    hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")(task)()


if __name__ == "__main__":
    main()
