"""Evaluate a model on a task: batched generation (greedy or sampled, dense or evicting), scored by the
task's own metrics (the same functions that are its reward).

`evaluate` is the library half of the `eval` stage: it takes plain objects (model, tokenizer, task,
examples, an optional eviction policy) and returns per-example rows plus a summary with each metric's
mean and standard error, the KV-cache and process peak memory, throughput and, under eviction on a task that
names its answer-bearing prompt positions (the synthetic ones), how much of that evidence survived
(`evidence/kept_l{l}`). Prompts are sorted by length before batching (less left padding), and rows come
back in the examples' order. Sampling draws one noise row per example up front (`sampling_noise`), so an
example's completion does not depend on the batch it is decoded in. Under torchrun each rank decodes every
N-th example of that order and the rows are gathered: the summary is the whole split's, on every rank.
"""

from __future__ import annotations

import resource
import time
from typing import Any

import torch

from smd_cli.attention.shadow import kept_through
from smd_cli.rollout.sampler import RolloutBatch, ended_with_eos, generate, response_texts, sampling_noise
from smd_cli.runtime import distributed
from smd_cli.tasks.base import Example, Task


def peak_memory_bytes(device: torch.device) -> dict[str, float]:
    """Peak accelerator memory allocated by torch (CUDA), or the process's peak resident set (CPU)."""
    if device.type == "cuda":
        return {"memory/peak_allocated_bytes": float(torch.cuda.max_memory_allocated(device))}
    return {"memory/peak_rss_bytes": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}


def _progress(enabled: bool, total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("eval"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), disable=not enabled)
    return progress, progress.add_task("examples", total=total)


def evidence_columns(task: Task, batch: RolloutBatch, examples: list[Example], prompts: list[list[int]]) -> list[list[int]] | None:
    """Each row's answer-bearing prompt columns in `batch` (left-padded to its prompt width), from the task's
    `evidence_positions`; None for a task that names none (the paper's datasets)."""
    locate = getattr(task, "evidence_positions", None)
    if locate is None:
        return None
    P = batch.prompt_length
    return [[P - len(p) + q for q in locate(e, p)] for e, p in zip(examples, prompts, strict=True)]


def evidence_kept(task: Task, batch: RolloutBatch, examples: list[Example], prompts: list[list[int]]) -> dict[str, float]:
    """How much of the answer-bearing KV survived the rollout's eviction: `evidence/kept_l{l}` per layer (over
    rows, evidence keys and KV heads) and `evidence/kept` (their mean). Empty for a dense rollout or a task
    without evidence positions."""
    columns = evidence_columns(task, batch, examples, prompts) if batch.evict_at is not None else None
    if columns is None or not any(columns):
        return {}
    per_layer = kept_through(batch.evict_at, columns)
    return {"evidence/kept": float(per_layer.mean()), **{f"evidence/kept_l{layer}": float(v) for layer, v in enumerate(per_layer)}}


def _scores(task: Task, completion: str, example: Example) -> dict[str, float]:
    """Every metric of a paper task (`HubTask.score`), or the reward of a task that only has one."""
    score = getattr(task, "score", None)
    return score(completion, example) if score is not None else {"reward": task.reward(completion, example)}


def evaluate(
    model,
    tokenizer,
    task: Task,
    examples: list[Example],
    *,
    max_new_tokens: int,
    batch_size: int = 8,
    policy=None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    progress: bool = True,
    kv_quant: str = "none",
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Per-example rows (id, completion, reference, metrics, lengths) and the summary of the whole split; `kv_quant`:
    the cache's 8-bit format (`smd_cli.attention.kv_quant`, decode steps read through it)."""
    if not examples:
        raise ValueError(f"no examples to evaluate for task {task.name}")
    if batch_size < 1:
        raise ValueError(f"eval.batch_size must be >= 1, got {batch_size}")
    device = next(model.parameters()).device
    noise = sampling_noise(len(examples), max_new_tokens, torch.Generator().manual_seed(seed)) if temperature > 0 else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    prompts = [task.encode_prompt(e, tokenizer) for e in examples]
    order = sorted(range(len(examples)), key=lambda i: len(prompts[i]))[distributed.rank() :: distributed.size()]
    rows: list[dict[str, Any] | None] = [None] * len(examples)
    kv_peak, kv_peak_dense, response_tokens = 0.0, 0.0, 0
    kept: dict[str, float] = {}  # evidence/* summed over rows (each batch's means weighted by its rows)
    started = time.perf_counter()
    bar, bar_task = _progress(progress, len(order))
    with bar:
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            batch = generate(
                model, [prompts[i] for i in chunk], policy=policy, max_new_tokens=max_new_tokens,
                temperature=temperature, top_p=top_p, top_k=top_k, noise=None if noise is None else noise[chunk],
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, measure_dense_kv=False,
                kv_quant=kv_quant,
            )
            kv_peak = max(kv_peak, batch.stats["kv/bytes_peak"])
            for key, value in evidence_kept(task, batch, [examples[i] for i in chunk], [prompts[i] for i in chunk]).items():
                kept[key] = kept.get(key, 0.0) + value * len(chunk)
            kv_peak_dense = max(kv_peak_dense, batch.stats.get("kv/bytes_peak_dense", float("nan")))
            texts, finished = response_texts(batch, tokenizer), ended_with_eos(batch, tokenizer.eos_token_id).tolist()
            lengths = batch.response_mask.sum(1).tolist()
            for i, text, length, done in zip(chunk, texts, lengths, finished):
                example = examples[i]
                rows[i] = {
                    "id": example["id"], "completion": text, "reference": example["reference"],
                    **_scores(task, text, example),
                    "prompt_tokens": len(prompts[i]), "response_tokens": length, "finished": done,
                }
                response_tokens += length
            bar.advance(bar_task, len(chunk))
    if distributed.size() > 1:  # every rank's rows and sums: the summary of the whole split
        for theirs in distributed.gather_objects({i: rows[i] for i in order}):
            for i, row in theirs.items():
                rows[i] = row
        kv_peak, kv_peak_dense = distributed.largest(kv_peak), distributed.largest(kv_peak_dense)
        response_tokens = int(distributed.total(response_tokens))
        kept = {key: distributed.total(value) for key, value in sorted(kept.items())}
    seconds = distributed.largest(time.perf_counter() - started)
    summary = task.metrics([r["completion"] for r in rows], examples)
    summary.update({
        "n": float(len(examples)),
        "kv/bytes_peak": kv_peak,
        "response_tokens_mean": response_tokens / len(examples),
        "finished_fraction": sum(r["finished"] for r in rows) / len(examples),
        "seconds": seconds,
        "tokens_per_second": response_tokens / max(seconds, 1e-9),
        **{key: distributed.largest(value) for key, value in peak_memory_bytes(device).items()},
        **{key: total / len(examples) for key, total in kept.items()},
    })
    if policy is None and kv_quant == "none":  # a dense cache's bytes (an 8-bit one's are kv/bytes_peak; no dense one ran)
        summary["kv/bytes_peak_dense"] = kv_peak_dense
    return rows, summary
