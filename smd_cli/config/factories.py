"""The objects a config names, built through Hydra: the task, the eviction policy, the rollout correction and the
optimizer; a constructor's error is a config error naming the key.
"""

from __future__ import annotations

import warnings

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from smd_cli.config.validation import ROOT, ConfigError, check, root_cause, to_dict
from smd_cli.corrections.base import Correction


def build_task(cfg: DictConfig):
    try:
        return instantiate(cfg.task)
    except Exception as err:  # Hydra wraps the constructor's error; surface its message
        raise ConfigError(f"task: {root_cause(err)}") from None


def build_policy(cfg: DictConfig, option: str | None = None):
    """The eviction policy of `cfg.eviction`, or of the `eviction` group's `option` (e.g. "snapkv") at the run's
    `compression` and seed."""
    node = cfg.eviction
    if option is not None:
        path = ROOT / "conf" / "eviction" / f"{option}.yaml"
        check(path.is_file(), "eviction option", option, f"one of {', '.join(sorted(p.stem for p in path.parent.glob('*.yaml')))}")
        node = OmegaConf.create({"compression": cfg.compression, "seed": cfg.get("seed", 0), "eviction": OmegaConf.load(path)}).eviction
    try:
        return instantiate(node)
    except Exception as err:
        raise ConfigError(f"eviction: {root_cause(err)}") from None


def build_correction(cfg: DictConfig):
    """The rollout correction of `algo.correction` (smd_cli/corrections/); a constructor's error is a config error
    naming it."""
    try:
        correction = instantiate(cfg.algo.correction)
    except Exception as err:  # Hydra wraps the constructor's error; surface its message
        raise ConfigError(f"algo.correction: {root_cause(err)}") from None
    check(isinstance(correction, Correction), "algo.correction._target_", cfg.algo.correction.get("_target_"),
          "a subclass of smd_cli.corrections.base.Correction")
    return correction


def optimizer_factory(cfg: DictConfig, device: torch.device):
    """(params -> optimizer, what it is) for `cfg.optim` (`offload` is not the optimizer's). optim=adamw8bit whose
    bitsandbytes does not import (or finds no CUDA library) falls back to torch's fused AdamW with the same lr, betas
    and weight decay, with one warning naming the error: a training run goes on, with 6 more bytes of optimizer
    state per parameter than `smd plan` counted."""
    settings = {k: v for k, v in to_dict(cfg.optim).items() if k != "offload"}
    target = str(settings.get("_target_", ""))
    name = target.rsplit(".", 1)[-1] + (" (fused)" if settings.get("fused") else "")
    if target.startswith("bitsandbytes."):
        try:
            import bitsandbytes  # noqa: F401
        except Exception as err:  # ImportError, or bitsandbytes' own error when its CUDA library does not load
            why = f"{type(err).__name__}: {err}"
            warnings.warn(f"optim=adamw8bit: bitsandbytes did not import ({why}); training with torch.optim.AdamW (fused) and the "
                          "same settings instead, whose float32 moments take 8 bytes per parameter, not 2", RuntimeWarning, stacklevel=2)
            settings = {**settings, "_target_": "torch.optim.AdamW", "fused": device.type in ("cuda", "cpu")}
            name = f"AdamW (fused; bitsandbytes did not import: {why})"
    return (lambda params: instantiate(settings, params=params)), name
