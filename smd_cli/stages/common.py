"""What every stage does at its start: validate the config, open the run directory, build the objects.

Stages are the only code that sees Hydra/OmegaConf; they turn the config into plain arguments here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from transformers import Qwen3ForCausalLM
from transformers.utils import logging as hf_logging
from rich.console import Console
from rich.table import Table

from smd_cli import distributed, integrity, model_dir, models, weights
from smd_cli.attention import use_smd_attention
from smd_cli.corrections.base import Correction
from smd_cli.io import seed_everything, to_json, write_json, write_provenance
from smd_cli.tasks.loading import PromptTooLong
from smd_cli.warmstart import warm_start

ROOT = Path(__file__).resolve().parents[2]
DTYPES = ("float32", "bfloat16", "float16", "float64")  # float64: parity against rounding (CPU)
console = Console(width=None if sys.stdout.isatty() else 140)  # logs and pipes: tables 140 columns wide, not 80


class ConfigError(ValueError):
    """A config value the stage cannot run with; the message names the key, the value and what is allowed."""


def check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is not allowed: {allowed}")


def check_offload(cfg: DictConfig, processes: int) -> None:
    """`optim.offload`: true or false, and only for one process (under torchrun FSDP2 shards that state instead)."""
    offload = cfg.optim.get("offload", False)
    check(isinstance(offload, bool), "optim.offload", offload, "true or false")
    check(not offload or processes == 1, "optim.offload", offload,
          f"false with {processes} processes: FSDP2 already splits the masters, gradients and optimizer state over the GPUs")


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


def to_dict(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


@dataclass
class Run:
    dir: Path
    generator: torch.Generator
    device: torch.device


def pick_device(cfg: DictConfig) -> torch.device:
    """The device of `cfg.device` (auto: CUDA when present); under torchrun on CUDA, the local rank's GPU."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but no CUDA device is available; use device=cpu or device=auto")
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", distributed.local_rank()) if distributed.launched() else torch.device("cuda")
    return torch.device("cpu")


def start_run(cfg: DictConfig) -> Run:
    """Seed, pick the device, join torchrun's process group when launched by it, and write the resolved config,
    overrides, git commit, versions and world size (rank 0: every rank uses rank 0's run directory)."""
    threads = cfg.get("threads")  # the values were checked by the stage's `validate` (`smd_cli.stages.rules`)
    if threads:
        torch.set_num_threads(threads)
    device = pick_device(cfg)
    world = distributed.init(device)
    if cfg.get("run_dir"):  # set by tests and by `smd ablate` for each of its runs
        run_dir, overrides = Path(cfg.run_dir), list(cfg.get("overrides") or [])
    elif HydraConfig.initialized():
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        overrides = list(HydraConfig.get().overrides.task)
    else:
        raise ConfigError("run_dir is not set: run through `smd STAGE` or compose with +run_dir=DIR")
    if "model" in cfg and "task" in cfg:
        check_context(cfg)
    if world.size > 1:
        run_dir = _main_run_dir(run_dir)
        console.quiet = not distributed.is_main()  # one console: rank 0's
    if distributed.is_main():
        lock_run_dir(run_dir)  # one writer per run directory: a second process stops here, before it writes anything
        write_provenance(run_dir, to_dict(cfg), overrides, ROOT, {"world_size": world.size, "backend": world.backend})
    distributed.barrier()
    return Run(run_dir, seed_everything(cfg.seed), device)


def _main_run_dir(mine: Path) -> Path:
    """Rank 0's run directory for every rank (Hydra's timestamped default may differ by a second between ranks);
    a directory Hydra made for this rank alone, holding only its own config and log, is removed."""
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


def check_context(cfg: DictConfig, response: bool = True) -> None:
    """What the model can serve, said at once (before a download of weights, a warm start or an allocation): its
    architecture (`check_supported`, from its config alone), and prompt plus response within its positions, for
    every model (the checkpoint's config.json for `model=hub`), counted from the real encoded prompt (the chat
    template and the task's own words included) after the nominal size (`task.prompt_tokens`) is checked first,
    so that a huge one is refused before anything is generated. `response=False`: the prompt alone (`smd train`
    plans its memory between the two)."""
    t, m = cfg.task, cfg.model
    config, limit = model_config(cfg)
    if config is not None:
        check_supported(config, m.get("name"))
    if not limit:
        return
    new, new_key = response_tokens(cfg) if response else (0, "")
    key = "task.prompt_tokens" if t.get("prompt_tokens") else "task.max_prompt_tokens"
    nominal = t.get("prompt_tokens") or t.get("max_prompt_tokens")
    where = f"model={m.name}'s {limit} positions (max_position_embeddings)"
    if isinstance(nominal, int) and nominal + new > limit:
        raise ConfigError(f"{key}={nominal} is not allowed: {f'with {new_key}={new} ' if new else ''}it exceeds {where}")
    task = build_task(cfg)
    if hasattr(task, "example"):  # a generated prompt: its real length, chat template included
        prompt = len(encode_prompt(task, task.example(task.train_split, 0), load_tokenizer(cfg)))
        if prompt + new > limit:
            raise ConfigError(f"{key}={nominal} is not allowed: its prompts encode to {prompt} tokens (chat template and the "
                              f"task's words included), which {f'with {new_key}={new} ' if new else ''}exceed {where}")


def response_tokens(cfg: DictConfig) -> tuple[int, str]:
    """(the longest response the stage generates, the key that sets it): `sampling.max_new_tokens` (train, rollout,
    check-parity), `eval.max_new_tokens` (eval) or `task.max_new_tokens`."""
    for key in ("sampling.max_new_tokens", "eval.max_new_tokens", "task.max_new_tokens"):
        value = OmegaConf.select(cfg, key)
        if isinstance(value, int):
            return value, key
    return 0, "task.max_new_tokens"


def model_config(cfg: DictConfig):
    """(the model's transformers config or None, its positions or None), read without loading a weight: the tiny
    architecture from `model.config`; a checkpoint's published fields (`model.architecture`, read offline: its
    config is then checked when the model loads); else the checkpoint's config.json."""
    m = cfg.model
    fields = {**dict(m.get("architecture") or {}), **dict(m.get("config") or {})}
    if m.name_or_path is None:
        vocabulary = len(load_tokenizer(cfg))
        fields = {"vocab_size": vocabulary, **fields}
        check_architecture(cfg, fields, vocabulary)
        config = tiny_architecture(cfg, fields)
        return config, config.max_position_embeddings
    if fields.get("max_position_embeddings"):
        return None, fields["max_position_embeddings"]
    config = checkpoint_config(cfg)
    return config, getattr(config, "max_position_embeddings", None)


def tiny_architecture(cfg: DictConfig, fields: dict):
    """`models.tiny_config(**fields)`; a config transformers refuses is a ConfigError naming `model.config`."""
    try:
        return models.tiny_config(**fields)
    except Exception as err:  # transformers' own checks of a config (rope, activation names, ...)
        raise ConfigError(f"model.config of model={cfg.model.name} is not allowed: transformers cannot build it "
                          f"({type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''})") from None


def checkpoint_config(cfg: DictConfig):
    """The config.json of `cfg.model`'s checkpoint with `model.config` over it (no weights loaded)."""
    m = cfg.model
    path, _ = model_source(cfg)
    try:
        return models.hub_config(path, m.trust_remote_code, dict(m.config or {}))
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.name_or_path={m.name_or_path!r}: could not read its config.json ({err})") from err


def check_supported(config, name) -> None:
    """A config error naming the architecture when the engine cannot serve a model of `config` (`models.unsupported`)."""
    reason = models.unsupported(config)
    if reason:
        arch = ", ".join(getattr(config, "architectures", None) or [type(config).__name__.replace("Config", "ForCausalLM")])
        raise ConfigError(f"model={name} ({arch}, model_type {config.model_type!r}) is not supported: {reason}")


def build_task(cfg: DictConfig):
    try:
        return instantiate(cfg.task)
    except Exception as err:  # Hydra wraps the constructor's error; surface its message
        raise ConfigError(f"task: {_root_cause(err)}") from None


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
        raise ConfigError(f"eviction: {_root_cause(err)}") from None


def build_correction(cfg: DictConfig):
    """The rollout correction of `algo.correction` (smd_cli/corrections/); a constructor's error is a config error
    naming it."""
    try:
        correction = instantiate(cfg.algo.correction)
    except Exception as err:  # Hydra wraps the constructor's error; surface its message
        raise ConfigError(f"algo.correction: {_root_cause(err)}") from None
    check(isinstance(correction, Correction), "algo.correction._target_", cfg.algo.correction.get("_target_"),
          "a subclass of smd_cli.corrections.base.Correction")
    return correction


def _root_cause(err: BaseException) -> str:
    while err.__cause__ is not None:
        err = err.__cause__
    return str(err)


def print_metrics(title: str, summary: dict, keys, first_rows: tuple[tuple[str, str], ...] = ()) -> None:
    """A two-column rich table: `first_rows` as given, then each of `keys` present in `summary`."""
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for row in first_rows:
        table.add_row(*row)
    for key in keys:
        if isinstance(summary.get(key), (int, float)):
            table.add_row(key, f"{summary[key]:.4g}")
    console.print(table)


def load_examples(task, split: str, limit: int | None = None) -> list[dict]:
    """The split's examples; a missing field, file or split, or an empty split, is a config error naming it."""
    try:
        examples = task.examples(split, limit=limit)
    except (KeyError, ValueError, OSError, RuntimeError) as err:  # a missing file or field, an empty split, no Hub
        raise ConfigError(f"task={task.name} split {split!r}: {err.args[0] if err.args else err}") from err
    if not examples:
        raise ConfigError(f"task={task.name} split {split!r} is empty (no examples)")
    return examples


def encode_prompt(task, example: dict, tokenizer) -> list[int]:
    """`task.encode_prompt`, with a prompt that cannot be fitted to `task.max_prompt_tokens` a ConfigError."""
    try:
        return task.encode_prompt(example, tokenizer)
    except PromptTooLong as err:
        raise ConfigError(str(err)) from None


def check_prompts(task, examples: list[dict], tokenizer) -> None:
    """Every example's prompt fits `task.max_prompt_tokens` (else a ConfigError naming it): before any model is
    loaded, so that a long question is said at once. Nothing longer than the budget allows is tokenised."""
    for example in examples:
        encode_prompt(task, example, tokenizer)


def model_source(cfg: DictConfig) -> tuple[str | None, weights.Weights]:
    """What `cfg.model` loads (a directory or Hub id; None builds the tiny or random architecture) and which
    weights those are: a model with `model.gguf` falls back to the dequantised GGUF when the Hub is out of reach
    (`smd_cli.weights`). Resolved once per process."""
    m = cfg.model
    if m.name_or_path is None:
        kind = "random" if m.get("name") != "tiny" else "tiny"
        return None, weights.Weights(kind, str(m.get("name")), "random init" + (", warm-started" if m.get("warmstart") else ""))
    gguf = to_dict(m.gguf) if m.get("gguf") else None
    source = m.get("source", "auto")
    check(source in weights.SOURCES, "model.source", source, "auto (the Hub when reachable or cached, else model.gguf), hub or gguf")
    cache_dir = cfg.get("cache_dir") or os.environ.get("SMD_CACHE_DIR", ".cache/smd")  # prepare-data and plan have no cache_dir key
    key = (str(m.name_or_path), json.dumps(gguf, sort_keys=True), str(cache_dir), source)
    if key not in _SOURCES:
        local = Path(str(m.name_or_path))
        if local.is_dir():  # what a local directory lacks is named before transformers reads it (smd_cli.model_dir)
            problem = model_dir.problem(local, bool(m.get("tokenizer")), bool(m.get("random_init")), bool(m.get("trust_remote_code")))
            check(problem is None, "model.name_or_path", str(local), problem or "")
        try:
            with cache_errors(cfg):
                _SOURCES[key] = weights.resolve(str(m.name_or_path), gguf, cache_dir, source, progress=cfg.get("progress", True))
        except ConfigError:
            raise
        except (weights.WeightsUnavailable, ValueError) as err:  # a malformed weights.json (integrity.Malformed) too
            raise ConfigError(f"model={m.get('name')} (model.name_or_path={m.name_or_path!r}): {err}") from err
    return _SOURCES[key]


_SOURCES: dict[tuple, tuple] = {}


def load_tokenizer(cfg: DictConfig):
    """The tokenizer of `cfg.model` alone: the project's own for the tiny scale, else the checkpoint's."""
    m = cfg.model
    source = m.tokenizer or model_source(cfg)[0]
    if source is None:
        return models.build_tiny_tokenizer()
    try:
        return models.load_hub_tokenizer(source, m.trust_remote_code)
    except (OSError, ValueError) as err:  # ValueError: transformers' "couldn't instantiate the backend tokenizer", custom code
        key = "model.tokenizer" if m.tokenizer else "model.name_or_path"
        raise ConfigError(f"{key}={source!r}: could not load its tokenizer ({err})") from err


def compute_dtype(cfg: DictConfig, device: torch.device) -> str:
    """The model's compute dtype on `device`: `model.dtype`, or on the CPU `model.cpu_dtype` when set."""
    m = cfg.model
    return m.cpu_dtype if device.type == "cpu" and m.get("cpu_dtype") else m.dtype


def load_model(cfg: DictConfig, task, device: torch.device, progress: bool = True):
    """(model, tokenizer) for `cfg.model`, in eval mode on `device`: a Hub checkpoint, an architecture with
    random weights (`name_or_path: null` builds it from `model.config` alone, offline: the tiny model, or
    Qwen3-4B's widths for `model=qwen3_4b_random`), the tiny one warm-started on a generated `task` (cached
    under `cfg.cache_dir`). Every model gets the smd attention, its compute dtype (`compute_dtype`), and
    gradient checkpointing when `model.gradient_checkpointing` is set."""
    m = cfg.model
    name = compute_dtype(cfg, device)
    tokenizer = load_tokenizer(cfg)
    dtype = getattr(torch, name)
    if m.name_or_path is None:
        fields = {"vocab_size": len(tokenizer), **dict(m.config or {})}  # an architecture's own vocabulary wins
        check_architecture(cfg, fields, len(tokenizer))
        check_supported(tiny_architecture(cfg, fields), m.get("name"))  # before the warm start
        model = models.build_tiny_model(fields.pop("vocab_size"), seed=cfg.seed, dtype=dtype, device=device, **fields)
        check_replayable(model, m.get("name"))
        # The warm start is for the generated tasks; the tiny model is a smoke test on the paper's datasets.
        if m.get("warmstart") and m.warmstart.steps > 0 and hasattr(task, "example"):
            model = _warm_started(cfg, model, tokenizer, task, progress)
    else:
        path, _ = model_source(cfg)
        check_supported(checkpoint_config(cfg), m.get("name"))  # before its weights are read
        try:
            model = models.load_hub_model(path, name, m.trust_remote_code, m.random_init, dict(m.config or {}))
        except OSError as err:
            raise ConfigError(f"model.name_or_path={m.name_or_path!r}: could not load it ({err})") from err
    check_replayable(model, m.get("name"))
    mark_weights(model, model_source(cfg)[1])
    if len(tokenizer) > model.config.vocab_size:
        raise ConfigError(f"model={m.name}: its vocabulary ({model.config.vocab_size}) is smaller than the tokenizer's "
                          f"{len(tokenizer)} ids; set model.config.vocab_size or model.tokenizer")
    if m.gradient_checkpointing:
        models.enable_checkpointing(model)
    return model.to(device).eval(), tokenizer


def check_architecture(cfg: DictConfig, fields: dict, vocabulary: int) -> None:
    """What attention and the tokenizer need of `model.config` (before anything is built or warm-started): KV heads
    that divide the query heads, and a vocabulary that holds every token id."""
    heads, kv = fields.get("num_attention_heads"), fields.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise ConfigError(f"model.config.num_key_value_heads={kv} is not allowed: a divisor of model.config.num_attention_heads="
                          f"{heads} (grouped-query attention shares each KV head among a whole group of query heads)")
    if isinstance(fields.get("vocab_size"), int) and fields["vocab_size"] < vocabulary:
        raise ConfigError(f"model.config.vocab_size={fields['vocab_size']} is not allowed: at least the tokenizer's {vocabulary} ids")


def _warm_started(cfg: DictConfig, model, tokenizer, task, progress: bool):
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
                raise ConfigError(f"model.warmstart.task: {_root_cause(err)}") from None
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


def check_replayable(model, name) -> None:
    """A config error naming the architecture when the engine cannot roll out and replay it (`models.unreplayable`)."""
    reason = models.unreplayable(model)
    if reason:
        arch = ", ".join(getattr(model.config, "architectures", None) or [type(model).__name__])
        raise ConfigError(f"model={name} ({arch}, model_type {model.config.model_type!r}) is not supported: {reason}")


def mark_weights(model, source: weights.Weights) -> None:
    """Record which weights `model` holds in its config (`smd_weights`), so that checkpoints trained from it say so
    too; a directory whose config already names its origin (a checkpoint) keeps that origin."""
    origin = getattr(model.config, "smd_weights", None)
    if source.source == "local" and isinstance(origin, dict) and origin.get("label"):
        source = weights.Weights("local", source.name, f"trained from {origin['label']}", origin.get("sha256"))
    model.config.smd_weights = source.to_dict()


def weights_label(model) -> str:
    """The one-line description of the weights `model` holds (`mark_weights`)."""
    return (getattr(model.config, "smd_weights", None) or {}).get("label", "unknown")


def record_weights(run_dir: Path, model, summary: dict | None = None) -> None:
    """Add which weights ran to the run's `provenance.json` (rank 0) and, given one, to a summary (`model/weights`)."""
    record = getattr(model.config, "smd_weights", None) or {"label": "unknown"}
    if summary is not None:
        summary["model/weights"] = record["label"]
    path = Path(run_dir) / "provenance.json"
    if distributed.is_main() and path.is_file():
        write_json(path, {**json.loads(path.read_text()), "weights": record})
