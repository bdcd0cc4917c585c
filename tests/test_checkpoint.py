"""Checkpoints and guard rails: atomic saves that load safely, RNG round trips, `resume` continuing
bit for bit (also after a write killed half-way), a NaN stopping the run with the last good checkpoint
kept, Sparse-RL's empty batches skipped and counted, and optim=adamw8bit refused with a clear message."""

import json
import random

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from smd_cli.cli import CONF_DIR, register_recipes
from smd_cli.config.validation import ConfigError
from smd_cli.corrections import sparse_rl as sparse_rl_correction
from smd_cli.learner import step as learner
from smd_cli.runtime import checkpoint as ckpt
from smd_cli.runtime import integrity
from smd_cli.runtime.failures import Interrupted, TrainingDiverged
from smd_cli.runtime.records import read_jsonl
from smd_cli.stages import train
from smd_cli.stages.evaluate import checkpoint_dir

TINY = ["grpo.prompts_per_step=2", "grpo.num_generations=4", "eval.num_prompts=0", "task.prompt_tokens=48",
        "model.warmstart.steps=5", "progress=false", "checkpoint.every=2", "checkpoint.keep_last=null"]
NOT_REPRODUCIBLE = ("time/", "step_time", "rollout/seconds", "memory/")  # wall clock and process memory


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")  # one warm start for the whole module


def train_run(run_dir, cache, *overrides):
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[*TINY, *overrides, f"+run_dir={run_dir}", f"cache_dir={cache}"])
    return train.run(cfg)


def reproducible(run_dir) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(NOT_REPRODUCIBLE)} for row in read_jsonl(run_dir / "metrics.jsonl")]


def tiny_setup(seed=0):
    from smd_cli.model.build import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(len(tokenizer), seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.tensor([[5, 6, 7]])).logits.sum().backward()
    optimizer.step()  # non-empty optimizer state
    return model, tokenizer, optimizer


def test_saved_checkpoint_restores_exactly_and_loads_with_weights_only(tmp_path):
    model, tokenizer, optimizer = tiny_setup()
    for step in (2, 4, 6):
        path = ckpt.save_checkpoint(tmp_path, step, model, optimizer, tokenizer, extra={"config": {"a": 1}, "skipped_steps": 3}, keep_last=2)
    assert path == tmp_path / "checkpoints" / "step_000006"
    assert [c.step for c in ckpt.list_checkpoints(tmp_path)] == [4, 6]  # keep_last=2 pruned step 2
    assert (path / "model" / "model.safetensors").is_file() and (path / "model" / "tokenizer.json").is_file()
    state = torch.load(path / "trainer_state.pt", weights_only=True)  # no pickled code anywhere
    assert state["step"] == 6 and state["extra"]["skipped_steps"] == 3

    fresh, _, fresh_optimizer = tiny_setup(seed=1)
    latest, corrupt = ckpt.newest_intact(tmp_path)
    assert latest.step == 6 and not corrupt
    ckpt.check_config(latest, {"a": 1})
    extra, rng, optimizer_state = ckpt.resume_run(latest, fresh)
    fresh_optimizer.load_state_dict(optimizer_state)
    assert extra == {"skipped_steps": 3}
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(optimizer.state.values(), fresh_optimizer.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    with pytest.raises(ValueError, match=r"other settings \(a: 1 -> 2\)"):
        ckpt.check_config(latest, {"a": 2})


def test_rng_states_round_trip():
    state = ckpt.rng_state()
    drawn = (random.random(), torch.rand(3))
    ckpt.set_rng_state(state)
    again = (random.random(), torch.rand(3))
    assert drawn[0] == again[0] and torch.equal(drawn[1], again[1])


def test_half_written_checkpoint_is_ignored_and_removed(tmp_path):
    model, tokenizer, optimizer = tiny_setup()
    ckpt.save_checkpoint(tmp_path, 2, model, optimizer)
    partial = tmp_path / "checkpoints" / ".step_000004.tmp"
    (partial / "model").mkdir(parents=True)
    (partial / "trainer_state.pt").write_bytes(b"\x80\x02trunc")  # a write killed half-way
    (tmp_path / "checkpoints" / "step_000005").mkdir()  # a bare folder is not a checkpoint either
    assert ckpt.latest_checkpoint(tmp_path).step == 2
    assert ckpt.remove_partial(tmp_path) == [partial] and not partial.exists()


def test_resume_true_picks_this_run_or_the_newest_sibling(tmp_path):
    model, tokenizer, optimizer = tiny_setup()
    old, new, current = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    ckpt.save_checkpoint(old, 2, model, optimizer)
    ckpt.save_checkpoint(new, 2, model, optimizer)
    current.mkdir()
    assert ckpt.resume_target(True, current) == new
    assert ckpt.resume_target(False, current) is None
    assert ckpt.resume_target(str(old), current) == old
    ckpt.save_checkpoint(current, 2, model, optimizer)
    assert ckpt.resume_target(True, current) == current
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        ckpt.resume_target(str(tmp_path / "missing"), current)


@pytest.mark.slow
def test_resume_is_bit_for_bit_even_after_a_killed_write(tmp_path, cache, monkeypatch):
    smd = ["algo=smd", "eviction=snapkv", "compression=0.5", "optim.lr=0.01"]
    straight, parts = tmp_path / "straight", tmp_path / "parts"
    # the 5-step warm start never earns a reward; a deterministic stand-in gives the GRPO term real advantages
    monkeypatch.setattr(train, "rollout_rewards", lambda batch, *_: [1 / (1 - float(lp.sum())) for lp in batch.logprobs])
    train_run(straight, cache, *smd, "steps=4")
    train_run(parts, cache, *smd, "steps=3")  # checkpoints at 2 and 3 (the end)

    def killed(path):  # the step-4 save dies after writing half of its trainer state, before the rename
        if path.name == "trainer_state.pt" and path.parent.name.startswith(".step_000004."):
            path.write_bytes(path.read_bytes()[:100])
            raise KeyboardInterrupt("killed")

    with monkeypatch.context() as patch:
        patch.setattr(integrity, "_fsync", killed)
        patch.setattr(integrity, "_remove", lambda path: None)  # a killed process removes nothing
        with pytest.raises(Interrupted, match="Ctrl-C at step 4 of 4; last checkpoint: .*step_000003 \\(step 3\\)"):
            train_run(parts, cache, *smd, "steps=4", "resume=true")  # as Ctrl-C is said: the step, the checkpoint
    left = list((parts / "checkpoints").glob(".step_000004.*.tmp"))
    assert len(left) == 1 and left[0].is_dir() and ckpt.latest_checkpoint(parts).step == 3

    summary = train_run(parts, cache, *smd, "steps=4", "resume=true")
    assert summary["status"] == "completed" and summary["steps"] == 4
    assert reproducible(parts) == reproducible(straight)
    assert all(row["reward_std"] > 0 and row["loss/policy"] != 0 for row in reproducible(straight))
    assert [r["step"] for r in read_jsonl(parts / "metrics.jsonl")] == [1, 2, 3, 4]
    assert not list((parts / "checkpoints").glob(".step_000004.*.tmp"))
    assert len((parts / "resumes.jsonl").read_text().splitlines()) == 2
    for name in ("checkpoints/step_000004/model", "final"):  # the weights too, bit for bit
        a, b = load_file(straight / name / "model.safetensors"), load_file(parts / name / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert checkpoint_dir(parts / "final") == parts / "final"  # what `smd eval checkpoint=RUN/final` accepts


@pytest.mark.slow
def test_nan_loss_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, cache, monkeypatch):
    run = tmp_path / "run"
    surrogate, calls = learner.clipped_surrogate, []

    def nan_at_step_3(*args):
        calls.append(1)
        loss, stats = surrogate(*args)
        return (loss * float("nan"), stats) if len(calls) == 3 else (loss, stats)

    with monkeypatch.context() as patch:
        patch.setattr(learner, "clipped_surrogate", nan_at_step_3)
        with pytest.raises(TrainingDiverged, match=r"training diverged at step 3: non-finite loss nan .*step_000002"):
            train_run(run, cache, "steps=4", "grpo.num_iterations=1", "grpo.micro_batch_size=null")  # one call per step
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["diverged_at_step"] == 3
    assert summary["last_checkpoint"] == str(run / "checkpoints" / "step_000002")
    assert [c.step for c in ckpt.list_checkpoints(run)] == [2]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    with pytest.raises(ConfigError, match="already holds checkpoints of an earlier run; pass resume=true"):
        train_run(run, cache, "steps=4")
    with pytest.raises(ConfigError, match=r"other settings \(optim.lr: [0-9.e-]+ -> 0.5\)"):
        train_run(run, cache, "steps=4", "resume=true", "optim.lr=0.5")
    assert train_run(run, cache, "steps=4", "resume=true")["status"] == "completed"  # the checkpoint is usable


@pytest.mark.slow
def test_empty_batches_after_rejection_are_skipped_and_counted(tmp_path, cache, monkeypatch):
    weights = sparse_rl_correction.sparse_rl_weights  # what the learner's Sparse-RL correction calls

    def reject_all(*args, **kwargs):
        w, keep, stats = weights(*args, **kwargs)
        return w, torch.zeros_like(keep), stats

    monkeypatch.setattr(sparse_rl_correction, "sparse_rl_weights", reject_all)
    run = tmp_path / "run"
    summary = train_run(run, cache, "algo=sparse_rl", "eviction=snapkv", "steps=2")
    assert summary["train/skipped_steps"] == 2 and summary["status"] == "completed"
    assert [r["learner/skipped_empty_batch"] for r in read_jsonl(run / "metrics.jsonl")] == [1.0, 1.0]
    start = next(p for p in (cache / "warmstart").iterdir() if p.is_dir()) / "model.safetensors"
    a, b = load_file(start), load_file(run / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # nothing was learned from empty batches


def test_adamw8bit_is_refused_with_what_to_do(tmp_path, cache):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ConfigError, match=r"optim=adamw8bit .* CUDA device.* use optim=adamw on CPU"):
        train_run(tmp_path / "run", cache, "optim=adamw8bit", "steps=1")
