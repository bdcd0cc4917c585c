"""Run `smd rollout` once per eviction policy on the tiny scale and print one markdown table.

Usage: python bench/rollout_policies.py [extra overrides, e.g. compression=0.7 num_prompts=16]
Each row is a real rollout of the warm-started tiny model (needle task, 256-token prompts): parity of the
shadow replay and of the physical learner against the sampler, the dense learner's mismatch, and KV bytes
measured from the allocated cache tensors next to the kept fraction counted from the cache's entries.
"""

import sys
import tempfile

from hydra import compose, initialize_config_dir

from smd_cli.cli import CONF_DIR
from smd_cli.stages import rollout

POLICIES = ["none", "snapkv", "recent", "random", "knorm", "h2o"]
COLUMNS = ["parity/max_abs_diff_shadow", "parity/max_abs_diff_physical", "mismatch/dense_mean_abs_diff", "mismatch/dense_max_abs_diff",
           "mismatch/dense_kl_k3", "kv/bytes_peak", "kv/bytes_peak_dense", "kv/bytes_ratio", "kv/kept_fraction", "reward/mean"]


def main(extra: list[str]) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for policy in POLICIES:
            cfg = compose(config_name="rollout", overrides=[f"eviction={policy}", "progress=false", *extra, f"+run_dir={tmp}/{policy}"])
            rows.append((policy, rollout.run(cfg)))
    print("| eviction | " + " | ".join(COLUMNS) + " |")
    print("|---|" + "---:|" * len(COLUMNS))
    for policy, s in rows:
        print(f"| {policy} | " + " | ".join(f"{s.get(c, float('nan')):.3g}" for c in COLUMNS) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
