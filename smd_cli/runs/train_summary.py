"""What `smd train` sums up at its end: statistics over the logged steps, and the summary tables it prints."""

from __future__ import annotations

from omegaconf import DictConfig
from rich.table import Table

from smd_cli.runs.console import console
from smd_cli.runtime.records import read_jsonl


def run_statistics(path) -> dict[str, float]:
    """Over all logged steps (`metrics.jsonl`, resumed runs included): the largest sampler/learner mismatch of
    the learner's own view and of a dense learner, the mean KV and answer-bearing KV kept, the mean fractions
    of tokens and sequences a rollout correction masked (MIS, IcePop, TRM), and the means of the agreement's 5th
    percentile and mean (`smd_cli.learner.agreement`) and of the rollouts' compression; and how many steps the log holds
    (`train/steps_logged`: fewer than `steps_run` when a run was continued from a checkpoint without its log)."""
    rows = read_jsonl(path) if path.is_file() else []
    out = {"train/steps_logged": len(rows)}
    for key, reduce in (("mismatch/max_abs_diff", max), ("mismatch/dense_max_abs_diff", max), ("kv/kept_fraction", None),
                        ("evidence/kept", None), ("rollout_corr/masked_token_frac", None), ("rollout_corr/masked_seq_frac", None),
                        ("agreement/p5", None), ("agreement/mean", None), ("compression", None)):
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if values:
            out[f"train/{key}" + ("_max" if reduce else "_mean")] = reduce(values) if reduce else sum(values) / len(values)
    return out


def print_summary(summary: dict, run_dir, cfg: DictConfig, policy) -> None:
    """What a newcomer needs side by side: held-out reward before and after (dense cache and under `policy`, the
    evicting evaluation's), then the learner's parity with its sampler, a dense learner's mismatch on the same
    rollouts, the KV kept."""
    evicting = "no eviction" if policy is None else f"{type(policy).__name__} c={_compression(summary, cfg)}"
    table = Table(title=f"smd train algo={cfg.algo.name}: {run_dir}")
    for name, justify in (("held-out (test split)", "left"), ("before", "right"), ("after", "right")):
        table.add_column(name, justify=justify)
    for label, key in ((f"reward, dense cache (T={cfg.eval.temperature:g})", "eval/reward"), ("greedy reward, dense cache", "eval/greedy_reward"),
                       (f"reward, {evicting} (T={cfg.eval.temperature:g})", "eval/evict/reward"),
                       (f"greedy reward, {evicting}", "eval/evict/greedy_reward"),
                       (f"exact match, dense cache (T={cfg.eval.temperature:g})", "eval/exact"),
                       (f"exact match, {evicting} (T={cfg.eval.temperature:g})", "eval/evict/exact"),
                       (f"answer-bearing KV kept, {evicting}", "eval/evict/kept")):
        if f"{key}_before" in summary or f"{key}_after" in summary:
            table.add_row(label, *(_number(summary.get(f"{key}_{when}")) for when in ("before", "after")))
    console.print(table)
    rows = ((parity_label(summary, cfg), "train/mismatch/max_abs_diff_max"),
            ("parity: the bound it is held to (never raised)", "parity/bound"),
            ("parity: steps above it, each replayed in float64: rounding", "parity/rounding_misses"),
            ("a dense learner on the same rollouts: max |log p - log p_sampler|", "train/mismatch/dense_max_abs_diff_max"),
            ("KV entries the sampler kept (mean)", "train/kv/kept_fraction_mean"),
            ("answer-bearing KV the sampler kept (mean)", "train/evidence/kept_mean"),
            ("agreement with the dense policy, 5th percentile (mean)", "train/agreement/p5_mean"),
            ("agreement with the dense policy, mean (mean)", "train/agreement/mean_mean"),
            ("compression of the rollouts (mean)", "train/compression_mean"),
            ("the sampler's reward, last step", "last/reward"),
            ("peak memory, rollout / learner (MiB)", None), ("steps skipped (empty batch)", "train/skipped_steps"),
            ("GRPO seconds", "train/seconds"))
    quant = (cfg.get("kv") or {}).get("quant", "none")
    training = Table(title=f"training, {cfg.steps} steps (max and mean over the steps); sampler: "
                           f"{evicting if cfg.algo.evicting else 'no eviction'}" + (f", KV cache {quant}" if quant != "none" else ""))
    training.add_column("metric")
    training.add_column("value", justify="right")
    for label, key in rows:
        if key is None:
            peaks = [summary.get(f"last/memory/{phase}_peak_bytes") for phase in ("rollout", "learner")]
            if all(isinstance(p, (int, float)) for p in peaks):
                training.add_row(label, " / ".join(f"{p / 2**20:.0f}" for p in peaks))
        elif isinstance(summary.get(key), (int, float)):
            training.add_row(label, _number(summary[key]))
    status = summary.get("status", "completed")
    if status == "collapsed":
        status = f"collapsed at step {summary.get('collapse_since_step')}" + (" (stopped)" if summary.get("stopped") else "")
    training.add_row("status", status, style="bold red" if status != "completed" else None)
    console.print(training)
    if summary.get("status_reason"):
        console.print(f"{summary.get('status', 'completed')}: {summary['status_reason']}", style="red" if summary.get("status", "completed") != "completed" else None,
                      markup=False, highlight=False, soft_wrap=True)


def parity_label(summary: dict, cfg: DictConfig) -> str:
    """The training table's first row: "parity" only where the run judged it (`parity/judged`, `train_parity`); else what
    the number is and why it is not judged (a dense learner of evicted or 8-bit rollouts: that mismatch is reported)."""
    if summary.get("parity/judged"):
        return "parity: max |log p_learner - log p_sampler|"
    quant = (cfg.get("kv") or {}).get("quant", "none")
    if cfg.algo.view != "shadow" and cfg.algo.evicting:
        why = "its dense learner does not see what the sampler evicted"
    elif cfg.algo.view != "shadow" and quant != "none":
        why = f"the sampler's KV cache is {quant}, the dense learner reads full precision"
    else:
        why = "no bound for this compute dtype (guard.parity_bound sets one)"
    return f"learner vs sampler, not judged ({why}): max |log p_learner - log p_sampler|"


def _compression(summary: dict, cfg: DictConfig) -> str:
    """The compression the evicting evaluation ran at: the run's, or an adaptive run's before and after."""
    if cfg.compression != "adaptive":
        return f"{cfg.compression:g}"
    before, after = (summary.get(f"eval/evict/compression_{when}") for when in ("before", "after"))
    return "adaptive" + (f" ({before:g} before, {after:g} after)" if isinstance(before, float) and isinstance(after, float) else "")


def _number(value) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value:.4g}"
