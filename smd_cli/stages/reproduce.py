"""`smd reproduce` (= `make reproduce`): the paper's tables and ablations, regenerated, in one command.

Each table is the sweep of a recipe (`sweeps.SCALE`: `main_table`, `ablate_compression`, `ablate_lambda`,
`ablate_selection`, or their `paper_` twins), run as `smd ablate +recipe=NAME` with every sweep's members in
one runs directory, so that a run two tables share (SMD at c = 0.5, lambda 0.1, SnapKV) runs once. First
every sweep is composed and what will run is printed (runs per table, shared, already finished); at the
paper scale the stage then stops, naming what is missing, unless a CUDA GPU and the Hugging Face Hub (or its
local cache) are there. Then the sweeps run one after another, each with `jobs` runs at once (Hydra's joblib
launcher), the benchmarks (`bench/learner_memory.py`, `bench/step_overhead.py`) write their JSON, and
`smd_cli.report` writes REPORT.md with its CSVs and PNGs. A failed run is reported in its table and the
rest go on; started again, the stage skips every finished run and benchmark result it finds.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict
from rich.table import Table

from smd_cli.io import git_commit, package_versions, write_json
from smd_cli.report.data import Sweep
from smd_cli.report.write import write_report
from smd_cli.stages.common import ROOT, ConfigError, check, console, start_run
from smd_cli.stages.sweep import distinct, finished, plan

HUB = {"paper_model": "Qwen/Qwen3-4B-Instruct-2507",
       "datasets": {"gsm8k": "openai/gsm8k", "tldr": "trl-lib/tldr", "govreport": "ccdv/govreport-summarization",
                    "hotpotqa": "hotpotqa/hotpot_qa"}}


def validate(cfg: DictConfig) -> str:
    """The scale ("tiny" or "paper"), after checking the options."""
    check(isinstance(cfg.paper, bool), "paper", cfg.paper, "true (Qwen3-4B on the paper's tasks) or false (the tiny scale)")
    check(isinstance(cfg.quick, bool), "quick", cfg.quick, "true or false")
    check(isinstance(cfg.jobs, int) and cfg.jobs >= 1, "jobs", cfg.jobs, "an integer >= 1 (runs at once)")
    scale = "paper" if cfg.paper else "tiny"
    tables = cfg.sweeps[scale]
    check(cfg.only is None or set(cfg.only) <= set(tables), "only", cfg.only, f"null or a subset of [{', '.join(tables)}]")
    return scale


def layout(cfg: DictConfig, scale: str) -> tuple[Path, Path]:
    """(root: the sweeps and their runs, out: the report)."""
    root = Path(cfg.root or ROOT / "runs" / "reproduce" / (scale + ("_quick" if cfg.quick else "")))
    out = Path(cfg.out) if cfg.out else root / "report" if cfg.quick else ROOT / "results" / ("reproduce" if scale == "tiny" else "reproduce_paper")
    return root, out


def sweep_overrides(cfg: DictConfig, scale: str, recipe: str, root: Path) -> list[str]:
    """The `smd ablate` overrides of one table."""
    quick = list(cfg.quick_overrides[scale]) if cfg.quick else []
    return [f"+recipe={recipe}", *quick, f"ablate.runs_dir={root / 'members'}", "progress=false"]


def show_plan(tables: dict[str, str], cfg: DictConfig, scale: str, root: Path) -> int:
    """Compose every table's sweep and print what will run; returns the number of runs to run."""
    seen: dict[str, str] = {}
    table = Table(title=f"smd reproduce, {scale} scale{', quick' if cfg.quick else ''}: what will run")
    for column in ("table", "recipe", "runs", "shared with an earlier table", "finished already", "to run"):
        table.add_column(column, justify="left" if column in ("table", "recipe") else "right")
    pending = 0
    for role, recipe in tables.items():
        overrides = sweep_overrides(cfg, scale, recipe, root)
        ablate_cfg = compose(config_name="ablate", overrides=overrides)
        _, combos = plan(ablate_cfg, [o for o in overrides if not o.startswith("ablate.")])
        members = distinct(combos)
        shared = [m for m in members if m.identity in seen]
        done = [m for m in members if m.identity not in seen and finished(root / "members" / m.name, m)]
        new = len(members) - len(shared) - len(done)
        pending += new
        table.add_row(role, recipe, str(len(members)), str(len(shared)), str(len(done)), str(new))
        seen.update({m.identity: role for m in members})
    console.print(table)
    console.print(f"{len(seen)} distinct training runs, {pending} to run; runs in {root / 'members'}")
    return pending


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


def run_logged(command: list[str]) -> int:
    console.print(f"[bold]$ {' '.join(command)}[/bold]", soft_wrap=True, highlight=False)
    return subprocess.run(command, cwd=ROOT).returncode


def run(cfg: DictConfig) -> dict:
    scale = validate(cfg)
    started = time.time()
    root, out = layout(cfg, scale)
    tables = {role: recipe for role, recipe in cfg.sweeps[scale].items() if cfg.only is None or role in cfg.only}
    pending = show_plan(tables, cfg, scale, root)
    if scale == "paper":
        missing = paper_requirements()
        if missing:
            raise ConfigError("make reproduce SCALE=paper stops here. It needs " + "; and ".join(missing) +
                              ". The plan above is what it would run: run it on a GPU machine with the Hub reachable, or with "
                              "the model and datasets in the Hugging Face cache (PAPER_HUB_OFFLINE=1)")
    with open_dict(cfg):
        cfg.run_dir, cfg.overrides = str(root), list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    start_run(cfg)
    launcher = [] if cfg.jobs == 1 else ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={cfg.jobs}"]
    outcomes = {}
    for role, recipe in tables.items():
        command = [sys.executable, "-m", "smd_cli.cli", "ablate", *sweep_overrides(cfg, scale, recipe, root), *launcher,
                   f"hydra.run.dir={root / 'sweeps' / recipe}"]
        outcomes[role] = run_logged(command)  # 1: some runs failed (reported in the table); the rest go on
        if not (root / "sweeps" / recipe / "summary.json").is_file():
            raise ConfigError(f"smd ablate +recipe={recipe} wrote no summary (exit {outcomes[role]}); see its output above")
    bench = run_benchmarks(cfg, "quick" if cfg.quick else scale, root / "bench")
    seconds = record_time(root, started, pending)
    sweeps = {role: Sweep.read(recipe, root / "sweeps" / recipe) for role, recipe in tables.items()}
    make = f"make reproduce{' SCALE=paper' if cfg.paper else ''}{' QUICK=1' if cfg.quick else ''}"
    header = {"scale": scale, "quick": cfg.quick, "command": f"{make} (smd reproduce)", "rerun": make,
              "commit": git_commit(ROOT), "versions": package_versions(), "wall_seconds": seconds,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                         + (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU") + f", {cfg.jobs} runs at once",
              "runs_dir": os.path.relpath(root / "members", ROOT)}
    report = write_report(out, sweeps, bench, header)
    failed = {role: code for role, code in outcomes.items() if code}
    console.print(f"report written to {report}" + (f"; tables with failed runs: {', '.join(failed)}" if failed else ""))
    return {"report": str(report), "sweeps": {r: str(root / "sweeps" / t) for r, t in tables.items()}, "failed_tables": failed}


def run_benchmarks(cfg: DictConfig, which: str, where: Path) -> dict:
    """Each benchmark of `benchmarks.WHICH` writes `where/NAME_I.json` (kept when it is there already)."""
    results: dict[str, list] = {}
    for name, arg_lists in cfg.benchmarks[which].items():
        for i, args in enumerate(arg_lists):
            path = where / f"{name}_{i}.json"
            if not path.is_file():
                code = run_logged([sys.executable, str(ROOT / "bench" / f"{name}.py"), *map(str, args), "--json", str(path)])
                if code:
                    console.print(f"[yellow]warning:[/yellow] bench/{name}.py failed (exit {code}): its table is left out")
                    continue
            results.setdefault(name, []).append(json.loads(path.read_text()))
    return {"learner_memory": (results.get("learner_memory") or [None])[0], "step_overhead": results.get("step_overhead", [])}


def record_time(root: Path, started: float, ran: int) -> float:
    """Append this invocation to ROOT/timing.json; returns the wall seconds of the invocations that ran training
    runs (the one that ran them all, or the attempts of a stopped and resumed one), not of report-only ones."""
    path = root / "timing.json"
    history = json.loads(path.read_text()) if path.is_file() else []
    history.append({"started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)), "seconds": round(time.time() - started, 1),
                    "runs_to_run": ran})
    write_json(path, history)
    return sum(h["seconds"] for h in history if h["runs_to_run"]) or history[-1]["seconds"]
