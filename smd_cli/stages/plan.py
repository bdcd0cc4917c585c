"""`smd plan`: how much memory a `smd train` config needs, phase by phase, before anything runs.

Composes the train config (any override or recipe: `smd plan +recipe=govreport`), reads the model's
architecture from the config alone (offline), and prints `smd_cli.checks.planner`'s terms and peaks: static
(weights, master weights, gradients, optimizer state, reference policy), rollout (KV cache and shadow
masks, prefill activations, scores, logits) and learner (checkpointed activations, one layer's recompute,
vocabulary chunk, LM-head gradients). `plan.gpus=N` plans each of N GPUs under torchrun and FSDP2 (its share
of the rows, sharded states, what FSDP2 gathers). Then, for each of `plan.device_gb`, whether the step fits and the
largest `grpo.micro_batch_size` and `sampling.batch_size` that do, and (one GPU) whether it fits with and without
`optim.offload` (masters, gradients and optimizer state on the host during the rollout); and the rows a rollout can
decode at once (the largest `sampling.batch_size`) for each KV format of `kv.quant` with the run's eviction and without
any (`kv_formats`). Writes `plan.json`.

`smd train` plans its own step the same way before it allocates anything (`smd_cli.runs.memory_fit.check_fits`).
"""

from __future__ import annotations

import math
from dataclasses import replace

from omegaconf import DictConfig
from rich.table import Table

from smd_cli.checks.planner import Run, largest_fitting, plan
from smd_cli.config.rules import check_config
from smd_cli.config.validation import ConfigError, check, check_offload
from smd_cli.rollout import adaptive
from smd_cli.runs.console import console
from smd_cli.runs.memory_fit import GIB, describe, gib
from smd_cli.runs.run_dirs import start_run
from smd_cli.runtime.records import write_json


def validate(cfg: DictConfig) -> None:
    """Every key's own rule (the train keys it plans, and `plan.*`), then the GPU count against the batch."""
    check_config(cfg, "plan")
    if adaptive.problem(cfg):  # what `smd train` refuses, refused here too (min_compression above max_compression, ...)
        raise ConfigError(adaptive.problem(cfg))
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
                     "step": result.peak_bytes, "offloaded": result.offloaded}, "devices": fits, "usable": p.usable,
           "kv_formats": kv_formats(step, [size * GIB * p.usable for size in p.device_gb], [f"{size:g}" for size in p.device_gb])}
    write_json(run_.dir / "plan.json", out)
    print_plan(cfg, step, result, fits)
    print_kv_formats(step, out["kv_formats"])
    return out


ROWS_LIMIT = 1 << 16  # the largest rollout chunk searched for (rows decoded at once)


def kv_formats(step: Run, capacities: list[float], names: list[str]) -> dict:
    """For each kv.quant format, with the run's eviction and without any (every prompt entry kept): the KV cache bytes
    of one row and the most rows a rollout decodes at once within each capacity (`largest_fitting`, None: not one)."""
    out = {}
    for quant in ("none", "int8", "fp8_e4m3"):
        for evicting in (True, False):
            if not evicting and step.kept == step.prompt:
                continue  # the run evicts nothing: one row says it
            other = replace(step, kv_quant=quant) if evicting else replace(step, kv_quant=quant, kept=step.prompt, cache_growth=0,
                                                                             score_rows=0)
            one = plan(replace(other, rollout_rows=1)).rollout
            out[f"{quant}, {'kept ' + str(step.kept) if evicting else 'no eviction'}"] = {
                "kv_quant": quant, "kept": other.kept, "kv_bytes_per_row": one["kv cache"] + one["kv rounding record"],
                "rows": {name: largest_fitting(other, "rollout_rows", ROWS_LIMIT, capacity) for name, capacity in zip(names, capacities)}}
    return out


def print_kv_formats(step: Run, formats: dict) -> None:
    table = Table(title=f"rows a rollout decodes at once (largest sampling.batch_size), P {step.prompt} + R {step.response}, by KV format")
    names = list(next(iter(formats.values()))["rows"])
    for column in ("kv.quant, prompt entries", "KV GiB a row", *(f"rows at {name} GiB" for name in names)):
        table.add_column(column, justify="left" if column.startswith("kv.quant") else "right")
    for label, f in formats.items():
        table.add_row(label, gib(f["kv_bytes_per_row"]), *(str(f["rows"][name] or "none") for name in names))
    console.print(table)


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
                table.add_row(phase, name, gib(value))
    table.add_row("[bold]peak[/bold]", "static", gib(result.static_bytes))
    if result.offloaded:
        table.add_row("[bold]peak[/bold]", "on the host during the rollout (optim.offload)", gib(result.offloaded))
    table.add_row("[bold]peak[/bold]", "rollout (static" + (" - offloaded" if result.offloaded else "") + " + rollout)",
                  gib(result.rollout_bytes))
    table.add_row("[bold]peak[/bold]", "learner (static + held + learner)", gib(result.learner_bytes))
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
        console.print(f"optim.offload moves {gib(moved)} GiB to host memory before each rollout and back after it "
                      f"({2 * moved / 1e9:,.0f} GB over PCIe per step)")
    if math.isfinite(result.peak_bytes):
        console.print(f"step peak: {gib(result.peak_bytes)} GiB")
