"""`smd rollout`: sample with an evicting KV cache and check that the learner can replay it.

Samples `num_prompts` x `num_generations` responses with the chosen eviction policy, scores them with the
task's reward, then scores the same tokens three ways (DESIGN.md section 3; under top-k / top-p over the kept
token sets the rollout recorded): the shadow replay and the physical-eviction learner (both must equal
the sampler's log-probs) and the dense learner (the mismatch that naive sparse RL trains on), and reports the
per-token agreement of the sampler's distribution with the dense one (`agreement/p5`, `p50`, `mean`:
`smd_cli.learner.agreement`). Writes
`rollouts.jsonl` (token ids, log-probs, rewards, text), `shadow_masks.safetensors` (evict_at, the sampling
support's kept token sets and the batch tensors) and `summary.json`.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from safetensors.torch import save_file

from smd_cli.attention.shadow import none_evicted
from smd_cli.config.factories import build_policy, build_task
from smd_cli.config.prompts import encode_prompt, load_examples
from smd_cli.config.rules import check_config
from smd_cli.evaluation.batch import evidence_kept
from smd_cli.learner import agreement
from smd_cli.learner.forward import response_hidden, vocab_terms
from smd_cli.learner.losses import mismatch_stats
from smd_cli.learner.physical import physical_response_logits
from smd_cli.rollout.sampler import RolloutBatch, generate, response_texts
from smd_cli.rollout.sampling import token_logprobs
from smd_cli.runs.console import console, print_metrics
from smd_cli.runs.model_loading import load_model, record_weights
from smd_cli.runs.run_dirs import start_run
from smd_cli.runtime.integrity import write_file
from smd_cli.runtime.records import write_json, write_jsonl


def validate(cfg: DictConfig) -> None:
    check_config(cfg, "rollout")


@torch.no_grad()
def parity_report(model, batch: RolloutBatch, temperature: float, physical: bool = True, backend: str = "auto") -> dict[str, float]:
    """Learner log-probs vs the sampler's, over the generated tokens: shadow, physical and dense (each over the
    sampling support the rollout recorded, under top-k / top-p: the sampler's kept token sets)."""
    tokens, mask = batch.input_ids[:, batch.prompt_length:], batch.response_mask
    args = (model, batch.input_ids, batch.attention_mask, batch.prompt_length)

    def logp(evict_at=None, quant=None):
        hidden = response_hidden(*args, evict_at, backend, quant)
        return vocab_terms(model.get_output_embeddings(), hidden, tokens, mask, temperature, support=batch.sampling_support)["logp"][mask]

    sampler = batch.logprobs[mask]
    dense = logp()
    shadow = dense if batch.evict_at is None else logp(batch.evict_at, batch.cache_reads())
    report = {
        "parity/max_abs_diff_shadow": float((shadow - sampler).abs().max()),
        "parity/mean_abs_diff_shadow": float((shadow - sampler).abs().mean()),
        **mismatch_stats("mismatch/dense_", dense, sampler, torch.ones_like(dense, dtype=torch.bool)),
    }
    if batch.kv_quant != "none":  # the dense mismatch's two parts: the quantisation's alone (the replay on full-precision
        alone = none_evicted(batch.evict_at, batch.attention_mask)  # K/V), the eviction's alone (no eviction, quantised K/V)
        for name, part in (("quant_only", logp(batch.evict_at)), ("evict_only", logp(alone, batch.cache_reads()))):
            report.update(mismatch_stats(f"mismatch/{name}_", part, sampler, torch.ones_like(part, dtype=torch.bool)))
    if physical and batch.evict_at is not None:
        physical = physical_response_logits(*args, batch.evict_at, batch.cache_reads())
        physical_logp = token_logprobs(physical, tokens, temperature, batch.sampling_support)[mask]
        report["parity/max_abs_diff_physical"] = float((physical_logp - sampler).abs().max())
    elif physical:
        report["parity/max_abs_diff_physical"] = report["parity/max_abs_diff_shadow"]
    return report


def save_rollouts(run_dir, batch: RolloutBatch, examples, rewards, texts, num_generations: int) -> None:
    rows = []
    for i, (example, reward, text) in enumerate(zip(examples, rewards, texts)):
        mask = batch.response_mask[i]
        prompt = batch.input_ids[i, : batch.prompt_length][batch.attention_mask[i, : batch.prompt_length].bool()]
        rows.append({
            "row": i, "group": i // num_generations, "example_id": example.get("id"), "prompt_ids": prompt.tolist(),
            "response_ids": batch.input_ids[i, batch.prompt_length:][mask].tolist(),
            "logprobs": batch.logprobs[i][mask].tolist(), "reward": reward, "response": text,
        })
    write_jsonl(run_dir / "rollouts.jsonl", rows)
    tensors = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
               "response_mask": batch.response_mask, "logprobs": batch.logprobs}
    if batch.evict_at is not None:
        tensors["evict_at"] = batch.evict_at  # [N, L, Hkv, T] int32, DESIGN.md section 2
    if batch.sampling_support is not None:  # the top-k / top-p kept token sets (smd_cli/rollout/sampling.py `Support`):
        tensors.update(batch.sampling_support.tensors())  # ids [M] int32, start [N, R] int64, count [N, R] int32
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    write_file(run_dir / "shadow_masks.safetensors", lambda tmp: save_file(tensors, str(tmp), metadata={"prompt_length": str(batch.prompt_length)}),
               "the shadow masks")


def run(cfg: DictConfig) -> dict:
    validate(cfg)
    run_ = start_run(cfg)
    task = build_task(cfg)
    policy = build_policy(cfg)
    model, tokenizer = load_model(cfg, task, run_.device, progress=cfg.progress)
    G = cfg.num_generations
    examples = [e for e in load_examples(task, cfg.split, cfg.num_prompts) for _ in range(G)]
    prompts = [encode_prompt(task, e, tokenizer) for e in examples]
    console.print(f"rollout: {len(prompts)} rows ({cfg.num_prompts} prompts x {G}), eviction={policy!r}")
    batch = generate(model, prompts, policy=policy, max_new_tokens=cfg.sampling.max_new_tokens,
                     temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k,
                     generator=torch.Generator(device=run_.device).manual_seed(cfg.seed),
                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, progress=cfg.progress,
                     compile=cfg.sampling.get("compile", "auto"), kv_quant=cfg.kv.quant)
    texts = response_texts(batch, tokenizer)
    rewards = [float(task.reward(t, e)) for t, e in zip(texts, examples)]
    summary = {**parity_report(model, batch, cfg.sampling.temperature, cfg.physical, cfg.model.replay), **batch.stats}
    summary.update(evidence_kept(task, batch, examples, prompts))  # the answer-bearing KV kept, per layer (tasks that name it)
    found = agreement.measure(model, batch, cfg.sampling.temperature, backend=cfg.model.replay)  # sampler vs dense, per token
    summary.update({} if found is None else agreement.summary(found))
    summary.update({"reward/mean": sum(rewards) / len(rewards), "rollout/rows": len(prompts),
                    "rollout/prompt_length": batch.prompt_length, "kv/bytes_ratio": batch.stats["kv/bytes_peak"] / batch.stats["kv/bytes_peak_dense"]})
    record_weights(run_.dir, model, summary)
    save_rollouts(run_.dir, batch, examples, rewards, texts, G)
    write_json(run_.dir / "summary.json", summary)
    print_summary(summary, run_.dir)
    return summary


def print_summary(summary: dict, run_dir) -> None:
    print_metrics(f"smd rollout: {run_dir}", summary, (
        "parity/max_abs_diff_shadow", "parity/max_abs_diff_physical", "mismatch/dense_mean_abs_diff", "mismatch/dense_kl_k3",
        "mismatch/quant_only_max_abs_diff", "mismatch/evict_only_max_abs_diff",
        "kv/bytes_peak", "kv/bytes_peak_dense", "kv/bytes_ratio", "kv/kept_fraction", "evidence/kept",
        "agreement/p5", "agreement/p50", "agreement/mean", "reward/mean"))
    if "evidence/kept_l0" in summary:
        layers = sorted((int(k.rsplit("_l", 1)[1]), v) for k, v in summary.items() if k.startswith("evidence/kept_l"))
        console.print("answer-bearing KV kept per layer: " + " ".join(f"{v:.2f}" for _, v in layers), soft_wrap=True)
    console.print(f"weights: {summary.get('model/weights', 'unknown')}", soft_wrap=True)
