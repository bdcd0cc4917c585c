"""The model and tokenizer a config names, and what is checked of them before a weight is read or a warm start
runs: the architecture the engine serves, prompt plus response within its positions; and which weights ran.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from smd_cli.config.factories import build_task
from smd_cli.config.prompts import encode_prompt
from smd_cli.config.validation import ConfigError, cache_errors, check, to_dict
from smd_cli.model import build as models
from smd_cli.model import local_dir as model_dir
from smd_cli.model import weights
from smd_cli.model.precision import cpu_compute_dtype
from smd_cli.runs.warm_cache import warm_started
from smd_cli.runtime import distributed
from smd_cli.runtime.records import write_json


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


def model_source(cfg: DictConfig) -> tuple[str | None, weights.Weights]:
    """What `cfg.model` loads (a directory or Hub id; None builds the tiny or random architecture) and which
    weights those are: a model with `model.gguf` falls back to the dequantised GGUF when the Hub is out of reach
    (`smd_cli.model.weights`). Resolved once per process."""
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
        if local.is_dir():  # what a local directory lacks is named before transformers reads it (smd_cli.model.local_dir)
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
    """The model's compute dtype on `device`: `model.dtype`, or on the CPU `model.cpu_dtype` when set (`auto`: bfloat16
    where the CPU has it natively)."""
    m = cfg.model
    return cpu_compute_dtype(m.get("cpu_dtype"), m.dtype) if device.type == "cpu" else m.dtype


def load_model(cfg: DictConfig, task, device: torch.device, progress: bool = True):
    """(model, tokenizer) for `cfg.model`, in eval mode on `device`: a Hub checkpoint, an architecture with
    random weights (`name_or_path: null` builds it from `model.config` alone, offline: the tiny model, or
    Qwen3-4B's widths for `model=qwen3_4b_random`), the tiny one warm-started on a generated `task` (cached
    under `cfg.cache_dir`). Every model gets the smd attention, its compute dtype (`compute_dtype`), the dtypes of
    its logits and attention (`set_precision`) and gradient checkpointing when `model.gradient_checkpointing` is set."""
    m = cfg.model
    check_precision(cfg, device)
    name = compute_dtype(cfg, device)
    tokenizer = load_tokenizer(cfg)
    dtype = getattr(torch, name)
    if m.name_or_path is None:
        fields = {"vocab_size": len(tokenizer), **dict(m.config or {})}  # an architecture's own vocabulary wins
        check_architecture(cfg, fields, len(tokenizer))
        check_supported(tiny_architecture(cfg, fields), m.get("name"))  # before the warm start
        # an architecture of its own (model=qwen3_4b_random) draws each weight once (3x faster at its widths); the tiny
        # model keeps the draws its warm starts and recorded runs were made with
        model = models.build_tiny_model(fields.pop("vocab_size"), seed=cfg.seed, dtype=dtype, device=device,
                                        draw_once=m.get("name") != "tiny", **fields)
        check_replayable(model, m.get("name"))
        # The warm start is for the generated tasks; the tiny model is a smoke test on the paper's datasets.
        if m.get("warmstart") and m.warmstart.steps > 0 and hasattr(task, "example"):
            model = warm_started(cfg, model, tokenizer, task, progress)
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
    set_precision(cfg, model)
    return model.to(device).eval(), tokenizer


def check_precision(cfg: DictConfig, device: torch.device) -> None:
    """`model.logits_dtype` and `model.attention_dtype` are CPU settings: on CUDA float64 would be neither planned
    (`smd plan` counts the compute dtype) nor compiled (flex has no float64 mode), so it is refused there by name,
    before anything is loaded."""
    wide = [key for key in ("logits_dtype", "attention_dtype") if cfg.model.get(key) == "float64"]
    if wide and device.type == "cuda":
        raise ConfigError(f"{', '.join(f'model.{k}=float64' for k in wide)} is a CPU setting (parity of a float32 model on the CPU): "
                          f"on CUDA `smd plan` does not count it and the flex replay has no float64 mode; set {'/'.join(f'model.{k}' for k in wide)}=null")


def set_precision(cfg: DictConfig, model) -> None:
    """`model.logits_dtype` and `model.attention_dtype` on `model` (`models.set_logits_dtype`, `set_attention_dtype`)."""
    models.set_logits_dtype(model, cfg.model.get("logits_dtype"))
    models.set_attention_dtype(model, cfg.model.get("attention_dtype"))


def check_architecture(cfg: DictConfig, fields: dict, vocabulary: int) -> None:
    """What attention and the tokenizer need of `model.config` (before anything is built or warm-started): KV heads
    that divide the query heads, and a vocabulary that holds every token id."""
    heads, kv = fields.get("num_attention_heads"), fields.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise ConfigError(f"model.config.num_key_value_heads={kv} is not allowed: a divisor of model.config.num_attention_heads="
                          f"{heads} (grouped-query attention shares each KV head among a whole group of query heads)")
    if isinstance(fields.get("vocab_size"), int) and fields["vocab_size"] < vocabulary:
        raise ConfigError(f"model.config.vocab_size={fields['vocab_size']} is not allowed: at least the tokenizer's {vocabulary} ids")


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
    """Add which weights ran, and in which compute dtype, to the run's `provenance.json` (rank 0) and, given one, to a
    summary (`model/weights`, `model/compute_dtype`)."""
    record = getattr(model.config, "smd_weights", None) or {"label": "unknown"}
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    if summary is not None:
        summary["model/weights"], summary["model/compute_dtype"] = record["label"], dtype
    path = Path(run_dir) / "provenance.json"
    if distributed.is_main() and path.is_file():
        write_json(path, {**json.loads(path.read_text()), "weights": record, "compute_dtype": dtype})
