"""Runs that cannot be damaged from outside or by accident (issue 40): a stage never writes into another stage's run
folder nor through a link in it; what a resume reads back (the metrics log up to its checkpoint, the checkpoint's
weights) is checked and a mismatch named; Ctrl-C and a file-size limit end a run with one line and a status in
summary.json, and the run continues from its last checkpoint. Each through `smd`, as a user runs it."""

import json
import os
import resource
import shutil
import subprocess
import sys

import pytest

from smd_cli.runtime import integrity
from smd_cli.stages import train
from tests.conftest import smd

TINY = ["grpo.prompts_per_step=2", "grpo.num_generations=2", "eval.num_prompts=0", "task.prompt_tokens=48",
        "model.warmstart.steps=5", "progress=false", "checkpoint.every=1"]


def said(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())  # rich wraps at the terminal's width


def summary(run) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache):
    """A finished two-step `smd train` run of the tiny model, a checkpoint at each step."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert smd("train", *TINY, "steps=2", f"hydra.run.dir={run}", f"cache_dir={cache}") == 0
    return run


def files(run) -> dict:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("stage", [["eval", "eval.limit=1"], ["rollout", "num_prompts=1"]], ids=["eval", "rollout"])
def test_a_stage_refuses_the_folder_of_another_stages_run_and_changes_nothing(trained, tmp_path, cache, capsys, stage):
    """Before: `smd eval ... hydra.run.dir=RUN` on a finished training run replaced its summary.json, config.json and
    provenance.json (and Hydra its .hydra/): the training status and held-out results were gone."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    before = files(run)
    stage = [*stage, "task.prompt_tokens=48", "model.warmstart.steps=5", "progress=false", f"cache_dir={cache}"]  # the warm start cached
    assert smd(*stage, f"hydra.run.dir={run}") == 2
    assert said(capsys) == (f"config error: hydra.run.dir={str(run)!r} is not allowed: it holds a `smd train` run, whose summary.json, "
                            f"config.json and provenance.json `smd {stage[0]}` would replace; write this one beside it, e.g. "
                            f"hydra.run.dir={run / stage[0]}")
    assert files(run) == before
    assert smd(*stage, f"hydra.run.dir={run / stage[0]}") == 0
    assert files(run).items() >= before.items() and summary(run)["status"] == "completed"  # beside it: the run is intact


@pytest.mark.parametrize("name", [".lock", "train.log", "final"])
def test_a_run_folder_holding_a_link_where_a_file_is_written_is_refused(trained, tmp_path, cache, capsys, name):
    """Before: RUN/.lock linked elsewhere was written through; RUN/final as a link ended, after training, in a chained
    traceback that left final.old and failed every later resume."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    shutil.copytree(trained, run)
    shutil.copytree(trained / "final", outside / "final")
    (outside / "note.txt").write_text("keep me")
    target = outside / ("final" if name == "final" else "note.txt")
    if (run / name).is_dir():
        shutil.rmtree(run / name)
    else:
        (run / name).unlink(missing_ok=True)
    (run / name).symlink_to(target)
    outside_before = files(outside)
    assert smd("train", *TINY, "steps=3", "resume=true", f"hydra.run.dir={run}", f"cache_dir={cache}") == 2
    assert said(capsys) == (f"config error: hydra.run.dir={str(run)!r} is not allowed: {run / name} is a symbolic link (to {target}): "
                            "smd and Hydra write a run's files by name and never through a link; remove the link, or choose "
                            "another directory")
    assert files(outside) == outside_before and (run / name).is_symlink() and not (run / "final.old").exists()


def test_a_resume_whose_metrics_log_lost_steps_before_the_checkpoint_is_refused_naming_them(trained, tmp_path, cache, capsys):
    """Before: a metrics.jsonl cut to its first line resumed silently, and the run's statistics came from what was left."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    first = (run / "metrics.jsonl").read_text().splitlines(keepends=True)[0]
    (run / "metrics.jsonl").write_text(first)
    assert smd("train", *TINY, "steps=3", "resume=true", f"hydra.run.dir={run}", f"cache_dir={cache}") == 2
    assert said(capsys) == (f"config error: resume=True: {run / 'metrics.jsonl'} lacks 1 of the 2 steps before the run's checkpoint "
                            "(steps 2): its statistics would be computed from 1 of them; only a torn last line (a write cut short "
                            "by a kill) is dropped on its own: restore the file or repair that line, then resume (or start a new run)")
    assert (run / "metrics.jsonl").read_text() == first


def test_a_checkpoint_whose_weights_header_is_corrupt_but_matches_its_manifest_is_set_aside(trained, tmp_path, cache, capsys):
    """Before: the manifest vouched for it (written after the damage), and resume died in safetensors with a traceback."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    step2 = run / "checkpoints" / "step_000002"
    weights = step2 / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:20] = b"\xff" * 12  # inside the JSON header that follows the 8-byte length
    weights.write_bytes(bytes(data))
    integrity.write_manifest(step2)
    assert not integrity.verify(step2)
    assert smd("train", *TINY, "steps=3", "resume=true", f"hydra.run.dir={run}", f"cache_dir={cache}") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (f"warning: {step2} is corrupt (model/model.safetensors cannot be read as safetensors (SafetensorError: Error while "
            "deserializing header") in out and "resuming from the newest intact checkpoint, step_000001" in out
    assert (run / "checkpoints" / "step_000002.corrupt").is_dir() and summary(run)["status"] == "completed"


def test_ctrl_c_ends_a_run_with_one_line_a_status_and_the_command_that_continues(tmp_path, cache, capsys, monkeypatch):
    """Before: about 100 lines of traceback, no status in summary.json, no word of how to continue."""
    run = tmp_path / "run"
    step = train.learner_step

    def interrupted_at_step_3(*args, **kwargs):
        if (run / "checkpoints" / "step_000002").is_dir():
            raise KeyboardInterrupt  # what Ctrl-C raises in the main thread
        return step(*args, **kwargs)

    monkeypatch.setattr(train, "learner_step", interrupted_at_step_3)
    assert smd("train", *TINY, "steps=4", f"hydra.run.dir={run}", f"cache_dir={cache}") == 130
    err = said(capsys)
    again = f"smd train {' '.join(TINY)} steps=4 cache_dir={cache} hydra.run.dir={run} resume=true"
    assert err == (f"interrupted: Ctrl-C at step 2 of 4; last checkpoint: {run / 'checkpoints' / 'step_000002'} (step 2); "
                   f"continue with: {again}")
    assert {k: summary(run)[k] for k in ("status", "status_reason", "steps", "steps_run", "resume_command")} == {
        "status": "interrupted", "status_reason": "interrupted by Ctrl-C, at step 2 of 4", "steps": 4, "steps_run": 2,
        "resume_command": again}
    monkeypatch.undo()
    assert smd("train", *TINY, "steps=4", "resume=true", f"hydra.run.dir={run}", f"cache_dir={cache}") == 0
    assert summary(run)["status"] == "completed" and summary(run)["steps_run"] == 4


def test_a_file_size_limit_during_a_checkpoint_is_one_line_and_a_status(trained, tmp_path, cache, capsys):
    """`ulimit -f` (a quota per file) below the checkpoint's size: before, three chained tracebacks and no summary. The
    limit is this process's own for the run (a soft limit, raised back after it; the warm start is cached by `trained`)."""
    run = tmp_path / "run"
    limit = 600 * 1024  # the tiny model's safetensors is about 0.6 MB, its summary and logs a few KB
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        code = smd("train", *TINY, "steps=1", f"hydra.run.dir={run}", f"cache_dir={cache}")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    err = said(capsys)
    assert code == 1 and "Traceback" not in err, err
    assert err.startswith(f"file too large: a file-size limit stopped the write of checkpoint step 1 to "
                          f"{run / 'checkpoints' / 'step_000001'} (this process may write files of at most {limit:,} bytes: "
                          "`ulimit -f`); the partial write was removed"), err
    assert err.endswith(f"resume=true. Stopped at step 1 of 1; last checkpoint: none yet (resuming starts again at step 0); continue "
                        f"with: smd train {' '.join(TINY)} steps=1 cache_dir={cache} hydra.run.dir={run} resume=true"), err
    assert summary(run)["status"] == "failed" and not list((run / "checkpoints").iterdir())


CHILD = r"""
import pathlib, signal, sys, time
here = pathlib.Path(sys.argv[1])
def said_where(*_):
    time.sleep(1)  # writing its summary takes a moment
    print("interrupted: Ctrl-C at step 3 of 9", file=sys.stderr, flush=True)
    (here / "said").write_text("")
    sys.exit(130)
signal.signal(signal.SIGINT, said_where)
print("ready", flush=True)
(here / "ready").write_text("")
time.sleep(30)
"""


@pytest.mark.parametrize("runner", ["sweep", "reproduce"])
def test_ctrl_c_gives_a_child_the_time_to_say_where_it_stopped(tmp_path, runner, request):
    """Ctrl-C reaches the whole process group: `smd ablate` (and `smd reproduce`) wait for the member (the sweep) to
    write its status and its one line, which lands in its console.log, instead of killing it at once."""
    import signal
    import threading
    import time

    from smd_cli.runs import sweep
    from smd_cli.stages import reproduce

    command = [sys.executable, "-c", CHILD, str(tmp_path)]

    main = threading.main_thread().ident

    def ctrl_c():  # as the terminal does: SIGINT to the child and to this process, once the child is ready
        deadline = time.time() + 60
        while not (tmp_path / "ready").exists() and time.time() < deadline:
            time.sleep(0.02)
        for pid in subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split():
            os.kill(int(pid), signal.SIGINT)
        # to the main thread itself: a signal sent to the process may land on this thread, leaving the main one blocked in
        # its wait (it then finished normally in one suite run)
        signal.pthread_kill(main, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, whatever an earlier test left
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    threading.Thread(target=ctrl_c, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        if runner == "sweep":
            sweep.run_logged(command, tmp_path / "console.log", stream=False)
        else:
            reproduce.run_logged(command)
    assert (tmp_path / "said").exists()  # before: killed at once (the sweep), or after 0.25 s (subprocess.run)
    if runner == "sweep":
        assert (tmp_path / "console.log").read_text() == "ready\ninterrupted: Ctrl-C at step 3 of 9\n"


def test_ctrl_c_of_a_sweep_is_one_line_and_its_summary_says_interrupted(tmp_path, capsys, monkeypatch):
    from smd_cli.runs import sweep

    monkeypatch.setattr(sweep, "member_command", lambda *a: pytest.fail("no run may start"))

    def interrupted(members, runs_dir):
        raise KeyboardInterrupt

    import smd_cli.stages.ablate as ablate

    monkeypatch.setattr(ablate, "launch", interrupted)
    assert smd("ablate", "lambda=0.1,0.8", *TINY, f"hydra.run.dir={tmp_path / 'sweep'}") == 130
    err = said(capsys)
    assert err.startswith(f"interrupted: Ctrl-C: 0 of 2 runs of the sweep are finished in {tmp_path / 'sweep' / 'runs'} (kept; an "
                          "interrupted one resumes from its last checkpoint); continue with: smd ablate "), err
    assert err.endswith(f"hydra.run.dir={tmp_path / 'sweep'}") and "lambda=0.1,0.8" in err
    found = summary(tmp_path / "sweep")
    assert found["status"] == "interrupted" and [r["status"] for r in found["runs"]] == ["failed", "failed"]
