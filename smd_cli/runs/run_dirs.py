"""A stage's start: seed, device, torchrun's process group, and its run directory (locked, with its provenance).

torch is imported by the functions that use it, so that `smd ablate` (`open_sweep_dir`), which only launches and
reads runs, never loads it."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from smd_cli.config.validation import ROOT, ConfigError, to_dict
from smd_cli.runs.console import console
from smd_cli.runtime import integrity
from smd_cli.runtime.provenance import seed_everything, write_provenance

if TYPE_CHECKING:
    import torch


@dataclass
class Run:
    dir: Path
    generator: torch.Generator
    device: torch.device


def pick_device(cfg: DictConfig) -> torch.device:
    """The device of `cfg.device` (auto: CUDA when present); under torchrun on CUDA, the local rank's GPU."""
    import torch

    from smd_cli.runtime import distributed

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but no CUDA device is available; use device=cpu or device=auto")
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", distributed.local_rank()) if distributed.launched() else torch.device("cuda")
    return torch.device("cpu")


def start_run(cfg: DictConfig) -> Run:
    """Seed, pick the device, join torchrun's process group when launched by it, and write the resolved config,
    overrides, git commit, versions and world size (rank 0: every rank uses rank 0's run directory)."""
    import torch

    from smd_cli.runtime import distributed

    threads = cfg.get("threads")  # the values were checked by the stage's `validate` (`smd_cli.config.rules`)
    if threads:
        torch.set_num_threads(threads)
    device = pick_device(cfg)
    world = distributed.init(device)
    run_dir, overrides = run_dir_of(cfg)
    if "model" in cfg and "task" in cfg:  # imported here: `smd reproduce` (no model) starts without transformers
        from smd_cli.runs.model_loading import check_context

        check_context(cfg)
    if world.size > 1:
        run_dir = _main_run_dir(run_dir)
        console.quiet = not distributed.is_main()  # one console: rank 0's
    if distributed.is_main():
        lock_run_dir(run_dir)  # one writer per run directory: a second process stops here, before it writes anything
        write_provenance(run_dir, to_dict(cfg), overrides, ROOT, {"world_size": world.size, "backend": world.backend, "stage": stage_name()})
    distributed.barrier()
    return Run(run_dir, seed_everything(cfg.seed), device)


def open_sweep_dir(cfg: DictConfig) -> Path:
    """`smd ablate`'s own directory, locked, with its config and provenance. A sweep only launches and reads runs: it
    picks no device, joins no process group and checks no model (each member checks its own when it starts,
    `start_run`), so it starts without torch or transformers."""
    run_dir, overrides = run_dir_of(cfg)
    lock_run_dir(run_dir)
    write_provenance(run_dir, to_dict(cfg), overrides, ROOT, {"world_size": 1, "backend": None, "stage": stage_name()})
    return run_dir


def stage_name() -> str | None:
    """The stage that owns the run directory (its verb: train, eval, check-parity, ...; None when not run as `smd VERB`),
    recorded in provenance.json: `smd VERB` refuses a directory that holds another stage's run (`smd_cli.cli.owner_problem`)."""
    return sys.argv[0].removeprefix("smd ") if sys.argv and sys.argv[0].startswith("smd ") else None


def run_dir_of(cfg: DictConfig) -> tuple[Path, list[str]]:
    """(run directory, the command line's overrides): `run_dir` when set (tests, and `smd ablate` for each of its
    runs), else Hydra's output directory."""
    if cfg.get("run_dir"):
        return Path(cfg.run_dir), list(cfg.get("overrides") or [])
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir), list(HydraConfig.get().overrides.task)
    raise ConfigError("run_dir is not set: run through `smd STAGE` or compose with +run_dir=DIR")


def _main_run_dir(mine: Path) -> Path:
    """Rank 0's run directory for every rank (Hydra's timestamped default may differ by a second between ranks);
    a directory Hydra made for this rank alone, holding only its own config and log, is removed."""
    from smd_cli.runtime import distributed

    main = Path(distributed.gather_objects(str(mine))[0])
    if main != mine and mine.is_dir() and all(p.name == ".hydra" or p.suffix == ".log" for p in mine.iterdir()):
        shutil.rmtree(mine, ignore_errors=True)
    return main


def lock_run_dir(run_dir: Path) -> None:
    """Hold `run_dir` for this process (`integrity.hold`); a second process gets a ConfigError naming the first."""
    try:
        integrity.hold(run_dir, "smd")
    except integrity.Locked as err:
        raise ConfigError(str(err)) from None
    except integrity.Unwritable as err:
        raise ConfigError(f"the run directory {run_dir} is not allowed: {err}") from None
