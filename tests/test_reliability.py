"""What a run directory guarantees against hostile but realistic use: `resume` continues only the run it
was pointed at, corrupt checkpoints and caches are never trusted (and never deleted), every random source
is saved, one process writes a run directory, divergence stops a run (collapse: test_collapse.py), and a
full disk or a torn log line is named, not a traceback."""

import errno
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from smd_cli.cli import CONF_DIR, main, register_recipes
from smd_cli.config.validation import ConfigError
from smd_cli.runs import run_dirs, warm_cache
from smd_cli.runtime import checkpoint as ckpt
from smd_cli.runtime import integrity
from smd_cli.runtime.failures import TrainingDiverged
from smd_cli.runtime.records import read_jsonl
from smd_cli.stages import train

ROOT = CONF_DIR.parent
TINY = ["grpo.prompts_per_step=2", "grpo.num_generations=4", "eval.num_prompts=0", "task.prompt_tokens=48",
        "model.warmstart.steps=5", "progress=false", "checkpoint.keep_last=null", "optim.lr=0.01"]
NOT_REPRODUCIBLE = ("time/", "step_time", "memory/")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def signal(monkeypatch):
    """The 5-step warm start never earns a reward: a deterministic stand-in in (0, 1], as a task's reward is, gives GRPO
    real advantages."""
    monkeypatch.setattr(train, "rollout_rewards", lambda batch, *_: [1 / (1 - float(lp.sum())) for lp in batch.logprobs])


def config(run_dir, cache, *overrides):
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=[*TINY, *overrides, f"+run_dir={run_dir}", f"cache_dir={cache}"])


def train_run(run_dir, cache, *overrides):
    try:
        return train.run(config(run_dir, cache, *overrides))
    finally:
        integrity.release_all()  # as when the process ends


def weights(path):
    return load_file(path / "model.safetensors")


def same_weights(a, b) -> bool:
    a, b = weights(a), weights(b)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def rows(run_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(NOT_REPRODUCIBLE)} for r in read_jsonl(run_dir / "metrics.jsonl")]


def flip_byte(path, offset=-100):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def tree(path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# -- resume continues only the run it was pointed at -----------------------------------------------------------

def test_resume_in_a_named_directory_without_a_checkpoint_starts_there_and_leaves_siblings_alone(tmp_path, cache):
    sibling = tmp_path / "runs" / "other"
    train_run(sibling, cache, "steps=2")
    before = tree(sibling)
    mine = tmp_path / "runs" / "mine"
    (mine / "checkpoints" / ".step_000001.tmp").mkdir(parents=True)  # killed during its first save
    summary = train_run(mine, cache, "steps=1", "resume=true")
    assert summary["status"] == "completed" and [r["step"] for r in read_jsonl(mine / "metrics.jsonl")] == [1]
    assert tree(sibling) == before  # not continued, not rotated, not rewritten
    assert not (sibling / "resumes.jsonl").exists()
    # where the directory is not named (a fresh timestamped one), resume=true may still pick the newest sibling
    assert ckpt.resume_target(True, tmp_path / "runs" / "new", named=False) in (sibling, mine)
    assert ckpt.resume_target(True, tmp_path / "runs" / "new", named=True) is None


# -- corrupt checkpoints, final weights and caches ------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("damage", ["bit flip", "truncation"])
def test_a_corrupt_checkpoint_is_set_aside_and_the_run_resumes_from_the_newest_intact_one(tmp_path, cache, signal, damage):
    straight, parts = tmp_path / "straight", tmp_path / "parts"
    train_run(straight, cache, "steps=4", "algo=smd", "checkpoint.every=1")
    train_run(parts, cache, "steps=3", "algo=smd", "checkpoint.every=1", "checkpoint.keep_last=2")
    newest = parts / "checkpoints" / "step_000003"
    if damage == "bit flip":
        flip_byte(newest / "model" / "model.safetensors")
    else:
        state = newest / "trainer_state.pt"
        state.write_bytes(state.read_bytes()[:1000])
    assert ckpt.newest_intact(parts)[0].step == 2
    summary = train_run(parts, cache, "steps=4", "algo=smd", "checkpoint.every=1", "checkpoint.keep_last=2", "resume=true")
    assert summary["status"] == "completed"
    assert (parts / "checkpoints" / "step_000003.corrupt").is_dir()  # kept for inspection, out of every listing
    assert [c.step for c in ckpt.list_checkpoints(parts)] == [3, 4]  # rotation kept the intact newest ones
    assert all(not integrity.verify(c.path) for c in ckpt.list_checkpoints(parts))
    assert rows(parts) == rows(straight) and same_weights(parts / "final", straight / "final")


@pytest.mark.slow
def test_eval_refuses_a_corrupt_checkpoint_and_names_the_file(tmp_path, cache):
    run = tmp_path / "run"
    train_run(run, cache, "steps=1")
    flip_byte(run / "final" / "model.safetensors")
    with pytest.raises(SystemExit) as exit_:
        main(["eval", f"checkpoint={run / 'final'}", f"hydra.run.dir={tmp_path / 'eval'}", "eval.limit=2", "task.prompt_tokens=48"])
    assert exit_.value.code == 2
    assert not (tmp_path / "eval" / "summary.json").exists()


@pytest.mark.slow
def test_a_broken_warm_start_cache_is_rebuilt(tmp_path, capsys):
    cache = tmp_path / "cache"
    train_run(tmp_path / "a", cache, "steps=0")
    (entry,) = [p for p in (cache / "warmstart").iterdir() if p.is_dir()]
    good = {k: v.clone() for k, v in weights(entry).items()}  # (load_file maps the file)
    flip_byte(entry / "model.safetensors")
    capsys.readouterr()
    train_run(tmp_path / "b", cache, "steps=0")
    assert "is broken (model.safetensors does not match its SHA-256" in capsys.readouterr().out
    assert not integrity.verify(entry) and all(torch.equal(good[k], v) for k, v in weights(entry).items())


def test_verify_names_missing_truncated_and_changed_files(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "b").write_bytes(b"y" * 10)
    (tmp_path / "c").write_bytes(b"z" * 10)
    integrity.write_manifest(tmp_path)
    assert integrity.verify(tmp_path) == []
    (tmp_path / "a").unlink()
    (tmp_path / "b").write_bytes(b"y" * 9)
    (tmp_path / "c").write_bytes(b"z" * 9 + b"!")
    assert integrity.verify(tmp_path) == ["a is missing", "b has 9 bytes, 10 were written",
                                          "c does not match its SHA-256 (changed on disk since it was written)"]


# -- every random source is saved: resume is bit for bit for every algorithm and every policy -----------------

@pytest.mark.slow
@pytest.mark.parametrize("algo,policy", [("dense", "none"), ("naive_sparse", "snapkv"), ("sparse_rl", "snapkv"), ("tis", "snapkv"),
                                         ("smd", "snapkv"), ("smd", "random"), ("smd", "recent"), ("smd", "h2o"), ("smd", "knorm")])
def test_resume_is_bit_for_bit_for_every_algorithm_and_policy(tmp_path, cache, signal, algo, policy):
    setting = [f"algo={algo}", f"eviction={policy}", "compression=0.5", "checkpoint.every=1"]
    train_run(tmp_path / "straight", cache, *setting, "steps=3")
    train_run(tmp_path / "parts", cache, *setting, "steps=1")
    train_run(tmp_path / "parts", cache, *setting, "steps=3", "resume=true")
    assert rows(tmp_path / "parts") == rows(tmp_path / "straight")
    assert same_weights(tmp_path / "parts" / "final", tmp_path / "straight" / "final")


def test_the_random_policy_state_round_trips():
    from smd_cli.eviction.random import RandomEviction

    a, b = RandomEviction(seed=3), RandomEviction(seed=3)
    torch.rand(5, generator=a._generator)
    b.load_state_dict(a.state_dict())
    assert torch.equal(torch.rand(5, generator=a._generator), torch.rand(5, generator=b._generator))


# -- one writer per run directory; caches safe under concurrency ------------------------------------------------

def test_a_second_process_is_refused_a_locked_run_directory_and_a_stale_lock_is_taken_over(tmp_path):
    run = tmp_path / "run"
    integrity.hold(run)
    command = [sys.executable, "-m", "smd_cli.cli", "train", f"hydra.run.dir={run}", "steps=0", *TINY, "model.warmstart.steps=0"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 2, done.stderr
    assert f"{run} is in use by another smd process (pid {os.getpid()}" in " ".join(done.stderr.split())
    assert not (run / "config.json").exists()  # refused before writing anything
    integrity.release_all()
    (run / ".lock").write_text("pid 1 on a host that was killed\n")  # a stale lock file: nobody holds the flock
    assert integrity.hold(run) == (run / ".lock").resolve()


@pytest.mark.slow
def test_two_fresh_runs_racing_on_one_warm_start_both_succeed(tmp_path):
    commands = [[sys.executable, "-m", "smd_cli.cli", "train", f"hydra.run.dir={tmp_path / name}", "steps=0", "eval.num_prompts=0",
                 "model.warmstart.steps=30", "task.prompt_tokens=48", "progress=false", f"cache_dir={tmp_path / 'cache'}"]
                for name in ("a", "b")]
    procs = [subprocess.Popen(c, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in commands]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sum("warm start: reusing" in out for out in outs) == 1  # one built it while the other waited
    assert same_weights(tmp_path / "a" / "final", tmp_path / "b" / "final")


# -- collapse and divergence -------------------------------------------------------------------------------------

def test_a_non_finite_learning_rate_is_refused(tmp_path, cache):
    with pytest.raises(ConfigError, match="optim.lr=inf is not allowed: a finite learning rate"):
        train_run(tmp_path / "run", cache, "optim.lr=inf")


@pytest.mark.slow
def test_non_finite_weights_after_a_step_stop_the_run(tmp_path, cache, monkeypatch):
    step, calls = train.learner_step, []

    def poisoned(model, *args, **kwargs):
        metrics = step(model, *args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            next(model.parameters()).data[0, 0] = float("inf")
        return metrics

    monkeypatch.setattr(train, "learner_step", poisoned)
    with pytest.raises(TrainingDiverged, match=r"at step 2: the weights are non-finite.*Last good checkpoint: .*step_000001 \(step 1\)"):
        train_run(tmp_path / "run", cache, "steps=3", "checkpoint.every=1", "guard.collapse_steps=0")
    assert [c.step for c in ckpt.list_checkpoints(tmp_path / "run")] == [1] and not (tmp_path / "run" / "final").exists()


# -- errors that name their cause ---------------------------------------------------------------------------------

def test_a_full_disk_is_named_and_the_partial_checkpoint_removed(tmp_path, cache, monkeypatch):
    run = tmp_path / "run"
    train_run(run, cache, "steps=1")
    real_save = torch.save

    def full(obj, f, *args, **kwargs):  # what torch's zip writer says when the disk fills
        real_save(obj, f, *args, **kwargs)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3584 vs 3478")

    monkeypatch.setattr(ckpt.torch, "save", full)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: SimpleNamespace(free=1 << 20))
    with pytest.raises(OSError) as err:
        train_run(run, cache, "steps=2", "resume=true")
    assert err.value.errno == errno.ENOSPC and "no space left on device while writing checkpoint step 2" in str(err.value)
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000001"]  # no partial folder left behind
    monkeypatch.undo()
    assert train_run(run, cache, "steps=2", "resume=true")["status"] == "completed"


def test_on_a_real_full_filesystem_the_cli_says_disk_full(tmp_path, cache):
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({made.stderr.decode().strip()[:80]})")
    try:
        command = [sys.executable, "-m", "smd_cli.cli", "train", f"hydra.run.dir={mount / 'run'}", "steps=1", *TINY,
                   "model.config.hidden_size=512", "model.config.intermediate_size=1024", "model.config.head_dim=128",
                   "model.warmstart.steps=0", f"cache_dir={cache}"]
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert done.returncode == 1 and "disk full:" in done.stderr and "no space left on device" in done.stderr, done.stderr[-2000:]
        assert not list((mount / "run" / "checkpoints").glob(".*.tmp"))
    finally:
        subprocess.run(["umount", str(mount)])


def test_a_resume_on_a_full_disk_removes_the_stale_partial_write_before_writing_anything(tmp_path, cache, monkeypatch):
    run = tmp_path / "run"
    train_run(run, cache, "steps=1")
    stale = run / "checkpoints" / ".step_000002.tmp"
    (stale / "model").mkdir(parents=True)
    written = []
    monkeypatch.setattr(run_dirs, "write_provenance", lambda *a: written.append(stale.exists()))
    train_run(run, cache, "steps=2", "resume=true")
    assert written == [False]


@pytest.mark.slow
def test_a_torn_last_metrics_line_does_not_block_resume(tmp_path, cache, signal):
    straight, parts = tmp_path / "straight", tmp_path / "parts"
    train_run(straight, cache, "steps=3", "checkpoint.every=1")
    train_run(parts, cache, "steps=2", "checkpoint.every=1")
    with (parts / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "rew')  # killed mid-write
    train_run(parts, cache, "steps=3", "checkpoint.every=1", "resume=true")
    assert rows(parts) == rows(straight)
    (parts / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "rew\n{"step": 3}\n')  # a bad line inside is named
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a valid JSON line"):
        read_jsonl(parts / "metrics.jsonl", torn_tail_ok=True)


def test_a_prompt_longer_than_the_model_is_refused_before_any_warm_start(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(warm_cache, "warm_start", lambda *a, **k: pytest.fail("the warm start ran"))
    with pytest.raises(ConfigError, match=r"task.prompt_tokens=100000 is not allowed: .* exceeds model=tiny's 4096 positions"):
        train_run(tmp_path / "run", cache, "task.prompt_tokens=100000")


def test_resume_with_a_changed_model_is_refused_before_any_warm_start(tmp_path, cache, monkeypatch):
    run = tmp_path / "run"
    train_run(run, cache, "steps=1")
    monkeypatch.setattr(warm_cache, "warm_start", lambda *a, **k: pytest.fail("the warm start ran"))
    with pytest.raises(ConfigError, match=r"other settings \(model.config.hidden_size: 64 -> 128\)"):
        train_run(run, cache, "steps=2", "resume=true", "model.config.hidden_size=128")
