"""`smd reproduce` (= `make reproduce`): the paper's tables and ablations, regenerated, in one command.

Each table is the sweep of a recipe (`sweeps.SCALE`: `main_table`, `ablate_compression`, `ablate_lambda`,
`ablate_selection`, or their `paper_` twins), run as `smd ablate +recipe=NAME` with every sweep's members in
one runs directory, so that a run two tables share (SMD at c = 0.5, lambda 0.1, SnapKV) runs once. First
every sweep is composed and what will run is printed (runs per table, shared, already finished), with the cost
model's prediction (`cost.SCALE`); at the paper scale the stage then stops, naming what is missing, unless a CUDA
GPU and the Hugging Face Hub (or its local cache) are there. Then the sweeps run one after another, each with
`jobs` runs at once (Hydra's joblib launcher). Seeds until decided (`sequential.SCALE`, `smd_cli.report.stats.Sequential`):
the claims are judged from the runs there are, and every cell of a claim still undecided gets the seeds of the next
look, through `smd ablate +recipe=NAME KEY=v ... seed=a,b` (printed as it runs; finished runs are reused), until
every claim is decided or at its cap. Then `smd check-parity` (every eviction policy, float32 and float64) and the
benchmarks (`bench/learner_memory.py`, `bench/step_overhead.py`) write their JSON, and `smd_cli.report` writes
REPORT.md with its CSVs and PNGs, and copies the JSON it read besides the runs into OUT/records/ (`keep_records`). A
failed run is reported in its table and the rest go on; started again, the stage skips every finished run and benchmark
result it finds, and reaches the same seeds (the verdicts are a function of the runs). A finished run recorded with the
fixed held-out prompts (every run from before `eval.prompts`) stands for its member (`sweep.stand_ins`), and the report
says that its verdicts are about those prompts.
"""

from __future__ import annotations

import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict
from rich.markup import escape
from rich.table import Table

from smd_cli.config.rules import check_config
from smd_cli.config.validation import ROOT, ConfigError, check
from smd_cli.model.precision import cpu_compute_dtype
from smd_cli.report import budget, claims
from smd_cli.report.across import write_across
from smd_cli.report.data import Run, Sweep, WeightsDiffer
from smd_cli.report.stats import Sequential
from smd_cli.report.write import write_report
from smd_cli.runs.console import console
from smd_cli.runs.run_dirs import start_run
from smd_cli.runs.sweep import distinct, finished, plan, stand_ins
from smd_cli.runtime import lifetime, records
from smd_cli.runtime.failures import Interrupted
from smd_cli.runtime.integrity import write_file
from smd_cli.runtime.provenance import git_commit, package_versions
from smd_cli.runtime.records import write_json

HUB = {"paper_model": "Qwen/Qwen3-4B-Instruct-2507",
       "datasets": {"gsm8k": "openai/gsm8k", "tldr": "trl-lib/tldr", "govreport": "ccdv/govreport-summarization",
                    "hotpotqa": "hotpotqa/hotpot_qa"}}


def validate(cfg: DictConfig) -> str:
    """The scale ("tiny" or "paper"), after checking the options."""
    check_config(cfg, "reproduce")
    check(not (cfg.get("small") and cfg.paper), "small", cfg.get("small"), "false with paper=true (one scale at a time)")
    scale = "paper" if cfg.paper else "small" if cfg.get("small") else "tiny"
    tables = cfg.sweeps[scale]
    check(cfg.only is None or set(cfg.only) <= set(tables), "only", cfg.only, f"null or a subset of [{', '.join(tables)}]")
    if cfg.tasks is not None:
        names = list(cfg.task_sets)
        check(scale == "small", "tasks", cfg.tasks, "null unless small=true (the tasks are the small scale's)")
        check(set(cfg.tasks) <= set(names) and len(set(cfg.tasks)) == len(cfg.tasks), "tasks", cfg.tasks,
              f"null or distinct names of task_sets: {', '.join(names)}")
        for name in cfg.tasks:
            only = cfg.task_sets[name].get("only")
            check(only is None or set(only) <= set(tables), f"task_sets.{name}.only", only, f"null or a subset of [{', '.join(tables)}]")
            check(bool(set(only or tables) & set(cfg.only or tables)), "only", cfg.only, f"tables that task {name} runs ({', '.join(only or tables)})")
        plain = [name for name in cfg.tasks if not cfg.task_sets[name].overrides]
        check(len(plain) <= 1, "tasks", cfg.tasks, f"at most one task without overrides (the scale's own; here {', '.join(plain)})")
    rule(cfg, scale)
    return scale


@dataclass(frozen=True)
class Task:
    """One task's tables: the overrides its runs get, where its runs and its report go, its cost model."""

    name: str
    overrides: tuple[str, ...]  # added to every run of its tables (after the quick check's)
    tables: dict[str, str]  # role -> recipe
    root: Path
    out: Path
    cost: dict | None

    @property
    def own(self) -> bool:
        """The scale's own task (no overrides): it runs the benchmarks and the parity check."""
        return not self.overrides


def tasks(cfg: DictConfig, scale: str, root: Path, out: Path) -> list[Task]:
    """The tasks to run (`tasks`, or the scale's own task): a task with overrides keeps its runs in ROOT/tasks/NAME and
    its report in OUT/tasks/NAME; the scale's own task (no overrides) keeps ROOT and OUT, so that its finished runs count."""
    base = cfg.cost.get("quick" if cfg.quick else scale)
    tables = {role: recipe for role, recipe in cfg.sweeps[scale].items() if cfg.only is None or role in cfg.only}
    if cfg.tasks is None:
        return [Task(scale, (), tables, root, out, base and dict(base))]
    found = []
    for name in cfg.tasks:
        t = cfg.task_sets[name]
        own = not t.overrides
        overrides = (*t.overrides, *(t.quick if cfg.quick else ()))
        cost = base and {**base, **task_cost(t.cost, overrides), **({} if own else {"benchmarks_s": 0})}
        mine = {role: recipe for role, recipe in tables.items() if t.only is None or role in t.only}
        found.append(Task(name, tuple(map(str, overrides)), mine, root if own else root / "tasks" / name,
                          out if own else out / "tasks" / name, cost))
    return found


def task_cost(cost, overrides: tuple) -> dict:
    """A task set's own seconds of the cost model, with those of the dtype its runs compute in on this machine where it
    gives them (`float32:` / `bfloat16:` entries): its last `model.cpu_dtype=` override as `smd train` resolves it
    (`auto`: bfloat16 where the CPU has it natively), over SmolLM2's float32."""
    own = dict(cost or {})
    by_dtype = {dtype: own.pop(dtype) for dtype in ("float32", "bfloat16") if dtype in own}
    asked = [o.split("=", 1)[1] for o in overrides if o.startswith("model.cpu_dtype=")]
    dtype = cpu_compute_dtype(asked[-1] if asked and asked[-1] != "null" else None, "float32")
    return {**own, **by_dtype.get(dtype, {})}


def rule(cfg: DictConfig, scale: str) -> Sequential:
    """The sequential rule of this scale (`sequential.SCALE`, `sequential.quick` with quick=true)."""
    key = "quick" if cfg.quick else scale
    s = cfg.sequential.get(key)
    check(s is not None, f"sequential.{key}", None, "looks, alpha and power of the seeds-until-decided rule (conf/reproduce.yaml)")
    try:
        return Sequential(tuple(s.looks), float(s.alpha), float(s.power))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"sequential.{key}={dict(s)} is not allowed: {err}") from None


def layout(cfg: DictConfig, scale: str) -> tuple[Path, Path]:
    """(root: the sweeps and their runs, out: the report)."""
    root = Path(cfg.root or ROOT / "runs" / "reproduce" / (scale + ("_quick" if cfg.quick else "")))
    out = Path(cfg.out) if cfg.out else root / "report" if cfg.quick else ROOT / "results" / ("reproduce" if scale == "tiny" else f"reproduce_{scale}")
    return root, out


def sweep_overrides(cfg: DictConfig, scale: str, recipe: str, task: Task) -> list[str]:
    """The `smd ablate` overrides of one table of `task`."""
    quick = list(cfg.quick_overrides[scale]) if cfg.quick else []
    return [f"+recipe={recipe}", *quick, *task.overrides, f"ablate.runs_dir={task.root / 'members'}", "progress=false"]


def show_plan(cfg: DictConfig, scale: str, task: Task, rule: Sequential) -> tuple[int, budget.Prediction | None]:
    """Compose every table's sweep and print what will run, with the cost model's prediction (base, and every claim
    undecided to the cap); returns the number of runs to run and the prediction."""
    seen: dict[str, str] = {}
    root = task.root
    table = Table(title=f"smd reproduce, {scale} scale{', quick' if cfg.quick else ''}"
                        f"{'' if task.name == scale else ', task ' + task.name}: what will run")
    for column in ("table", "recipe", "runs", "shared with an earlier table", "finished already", "to run"):
        table.add_column(column, justify="left" if column in ("table", "recipe") else "right")
    planned, plans, todo = {}, {}, set()
    for role, recipe in task.tables.items():
        overrides = sweep_overrides(cfg, scale, recipe, task)
        ablate_cfg = compose(config_name="ablate", overrides=overrides)
        sweep, combos = plan(ablate_cfg, [o for o in overrides if not o.startswith("ablate.")])
        if ablate_cfg.ablate.reuse_fixed_prompts:  # what `smd ablate` will reuse: runs recorded with the fixed held-out prompts
            combos = stand_ins(combos, root / "members")[0]
        members = distinct(combos)
        shared = [m for m in members if m.identity in seen]
        done = [m for m in members if m.identity not in seen and finished(root / "members" / m.name, m)]
        new = len(members) - len(shared) - len(done)
        todo |= {m.identity for m in members} - {m.identity for m in shared + done}
        table.add_row(role, recipe, str(len(members)), str(len(shared)), str(len(done)), str(new))
        seen.update({m.identity: role for m in members})
        keys = [k for k, _ in sweep]
        plans[role] = Sweep(recipe, root / "sweeps" / recipe, keys, [Run({k: str(v) for k, v in m.combo}, "not run", None,
                                                                          root / "members" / m.name) for m in combos])
        for m in combos:
            values = dict(m.combo)
            cell = tuple(sorted((k, v) for k, v in values.items() if k != "seed"))
            planned[(role, cell, values.get("seed"))] = (m.identity, planned_run(ablate_cfg, m, values.get("seed", str(ablate_cfg.seed))))
    console.print(table)
    console.print(f"{len(seen)} distinct training runs, {len(todo)} to run; runs in {root / 'members'}")
    prediction = predict(task, cfg.jobs, rule, planned, plans, todo)
    if prediction:
        console.print(f"cost model: {prediction}", highlight=False)
    return len(todo), prediction


def planned_run(ablate_cfg: DictConfig, member, seed: str) -> budget.Planned:
    """A run of this table as the cost model sees it."""
    e = ablate_cfg.eval
    evaluations = (2 if e.evicting else 1) * (2 if e.greedy else 1)  # after training: dense / evicting, sampled / greedy
    warm = ablate_cfg.model.get("warmstart") or {}
    return budget.Planned(member.name.split("_")[0], str(seed), int(ablate_cfg.steps), int(e.num_prompts), evaluations,
                          int(warm.get("steps") or 0), member.before)


def predict(task: Task, jobs: int, rule: Sequential, planned: dict, plans: dict[str, Sweep], todo: set[str]) -> budget.Prediction | None:
    """The cost model's prediction (`budget.prediction`) with the task's cost (`cost.SCALE` and its own), or None without one."""
    if not task.cost:
        return None
    cells = {(role, tuple(sorted(sel.items()))) for f in claims.policies(plans, rule) for role, sel in f.cells}
    return budget.prediction(planned, cells, todo, rule.cap, budget.Cost(**task.cost), jobs)


def paper_requirements() -> list[str]:
    """What the paper scale needs and this machine lacks: a CUDA GPU, the model and datasets on the Hub (or cached)."""
    problems = []
    if not torch.cuda.is_available():
        problems.append("a CUDA GPU: torch.cuda.is_available() is False (Qwen3-4B-Instruct-2507 in bf16 needs about "
                        "50-80 GB; `smd plan +recipe=gsm8k` predicts each phase)")
    from huggingface_hub import hf_hub_download

    wanted = [(HUB["paper_model"], "model", "config.json"), *((repo, "dataset", "README.md") for repo in HUB["datasets"].values())]
    missing = []
    for repo, kind, filename in wanted:  # the local cache first: offline runs need nothing more
        try:
            hf_hub_download(repo, filename, repo_type=kind, local_files_only=True)
        except Exception:
            missing.append((repo, kind, filename))
    if not missing:
        return problems
    names = ", ".join(f"{kind} {repo}" for repo, kind, _ in missing)
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return [*problems, f"the Hugging Face Hub's {names}: not in the local cache, and HF_HUB_OFFLINE=1 is set"]
    unreachable = hub_unreachable()
    if unreachable:
        return [*problems, f"the Hugging Face Hub's {names}: not in the local cache, and the Hub is unreachable ({unreachable})"]
    for repo, kind, filename in missing:  # reachable: gated or absent repositories are named
        try:
            hf_hub_download(repo, filename, repo_type=kind)
        except Exception as err:
            problems.append(f"the Hugging Face Hub {kind} {repo}: {type(err).__name__}: {str(err).splitlines()[0]}")
    return problems


def hub_unreachable(timeout: float = 5.0) -> str | None:
    """Why the Hub's endpoint cannot be reached (one quick try, no retries), or None."""
    import socket
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
    except OSError as err:
        return f"{host}:443: {err}"
    return None


INTERRUPT_GRACE = 60.0  # seconds a command interrupted by Ctrl-C has to say where it stopped (a sweep waits for its runs)


def run_logged(command: list[str]) -> int:
    """Run `command` (which dies with this process: `smd_cli.runtime.lifetime`), its output streamed; its exit status. On
    Ctrl-C, which reaches the command too, it is given `INTERRUPT_GRACE` to stop on its own before it is killed."""
    console.print(f"[bold]$ {escape(' '.join(command))}[/bold]", soft_wrap=True, highlight=False)
    proc = subprocess.Popen(command, cwd=ROOT, env=lifetime.child_env())
    try:
        return proc.wait()
    except KeyboardInterrupt:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            proc.wait(timeout=INTERRUPT_GRACE)
        except subprocess.TimeoutExpired:
            pass
        finally:
            signal.signal(signal.SIGINT, previous)
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run(cfg: DictConfig) -> dict:
    """`smd reproduce`. Ctrl-C ends it with one line saying what is kept and the command that continues, and its
    root's summary.json says "interrupted" (it says "completed", with the report, at the end)."""
    scale = validate(cfg)
    root, out = layout(cfg, scale)
    todo, results = tasks(cfg, scale, root, out), {}
    current = todo[0]
    try:
        for current in todo:
            results[current.name] = _run(cfg, scale, current)
        if cfg.dry_run:
            return dry_run_total(results) if cfg.tasks else results[scale]
        if cfg.tasks and len(todo) > 1:
            across = write_across(out, {t.name: t.out for t in todo}, {t.name: results[t.name]["rerun"] for t in todo})
            console.print(f"claims across tasks: {across}")
    except KeyboardInterrupt:
        again = shlex.join(["smd", "reproduce", *(HydraConfig.get().overrides.task if HydraConfig.initialized() else [])])
        for where in dict.fromkeys((root, current.root)):  # this stage's root and the task it was running
            if (where / "provenance.json").is_file():  # the run started (`start_run`): its directory is ours to write
                write_json(where / "summary.json", {"status": "interrupted", "status_reason": "Ctrl-C"})
        raise Interrupted(f"Ctrl-C: smd reproduce stopped; the finished runs and benchmark results in {root} are kept (an "
                          f"interrupted run resumes from its last checkpoint); continue with: {again}") from None
    result = {"tasks": results, **({"across": str(across)} if len(todo) > 1 else {})} if cfg.tasks else results[scale]
    if (root / "provenance.json").is_file():  # not when only tasks of their own ran (each wrote its own summary)
        write_json(root / "summary.json", {"status": "completed", **result})
    return result


def dry_run_total(results: dict[str, dict]) -> dict:
    """Print the tasks' predictions added up (they run one after another); the dry run's result per task and in all."""
    found = [r["prediction"] for r in results.values() if r["prediction"]]
    if found:
        now, most = sum(p.now_s for p in found) / 3600, sum(p.most_s for p in found) / 3600
        console.print(f"cost model, {len(results)} task{'s' if len(results) > 1 else ''} one after another: {sum(p.runs_now for p in found)} runs now, {now:.1f} h; "
                      f"at most {most:.1f} h if every claim stayed undecided to the cap", highlight=False)
    return {"tasks": results, "to_run": sum(r["to_run"] for r in results.values())}


def _run(cfg: DictConfig, scale: str, task: Task) -> dict:
    started = time.time()
    seq = rule(cfg, scale)
    root, tables = task.root, task.tables
    pending, prediction = show_plan(cfg, scale, task, seq)
    if cfg.dry_run:
        return {"to_run": pending, "prediction": prediction}  # a budget.Prediction (None without a cost model)
    if scale == "paper":
        missing = paper_requirements()
        if missing:
            raise ConfigError("make reproduce SCALE=paper stops here. It needs " + "; and ".join(missing) +
                              ". The plan above is what it would run: run it on a GPU machine with the Hub reachable, or with "
                              "the model and datasets in the Hugging Face cache (PAPER_HUB_OFFLINE=1)")
    with open_dict(cfg):
        cfg.run_dir, cfg.overrides = str(root), list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    start_run(cfg)
    recorded = outcomes_recorded(root)
    outcomes = {}
    for role, recipe in tables.items():
        outcomes[role] = run_logged(ablate_command(cfg, scale, recipe, task, root / "sweeps" / recipe))
        if not (root / "sweeps" / recipe / "summary.json").is_file():  # 1: some runs failed (in the table); the rest go on
            raise ConfigError(f"smd ablate +recipe={recipe} wrote no summary (exit {outcomes[role]}); see its output above")
    rounds = add_seeds(cfg, scale, task, seq)[1]
    which = f"{scale}_quick" if cfg.quick else scale  # the benchmarks and parity check of this scale, or of its quick check
    bench = {"parity_check": None}  # a task of its own: no benchmarks (the scale's own task runs them)
    if task.own:
        bench = {**run_benchmarks(cfg, which, root / "bench"), "parity_check": run_parity(cfg, which, root / "bench" / "check_parity")}
    ran = sum(stamp != recorded.get(name) for name, stamp in outcomes_recorded(root).items())  # runs this invocation ran
    seconds = record_time(root, started, ran)
    make = f"make reproduce{'' if scale == 'tiny' else ' SCALE=' + scale}{' QUICK=1' if cfg.quick else ''}"
    extra = [o for o in cfg.overrides if o.split("=")[0] not in ("small", "paper", "quick")]  # a subset, other looks, ...: said
    if cfg.tasks:  # this task alone (the scale's own: without `tasks`)
        extra = [o for o in extra if o.split("=")[0] != "tasks"] + ([] if task.own else [f"tasks=[{task.name}]"])
    args = f" ARGS=\"{' '.join(extra)}\"" if extra else ""
    header = {"scale": scale, "quick": cfg.quick, "command": f"{make}{args} ({' '.join(['smd reproduce', *cfg.overrides])})",
              "rerun": make + args, "task": None if task.own else f"{task.name} ({' '.join(task.overrides)})",
              "commit": git_commit(ROOT), "versions": package_versions(), "wall_seconds": seconds,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                         + (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU") + f", {cfg.jobs} runs at once",
              "runs_dir": os.path.relpath(root / "members", ROOT), "prediction": prediction and str(prediction), "rounds": rounds}
    try:
        report = write_report(task.out, read_tables(tables, root), bench, header, seq)
    except WeightsDiffer as err:  # the network chose the weights run by run (model.source=auto)
        raise ConfigError(str(err)) from None
    keep_records(root, task.out)
    failed = {role: code for role, code in outcomes.items() if code}
    console.print(f"report written to {report}" + (f"; tables with failed runs: {', '.join(failed)}" if failed else ""))
    result = {"report": str(report), "rerun": make + args, "sweeps": {r: str(root / "sweeps" / t) for r, t in tables.items()},
              "failed_tables": failed}
    if not task.own:
        write_json(root / "summary.json", {"status": "completed", **result})
    return result


def ablate_command(cfg: DictConfig, scale: str, recipe: str, task: Task, where: Path, extra: list[str] = ()) -> list[str]:
    """`smd ablate` of a table's recipe for `task` (with `extra` overrides: fixed values, seeds), its sweep written to `where`."""
    overrides = sweep_overrides(cfg, scale, recipe, task)
    if any(o.startswith("seed=") for o in extra):  # the seeds asked for replace the quick check's one
        overrides = [o for o in overrides if not o.startswith("seed=")]
    launcher = [] if cfg.jobs == 1 else ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={cfg.jobs}"]
    return [sys.executable, "-m", "smd_cli.cli", "ablate", *overrides, *extra, *launcher, f"hydra.run.dir={where}"]


def read_tables(tables: dict[str, str], root: Path) -> dict[str, Sweep]:
    """Each table's sweep: its recipe's, with the seeds added until decided (`sweeps/RECIPE/seeds/*`) merged in."""
    out = {}
    for role, recipe in tables.items():
        where = root / "sweeps" / recipe
        more = sorted((p.parent for p in (where / "seeds").glob("*/summary.json")), key=lambda p: p.stat().st_mtime)
        out[role] = Sweep.read(recipe, where, more)
    return out


def add_seeds(cfg: DictConfig, scale: str, task: Task, seq: Sequential) -> tuple[int, str]:
    """Seeds until decided: judge the claims, give every cell of an undecided claim the seeds of its next look, again
    until no claim is undecided below its cap. Returns the table entries asked for (a run that tables share counts once
    per table) and one line per round for the report
    (also kept in ROOT/rounds.json, so that a report-only invocation says the same)."""
    root, tables = task.root, task.tables
    path, asked, lines = root / "rounds.json", 0, []
    history = records.read_list(path, missing_ok=True)
    for _ in seq.looks:
        sweeps = read_tables(tables, root)
        found = claims.policies(sweeps, seq)
        wanted = claims.wanted(found, seq)
        extensions = budget.extensions(wanted, sweeps)
        if not extensions:
            break
        undecided = sum(f.pending for f in found)
        runs = sum(e.runs for e in extensions)
        target = max(wanted.values())
        console.print(f"seeds until decided: {undecided} verdicts undecided; {len(wanted)} cells to {target} seeds, "
                      f"{runs} table entries (finished runs are reused; a run that tables share runs once)", highlight=False)
        for e in extensions:
            recipe = tables[e.role]
            run_logged(ablate_command(cfg, scale, recipe, task, root / "sweeps" / recipe / "seeds" / e.label, e.overrides()))
        asked += runs
        lines.append(f"to {target} seeds: {runs} table entries for {undecided} undecided verdicts ({len(wanted)} cells)")
        write_json(path, history + lines)
    rounds = history + lines
    return asked, "; ".join(rounds) if rounds else "none (every claim decided at the recipes' seeds, or no later look)"


def run_benchmarks(cfg: DictConfig, which: str, where: Path) -> dict:
    """Each benchmark of `benchmarks.WHICH` writes `where/NAME_I.json` (kept when it is there already)."""
    results: dict[str, list] = {}
    for name, arg_lists in cfg.benchmarks[which].items():
        for i, args in enumerate(arg_lists):
            path = where / f"{name}_{i}.json"
            if not path.is_file():
                code = run_logged([sys.executable, "-m", "smd_cli.runtime.lifetime", str(ROOT / "bench" / f"{name}.py"), *map(str, args),
                                   "--json", str(path)])
                if code:
                    console.print(f"[yellow]warning:[/yellow] bench/{name}.py failed (exit {code}): its table is left out")
                    continue
            try:  # a result a killed or edited benchmark left is named and left out, never used
                results.setdefault(name, []).append(records.read_object(path))
            except records.Damaged as err:
                console.print(f"[yellow]warning:[/yellow] {escape(str(err))}: bench/{name}.py's table is left out (remove the file "
                              "to run it again)", highlight=False)
    return {"learner_memory": (results.get("learner_memory") or [None])[0], "step_overhead": results.get("step_overhead", [])}


def run_parity(cfg: DictConfig, which: str, where: Path) -> dict | None:
    """`smd check-parity` with `parity_check.WHICH` (its parity.json kept when it is there already; a failed check is a
    result: it writes parity.json and exits 1)."""
    overrides = cfg.parity_check.get(which)
    path = where / "parity.json"
    if overrides is None:
        return None
    if not path.is_file():
        run_logged([sys.executable, "-m", "smd_cli.cli", "check-parity", *map(str, overrides), "progress=false", f"hydra.run.dir={where}"])
    if not path.is_file():
        console.print("[yellow]warning:[/yellow] smd check-parity wrote no parity.json: the parity claim reads the runs alone")
        return None
    return records.read_object(path)


RECORDS = ("bench/*.json", "bench/check_parity/parity.json", "timing.json")  # what the report reads besides the runs and the rounds


def keep_records(root: Path, out: Path) -> None:
    """Copy what the report read besides the runs (the benchmarks' and the parity check's JSON, the invocations' times)
    into OUT/records/, in ROOT's layout: copied back into a runs directory with the runs' own records, `smd reproduce`
    skips every benchmark and reaches the same report (results/reproduce_small/members/README.md). The rounds of seeds
    added are not kept: a function of the runs, they come out the same again."""
    for pattern in RECORDS:
        for path in sorted(root.glob(pattern)):
            write_file(out / "records" / path.relative_to(root), path.read_bytes())


def outcomes_recorded(root: Path) -> dict[str, int]:
    """Each member directory's member.json (the outcome of a run that ran: finished or failed) by its modification time."""
    return {p.parent.name: p.stat().st_mtime_ns for p in (root / "members").glob("*/member.json")}


def record_time(root: Path, started: float, ran: int) -> float | None:
    """Append this invocation to ROOT/timing.json; returns the wall seconds of the invocations that ran training
    runs (the one that ran them all, or the attempts of a stopped and resumed one), not of report-only ones."""
    path = root / "timing.json"
    history = records.read_list(path, missing_ok=True)
    history.append({"started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)), "seconds": round(time.time() - started, 1),
                    "runs_to_run": ran})
    write_json(path, history)
    return sum(h["seconds"] for h in history if h["runs_to_run"]) or None  # None: no invocation here ran a run (a report only)
