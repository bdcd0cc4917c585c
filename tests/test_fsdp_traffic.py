"""FSDP2's traffic per learner step under `torchrun --nproc_per_node=2` (gloo): each decoder layer's weights are
gathered once for the forward and once for the backward, and its gradients reduced once, for naive_sparse and smd,
on GRPO batches (G samples per prompt, whose prompt the learner computes once, calling each layer several times)
and on distinct prompts. Before, every call of a layer gathered it (4 to 5 gathers per layer and step on GRPO
batches of 2 layers), and FSDP2's implicit backward prefetch, reading the order of the rollout's forwards,
re-gathered the last layer after its backward. The counting script is tests/fsdp_traffic.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def test_each_layer_is_gathered_once_per_forward_and_once_per_backward(tmp_path):
    out = tmp_path / "traffic.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", str(Path(__file__).with_name("fsdp_traffic.py")),
                           str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = json.loads(out.read_text())
    assert len(runs) == 6  # naive_sparse and smd x (GRPO batch with and without checkpointing, distinct prompts)
    for name, run in runs.items():
        layers = run["gathers_per_layer"]
        assert len(layers) == run["layers"] == 2, name
        assert set(layers.values()) == {2}, (name, layers)  # one forward, one backward
        assert run["other_gathers"] == {"root": 1}, name  # embeddings, final norm, LM head: once for the whole pass
        assert run["reduce_scatters"] == run["layers"] + 1, name  # each layer's gradients and the root's, once
