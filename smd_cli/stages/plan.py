"""`smd plan`: how much memory a `smd train` config needs, phase by phase, before anything runs.

Composes the train config (any override or recipe: `smd plan +recipe=govreport`), reads the model's
architecture from the config alone (offline), and prints `smd_cli.planner`'s terms and peaks: static
(weights, master weights, gradients, optimizer state, reference policy), rollout (KV cache and shadow
masks, prefill activations, scores, logits) and learner (checkpointed activations, one layer's recompute,
vocabulary chunk, LM-head gradients). `plan.gpus=N` plans each of N GPUs under torchrun and FSDP2 (its share
of the rows, sharded states, what FSDP2 gathers). Then, for each of `plan.device_gb`, whether the step fits and the
largest `grpo.micro_batch_size` and `sampling.batch_size` that do, and (one GPU) whether it fits with and without
`optim.offload` (masters, gradients and optimizer state on the host during the rollout). Writes `plan.json`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from omegaconf import DictConfig
from rich.table import Table

from smd_cli import models
from smd_cli.eviction.snapkv import SnapKV
from smd_cli.io import write_json
from smd_cli.planner import Arch, Run, largest_fitting, plan
from smd_cli.stages.common import (ConfigError, build_correction, build_policy, build_task, check, check_offload, console,
                                  load_tokenizer, start_run)
from smd_cli.stages.rules import check_config

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
        reference=g.beta > 0, logits_chunk=g.logits_chunk, lam=cfg["lambda"], gpus=gpus, offload=bool(cfg.optim.get("offload", False)),
        shadow=cfg.algo.view == "shadow", distill=bool(cfg.algo.distill), batch_level=build_correction(cfg).batch_level,
    )


def validate(cfg: DictConfig) -> None:
    """Every key's own rule (the train keys it plans, and `plan.*`), then the GPU count against the batch."""
    check_config(cfg, "plan")
    check(cfg.grpo.prompts_per_step % cfg.plan.gpus == 0, "plan.gpus", cfg.plan.gpus,
          f"a divisor of grpo.prompts_per_step={cfg.grpo.prompts_per_step} (each GPU takes an equal share of whole prompt groups)")
    check_offload(cfg, cfg.plan.gpus)


def run(cfg: DictConfig) -> dict:
    validate(cfg)
    p = cfg.plan
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
        if step.gpus == 1:  # optim.offload both ways (one process only)
            for offload in (False, True):
                other = replace(step, offload=offload)
                micro, chunk = largest_fitting(other, "micro_batch", step.rows, capacity), largest_fitting(other, "rollout_rows", step.rows, capacity)
                fitted = replace(other, micro_batch=min(micro or 1, step.micro_batch), rollout_rows=min(chunk or 1, step.rollout_rows))
                fits[f"{size:g}"][f"offload_{'on' if offload else 'off'}"] = {
                    "fits": plan(other).peak_bytes <= capacity, "largest_sampling_batch_size": chunk,
                    # with the micro-batch and rollout chunk cut to what fits (None: not even that)
                    "fits_with": {"grpo.micro_batch_size": fitted.micro_batch, "sampling.batch_size": fitted.rollout_rows}
                    if micro and chunk and plan(fitted).peak_bytes <= capacity else None}
    out = {"run": {k: v for k, v in vars(step).items() if k != "arch"}, "arch": vars(step.arch), "params": step.arch.params,
           "static": result.static, "rollout": result.rollout, "learner": result.learner,
           "peaks": {"static": result.static_bytes, "rollout": result.rollout_bytes, "learner": result.learner_bytes,
                     "step": result.peak_bytes, "offloaded": result.offloaded}, "devices": fits, "usable": p.usable}
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
    if result.offloaded:
        table.add_row("[bold]peak[/bold]", "on the host during the rollout (optim.offload)", _gib(result.offloaded))
    table.add_row("[bold]peak[/bold]", "rollout (static" + (" - offloaded" if result.offloaded else "") + " + rollout)",
                  _gib(result.rollout_bytes))
    table.add_row("[bold]peak[/bold]", "learner (static + held + learner)", _gib(result.learner_bytes))
    console.print(table)
    devices = Table(title=f"fits (usable fraction {cfg.plan.usable:g})")
    both = step.gpus == 1
    columns = ["device GiB", "fits", "largest grpo.micro_batch_size", "largest sampling.batch_size"]
    if both:
        columns += ["fits, optim.offload=false", "fits, optim.offload=true", "largest sampling.batch_size, offload"]
    for column in columns:
        devices.add_column(column, justify="right")

    def yes(ok: bool) -> str:
        return "yes" if ok else "[red]no[/red]"

    for size, f in fits.items():
        row = [size, yes(f["fits"]), str(f["largest_micro_batch_size"] or "none"), str(f["largest_sampling_batch_size"] or "none")]
        if both:
            row += [yes(f["offload_off"]["fits"]), yes(f["offload_on"]["fits"]), str(f["offload_on"]["largest_sampling_batch_size"] or "none")]
        devices.add_row(*row)
    console.print(devices)
    for size, f in fits.items():
        if both and not f["offload_off"]["fits"] and f["offload_on"]["fits_with"]:
            with_, without = (" ".join(f"{k}={v}" for k, v in (f[key]["fits_with"] or {}).items()) for key in ("offload_on", "offload_off"))
            console.print(f"{size} GiB: fits with optim.offload=true {with_} (without offload: "
                          + (f"{without})" if without else "at no batch size)"))
    if both:
        moved = plan(replace(step, offload=True)).offloaded
        console.print(f"optim.offload moves {_gib(moved)} GiB to host memory before each rollout and back after it "
                      f"({2 * moved / 1e9:,.0f} GB over PCIe per step)")
    if math.isfinite(result.peak_bytes):
        console.print(f"step peak: {_gib(result.peak_bytes)} GiB")
