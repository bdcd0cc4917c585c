"""`smd plan`: how much memory a `smd train` config needs, phase by phase, before anything runs.

Composes the train config (any override or recipe: `smd plan +recipe=govreport`), reads the model's
architecture from the config alone (offline), and prints `smd_cli.planner`'s terms and peaks: static
(weights, master weights, gradients, optimizer state, reference policy), rollout (KV cache and shadow
masks, prefill activations, scores, logits) and learner (checkpointed activations, one layer's recompute,
vocabulary chunk, LM-head gradients). `plan.gpus=N` plans each of N GPUs under torchrun and FSDP2 (its share
of the rows, sharded states, what FSDP2 gathers). Then, for each of `plan.device_gb`, whether the step fits and the
largest `grpo.micro_batch_size` and `sampling.batch_size` that do. Writes `plan.json` to the run directory.
"""

from __future__ import annotations

import math

import torch
from omegaconf import DictConfig
from rich.table import Table

from smd_cli import models
from smd_cli.eviction.snapkv import SnapKV
from smd_cli.io import write_json
from smd_cli.planner import Arch, Run, largest_fitting, plan
from smd_cli.stages.common import ConfigError, build_correction, build_policy, build_task, check, console, load_tokenizer, start_run

GIB = 2**30
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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
    if cfg.plan.prompt_tokens:
        return int(cfg.plan.prompt_tokens)
    if hasattr(task, "example"):  # generated: measure one prompt
        return len(task.encode_prompt(task.example(task.train_split, 0), load_tokenizer(cfg)))
    return int(cfg.task.max_prompt_tokens)


def describe(cfg: DictConfig) -> Run:
    """The planner's view of `cfg`'s training step on `plan.device`."""
    g, s, m = cfg.grpo, cfg.sampling, cfg.model
    device = cfg.plan.device
    dtype = m.dtype if device == "cuda" else (m.get("cpu_dtype") or m.dtype)
    task = build_task(cfg)
    P, R = prompt_width(cfg, task), int(s.max_new_tokens)
    gpus = int(cfg.plan.gpus)
    rows = g.prompts_per_step // gpus * g.num_generations  # per GPU
    evicting = bool(cfg.algo.evicting)
    policy = build_policy(cfg) if evicting else None
    kept = int(policy.budget(torch.tensor([P]))[0]) if evicting else P
    return Run(
        arch=architecture(cfg), compute_bytes=BYTES[dtype], device=device, algo=cfg.algo.name, rows=rows,
        micro_batch=min(g.micro_batch_size or rows, rows), rollout_rows=min(s.get("batch_size") or rows, rows), prompt=P, response=R, kept=kept,
        cache_growth=policy.cache_growth(R - 1) if evicting else 0,
        score_rows=policy.window if isinstance(policy, SnapKV) else 0,
        optimizer="adamw8bit" if str(cfg.optim.get("_target_", "")).startswith("bitsandbytes.") else "adamw",
        reference=g.beta > 0, logits_chunk=g.logits_chunk, lam=cfg["lambda"], gpus=gpus,
        shadow=cfg.algo.view == "shadow", distill=bool(cfg.algo.distill), batch_level=build_correction(cfg).batch_level,
    )


def run(cfg: DictConfig) -> dict:
    p = cfg.plan
    check(p.device in ("cuda", "cpu"), "plan.device", p.device, "cuda or cpu (which kernels and compute dtype to plan for)")
    check(len(p.device_gb) >= 1 and all(v > 0 for v in p.device_gb), "plan.device_gb", list(p.device_gb), "a list of positive sizes in GiB")
    check(0 < p.usable <= 1, "plan.usable", p.usable, "the usable fraction of device memory, in (0, 1]")
    check(p.prompt_tokens is None or p.prompt_tokens >= 1, "plan.prompt_tokens", p.prompt_tokens, "null or >= 1")
    check(isinstance(p.gpus, int) and p.gpus >= 1, "plan.gpus", p.gpus, "an integer >= 1 (torchrun's --nproc_per_node x --nnodes)")
    check(cfg.grpo.prompts_per_step % p.gpus == 0, "plan.gpus", p.gpus,
          f"a divisor of grpo.prompts_per_step={cfg.grpo.prompts_per_step} (each GPU takes an equal share of whole prompt groups)")
    run_ = start_run(cfg)
    step = describe(cfg)
    result = plan(step)
    fits = {}
    for size in p.device_gb:
        capacity = size * GIB * p.usable
        fits[f"{size:g}"] = {
            "fits": result.peak_bytes <= capacity,
            "largest_micro_batch_size": largest_fitting(step, "micro_batch", step.rows, capacity),
            "largest_sampling_batch_size": largest_fitting(step, "rollout_rows", step.rows, capacity),
        }
    out = {"run": {k: v for k, v in vars(step).items() if k != "arch"}, "arch": vars(step.arch), "params": step.arch.params,
           "static": result.static, "rollout": result.rollout, "learner": result.learner,
           "peaks": {"static": result.static_bytes, "rollout": result.rollout_bytes, "learner": result.learner_bytes,
                     "step": result.peak_bytes}, "devices": fits, "usable": p.usable}
    write_json(run_.dir / "plan.json", out)
    print_plan(cfg, step, result, fits)
    return out


def _gib(x: float) -> str:
    return f"{x / GIB:,.2f}"


def print_plan(cfg, step: Run, result, fits: dict) -> None:
    a = step.arch
    console.print(f"smd plan: model={cfg.model.name} ({a.params / 1e9:.2f} B parameters, {a.layers} layers), algo={step.algo}, "
                  f"device={step.device} ({'bf16' if step.compute_bytes == 2 else 'fp32'} compute), "
                  f"{step.rows} rows x (P {step.prompt} + R {step.response}), micro-batch {step.micro_batch}, "
                  f"rollout chunk {step.rollout_rows}" + (f"; per GPU of {step.gpus} (FSDP2)" if step.gpus > 1 else ""))
    table = Table(title="predicted memory (GiB)" + (f", per GPU of {step.gpus}" if step.gpus > 1 else ""))
    for column in ("phase", "term", "GiB"):
        table.add_column(column, justify="right" if column == "GiB" else "left")
    for phase, terms in (("static", result.static), ("rollout", result.rollout), ("learner", result.learner)):
        for name, value in terms.items():
            if name != "peak" and value:
                table.add_row(phase, name, _gib(value))
    table.add_row("[bold]peak[/bold]", "static", _gib(result.static_bytes))
    table.add_row("[bold]peak[/bold]", "rollout (static + rollout)", _gib(result.rollout_bytes))
    table.add_row("[bold]peak[/bold]", "learner (static + held + learner)", _gib(result.learner_bytes))
    console.print(table)
    devices = Table(title=f"fits (usable fraction {cfg.plan.usable:g})")
    for column in ("device GiB", "fits", "largest grpo.micro_batch_size", "largest sampling.batch_size"):
        devices.add_column(column, justify="right")
    for size, f in fits.items():
        devices.add_row(size, "yes" if f["fits"] else "[red]no[/red]", str(f["largest_micro_batch_size"] or "none"),
                        str(f["largest_sampling_batch_size"] or "none"))
    console.print(devices)
    if math.isfinite(result.peak_bytes):
        console.print(f"step peak: {_gib(result.peak_bytes)} GiB")
