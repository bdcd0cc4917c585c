"""What `smd STAGE ARGS` judges of its command line before Hydra runs anything or makes a folder (issue 27 item 4):
a `check-parity` policy that is not a conf/eviction/ option, a `-m` sweep directory that is a file, a `-m` sweep
with a value its stage refuses (every run is checked before the first starts), a run directory Hydra cannot parse
or resolve (nothing is left behind), and `+KEY=VALUE` adding a key no stage reads (a warning naming the closest
known key). Each runs `smd` in this process, as a user would; none runs a model."""

import pytest

from smd_cli.runs import sweep
from smd_cli.stages import check_parity, train
from tests.conftest import smd


def said(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


@pytest.fixture
def nothing_runs(monkeypatch):
    for stage in (train, check_parity):
        monkeypatch.setattr(stage, "run", lambda cfg: pytest.fail("no run may start"))
    monkeypatch.setattr(sweep, "member_command", lambda *a: pytest.fail("no member may start"))


def test_a_check_parity_policy_that_is_a_path_is_a_config_error(tmp_path, capsys):
    assert smd("check-parity", "policies=[../algo/smd]", "model.warmstart.steps=0", "num_prompts=1", "num_generations=1",
               "device=cpu", "progress=false", f"hydra.run.dir={tmp_path / 'run'}") == 2
    err = said(capsys)
    assert err.startswith("config error: policies=['../algo/smd'] is not allowed: null (the composed eviction), all, or a list "
                          "of conf/eviction/ option names: "), err
    assert "snapkv" in err and "Traceback" not in err


def test_a_sweep_directory_that_is_a_file_is_a_config_error(tmp_path, capsys, nothing_runs):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert smd("train", "-m", "steps=1", f"hydra.sweep.dir={a_file}") == 2
    assert said(capsys) == f"config error: hydra.sweep.dir='{a_file}' is not allowed: it is an existing file, not a directory"


@pytest.mark.parametrize("stage, values, prefix", [("train", "0.1,abc", "-m run"), ("ablate", "abc,0.1", "ablate run")])
def test_every_run_of_a_sweep_is_checked_before_the_first_starts(stage, values, prefix, tmp_path, capsys, nothing_runs):
    """`smd train -m` checks every run of its sweep, `smd ablate -m` every member of each ablate run, before any starts."""
    out = tmp_path / "sweep"
    assert smd(stage, "-m", f"lambda={values}", f"hydra.sweep.dir={out}") == 2
    assert said(capsys) == (f"config error: {prefix} lambda=abc: lambda='abc' is not allowed: a finite number >= 0 "
                            "(the SMD distillation weight)")
    assert not out.exists()


def test_a_valid_sweep_runs_every_member(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert smd("plan", "-m", "seed=0,1", f"hydra.sweep.dir={out}") == 0
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["0", "1"]


@pytest.mark.parametrize("name, why", [
    ("run[1]", "Hydra cannot parse it (mismatched input '[' expecting <EOF>); quote a value that holds [ ] { } ( ) = or spaces, "
               "e.g. hydra.run.dir='{where}'"),
    ("run_${nope:1}", "it uses ${nope:...}, a resolver OmegaConf does not have (e.g. ${now:%H-%M-%S}, ${oc.env:VAR})"),
])
def test_a_run_directory_hydra_cannot_read_leaves_nothing_behind(tmp_path, capsys, nothing_runs, name, why):
    where = tmp_path / "new" / "deeper" / name
    assert smd("train", f"hydra.run.dir={where}") == 2
    assert said(capsys) == f"config error: hydra.run.dir='{where}' is not allowed: {why.replace('{where}', str(where))}"
    assert list(tmp_path.iterdir()) == []


def test_a_usable_run_directory_is_tried_and_left_for_hydra_to_make(tmp_path, capsys):
    from smd_cli.cli import run_dir_problem

    assert run_dir_problem(tmp_path / "a" / "b") is None
    assert list(tmp_path.iterdir()) == []


def test_the_try_never_removes_a_run_directory_another_rank_made_meanwhile(tmp_path, monkeypatch):
    """Under torchrun every rank tries the run directory while Hydra makes it in the others: a rank that removed the
    (still empty) directory it had made for its try once took it from under another rank's log file."""
    import tempfile

    from smd_cli.cli import run_dir_problem

    run = tmp_path / "a" / "b"
    for name in ("mkdtemp", "TemporaryFile"):  # whichever the try uses, another rank's Hydra makes `run` during it
        real = getattr(tempfile, name)
        monkeypatch.setattr(tempfile, name, lambda *a, _real=real, **k: (run.mkdir(parents=True, exist_ok=True), _real(*a, **k))[1])
    assert run_dir_problem(run) is None
    assert run.is_dir() and list(run.iterdir()) == []


def test_an_added_key_no_stage_reads_is_warned_about_with_the_closest_known_key(tmp_path, capsys):
    assert smd("train", "+sampling.topk=5", "+task.size={test:3}", "+recipe=tiny_smd", "lambda=abc", f"hydra.run.dir={tmp_path}") == 2
    assert said(capsys) == ("warning: +sampling.topk=5 sets a key no stage reads; did you mean sampling.top_k? "
                            "config error: lambda='abc' is not allowed: a finite number >= 0 (the SMD distillation weight)")
