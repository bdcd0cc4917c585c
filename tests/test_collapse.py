"""A collapsed policy never reads "completed" and a healthy one never reads "collapsed" (`smd_cli.checks.collapse`): the
rule on logged rows (the issues' runs among them), and through `smd train`: a policy that collapses onto wrong answers stops with status "collapsed",
its reason, and the last checkpoint from before the collapse (kept through rotation, found again on resume); a
dead network (lr=1e6) likewise; a policy that converged (every sample earns the full reward, so its advantages
and gradients are exactly zero) completes; so does a healthy run whose first step was lucky, while a reward that
falls without a silent step (partial credit) is a collapse at the end."""

import json

import pytest

from smd_cli.checks import collapse
from smd_cli.runtime.records import read_jsonl
from smd_cli.stages import train
from tests.conftest import smd

TINY = ["grpo.prompts_per_step=2", "grpo.num_generations=4", "eval.num_prompts=0", "task.prompt_tokens=48",
        "model.warmstart.steps=5", "progress=false", "guard.collapse_steps=3", "checkpoint.every=1"]

# The issue's run (`smd train steps=40 optim.lr=0.1 eval.num_prompts=8 grpo.prompts_per_step=4
# grpo.num_generations=4`, seed 0, the cached 700-step warm start), its first 12 logged steps:
# (reward, entropy, grad_norm, frac_reward_zero_std). It ended "completed", held-out reward 0.875 -> 0.
ISSUE = [(0.25, 1.9, 0.501, 1), (0, 3.69, 0.0334, 1), (0, 4.32, 0.415, 1), (0, 3.54, 0.0297, 1), (0, 2.53, 0.00767, 1),
         (0, 0.973, 0.00334, 1), (0, 0.339, 0.000272, 1), (0, 0.0343, 3.53e-05, 1), (0, 0.0039, 3.39e-06, 1),
         (0, 0.000603, 8.78e-07, 1), (0, 0.000121, 2.5e-07, 1), (0, 2.92e-05, 1.14e-06, 1)]


def rows(values) -> list[dict]:
    return [{"step": i, "reward": r, "entropy": e, "grad_norm": g, "frac_reward_zero_std": z} for i, (r, e, g, z) in enumerate(values, 1)]


def first_certain(history: list[dict], window: int):
    """The first step at which the rule, fed the rows one at a time as a run logs them, is certain."""
    return next((v for i in range(1, len(history) + 1) if (v := collapse.verdict(history[:i], window)) and v.certain), None)


def test_the_rule_on_the_issues_run_and_on_healthy_ones():
    found = first_certain(rows(ISSUE), 10)
    # steps 1-10: every group's samples agreed; the reward fell from a mean of 0.0833 over steps 1-3 to 0.025 (at
    # most half); entropy 0.000603 <= 1 % of steps 1-3's mean, (1.9 + 3.69 + 4.32) / 3 = 3.30
    assert (found.step, found.since, found.last_good_step, found.kind) == (10, 1, 0, "same")
    assert found.reason.startswith("the sampler's reward fell from a mean of 0.0833 (steps 1-3) to a mean of 0.025 over the "
                                   "last 10 steps, and every group's samples earned the same reward (steps 1-10)")
    assert "token entropy 0.000603 nats (steps 1-3: 3.3); the policy writes the same thing every time" in found.reason
    assert first_certain(rows(ISSUE[:9]), 10) is None  # nine steps are not yet certain, nor said at the end
    assert collapse.verdict(rows(ISSUE[:9]), 10, end=True) is None
    # ... unless the held-out reward fell by half as well (0.875 -> 0): said at the end, not stopped
    late = collapse.verdict(rows(ISSUE[:9]), 10, end=True, held_out=(0.875, 0.0))
    assert not late.certain and late.since == 1 and late.reason.endswith("held-out reward 0.875 -> 0")
    # converged: the full reward on every sample, zero gradient, zero entropy, for 20 steps
    converged = rows([(0.6, 2.0, 0.9, 0.2)] + [(1.0, 0.0, 0.0, 1)] * 20)
    assert first_certain(converged, 3) is None and collapse.verdict(converged, 3, end=True, held_out=(0.6, 1.0)) is None
    assert collapse.converged(converged).startswith("converged: every sample earned the full reward for the last 20 step(s)")
    # a model that never earned a reward (all groups equal at 0 from the first step, zero gradient): not worse than it began
    never = rows([(0.0, 6.2, 0.0, 1)] * 20)
    assert first_certain(never, 3) is None and collapse.verdict(never, 3, end=True) is None
    # a dead network: rewards still differ, the gradient is 1e-7 of the run's largest (not exactly 0)
    dead = rows([(0.6, 2.0, 1.0, 0.0)] + [(0.5, 6.29, 1e-7, 0.5)] * 3)
    found = first_certain(dead, 3)
    assert (found.step, found.since, found.kind) == (4, 2, "dead") and found.reason.startswith("the gradient vanished (steps 2-4")
    assert first_certain(rows([(0.6, 2.0, 1.0, 0.0)] + [(0.5, 6.29, 1e-5, 0.5)] * 3), 3) is None  # 1e-5: small, still a signal
    # fallen and stuck, but still sampling widely (entropy 3.0): not certain, said at the end of the run
    wide = rows([(0.7, 3.0, 1.0, 0.1)] + [(0.0, 3.0, 0.0, 1)] * 4)
    assert first_certain(wide, 3) is None and collapse.verdict(wide, 3, end=True).since == 2
    assert collapse.verdict(wide, 3, end=True, held_out=(0.3, 0.4)) is None  # a held-out reward that rose overrules it
    assert collapse.verdict(ISSUE and rows(ISSUE), 0) is None  # guard.collapse_steps=0: off


# The issue's healthy run: binary rewards, 2 prompts x 4 samples; a lucky first step (prompt 0 solved 4/4, prompt 1
# 1/4: 0.625), then prompt 0 always solved and prompt 1 always missed (0.5, every group silent), entropy falling to
# 0.5 % of step 1's; held-out reward 0.50 -> 0.56.
HEALTHY = [(0.625, 2.0, 0.8, 0.5)] + [(0.5, 2.0 * 0.7 ** i, 0.0, 1) for i in range(1, 20)]


def test_a_healthy_run_with_a_lucky_first_step_is_no_collapse():
    healthy = rows(HEALTHY)
    assert healthy[-1]["entropy"] < collapse.LOW_ENTROPY * 2.0 and all(r["frac_reward_zero_std"] == 1 for r in healthy[1:])
    # step 1 alone as the baseline (the old rule): 0.5 < 0.625, and entropy below 1 % of step 1's stopped it at step 14;
    # against steps 1-3 (mean 0.542) a reward of 0.5 has not fallen (at most half: 0.271)
    assert first_certain(healthy, 10) is None
    assert collapse.verdict(healthy, 10, end=True, held_out=(0.50, 0.56)) is None
    assert collapse.verdict(healthy, 10, end=True) is None  # not said without a held-out reward either
    assert collapse.baseline(healthy) == pytest.approx((0.625 + 0.5 + 0.5) / 3)
    assert collapse.suspect_since(healthy, 10) == 2  # silent steps still protect the checkpoint before them


# Partial-credit (or ROUGE) rewards: the groups' samples always differ, so no step is ever silent, while the
# reward falls from 0.9 to 0.1 over 20 steps (held-out 0.9 -> 0.05).
FALLING = [(0.9 - 0.8 * i / 19, 2.5, 0.4, 0.0) for i in range(20)]


def test_a_falling_reward_is_a_collapse_even_when_no_step_is_silent():
    falling = rows(FALLING)
    assert collapse.trailing(collapse.judge(falling)) == 0 and first_certain(falling, 10) is None  # said at the end only
    found = collapse.verdict(falling, 10, end=True, held_out=(0.9, 0.05))
    # baseline: steps 1-3, (0.9 + 0.858 + 0.816) / 3 = 0.858; steps 11-20: mean 0.9 - 0.8 * 14.5 / 19 = 0.289 <= 0.429. Steps 13-20 are each at
    # most 0.429, steps 11-12 not: the collapse is dated from the window's first step, 11
    assert (found.since, found.step, found.kind, found.certain, found.last_good_step) == (11, 20, "fell", False, 9)
    assert found.reason == ("the sampler's reward fell from a mean of 0.858 (steps 1-3) to a mean of 0.289 over the last 10 "
                            "steps; token entropy 2.5 nats (steps 1-3: 2.5); held-out reward 0.9 -> 0.05")
    assert collapse.verdict(falling, 10, end=True).since == 11  # the trend alone, without a held-out reward
    assert collapse.verdict(falling, 10, end=True, held_out=(0.9, 0.95)) is None  # the held-out reward rose: overruled
    assert collapse.suspect_since(falling, 10) == 11
    # the trend needs the baseline's steps and a whole window after them (12 < 3 + 10), and a fall of half or more
    assert collapse.verdict(falling[:12], 10, end=True) is None
    noisy = rows([(0.6 if i % 2 else 0.35, 2.5, 0.4, 0.0) for i in range(20)])  # baseline 0.433, recent 0.475
    assert collapse.verdict(noisy, 10, end=True) is None


# Issue 40's probe: `smd train steps=4 optim.lr=1e30` ended "completed" (held-out reward 0.75 -> 0, greedy 1 -> 0, the
# gradient norm exactly 0 from step 2). Four steps: the baseline (steps 1-3) is made of the collapsed steps themselves,
# so the reward never "fell" against it, and three silent steps are fewer than the window (10).
SHORT = [(0.25, 1.8, 0.81, 0.5)] + [(0.25, 6.29, 0.0, 1)] * 3


def test_a_short_run_that_destroys_the_policy_is_a_collapse_however_few_its_steps():
    short = rows(SHORT)
    assert first_certain(short, 10) is None and collapse.verdict(short, 10, end=True) is None  # no held-out: nothing to tell
    found = collapse.verdict(short, 10, end=True, held_out=(0.75, 0.0))
    assert (found.since, found.step, found.kind, found.certain, found.last_good_step) == (2, 4, "vanished", False, 0)
    assert found.reason == ("the gradient vanished (steps 2-4: norm 0, the run's largest 0.81) and the held-out reward fell by "
                            "half or more (0.75 -> 0): the updates before destroyed the policy, and no gradient is left to repair "
                            "it; token entropy 6.29 nats (steps 1-3: 4.79)")
    assert collapse.verdict(short[:2], 10, end=True, held_out=(0.75, 0.0)).since == 2  # two steps are enough
    # not a collapse: the held-out reward held (0.75 -> 0.5 is not half) or rose, or the gradient did not vanish
    assert collapse.verdict(short, 10, end=True, held_out=(0.75, 0.5)) is None
    assert collapse.verdict(rows([(1.0, 0.1, 0.0, 1)] * 4), 10, end=True, held_out=(0.75, 0.0)) is None  # never learned a thing
    assert collapse.verdict(rows(HEALTHY), 10, end=True, held_out=(0.50, 0.56)) is None
    live = rows([(0.25, 1.8, 0.81, 0.5)] + [(0.25, 6.29, 1e-3, 0.5)] * 3)
    assert collapse.verdict(live, 10, end=True, held_out=(0.75, 0.0)) is None


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def rewards(monkeypatch):
    """Stand-in task rewards (the 5-step warm start earns none): `rule(step, first_response_token, row) -> reward`,
    row i of the batch being sample i % G of prompt i // G."""
    state = {"step": 0, "rule": None}
    real = train.sample_step

    def sample_step(cfg, step, *args, **kwargs):
        state["step"] = step + 1
        return real(cfg, step, *args, **kwargs)

    def rollout_rewards(batch, *_):
        R = batch.response_mask.size(1)
        return [float(state["rule"](state["step"], int(row[-R]), i)) for i, row in enumerate(batch.input_ids)]

    monkeypatch.setattr(train, "sample_step", sample_step)
    monkeypatch.setattr(train, "rollout_rewards", rollout_rewards)
    return state


def smd_train(run_dir, cache, *overrides) -> int:
    return smd("train", *TINY, *overrides, f"hydra.run.dir={run_dir}", f"cache_dir={cache}")


def summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_a_collapsed_policy_stops_as_collapsed_naming_the_checkpoint_before_it(tmp_path, cache, rewards, capsys):
    # Steps 1-3: every sample earns 1 (no advantage, so no update: step_3 holds the starting weights). From step 4:
    # 1 for an even first response token. lr=100 makes step 4's update put all the probability on one token per
    # prompt, here odd for both: from step 5 the reward falls to 0 and every group's samples agree.
    rewards["rule"] = lambda step, token, _: 1.0 if step <= 3 else token % 2 == 0
    run = tmp_path / "run"
    assert smd_train(run, cache, "algo=dense", "optim.lr=100", "steps=10", "checkpoint.keep_last=2") == 1
    err = " ".join(capsys.readouterr().err.split())
    said = summary(run)
    assert said["status"] == "collapsed" and said["collapse_since_step"] == 5 and said["collapsed_at_step"] == 7 and said["stopped"]
    assert said["status_reason"].startswith("the sampler's reward fell from a mean of 1 (steps 1-3) to a mean of 0 over the last 3 "
                                            "steps")
    assert "token entropy 0 nats (steps 1-3: 6.23); the policy writes the same thing every time" in said["status_reason"]
    assert said["last_checkpoint"] == str(run / "checkpoints" / "step_000003")
    assert err.startswith("training collapsed: the policy collapsed at step 5 (stopped at step 7): the sampler's reward fell")
    assert err.endswith(f"Last good checkpoint: {run / 'checkpoints' / 'step_000003'} (step 3)")
    # rotation (keep_last=2) kept step_3, the last one before the collapse; the collapsed weights are not published
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000003", "step_000005", "step_000006"]
    assert not (run / "final").exists() and [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(1, 8))
    # the same run in two parts: the resumed part judges the whole history and stops where this one did
    parts = tmp_path / "parts"
    assert smd_train(parts, cache, "algo=dense", "optim.lr=100", "steps=5", "checkpoint.keep_last=2") == 0
    # step 5: one silent step, and no whole window after the baseline's steps for the reward trend: not yet a collapse
    assert summary(parts)["status"] == "completed"
    assert smd_train(parts, cache, "algo=dense", "optim.lr=100", "steps=10", "checkpoint.keep_last=2", "resume=true") == 1
    assert {k: summary(parts)[k] for k in ("status", "status_reason", "collapse_since_step", "collapsed_at_step")} == \
           {k: said[k] for k in ("status", "status_reason", "collapse_since_step", "collapsed_at_step")}
    assert summary(parts)["last_checkpoint"] == str(parts / "checkpoints" / "step_000003")


def test_a_dead_network_is_a_collapse_with_no_checkpoint_before_it(tmp_path, cache, rewards, capsys):
    rewards["rule"] = lambda step, token, _: token % 2 == 0  # a random policy earns about half
    run = tmp_path / "run"
    # lr=1e6: the first update saturates the weights; from step 2 every gradient is exactly 0 while rewards differ
    assert smd_train(run, cache, "optim.lr=1e6", "steps=8") == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "training collapsed: the policy collapsed at step 2 (stopped at step 4): the gradient vanished (steps 2-4: norm 0" in err
    assert err.endswith("Last good checkpoint: none: the run's starting weights were the last good ones (its warm start, "
                        "or the model it loaded); step_000002, step_000003 hold weights from after it")
    assert summary(run)["status"] == "collapsed" and summary(run)["last_checkpoint"] is None


def test_a_converged_policy_completes(tmp_path, cache, rewards, capsys):
    # GRPO learns the stand-in reward at lr=1: from step 4 reward 1.0 on every sample, entropy 0 and a gradient of
    # exactly 0 (the old guard, "exactly 0 for guard.collapse_steps steps", stopped this run as "diverged" at step 6)
    rewards["rule"] = lambda step, token, _: token % 2 == 0
    run = tmp_path / "run"
    assert smd_train(run, cache, "optim.lr=1", "steps=12") == 0
    logged = read_jsonl(run / "metrics.jsonl")
    assert [r["reward"] for r in logged[3:]] == [1.0] * 9 and [r["grad_norm"] for r in logged[3:]] == [0.0] * 9
    said = summary(run)
    assert said["status"] == "completed" and (run / "final").is_dir()
    assert said["status_reason"].startswith("converged: every sample earned the full reward for the last 9 step(s) (from step 4)")
    assert "status" in capsys.readouterr().out  # the console table's status row


def test_a_healthy_run_with_a_lucky_first_step_completes(tmp_path, cache, rewards):
    # Issue 26's healthy run: step 1, prompt 0 solved 4/4 and prompt 1 1/4 (0.625); then prompt 0 always solved and
    # prompt 1 always missed (0.5, every group silent). Step 1 alone as the baseline read "collapsed" at the end
    # (0.5 < 0.625 over the last 3 silent steps, exit 1); against steps 1-3 (0.542) it has not fallen.
    rewards["rule"] = lambda step, token, i: 1.0 if i < 4 or (step == 1 and i == 4) else 0.0
    run = tmp_path / "run"
    assert smd_train(run, cache, "steps=6") == 0
    assert [r["reward"] for r in read_jsonl(run / "metrics.jsonl")] == [0.625] + [0.5] * 5
    said = summary(run)
    assert said["status"] == "completed" and "collapse_since_step" not in said and (run / "final").is_dir()


def test_a_falling_partial_credit_reward_is_a_collapse_at_the_end(tmp_path, cache, rewards, capsys):
    # Partial credit: a group's samples always differ (+0, 1/30, 2/30, 3/30), so no step is silent; the level falls
    # from 0.8 (steps 1-3) to 0.1 (steps 4-8). Without a silent step the old rule never said anything.
    rewards["rule"] = lambda step, token, i: (0.8 if step <= 3 else 0.1) + (i % 4) / 30
    run = tmp_path / "run"
    assert smd_train(run, cache, "steps=8") == 1
    logged = read_jsonl(run / "metrics.jsonl")
    assert [r["frac_reward_zero_std"] for r in logged] == [0.0] * 8
    said = summary(run)
    # baseline 0.85; steps 6-8: 0.15 <= 0.425; steps 4-8 each at most 0.425: the collapse began at step 4
    assert (said["status"], said["collapse_since_step"], said["collapsed_at_step"], said["stopped"]) == ("collapsed", 4, 8, False)
    assert said["status_reason"].startswith("the sampler's reward fell from a mean of 0.85 (steps 1-3) to a mean of 0.15 "
                                            "over the last 3 steps; token entropy")
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("training collapsed: the policy collapsed at step 4 (found at the end of the run at step 8)")


def test_non_finite_weights_after_a_step_stop_the_run_as_diverged():
    """The guard's weight check, one NaN or one infinity in any tensor (and none in a finite model)."""
    import torch

    from smd_cli.runs.train_state import CollapseGuard, TrainingDiverged

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    guard = CollapseGuard(window=3)
    guard.check_weights(1, model)
    for bad in (float("nan"), float("inf"), -float("inf")):
        with torch.no_grad():
            model[1].bias[2] = bad
        with pytest.raises(TrainingDiverged, match="non-finite after the optimizer step"):
            guard.check_weights(4, model)
        assert guard.last_good == 3
        with torch.no_grad():
            model[1].bias[2] = 0.0


def test_a_four_step_run_that_destroys_the_policy_is_not_completed(tmp_path, cache, rewards, monkeypatch, capsys):
    """The probe's `smd train steps=4 optim.lr=1e30` at the test's size, the window at its default (10): lr=1e6
    saturates the network at step 1 and every later gradient is exactly 0 while rewards still differ (at this size
    lr=1e30 makes them NaN: diverged, checked last); the held-out evaluation is a stand-in with the probe's numbers
    (0.75 before, 0 after)."""
    rewards["rule"] = lambda step, token, _: token % 2 == 0
    monkeypatch.setattr(train, "held_out", lambda *args: {f"eval/reward_{args[-1]}": 0.75 if args[-1] == "before" else 0.0})
    run = tmp_path / "run"
    assert smd_train(run, cache, "optim.lr=1e6", "steps=4", "guard.collapse_steps=10", "eval.reuse_before=false") == 1
    logged = read_jsonl(run / "metrics.jsonl")
    assert [r["grad_norm"] for r in logged[1:]] == [0.0] * 3 and all(r["frac_reward_zero_std"] < 1 for r in logged[1:])
    said = summary(run)
    assert (said["status"], said["collapse_since_step"], said["collapsed_at_step"], said["stopped"]) == ("collapsed", 2, 4, False)
    assert said["status_reason"].startswith("the gradient vanished (steps 2-4: norm 0, the run's largest ")
    assert "and the held-out reward fell by half or more (0.75 -> 0)" in said["status_reason"]
    captured = capsys.readouterr()
    assert "collapsed at step 2" in captured.out  # the console's status row
    assert " ".join(captured.err.split()).startswith("training collapsed: the policy collapsed at step 2 (found at the end of the "
                                                     "run at step 4): the gradient vanished")
    assert smd_train(tmp_path / "e30", cache, "optim.lr=1e30", "steps=4", "eval.reuse_before=false") == 1
    assert summary(tmp_path / "e30")["status"] == "diverged"
