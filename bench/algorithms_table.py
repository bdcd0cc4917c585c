"""The five algorithms side by side, from runs made with the same seed and steps.

Usage: python bench/algorithms_table.py PREFIX   (reads PREFIX_{dense,naive_sparse,sparse_rl,tis,smd}/)
Make the runs first, e.g. (each 1-3 minutes on a CPU; the warm start is cached after the first):

    for a in smd naive_sparse sparse_rl tis; do
      smd train algo=$a eviction=snapkv compression=0.5 steps=40 progress=false hydra.run.dir=/tmp/algo_$a
    done
    smd train algo=dense steps=40 progress=false hydra.run.dir=/tmp/algo_dense

Prints two markdown tables: training reward per 10-step window with the held-out reward before/after, and
the sampler-vs-learner mismatch with the correction statistics.
"""

import json
import sys
from pathlib import Path

ALGOS = ["dense", "naive_sparse", "sparse_rl", "tis", "smd"]


def fmt(x, spec=".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def main(prefix: str) -> None:
    reward = ["| algo | reward 1-10 | 11-20 | 21-30 | 31-40 | eval before | eval after | greedy before | greedy after |",
              "|---|---|---|---|---|---|---|---|---|"]
    diag = ["| algo | mismatch/max_abs_diff (max over steps) | mismatch/dense_max_abs_diff (max) | mismatch/kl_k3 (mean) | "
            "is/rejected_token_frac (mean) | is/rejected_seq_frac (mean) | skipped steps | kv/kept_fraction | train seconds |",
            "|---|---|---|---|---|---|---|---|---|"]
    for algo in ALGOS:
        run = Path(f"{prefix}_{algo}")
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((run / "summary.json").read_text())
        windows = [sum(r["reward"] for r in rows[i : i + 10]) / len(rows[i : i + 10]) for i in range(0, len(rows), 10)]
        evals = ("eval/reward_before", "eval/reward_after", "eval/greedy_reward_before", "eval/greedy_reward_after")
        reward.append(f"| {algo} | " + " | ".join(fmt(w) for w in windows) + " | " + " | ".join(fmt(summary.get(k)) for k in evals) + " |")

        def col(key):
            return [r[key] for r in rows if r.get(key) is not None]

        def mean(key):
            return sum(col(key)) / len(col(key)) if col(key) else None

        diag.append(f"| {algo} | {fmt(max(col('mismatch/max_abs_diff')), '.2e')} | {fmt(max(col('mismatch/dense_max_abs_diff')), '.2e')} | "
                    f"{fmt(mean('mismatch/kl_k3'), '.2e')} | {fmt(mean('is/rejected_token_frac'), '.4f')} | "
                    f"{fmt(mean('is/rejected_seq_frac'), '.4f')} | {summary.get('train/skipped_steps')} | "
                    f"{fmt(mean('kv/kept_fraction'), '.3f')} | {fmt(summary.get('train/seconds'), '.0f')} |")
    print("\n".join(reward) + "\n\n" + "\n".join(diag))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/algo")
