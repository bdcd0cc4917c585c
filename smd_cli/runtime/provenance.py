"""What makes a run traceable and repeatable: its seeds, the git commit and package versions that ran, written beside
its resolved config (`write_provenance`)."""

from __future__ import annotations

import platform
import random
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from smd_cli.runtime.records import write_json

PACKAGES = ("torch", "transformers", "tokenizers", "hydra-core", "datasets", "rouge-score", "rich", "safetensors", "smd")


def seed_everything(seed: int):
    """Seed Python and torch globally (for model init) and return a generator for sampling."""
    import torch  # here, so that the stages that only launch or read runs (smd ablate, its workers) never import it

    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def git_commit(repo: Path) -> str:
    """The commit of the code that ran, with `+dirty` when the work tree has changes."""
    try:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def package_versions() -> dict[str, str]:
    versions = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    torch = sys.modules.get("torch")  # every stage that computes has loaded it; a sweep (`smd ablate`) never does
    versions["cuda"] = (torch.version.cuda or "none") if torch else "not loaded (this process ran no torch)"
    return versions


def write_provenance(run_dir: Path, config: dict, overrides: list[str], repo: Path, extra: dict | None = None) -> None:
    """The resolved config, the overrides, the git commit and package versions of a run (and `extra`: the world size)."""
    write_json(run_dir / "config.json", config)
    write_json(
        run_dir / "provenance.json",
        {"overrides": overrides, "argv": sys.argv, "git_commit": git_commit(repo), "versions": package_versions(), **(extra or {})},
    )
