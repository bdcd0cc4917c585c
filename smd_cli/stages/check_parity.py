"""`smd check-parity`: the lr = 0 protocol of a sampler/learner pair, per eviction policy (`smd_cli.checks.parity`).

For each policy (the composed `eviction`, every option of conf/eviction/, or a list), samples `num_prompts` x
`num_generations` responses with it, then scores them with the learner at the sampler's own weights in each view:
`learner_step` at learning rate 0 with the shadow replay and with the dense view, the physical-eviction learner,
and the shadow replay in float64. Writes `parity.json` (the bound, and per policy every view's largest and mean
|log p_view - log p_sampler| and k3 KL, whether it passed and why not, and the per-token agreement of the sampler's
distribution with the dense policy's: p5, p50, mean, min, `smd_cli.learner.agreement`) and `summary.json`, prints a table, and
exits 1 (`ParityFailed`) when a view that must equal the sampler misses it by more than `parity.bound`.
"""

from __future__ import annotations

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich.table import Table

from smd_cli.checks.contracts import contract_bound, unbounded
from smd_cli.checks.parity import JUDGED, Settings, check
from smd_cli.config.factories import build_policy, build_task
from smd_cli.config.prompts import encode_prompt, load_examples
from smd_cli.config.rules import check_config
from smd_cli.config.validation import ROOT, ConfigError, to_dict
from smd_cli.learner import agreement
from smd_cli.rollout.sampler import generate
from smd_cli.runs.console import console
from smd_cli.runs.model_loading import compute_dtype, load_model
from smd_cli.runs.run_dirs import start_run
from smd_cli.runtime.failures import ParityFailed
from smd_cli.runtime.records import write_json

VIEWS = ("shadow", "physical", "shadow_float64", "dense", "quant_only", "evict_only", "own_rounding")  # the columns; the last three
# under an 8-bit kv.quant (`parity.mismatch_parts`): the dense mismatch's parts, the replay without the rollout's rounding record


def validate(cfg: DictConfig) -> None:
    """Every key's own rule (`smd_cli.config.rules`); a policy name is checked when it is built (`policies`)."""
    check_config(cfg, "check_parity")


def policies(cfg: DictConfig) -> list[tuple[str, object]]:
    """(name, policy) to check: the composed `eviction`, every conf/eviction/ option, or the listed ones."""
    if cfg.policies is None:
        choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
        return [(choices.get("eviction") or str(cfg.eviction._target_).rsplit(".", 1)[-1], build_policy(cfg))]
    names = sorted(p.stem for p in (ROOT / "conf" / "eviction").glob("*.yaml")) if cfg.policies == "all" else list(cfg.policies)
    return [(name, build_policy(cfg, name)) for name in names]


def parity_bound(cfg: DictConfig, device: torch.device) -> float:
    """`parity.bound`, or the contract bound of the model's compute dtype on `device`."""
    if cfg.parity.bound is not None:
        return float(cfg.parity.bound)
    dtype = compute_dtype(cfg, device)
    bound = contract_bound(dtype, cfg.model.get("attention_dtype"))
    if bound is None:
        raise ConfigError(f"parity.bound=null: {unbounded(dtype)}; set parity.bound=... to judge its parity")
    return bound


def run(cfg: DictConfig) -> dict:
    validate(cfg)
    run_ = start_run(cfg)
    task = build_task(cfg)
    chosen = policies(cfg)  # a wrong option is named before the model is built
    bound = parity_bound(cfg, run_.device)  # before the model is loaded: a dtype with no bound is named at once
    model, tokenizer = load_model(cfg, task, run_.device, progress=cfg.progress)
    G, s, p = cfg.num_generations, cfg.sampling, cfg.parity
    examples = [e for e in load_examples(task, cfg.split, cfg.num_prompts) for _ in range(G)]
    prompts = [encode_prompt(task, e, tokenizer) for e in examples]
    settings = Settings(temperature=float(s.temperature), micro_batch_size=p.micro_batch_size, logits_chunk=p.logits_chunk,
                        replay_backend=cfg.model.replay, physical=p.physical, float64=p.float64)
    results = {}
    for name, policy in chosen:
        batch = generate(model, prompts, policy=policy, max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                         top_k=s.top_k, generator=torch.Generator(device=run_.device).manual_seed(cfg.seed),
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, progress=cfg.progress,
                         measure_dense_kv=False, compile=s.get("compile", "auto"), kv_quant=cfg.kv.quant)
        found = check(model, batch, settings, bound)
        values = agreement.measure(model, batch, float(s.temperature), p.logits_chunk, p.micro_batch_size, cfg.model.replay)
        found["agreement"] = {} if values is None else agreement.summary(values, prefix="")  # sampler vs dense, per token
        results[name] = {"target": f"{type(policy).__module__}.{type(policy).__name__}", "rows": len(prompts),
                         "tokens": int(batch.response_mask.sum()), "kv/kept_fraction": batch.stats["kv/kept_fraction"],
                         "sampling_support": batch.sampling_support is not None, **found}
    report = {"bound": bound, "passed": all(r["passed"] for r in results.values()), "judged": list(JUDGED),
              "model": cfg.model.name, "task": task.name, "compression": float(cfg.compression), "seed": cfg.seed, "kv_quant": cfg.kv.quant,
              "sampling": to_dict(s), "policies": results}
    write_json(run_.dir / "parity.json", report)
    summary = {"parity/passed": float(report["passed"]), **{f"parity/{n}/{v}_max_abs_diff": r["views"][v]["max_abs_diff"]
                                                           for n, r in results.items() for v in VIEWS if v in r["views"]},
               **{f"agreement/{n}/{k}": v for n, r in results.items() for k, v in r["agreement"].items()}}
    write_json(run_.dir / "summary.json", summary)
    print_table(report, run_.dir)
    if not report["passed"]:
        failed = "; ".join(f"{n}: {r['verdict']}" for n, r in results.items() if not r["passed"])
        raise ParityFailed(f"{failed} ({run_.dir / 'parity.json'})")
    return report


def print_table(report: dict, run_dir) -> None:
    table = Table(title=f"smd check-parity: max |log p_view - log p_sampler|, bound {report['bound']:g} (dense: reported, "
                        f"not judged): {run_dir}")
    for column in ("policy", *VIEWS, "passed"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for name, r in report["policies"].items():
        views = r["views"]
        table.add_row(name, *(f"{views[v]['max_abs_diff']:.2e}" if v in views else "-" for v in VIEWS), "yes" if r["passed"] else "NO")
    console.print(table)
    agreed = Table(title=f"the sampler's per-token agreement with the dense policy, sum_v min(p, q), at c = {report['compression']:g} "
                         "(smd_cli/learner/agreement.py)")
    for column in ("policy", "p5", "p50", "mean", "min"):
        agreed.add_column(column, justify="left" if column == "policy" else "right")
    for name, r in report["policies"].items():
        agreed.add_row(name, *(f"{r['agreement'][k]:.4f}" if k in r.get("agreement", {}) else "-" for k in ("p5", "p50", "mean", "min")))
    console.print(agreed)
