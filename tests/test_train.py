"""The train stage: one GRPO step changes the weights, config errors name the key, a short run writes
its provenance, metrics and summary."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from smd_cli.cli import CONF_DIR, register_recipes
from smd_cli.config.validation import ConfigError
from smd_cli.learner.losses import group_advantages
from smd_cli.learner.step import Algorithm, learner_step
from smd_cli.rollout.sampler import generate
from smd_cli.stages import train
from smd_cli.tasks.synthetic import NeedleRetrieval

REPO = Path(__file__).resolve().parents[1]  # the repository whose code runs (smd_cli is imported from it)
TINY_RUN = ["steps=2", "grpo.prompts_per_step=2", "grpo.num_generations=4", "eval.num_prompts=8",
            "task.prompt_tokens=48", "model.warmstart.steps=5", "progress=false"]


def git_commit_of_work_tree() -> str:
    """`git rev-parse HEAD` of this repository, plus `+dirty` exactly when a tracked file has changes."""
    def git(*args):
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()

    sha = git("rev-parse", "HEAD")
    assert len(sha) == 40 and all(c in "0123456789abcdef" for c in sha), sha
    return sha + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def compose_train(tmp_path, *overrides):
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=[*overrides, f"+run_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("grpo.num_generations=1", "grpo.num_generations=1 is not allowed: an integer >= 2"),
        ("optim.lr=-0.001", "optim.lr=-0.001 is not allowed: a finite learning rate > 0"),
        ("grpo.loss_agg=sum", "grpo.loss_agg='sum' is not allowed: token_mean or seq_mean_token_mean"),
        ("compression=1.5", "compression=1.5 is not allowed: a fraction in [0, 1)"),
        ("sampling.temperature=0", "sampling.temperature=0 is not allowed: > 0"),
        ("algo=dense,eviction=snapkv", "algo=dense samples without eviction, but eviction=SnapKV was set"),
        ("task.prompt_tokens=4", "task: task.prompt_tokens=4: too short"),
        ("device=cuda", "device='cuda' but no CUDA device is available"),
    ],
)
def test_config_errors_name_key_value_and_range(tmp_path, override, message):
    if override == "device=cuda" and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    cfg = compose_train(tmp_path, *TINY_RUN, *override.split(","))
    with pytest.raises(ConfigError) as err:
        train.run(cfg)
    assert message in str(err.value)


def test_a_grpo_step_changes_the_parameters(tiny_model, tiny_tokenizer):
    task = NeedleRetrieval(prompt_tokens=32)
    prompts = [task.encode_prompt(task.example("train", i), tiny_tokenizer) for i in range(2) for _ in range(4)]
    batch = generate(tiny_model, prompts, max_new_tokens=4, generator=torch.Generator().manual_seed(0),
                     eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id)
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]), 4)
    before = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    optimizer = torch.optim.AdamW(tiny_model.parameters(), lr=1e-3)
    metrics = learner_step(tiny_model, optimizer, batch, advantages, Algorithm("dense"))
    changed = [n for n, p in tiny_model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)  # every tensor moved (embeddings are tied to the head)
    assert metrics["mismatch/max_abs_diff"] <= 1e-5  # dense sampler vs dense learner
    assert metrics["grad_norm"] > 0 and 0 <= metrics["clip_ratio/region_mean"] <= 1


@pytest.mark.slow
def test_short_default_run_writes_everything(tmp_path, capsys):
    """`smd train` as it is (SMD, SnapKV at c = 0.5, the vote task), shortened: metrics per step, held-out both ways."""
    cfg = compose_train(tmp_path, *TINY_RUN)
    assert (cfg.algo.name, cfg.eviction._target_.rsplit(".", 1)[1], cfg.compression) == ("smd", "SnapKV", 0.5)
    tree_before = git_commit_of_work_tree()
    summary = train.run(cfg)
    run = tmp_path / "run"
    assert {"config.json", "provenance.json", "metrics.jsonl", "summary.json"} <= {p.name for p in run.iterdir()}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward", "reward_std", "loss", "entropy", "grad_norm", "mismatch/max_abs_diff", "time/rollout_s", "kv/bytes_peak",
                "evidence/kept", "evidence/kept_l0", "evidence/kept_l1"):
        assert key in rows[0], key
    assert all(0 <= r["evidence/kept_l0"] <= 1 and r["evidence/kept"] == pytest.approx((r["evidence/kept_l0"] + r["evidence/kept_l1"]) / 2)
               for r in rows)
    saved = json.loads((run / "summary.json").read_text())
    assert saved["eval/reward_before"] == summary["eval/reward_before"]
    assert 0.0 <= saved["eval/reward_after"] <= 1.0
    for when in ("before", "after"):  # held-out both ways: a dense cache and the run's own eviction
        assert 0.0 <= saved[f"eval/evict/reward_{when}"] <= 1.0 and 0.0 <= saved[f"eval/evict/greedy_reward_{when}"] <= 1.0
        assert 0.0 < saved[f"eval/evict/kept_{when}"] < 1.0 and f"eval/evict/kept_l1_{when}" in saved
    assert saved["train/mismatch/max_abs_diff_max"] == max(r["mismatch/max_abs_diff"] for r in rows) <= 1e-5  # SMD's parity
    assert saved["train/kv/kept_fraction_mean"] == pytest.approx(sum(r["kv/kept_fraction"] for r in rows) / 2)
    printed = " ".join(capsys.readouterr().out.split())
    for label in ("reward, dense cache (T=1)", "reward, SnapKV c=0.5 (T=1)", "parity: max |log p_learner - log p_sampler|",
                  "KV entries the sampler kept"):
        assert label in printed, label
    provenance = json.loads((run / "provenance.json").read_text())
    assert provenance["versions"]["torch"] == torch.__version__
    # the commit that ran, computed here independently; the work tree may change while the run goes on (other
    # edits), so the state before and the state after the run are both accepted, and nothing else
    assert provenance["git_commit"] in {tree_before, git_commit_of_work_tree()}, (provenance["git_commit"], tree_before)
    assert json.loads((run / "config.json").read_text())["grpo"]["num_generations"] == 4
    # the warm start is cached: a second run reuses it
    assert any((tmp_path / "cache" / "warmstart").iterdir())


@pytest.mark.slow
def test_dense_run_is_evaluated_under_snapkv_too_unless_asked_not_to(tmp_path):
    dense = train.run(compose_train(tmp_path / "a", *TINY_RUN, "algo=dense"))
    assert 0.0 <= dense["eval/evict/reward_after"] <= 1.0 and "last/evidence/kept" not in dense  # its sampler never evicts
    off = train.run(compose_train(tmp_path / "b", *TINY_RUN, "algo=dense", "eval.evicting=false", "checkpoint.at_end=false"))
    assert not [k for k in off if k.startswith("eval/evict/")]
    assert off["eval/reward_after"] == dense["eval/reward_after"]  # the same training and dense evaluation
    # the resumable state at the end: written by default, not with checkpoint.at_end=false (final/ either way)
    ended = [p.name for p in (tmp_path / "a" / "run" / "checkpoints").iterdir()]
    assert ended == ["step_000002"] and (tmp_path / "a" / "run" / "final" / "config.json").is_file()
    assert not any((tmp_path / "b" / "run" / "checkpoints").glob("step_*")) and (tmp_path / "b" / "run" / "final" / "config.json").is_file()


def test_checkpoint_final_false_keeps_no_weights(tmp_path):
    """`checkpoint.final=false` (the small reproduction's recipes: SmolLM2's final/ is 517 MB a run): the run completes
    and is summarised, with no final/ and no checkpoint."""
    summary = train.run(compose_train(tmp_path, *TINY_RUN, "checkpoint.every=0", "checkpoint.at_end=false", "checkpoint.final=false"))
    assert summary["status"] == "completed" and (tmp_path / "run" / "summary.json").is_file()
    assert not (tmp_path / "run" / "final").exists() and not (tmp_path / "run" / "checkpoints").exists()
