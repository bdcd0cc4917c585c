"""Config checks every stage shares: the error a stage stops with (naming the key, the value and what is allowed),
the one-line check, the config as plain data, and a cache folder that cannot be written said as a config error.

Stages are the only code that sees Hydra/OmegaConf; they turn the config into plain arguments.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from smd_cli.runtime import integrity

ROOT = Path(__file__).resolve().parents[2]
DTYPES = ("float32", "bfloat16", "float16", "float64")  # float64: parity against rounding (CPU)


class ConfigError(ValueError):
    """A config value the stage cannot run with; the message names the key, the value and what is allowed."""


def check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is not allowed: {allowed}")


def to_dict(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


def root_cause(err: BaseException) -> str:
    while err.__cause__ is not None:
        err = err.__cause__
    return str(err)


def check_offload(cfg: DictConfig, processes: int) -> None:
    """`optim.offload`: true or false, and only for one process (under torchrun FSDP2 shards that state instead)."""
    offload = cfg.optim.get("offload", False)
    check(isinstance(offload, bool), "optim.offload", offload, "true or false")
    check(not offload or processes == 1, "optim.offload", offload,
          f"false with {processes} processes: FSDP2 already splits the masters, gradients and optimizer state over the GPUs")


@contextmanager
def cache_errors(cfg: DictConfig):
    """A cache folder that cannot be written (`integrity.Unwritable`: read-only, a file) as a config error naming the
    key that chose it: `cache_dir`, or the SMD_CACHE_DIR it defaults to."""
    try:
        yield
    except integrity.Unwritable as err:
        value = cfg.get("cache_dir") or os.environ.get("SMD_CACHE_DIR", ".cache/smd")
        key = "cache_dir" + (" (from SMD_CACHE_DIR)" if value == os.environ.get("SMD_CACHE_DIR") else "")
        raise ConfigError(f"{key}={value!r} is not allowed: {err}; point cache_dir (or SMD_CACHE_DIR) at a writable folder") from None


def one_line(err: BaseException) -> str:
    """An error and its causes in one line, without OmegaConf's full_key / object_type detail lines."""
    parts = []
    while err is not None:
        lines = [line.strip() for line in str(err).split("Config search path")[0].splitlines() if line.strip()]
        text = " ".join(line for line in lines if not line.startswith(("full_key:", "object_type=", "reference_type=")))
        if text and text not in parts:
            parts.append(text)
        err = err.__cause__
    return ": ".join(parts)


def unread_keys_note(cfg: DictConfig) -> str | None:
    """The note for `adaptive.*` keys given on the command line while `compression` is fixed: nothing reads them (the
    run evicts `compression` of the prompt KV every step), which is said rather than ignored silently."""
    from hydra.core.hydra_config import HydraConfig

    if cfg.get("compression") == "adaptive" or not HydraConfig.initialized():
        return None
    given = [o for o in HydraConfig.get().overrides.task if o.lstrip("+~").startswith("adaptive.")]
    if not given:
        return None
    return (f"{', '.join(given)}: read only with compression=adaptive; this run's compression is fixed at {cfg.get('compression')}, "
            "so nothing reads them")
