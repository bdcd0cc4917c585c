"""`smd ablate`: the sweep syntax (recipe, command line, fixed values, subsets), members named by what they run and
run once, failed runs (reported with their reason, no bar, exit 1), resuming a sweep, config mistakes caught before
the first run, and real sweeps of tiny runs through Hydra's joblib and submitit launchers."""

import csv
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from smd_cli.cli import register_recipes, sweep_arguments
from smd_cli.config.validation import ConfigError
from smd_cli.report.sweep_tables import write_plot
from smd_cli.runs import sweep
from smd_cli.runs.sweep import error_message, failure_reason, parse_sweep, sweep_of
from smd_cli.stages import ablate as stage
from tests.conftest import smd

CONF = Path(__file__).resolve().parents[1] / "conf"
TINY = ["steps=2", "grpo.prompts_per_step=2", "grpo.num_generations=2", "eval.num_prompts=4", "task.prompt_tokens=40",
        "model.warmstart.steps=2", "progress=false"]

# Stands in for `smd train` (milliseconds instead of a model): lambda picks how the run ends; every call is counted.
FAKE_TRAIN = r"""
import json, pathlib, sys
args = dict(a.split("=", 1) for a in sys.argv[1:])
run = pathlib.Path(args["hydra.run.dir"])
run.mkdir(parents=True, exist_ok=True)
with open(run.parents[1] / "calls.txt", "a") as f:
    f.write(run.name + "\n")
lam, seed = args["lambda"], int(args.get("seed", 0))
print(f"fake train lambda={lam}")
(run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward": 0.1 * s}) + "\n" for s in range(3)))
flaky = run.parents[1] / f"fail_once_{lam}_{seed}"
if flaky.exists():  # a run that dies the first time (the machine went down), then works
    flaky.unlink()
    sys.exit("killed half way")
if lam == "0.5":  # a crash: a traceback, then Hydra's hint
    sys.stderr.write('Traceback (most recent call last):\n  File "train.py", line 1, in <module>\n'
                     'ValueError: boom at step 3\n\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n')
    sys.exit(1)
if lam == "0.7":  # the CLI's config error, wrapped by rich at 80 columns
    sys.stderr.write("some warning\n\nconfig error: grpo.num_generations=1 is not allowed: an integer >= 2 (GRPO\n"
                     "normalises each reward against the other samples of its group)\n")
    sys.exit(2)
if lam == "0.6":  # the policy collapsed: stopped with exit 1, its numbers and reason in summary.json
    (run / "summary.json").write_text(json.dumps({"status": "collapsed", "status_reason": "the sampler's reward fell to 0",
                                                  "eval/reward_before": 0.25, "eval/reward_after": 0.0}))
    sys.stderr.write("training collapsed: the policy collapsed at step 2\n")
    sys.exit(1)
if lam == "0.9":  # the run wrote its own error into summary.json
    (run / "summary.json").write_text(json.dumps({"status": "diverged", "error": "loss is nan at step 2"}))
    sys.stderr.write("training diverged: loss is nan at step 2\n")
    sys.exit(1)
reward = float(lam) + 0.1 * seed
(run / "summary.json").write_text(json.dumps({"status": "completed", "eval/reward_before": 0.25, "eval/reward_after": reward}))
"""


@pytest.fixture
def fake_train(tmp_path, monkeypatch):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    monkeypatch.setattr(sweep, "member_command", lambda overrides, run_dir: [sys.executable, str(script), *overrides, f"hydra.run.dir={run_dir}"])
    return tmp_path


def ablate(tmp_path, *args, out: str = "ablate") -> int:
    """`smd ablate ARGS` in this process (so the fake train is used), writing to tmp_path/out; its exit status."""
    return smd("ablate", "progress=false", f"hydra.run.dir={tmp_path / out}", *args)


def calls(root: Path) -> list[str]:
    path = root / "calls.txt"
    return path.read_text().split() if path.is_file() else []


def test_sweep_arguments_split_swept_from_fixed():
    out = sweep_arguments(["lambda=0.1,0.8", "algo=smd", "hydra.run.dir=/x", "grpo.epsilon=0.1,0.2", "+recipe=tiny_smd"])
    assert out == ["algo=smd", "hydra.run.dir=/x", "+recipe=tiny_smd", "ablate.command_line=['lambda=0.1,0.8','grpo.epsilon=0.1,0.2']"]
    assert sweep_arguments(["steps=3"]) == ["steps=3"]


def test_the_sweep_is_the_recipe_with_the_command_line_on_top():
    assert parse_sweep(["lambda=0.1,0.8", "eviction=snapkv,recent"]) == [("lambda", ["0.1", "0.8"]), ("eviction", ["snapkv", "recent"])]
    with pytest.raises(ConfigError, match="write KEY=v1,v2"):
        parse_sweep(["lambda"])
    cfg = OmegaConf.create({"ablate": {"sweep": ["lambda=0,0.1,0.8", "seed=0,1,2"], "command_line": ["seed=0,1", "algo=smd,tis"],
                                       "subset": ["lambda=0.10,0.8", "task=vote"]}})  # 0.10 is the value 0.1
    assert sweep_of(cfg, []) == [("lambda", ["0.1", "0.8"]), ("seed", ["0", "1"]), ("algo", ["smd", "tis"])]
    assert sweep_of(cfg, ["seed=2", "steps=3"]) == [("lambda", ["0.1", "0.8"]), ("seed", ["2"]), ("algo", ["smd", "tis"])]
    shared = OmegaConf.create({"ablate": {"sweep": ["lambda=0,0.1,0.8"], "command_line": [], "subset": ["lambda=0.1,0.5"]}})
    assert sweep_of(shared, []) == [("lambda", ["0.1"])]  # 0.5 is not swept: named in a note, left out
    with pytest.raises(ConfigError, match=r"ablate.subset entry 'lambda=0.5' is not allowed: none of its values is among"):
        sweep_of(OmegaConf.create({"ablate": {"sweep": ["lambda=0,0.1"], "command_line": [], "subset": ["lambda=0.5"]}}), [])
    with pytest.raises(ConfigError, match="give at least one KEY=v1,v2"):
        sweep_of(OmegaConf.create({"ablate": {"sweep": [], "command_line": []}}), [])


def test_members_are_named_by_what_they_run_and_composed_once(tmp_path):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("ablate", overrides=["ablate.command_line=['lambda=0.1,0.10,0.3','algo=smd,dense']"])
    _, members = sweep.plan(cfg, ["task=needle"])
    assert [m.label for m in members] == [f"lambda={lam},algo={a}" for lam in ("0.1", "0.10", "0.3") for a in ("smd", "dense")]
    # 0.1 and 0.10 compose to the same config, and dense does not read lambda: three runs for six combinations
    runs = sweep.distinct(members)
    assert [m.label for m in runs] == ["lambda=0.1,algo=smd", "lambda=0.1,algo=dense", "lambda=0.3,algo=smd"]
    assert members[2].identity == members[0].identity and members[1].identity == members[3].identity == members[5].identity
    names = [m.name for m in runs]
    assert names[0].startswith("needle_smd_snapkv_c0.5_lam0.1_seed0_") and names[1].startswith("needle_dense_seed0_")
    assert names[2].startswith("needle_smd_snapkv_c0.5_lam0.3_seed0_") and names[0][-8:] == runs[0].identity[:8]


def test_members_compose_as_hydra_composes_each_one_alone():
    """`plan` composes once per combination of swept groups and sets swept values on copies; each member's config, hence
    its identity and directory, must be what a compose of its whole command line gives (the reference here), including
    fixed values, an interpolated key and a group default that a swept value overrides (sparse_rl sets grpo.beta)."""
    fixed = ["task=needle", "steps=3", "task.max_new_tokens=5"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("ablate", overrides=["ablate.command_line=['algo=sparse_rl,smd','grpo.beta=0,0.01','seed=0,1','compression=0.3,adaptive']"])
        _, members = sweep.plan(cfg, fixed)
        for m in members:
            alone = compose("train", overrides=m.overrides, return_hydra_config=True)
            assert m.identity == sweep.config_identity(alone), m.label
            assert alone.sampling.max_new_tokens == 5
    assert len(members) == 16 and len({m.identity for m in members}) == 16


def test_failed_runs_are_reported_not_plotted_and_exit_1(fake_train, capfd):
    code = ablate(fake_train, "lambda=0.1,0.5,0.7,0.9", "ablate.metrics=[eval/reward_before,eval/reward_after]")
    assert code == 1
    out, err = capfd.readouterr()
    assert "fake train lambda=0.5" in out and "ValueError: boom at step 3" in err  # streamed as it runs (basic launcher)
    assert "ablate failed: 3 of 4 runs failed (lambda=0.5: ValueError: boom at step 3; lambda=0.7: config error: " in " ".join(err.split())
    root = fake_train / "ablate"
    rows = list(csv.DictReader((root / "ablation.csv").open()))
    assert [(r["lambda"], r["status"]) for r in rows] == [("0.1", "ok"), ("0.5", "failed (exit 1)"), ("0.7", "failed (exit 2)"),
                                                         ("0.9", "failed (exit 1)")]
    assert [r["error"] for r in rows] == [
        "", "ValueError: boom at step 3",
        ("config error: grpo.num_generations=1 is not allowed: an integer >= 2 (GRPO normalises each reward against "
         "the other samples of its group)"),
        "loss is nan at step 2"]
    assert [r["eval/reward_after"] for r in rows] == ["0.1", "", "", ""]  # a failure is missing, not 0
    md = (root / "ablation.md").read_text()
    assert "| lambda | eval/reward_before | eval/reward_after | status | error |" in md
    assert "| 0.5 | - | - | failed (exit 1) | ValueError: boom at step 3 |" in md
    summary = json.loads((root / "summary.json").read_text())
    assert summary["failed"] == ["lambda=0.5", "lambda=0.7", "lambda=0.9"]
    failed_dir = Path(rows[1]["dir"])
    log = (failed_dir / "console.log").read_text()
    assert "fake train lambda=0.5" in log and "ValueError: boom at step 3" in log  # its stdout and stderr
    assert json.loads((failed_dir / "member.json").read_text())["returncode"] == 1
    assert (root / "ablation.png").stat().st_size > 10_000
    # the plot: a bar for the finished run, none for the failed ones
    assert write_plot(fake_train, summary["runs"], "eval/reward_after") == {"lambda=0.1": 0.1}


def test_a_collapsed_member_is_marked_with_its_numbers_and_reason_and_not_run_again(fake_train, capfd):
    runs = f"ablate.runs_dir={fake_train / 'members'}"
    assert ablate(fake_train, "lambda=0.6", "seed=0,1", runs, "ablate.metrics=[eval/reward_after]") == 0  # a result, not a failure
    assert "ablate: 2 of 2 runs collapsed (their numbers are in the tables, marked collapsed): seed=0: the sampler's reward " \
           "fell to 0; seed=1: the sampler's reward fell to 0" in " ".join(capfd.readouterr().err.split())
    root = fake_train / "ablate"
    rows = list(csv.DictReader((root / "ablation.csv").open()))
    assert [(r["seed"], r["status"], r["error"], r["eval/reward_after"]) for r in rows] == [
        ("0", "collapsed", "the sampler's reward fell to 0", "0.0"), ("1", "collapsed", "the sampler's reward fell to 0", "0.0")]
    assert "| 1 | 0 | collapsed | the sampler's reward fell to 0 |" in (root / "ablation.md").read_text()
    summary = json.loads((root / "summary.json").read_text())
    assert summary["failed"] == [] and summary["collapsed"] == ["seed=0", "seed=1"]
    assert [(r["run_status"], r["status_reason"]) for r in summary["runs"]][0] == ("collapsed", "the sampler's reward fell to 0")
    (mean,) = csv.DictReader((root / "ablation_mean.csv").open())
    assert (mean["eval/reward_after"], mean["n"], mean["collapsed"]) == ("0.0", "2", "2")  # averaged in, and counted
    assert "2/2 (2 collapsed)" in (root / "ablation_mean.md").read_text()
    member = json.loads((Path(rows[0]["dir"]) / "member.json").read_text())
    assert (member["status"], member["returncode"], member["run_status"], member["status_reason"]) == \
           ("collapsed", 1, "collapsed", "the sampler's reward fell to 0")
    assert write_plot(fake_train, summary["runs"], "eval/reward_after") == {"seed=0": 0.0, "seed=1": 0.0}  # drawn, hatched
    first = calls(fake_train)
    assert ablate(fake_train, "lambda=0.6", "seed=0,1", runs, "ablate.metrics=[eval/reward_after]") == 0
    assert calls(fake_train) == first  # a collapsed member is finished: it would collapse again


def test_shared_members_run_once_and_a_stopped_sweep_resumes(fake_train):
    runs = f"ablate.runs_dir={fake_train / 'members'}"
    (fake_train / "fail_once_0.3_1").touch()  # lambda 0.3, seed 1 dies the first time
    assert ablate(fake_train, "lambda=0.1,0.3", "seed=0,1", runs) == 1
    first = calls(fake_train)
    assert len(first) == 4
    rows = {r["run"]: r for r in csv.DictReader((fake_train / "ablate" / "ablation.csv").open())}
    assert rows["lambda=0.3,seed=1"]["error"] == "killed half way"
    # started again: only the member that did not finish runs; the sweep completes
    assert ablate(fake_train, "lambda=0.1,0.3", "seed=0,1", runs) == 0
    assert calls(fake_train)[4:] == [n for n in first if "lam0.3_seed1" in n]
    # another sweep in the same runs directory runs only what it does not share
    assert ablate(fake_train, "lambda=0.3,0.0", "seed=0,1", runs, out="other") == 0
    new = calls(fake_train)[5:]
    assert len(new) == 2 and all("lam0_seed" in n for n in new)
    means = {r["lambda"]: r for r in csv.DictReader((fake_train / "other" / "ablation_mean.csv").open())}
    assert float(means["0.3"]["eval/reward_after"]) == pytest.approx(0.35)  # (0.3 + 0.4) / 2, the shared runs' values


def test_a_run_recorded_with_the_fixed_prompts_stands_for_its_member(fake_train, capfd):
    """Every run recorded before `eval.prompts` evaluated the same fixed held-out prompts for every seed: such a run (here
    one made with eval.prompts=fixed, which keeps that identity) stands for its member of a sweep with the default
    per-seed prompts, said as it is reused, so a finished reproduction is not run again; ablate.reuse_fixed_prompts=false
    runs the member again on its seed's own prompts, in a directory of its own."""
    runs = f"ablate.runs_dir={fake_train / 'members'}"
    assert ablate(fake_train, "lambda=0.1", "seed=0,1", "eval.prompts=fixed", runs) == 0
    first = calls(fake_train)
    assert len(first) == 2
    capfd.readouterr()
    assert ablate(fake_train, "lambda=0.1", "seed=0,1", runs) == 0  # eval.prompts=per_seed, the default
    assert calls(fake_train) == first  # nothing ran: the fixed-prompts runs stand for the members
    assert "2 runs finished with eval.prompts=fixed" in " ".join(capfd.readouterr().out.split())
    rows = list(csv.DictReader((fake_train / "ablate" / "ablation.csv").open()))
    assert sorted(Path(r["dir"]).name for r in rows) == sorted(first) and {r["status"] for r in rows} == {"ok"}
    assert ablate(fake_train, "lambda=0.1", "seed=0,1", runs, "ablate.reuse_fixed_prompts=false") == 0
    again = calls(fake_train)[2:]
    assert len(again) == 2 and not set(again) & set(first)
    assert sorted(n.rsplit("_", 1)[0] for n in again) == sorted(n.rsplit("_", 1)[0] for n in first)  # the same runs, new identities


def by_hand(cfg, drop_prompts=True, **model):
    """A member's identity recomputed by hand: the SHA-256 of its composed config less NOT_IDENTITY (`model`: keys
    replaced)."""
    config = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for k, v in cfg.items()
              if k not in sweep.NOT_IDENTITY}
    config["model"].update(model)
    if drop_prompts:
        del config["eval"]["prompts"]
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def test_eval_prompts_fixed_keeps_the_identity_of_the_runs_recorded_before_it():
    """A member's identity is the SHA-256 of its composed config less NOT_IDENTITY (here recomputed by hand): with
    eval.prompts=fixed the key is left out, so it is the identity every run recorded before the key has; per_seed is a
    different run, whose twin (`Member.twin`) is the fixed one. The small reproduction's records (results/reproduce_small/
    members) are every one the twin of a member of today's main table."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        fixed, per_seed = (compose("train", overrides=["algo=smd", f"eval.prompts={d}"]) for d in ("fixed", "per_seed"))
    assert sweep.config_identity(fixed) == by_hand(fixed, True) == sweep.config_identity(per_seed, prompts="fixed")
    assert sweep.config_identity(per_seed) == by_hand(per_seed, False) != sweep.config_identity(fixed)
    recorded = {p.name for p in (CONF.parent / "results" / "reproduce_small" / "members").iterdir() if p.is_dir()}
    register_recipes()  # `+recipe=...` as the CLI has it (alone, no earlier test registered them)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("ablate", overrides=["+recipe=small_main_table"])
        members = sweep.plan(cfg, ["+recipe=small_main_table"])[1]
    assert len(members) == 24 and all(m.twin[1] in recorded and m.name not in recorded for m in members)
    assert [m.name for m in sweep.stand_ins(members, CONF.parent / "results" / "reproduce_small" / "members")[0]] == \
        [m.twin[1] for m in members]


def test_config_mistakes_stop_the_sweep_before_any_run(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "member_command", lambda *a: pytest.fail("no run may start"))

    def config(*overrides):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose("ablate", overrides=["progress=false", f"+run_dir={tmp_path / 'ablate'}", *overrides])

    with pytest.raises(ConfigError, match=r"ablate run lamda=0.1: Could not override 'lamda'.*Key 'lamda' is not in struct"):
        stage.run(config("ablate.command_line=['lamda=0.1,0.8']"))
    with pytest.raises(ConfigError, match=r"ablate run eviction=nope: .*Could not find 'eviction/nope'"):
        stage.run(config("ablate.command_line=['eviction=snapkv,nope']"))
    with pytest.raises(ConfigError, match=r"ablate.metrics=\[\] is not allowed: a non-empty list"):
        stage.run(config("ablate.command_line=['lambda=0.1,0.8']", "ablate.metrics=[]"))
    assert not (tmp_path / "ablate").exists()


def test_error_message_and_failure_reason():
    wrapped = "\x1b[31mconfig error:\x1b[0m task=gsm8k split 'test': a.jsonl, line 2: field\n'answer' is null, expected a string\n"
    assert error_message(wrapped) == "config error: task=gsm8k split 'test': a.jsonl, line 2: field 'answer' is null, expected a string"
    assert error_message("progress 10%\rprogress 100%\n\nRuntimeError: CUDA out of memory\n\n") == "RuntimeError: CUDA out of memory"
    assert error_message("Could not override 'x'.\nKey 'x' is not in struct\n") == "Could not override 'x'. Key 'x' is not in struct"
    assert error_message("") == "" and len(error_message("ValueError: " + "x" * 1000)) == 300
    assert failure_reason(1, "ValueError: boom\n", {"error": "loss is nan"}) == "loss is nan"
    assert failure_reason(-9, "", {}) == "killed by SIGKILL (out of memory?)"
    assert failure_reason(3, "", {}) == "exit status 3, nothing in its output"


def run_cli(*args, tmp_path, timeout=600):
    env = {**os.environ, "SMD_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "smd_cli.cli", *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_seeded_sweep_in_parallel_with_joblib_writes_means_and_standard_errors(tmp_path):
    """`smd ablate lambda=0.1,0.8 seed=0,1` on real tiny runs, two at a time: each value's mean and standard error
    over the seeds, computed here from the runs' own summaries."""
    out = tmp_path / "ablate"
    done = run_cli("ablate", "lambda=0.1,0.8", "seed=0,1", "algo=smd", *TINY, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                   f"hydra.run.dir={out}", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Joblib.Parallel(n_jobs=2" in done.stdout + done.stderr
    rows = list(csv.DictReader((out / "ablation.csv").open()))
    assert sorted((r["lambda"], r["seed"]) for r in rows) == [("0.1", "0"), ("0.1", "1"), ("0.8", "0"), ("0.8", "1")]
    means = {r["lambda"]: r for r in csv.DictReader((out / "ablation_mean.csv").open())}
    for lam in ("0.1", "0.8"):
        values = [json.loads((Path(r["dir"]) / "summary.json").read_text())["eval/evict/reward_before"] for r in rows if r["lambda"] == lam]
        mean = sum(values) / 2
        se = (sum((v - mean) ** 2 for v in values) / 1) ** 0.5 / 2 ** 0.5
        assert float(means[lam]["eval/evict/reward_before"]) == pytest.approx(mean)
        assert float(means[lam]["eval/evict/reward_before se"]) == pytest.approx(se, abs=1e-12)
        assert means[lam]["n"] == "2"
    for r in rows:
        assert float(r["last/mismatch/max_abs_diff"]) <= 1e-5  # SMD: the learner sees what the sampler saw
        config = json.loads((Path(r["dir"]) / "config.json").read_text())
        assert config["lambda"] == float(r["lambda"]) and config["seed"] == int(r["seed"]) and config["steps"] == 2
    assert (out / "ablation_mean.png").stat().st_size > 10_000 and "| lambda |" in (out / "ablation_mean.md").read_text()


@pytest.mark.slow
def test_submitit_launcher_runs_a_member(tmp_path):
    """The cluster launcher (submitit, here its local executor): the member runs as a submitit job (one run: the two
    values compose to one config)."""
    out = tmp_path / "ablate"
    done = run_cli("ablate", "lambda=0.5,0.50", "algo=smd", *TINY, "hydra/launcher=submitit_local", f"hydra.run.dir={out}",
                   tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = list(csv.DictReader((out / "ablation.csv").open()))
    assert [r["status"] for r in rows] == ["ok", "ok"] and len({r["dir"] for r in rows}) == 1
    assert any((out / "runs" / ".submitit").rglob("*_result.pkl"))  # what submitit itself wrote for each job


@pytest.mark.slow
def test_ablate_cli_failed_runs_exit_1_with_the_reason(tmp_path):
    """Two real `smd train` runs that stop on a config error found only when they run (a tokenizer that is not there;
    a wrong type or range is refused before the sweep starts): each reason in the table, exit status 1."""
    out = tmp_path / "ablate"
    done = run_cli("ablate", "model.tokenizer=/no/such/tokenizer_a,/no/such/tokenizer_b", "progress=false", f"hydra.run.dir={out}",
                   tmp_path=tmp_path)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "ablate failed: 2 of 2 runs failed" in done.stderr
    rows = list(csv.DictReader((out / "ablation.csv").open()))
    assert [r["status"] for r in rows] == ["failed (exit 2)"] * 2
    for r in rows:
        assert r["error"].startswith(f"config error: model.tokenizer='{r['model.tokenizer']}': could not load its tokenizer")
    assert (out / "ablation.png").is_file() and json.loads((out / "summary.json").read_text())["failed"]
    # the sweep's own process loaded no torch (its members did): `run_dirs.open_sweep_dir`
    assert json.loads((out / "provenance.json").read_text())["versions"]["cuda"] == "not loaded (this process ran no torch)"


def test_console_tables_do_not_break_words_at_140_columns(tmp_path, monkeypatch):
    """The ablate tables on a 140-column terminal: every header word whole (it printed "eval/reward_befor e"), the
    metric each short label stands for in the caption; the CSVs keep the summary keys."""
    import io

    from rich.console import Console

    from smd_cli.report import sweep_tables
    from smd_cli.report.stats import aggregate

    metrics = list(OmegaConf.load(CONF / "ablate.yaml").ablate.metrics)  # the defaults every sweep prints
    monkeypatch.setattr(sweep_tables, "console", Console(width=140, record=True, file=io.StringIO()))
    rows = [{"run": f"lambda={lam},seed={s}", "lambda": lam, "seed": s, "status": "ok", "error": None, "dir": str(tmp_path),
             **{m: 0.123456 + s for m in metrics}} for lam in ("0.1", "0.8") for s in (0, 1)]
    rows[-1].update(status="failed (exit 1)", error="config error: grpo.num_generations=1 is not allowed: an integer >= 2")
    sweep_tables.write_table(tmp_path, rows, ["lambda", "seed"], metrics)
    groups = aggregate(rows, ["lambda"], metrics)
    drawn = sweep_tables.write_means(tmp_path, groups, ["lambda"], metrics, ["seed"], "eval/evict/reward_after")
    text = sweep_tables.console.export_text()
    words = {w for m in metrics for w in sweep_tables.label(m).split()}
    printed = set(text.replace("│", " ").replace("┃", " ").split())
    assert words <= printed, words - printed  # no label word broken across lines
    assert max(len(line) for line in text.splitlines()) <= 140
    assert "evict after = eval/evict/reward_after" in " ".join(text.split())
    assert list(csv.DictReader((tmp_path / "ablation_mean.csv").open()))[0]["eval/evict/reward_after"]
    # the plot: both held-out evaluations per value, with the standard error over the seeds (0.1: seeds 0 and 1 -> se 0.5)
    assert drawn == {("lambda=0.1", "eval/reward_after"): (pytest.approx(0.623456), pytest.approx(0.5)),
                     ("lambda=0.1", "eval/evict/reward_after"): (pytest.approx(0.623456), pytest.approx(0.5)),
                     ("lambda=0.8", "eval/reward_after"): (pytest.approx(0.123456), None),
                     ("lambda=0.8", "eval/evict/reward_after"): (pytest.approx(0.123456), None)}
    assert (tmp_path / "ablation_mean.png").stat().st_size > 10_000


def test_cpu_dtype_auto_is_the_dtype_this_machine_computes_in(monkeypatch):
    """`model.cpu_dtype=auto` runs in bfloat16 on a CPU with native bf16 and in float32 elsewhere: two different runs,
    so two identities (a sweep continued on the other kind of machine runs its members again rather than pairing a
    float32 run with a bfloat16 one). Where auto means float32 the identity is the one recorded before this rule."""
    from smd_cli.model import precision

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        auto, bf16 = (compose("train", overrides=["model=smollm2_135m", "device=cpu", f"model.cpu_dtype={d}"])
                      for d in ("auto", "bfloat16"))
    monkeypatch.setattr(precision, "native_bf16", lambda: False)
    assert sweep.config_identity(auto) == by_hand(auto, False)
    monkeypatch.setattr(precision, "native_bf16", lambda: True)
    assert sweep.config_identity(auto) == by_hand(auto, False, cpu_dtype="bfloat16") == sweep.config_identity(bf16) != by_hand(auto, False)
    auto.device = "cuda"  # a GPU computes in model.dtype whatever the CPU has
    assert sweep.config_identity(auto) == by_hand(auto, False)
