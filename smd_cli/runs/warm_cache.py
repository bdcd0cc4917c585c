"""The tiny model's supervised warm start (`smd_cli.learner.warmstart` trains it), trained once per config and cached
under `cache_dir`, read without a lock and published atomically (`smd_cli.runtime.integrity`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig
from transformers import Qwen3ForCausalLM
from transformers.utils import logging as hf_logging

from smd_cli.attention.dispatch import use_smd_attention
from smd_cli.config.validation import ConfigError, cache_errors, root_cause, to_dict
from smd_cli.learner.warmstart import warm_start
from smd_cli.runs.console import console
from smd_cli.runtime import distributed, integrity
from smd_cli.runtime.records import to_json


def warm_started(cfg: DictConfig, model, tokenizer, task, progress: bool):
    """The tiny model after the supervised warm start on `task`, trained once and cached by config hash. Under
    torchrun, rank 0 trains (or verifies) the cached copy and every rank loads it (transformers' save_pretrained
    writes no weights on the other ranks)."""
    # Keyed by what decides the weights (not by kernels or checkpointing, which change no number).
    weights = {k: v for k, v in to_dict(cfg.model).items() if k in ("config", "dtype", "warmstart", "tokenizer")}
    key = json.dumps({"model": weights, "task": to_dict(cfg.task), "seed": cfg.seed}, sort_keys=True)
    path = Path(cfg.cache_dir) / "warmstart" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if distributed.size() == 1:
        with cache_errors(cfg):
            return _cached_warm_start(cfg, model, tokenizer, task, progress, key, path)

    def on_rank_0() -> None:
        with cache_errors(cfg):
            _cached_warm_start(cfg, model, tokenizer, task, progress, key, path)

    distributed.from_main(on_rank_0)
    return use_smd_attention(Qwen3ForCausalLM.from_pretrained(path, dtype=model.dtype, use_safetensors=True))


def _reuse_warm_start(path: Path, dtype):
    console.print(f"warm start: reusing {path}", soft_wrap=True)
    return use_smd_attention(Qwen3ForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True))


def _cached_warm_start(cfg: DictConfig, model, tokenizer, task, progress: bool, key: str, path: Path):
    """The warm start cached at `path` (verified, read without a lock: a read-only cache serves), or trained now on
    `model` and published there atomically (`integrity.write_dir`) by one process while the others wait."""
    if path.is_dir() and not integrity.verify(path):
        return _reuse_warm_start(path, model.dtype)
    say = lambda text: console.print(f"warm start: {text}", soft_wrap=True, markup=False)  # noqa: E731
    with integrity.exclusive(path.with_name(f".{path.name}.lock"), f"warm-starting {path}", say):
        if path.is_dir():
            problems = integrity.verify(path)
            if not problems:  # trained by the process this one waited for
                return _reuse_warm_start(path, model.dtype)
            console.print(f"[yellow]warning:[/yellow] the cached warm start {path} is broken ({'; '.join(problems[:3])}); "
                          "rebuilding it", soft_wrap=True)
            shutil.rmtree(path)
        ws = cfg.model.warmstart
        if ws.get("task"):  # e.g. shorter prompts for the warm start than for RL: {prompt_tokens: 64}
            try:
                task = instantiate(cfg.task, **ws.task)
            except Exception as err:
                raise ConfigError(f"model.warmstart.task: {root_cause(err)}") from None
        stats = warm_start(model, tokenizer, task, steps=ws.steps, batch_size=ws.batch_size, lr=ws.lr,
                           label_smoothing=ws.get("label_smoothing", 0.0), progress=progress)
        hf_logging.disable_progress_bar()

        def write(tmp: Path) -> None:
            model.save_pretrained(tmp)
            integrity.write_file(tmp / "warmstart.json", to_json({**stats, "config": json.loads(key)}, indent=2))

        integrity.write_dir(path, write, "the warm start")
    console.print(f"warm start: {ws.steps} steps, loss {stats['warmstart/loss']:.3f}", soft_wrap=True)
    console.print(f"warm start cached at {path}", soft_wrap=True)
    return model
