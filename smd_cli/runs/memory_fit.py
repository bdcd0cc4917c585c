"""The planner's view of a `smd train` config (`smd_cli.checks.planner` does the arithmetic): the model's shapes and the run's
sizes read from the config alone, and the check that `smd train` runs before it allocates anything (`check_fits`): for
the device it runs on, the step's peak plus what it keeps on the host (the step's sampling noise, the held-out
prompts), against what the machine has (free CUDA memory; available host memory), refused with the planner's numbers
when it cannot fit. `smd plan` prints the same numbers."""

from __future__ import annotations

import os
from dataclasses import replace

import torch
from omegaconf import DictConfig, OmegaConf

from smd_cli.checks.contracts import contract_bound
from smd_cli.checks.planner import Arch, Run, plan, rounding_record_bytes
from smd_cli.config.factories import build_correction, build_policy, build_task
from smd_cli.config.validation import ConfigError
from smd_cli.eviction.snapkv import SnapKV
from smd_cli.model import build as models
from smd_cli.model.precision import cpu_compute_dtype
from smd_cli.rollout import adaptive
from smd_cli.runs.guard import judged_view
from smd_cli.runs.model_loading import load_tokenizer

GIB = 2**30
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
NOISE_BYTES = 8  # a float64 uniform per sampled token, drawn for the whole step at once (smd_cli.rollout.sampler.sampling_noise)
PROMPT_ID_BYTES = 36  # a token id in a Python list: an 8-byte pointer and a 28-byte int


def architecture(cfg: DictConfig) -> Arch:
    """The model's shapes from its config: `model.architecture` (a Hub model's published config.json) or
    `model.config` over the tiny defaults, else the checkpoint's config.json (needs it cached or the Hub)."""
    m = cfg.model
    fields = dict(m.get("architecture") or {}) if m.name_or_path is not None else {}
    fields.update(dict(m.config or {}))
    if m.name_or_path is not None and "hidden_size" not in fields:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(m.name_or_path, trust_remote_code=m.trust_remote_code, **fields)
        except OSError as err:
            raise ConfigError(f"model.name_or_path={m.name_or_path!r}: no config.json to plan from ({err}); "
                              "give its shapes in model.architecture") from None
    else:
        if "vocab_size" not in fields:
            fields["vocab_size"] = len(load_tokenizer(cfg))
        config = models.tiny_config(**fields)
    return Arch(layers=config.num_hidden_layers, hidden=config.hidden_size, intermediate=config.intermediate_size,
                heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                vocab=config.vocab_size, tied=bool(config.tie_word_embeddings))


def prompt_width(cfg: DictConfig, task) -> int:
    """P: `plan.prompt_tokens`, else the task's bound (its prompt cut, or a generated prompt's length)."""
    if OmegaConf.select(cfg, "plan.prompt_tokens"):  # train has no plan.* keys
        return int(cfg.plan.prompt_tokens)
    if hasattr(task, "example"):  # generated: measure one prompt
        return len(task.encode_prompt(task.example(task.train_split, 0), load_tokenizer(cfg)))
    return int(cfg.task.max_prompt_tokens)


def describe(cfg: DictConfig, device: str | None = None, gpus: int | None = None) -> Run:
    """The planner's view of `cfg`'s training step on `device` over `gpus` processes (default: `plan.device`, `plan.gpus`)."""
    g, s, m = cfg.grpo, cfg.sampling, cfg.model
    device = device or cfg.plan.device
    dtype = m.dtype if device == "cuda" else cpu_compute_dtype(m.get("cpu_dtype"), m.dtype)
    task = build_task(cfg)
    P, R = prompt_width(cfg, task), int(s.max_new_tokens)
    gpus = int(gpus or cfg.plan.gpus)
    rows = g.prompts_per_step // gpus * g.num_generations  # per GPU
    evicting = bool(cfg.algo.evicting)
    policy = build_policy(adaptive.fixed(cfg)) if evicting else None  # compression=adaptive: its most KV (adaptive.min_compression)
    kept = int(policy.budget(torch.tensor([P]))[0]) if evicting else P
    return Run(
        arch=architecture(cfg), compute_bytes=BYTES[dtype], device=device, algo=cfg.algo.name, rows=rows,
        micro_batch=min(g.micro_batch_size or rows, rows), rollout_rows=min(s.get("batch_size") or rows, rows), prompt=P, response=R, kept=kept,
        cache_growth=policy.cache_growth(R - 1) if evicting else 0,
        score_rows=policy.window if isinstance(policy, SnapKV) else 0,
        optimizer="adamw8bit" if str(cfg.optim.get("_target_", "")).startswith("bitsandbytes.") else "adamw",
        reference=g.beta > 0, logits_chunk=g.logits_chunk, lam=cfg["lambda"], gpus=gpus, offload=bool(cfg.optim.get("offload", False)),
        shadow=cfg.algo.view == "shadow", distill=bool(cfg.algo.distill), batch_level=build_correction(cfg).batch_level,
        kv_quant=cfg.kv.quant, parity_replay=parity_replays(cfg, dtype, gpus),
    )


def parity_replays(cfg: DictConfig, dtype: str, gpus: int) -> bool:
    """Whether `smd train`'s parity guard may replay a miss in float64 inside the step (`train_parity.ParityGuard`): a
    judged view with a bound for `dtype` (or `guard.parity_bound`), on one process."""
    explicit = OmegaConf.select(cfg, "guard.parity_bound")
    return gpus == 1 and judged_view(cfg) and (explicit is not None or contract_bound(dtype, cfg.model.get("attention_dtype")) is not None)


def host_terms(cfg: DictConfig, step: Run) -> dict[str, float]:
    """Bytes a training run keeps in host memory beside the step the planner counts: the step's sampling noise (every
    row of every process, drawn at once) and the held-out prompts' token ids (a lower bound: their texts come on top)."""
    rows = step.rows * step.gpus
    terms = {"sampling noise": float(NOISE_BYTES * rows * step.response),
             "held-out prompts": float(PROMPT_ID_BYTES * int(cfg.eval.num_prompts or 0) * step.prompt)}
    if step.kv_quant != "none":  # an 8-bit cache's record of rounding directions, the step's rows (`smd_cli.attention.kv_quant`)
        terms["kv rounding record"] = rounding_record_bytes(step, rows)
    return terms


def machine_memory(device: torch.device) -> tuple[float, float, str]:
    """(bytes the step may use on `device`, bytes free on the host, words naming them): free CUDA memory, and the
    host's available memory (psutil when installed, else os.sysconf's free pages)."""
    try:
        import psutil

        host, how = float(psutil.virtual_memory().available), "available host memory"
    except ImportError:
        host, how = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")), "free host memory (os.sysconf)"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free), host, f"free memory of {torch.cuda.get_device_name(device)}"
    return host, host, how


def demand(cfg: DictConfig, step: Run) -> tuple[float, float, dict[str, float], object]:
    """(bytes on the step's device, bytes on the host, the host terms, the plan) of `step`; on the CPU both are one memory."""
    found, host = plan(step), host_terms(cfg, step)
    on_host = sum(host.values()) + (plan(replace(step, offload=True)).offloaded if step.offload else 0.0)
    if step.device == "cpu":
        return found.peak_bytes + on_host, found.peak_bytes + on_host, host, found
    return found.peak_bytes, on_host, host, found


def _rows(step: Run, rows: int) -> Run:
    return replace(step, rows=rows, micro_batch=min(step.micro_batch, rows), rollout_rows=min(step.rollout_rows, rows))


# the sizes `check_fits` may name, each with the step it would plan at its smallest value
SIZES = {
    "grpo.num_generations": lambda cfg, step: _rows(step, step.rows // cfg.grpo.num_generations * 2),
    "grpo.prompts_per_step": lambda cfg, step: _rows(step, cfg.grpo.num_generations),
    "sampling.max_new_tokens": lambda cfg, step: replace(step, response=1, cache_growth=0),
    "sampling.batch_size": lambda cfg, step: replace(step, rollout_rows=1),
    "grpo.micro_batch_size": lambda cfg, step: replace(step, micro_batch=1),
}


def check_fits(cfg: DictConfig, device: torch.device, processes: int = 1) -> None:
    """A ConfigError with the planner's numbers when `cfg`'s training step cannot fit this machine: the planned
    peak (`smd plan` on the run's device) and the host terms (`host_terms`) against `machine_memory`. It names the
    size whose smallest value would relieve the machine most (eval.num_prompts when the held-out prompts alone do
    not fit)."""
    step = describe(cfg, device.type, processes)
    on_device, on_host, host, found = demand(cfg, step)
    have_device, have_host, words = machine_memory(device)
    if on_device <= have_device and on_host <= have_host:
        return

    def overload(other: Run, prompts: bool = True) -> float:
        d, h, _, _ = demand(cfg, other)
        h -= 0.0 if prompts else host["held-out prompts"]
        d -= 0.0 if prompts or step.device != "cpu" else host["held-out prompts"]
        return max(d / have_device, h / have_host)

    options = {key: overload(shrink(cfg, step)) for key, shrink in SIZES.items()}
    options["eval.num_prompts"] = overload(step, prompts=False)
    key = min(options, key=options.get)
    value = OmegaConf.select(cfg, key)
    kind = f"{device.type} ({'fp64' if step.compute_bytes == 8 else 'bf16' if step.compute_bytes == 2 else 'fp32'} compute)"
    extra = "".join(f", {name} {gib(v)}" for name, v in host.items())
    need, have = (on_device, have_device) if on_device > have_device else (on_host, have_host)
    raise ConfigError(
        f"{key}={value!r} is not allowed: the planner (`smd plan`) predicts {gib(need)} GiB for this run on {kind}: step peak "
        f"{gib(found.peak_bytes)} GiB (static {gib(found.static_bytes)}, rollout {gib(found.rollout_bytes)}, learner "
        f"{gib(found.learner_bytes)}) for {step.rows} rows x (P {step.prompt} + R {step.response}); on the host{extra} GiB; "
        f"more than the {gib(have)} GiB of {words if need == on_device else 'available host memory'}. Lower it "
        f"(`smd plan plan.device={device.type} ...` shows every term and the batch sizes that fit)")


def gib(x: float) -> str:
    return f"{x / GIB:,.2f}"
