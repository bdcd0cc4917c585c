"""Mistakes a user makes at the command line end in one `config error:` line and exit 2 (or, for a run, its own
status), never a traceback and never a silent fallback: a sweep subset that matches nothing, `smd eval` with a model
that is not the checkpoint's, wrong types of `plan.device_gb` and `lambda`, `only=[]`, square brackets in messages,
damaged or foreign checkpoints, unusable run directories, data paths that are not files, a question longer than the
prompt budget, a damaged metrics log on resume. Each runs `smd` in this process, as a user would from the shell."""

import json
import os
import shutil
import subprocess

import pytest
import torch

from smd_cli.runs import sweep
from smd_cli.runtime import integrity
from tests.conftest import smd

TINY = ["grpo.prompts_per_step=2", "grpo.num_generations=2", "eval.num_prompts=0", "task.prompt_tokens=48",
        "model.warmstart.steps=5", "progress=false"]
GSM8K_ROW = {"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"}


def said(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache):
    """A one-step `smd train` run of the tiny model (its final/ weights and its step_1 checkpoint)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert smd("train", *TINY, "steps=1", f"hydra.run.dir={run}", f"cache_dir={cache}") == 0
    return run


# -- 2: a subset that matches nothing --------------------------------------------------------------------------

def test_an_ablate_subset_of_values_that_are_not_swept_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweep, "member_command", lambda *a: pytest.fail("no run may start"))
    assert smd("ablate", "lambda=0.1,0.8", "ablate.subset=['lambda=0.5']", f"hydra.run.dir={tmp_path / 'sweep'}") == 2
    assert said(capsys) == ("config error: ablate.subset entry 'lambda=0.5' is not allowed: none of its values is among the "
                            "swept values of lambda (0.1, 0.8); keep a subset of those")


# -- 3: smd eval with a model that is not the checkpoint's ------------------------------------------------------

def test_eval_of_a_checkpoint_refuses_another_architecture_and_records_the_one_it_ran(trained, tmp_path, cache, capsys):
    final = trained / "final"
    common = [f"checkpoint={final}", "task.prompt_tokens=48", "eval.limit=2", "progress=false", f"cache_dir={cache}"]
    assert smd("eval", *common, "model=qwen3_4b_random", f"hydra.run.dir={tmp_path / 'a'}") == 2
    assert said(capsys) == (f"config error: model=qwen3_4b_random is not allowed with checkpoint='{final}': the checkpoint's "
                            "architecture differs (vocab_size 541, not 151936; hidden_size 64, not 2560; intermediate_size 192, "
                            "not 9728; num_hidden_layers 2, not 36) (it was trained as model=tiny). smd eval runs the "
                            "checkpoint's own architecture: leave model out, or name the model it was trained as")
    assert smd("eval", *common, "model.config.hidden_size=128", f"hydra.run.dir={tmp_path / 'b'}") == 2
    assert "the checkpoint's architecture differs (hidden_size 64, not 128)" in said(capsys)
    assert not (tmp_path / "a" / "summary.json").exists()
    assert smd("eval", *common, f"hydra.run.dir={tmp_path / 'c'}") == 0  # no model named: the checkpoint's own, recorded
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["model"] == "tiny"


# -- 4, 5, 6: wrong types, rich markup, only=[] -------------------------------------------------------------------

@pytest.mark.parametrize("value, shown", [
    ("24", "plan.device_gb=24 is not allowed: a non-empty list of finite sizes > 0 in GiB, e.g. [80, 141]"),
    ("[80,null]", "plan.device_gb=[80, None] is not allowed"), ("[inf]", "plan.device_gb=[inf] is not allowed"),
    ("[true]", "plan.device_gb=[True] is not allowed"), ("[nan]", "plan.device_gb=[nan] is not allowed"),
])
def test_plan_device_sizes_of_the_wrong_type_are_config_errors(tmp_path, capsys, value, shown):
    assert smd("plan", f"plan.device_gb={value}", f"hydra.run.dir={tmp_path}") == 2
    assert said(capsys).startswith(f"config error: {shown}")  # the list is printed, not eaten as rich markup


def test_a_non_number_lambda_is_a_config_error_in_train_and_in_a_sweep(tmp_path, monkeypatch, capsys):
    assert smd("train", "lambda=abc", f"hydra.run.dir={tmp_path / 'train'}") == 2
    assert said(capsys) == "config error: lambda='abc' is not allowed: a finite number >= 0 (the SMD distillation weight)"
    monkeypatch.setattr(sweep, "member_command", lambda *a: pytest.fail("no run may start"))
    assert smd("ablate", "lambda=0.1,abc", f"hydra.run.dir={tmp_path / 'sweep'}") == 2
    assert said(capsys) == ("config error: ablate run lambda=abc: lambda='abc' is not allowed: a finite number >= 0 "
                            "(the SMD distillation weight)")


def test_reproduce_refuses_an_empty_or_unknown_table_list_before_running_anything(tmp_path, capsys):
    assert smd("reproduce", "quick=true", "only=[]", f"root={tmp_path}") == 2
    assert said(capsys) == ("config error: only=[] is not allowed: null (all of the scale's tables) or a non-empty list of "
                            "tables, e.g. [main, lambda]")
    assert smd("reproduce", "quick=true", "only=[nonsense]", f"root={tmp_path}") == 2
    assert said(capsys) == ("config error: only=['nonsense'] is not allowed: null or a subset of [main, compression, lambda, "
                            "selection]")
    assert not (tmp_path / "bench").exists() and not (tmp_path / "sweeps").exists()


# -- 7: weights cut short without a manifest; a trainer_state.pt that holds code ---------------------------------

def test_eval_of_cut_weights_without_a_manifest_is_a_config_error(trained, tmp_path, capsys):
    foreign = tmp_path / "foreign"
    shutil.copytree(trained / "final", foreign)
    (foreign / integrity.MANIFEST).unlink()
    weights = foreign / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert smd("eval", f"checkpoint={foreign}", "task.prompt_tokens=48", "eval.limit=2", f"hydra.run.dir={tmp_path / 'e'}") == 2
    err = said(capsys)
    assert err.startswith(f"config error: checkpoint='{foreign}': its weights in {foreign} cannot be loaded (")
    assert err.endswith("; it has no MANIFEST.json (not written by smd train), so nothing could check it before loading")


class Payload:
    def __reduce__(self):
        return os.system, ("touch PWNED_BY_TRAINER_STATE",)


def test_a_trainer_state_that_holds_code_is_not_a_checkpoint_this_tool_wrote(trained, tmp_path, cache, capsys, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    step = run / "checkpoints" / "step_000001"
    torch.save({"format": 2, "step": 1, "extra": Payload()}, step / "trainer_state.pt")  # pickles os.system, runs nothing
    integrity.write_manifest(step)  # a manifest that matches: the file came from elsewhere, whole
    monkeypatch.chdir(tmp_path)
    assert smd("train", *TINY, "steps=2", "resume=true", f"hydra.run.dir={run}", f"cache_dir={cache}") == 2
    err = said(capsys)
    assert err.startswith(f"config error: resume=True: {step / 'trainer_state.pt'} is not a checkpoint this tool wrote: it "
                          "holds Python objects that smd never loads, only tensors and plain values")
    assert "weights_only=False" not in err and not (tmp_path / "PWNED_BY_TRAINER_STATE").exists()


# -- 8: run directories smd cannot use -----------------------------------------------------------------------------

def test_unusable_run_directories_are_config_errors(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for where, why in [(a_file, "it is an existing file, not a directory"),
                       (a_file / "run", f"{a_file} is a file, so nothing can be created under it"),
                       ("/proc/smd_run", "a run directory must be a folder smd can create and write to (No such file or directory)")]:
        assert smd("plan", f"hydra.run.dir={where}") == 2
        assert said(capsys) == f"config error: hydra.run.dir='{where}' is not allowed: {why}"
    mount = tmp_path / "ro"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here ({made.stderr.decode().strip()[:80]})")
    try:
        for where in (mount, mount / "run"):  # an existing read-only directory, and a new one on a read-only mount
            assert smd("plan", f"hydra.run.dir={where}") == 2
            assert said(capsys) == (f"config error: hydra.run.dir='{where}' is not allowed: a run directory must be a folder "
                                    "smd can create and write to (Read-only file system)")
    finally:
        subprocess.run(["umount", str(mount)])


# -- 9: data paths that exist but are not files ----------------------------------------------------------------------

def test_a_fifo_or_a_link_to_a_device_is_named_as_such(tmp_path, capsys):
    fifo = tmp_path / "test.jsonl"
    os.mkfifo(fifo)
    link = tmp_path / "zero.jsonl"
    link.symlink_to("/dev/zero")
    for path, what in [(fifo, "a named pipe (FIFO)"), (link, "a character device (a link to /dev/zero)")]:
        assert smd("eval", "task=gsm8k", f"task.data_files={path}", "eval.limit=3", f"hydra.run.dir={tmp_path / 'e'}") == 2
        assert said(capsys) == (f"config error: task=gsm8k split 'test': task.data_files: '{path}' is {what}, not a regular "
                                "file (split 'test')")


# -- 10: a question longer than the prompt budget; a damaged metrics log ------------------------------------------------

def test_a_question_longer_than_the_prompt_budget_is_a_config_error_naming_it(tmp_path, capsys):
    data = tmp_path / "test.jsonl"
    long = {"question": "How many? " + "x y " * 2500, "answer": "#### 1"}  # 10 KB
    data.write_text("".join(json.dumps(r) + "\n" for r in (GSM8K_ROW, long, GSM8K_ROW)))
    for stage in (["eval", "eval.limit=3"], ["prepare-data", "splits=[test]"]):
        assert smd(*stage, "task=gsm8k", f"task.data_files={data}", "progress=false", f"hydra.run.dir={tmp_path / stage[0]}") == 2
        err = said(capsys)
        assert err.startswith(f"config error: task.max_prompt_tokens=2048 is not allowed for gsm8k example gsm8k-test-1 "
                              f"({data}, line 2): its prompt is ")
        assert err.endswith(" tokens and has no document to cut; raise task.max_prompt_tokens (within the model's positions) "
                            "or leave the example out")


def test_a_damaged_middle_line_of_the_metrics_log_is_named_on_resume(trained, tmp_path, cache, capsys, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    (run / "metrics.jsonl").write_text('{"step": 1, "rew\n{"step": 2}\n')
    monkeypatch.setattr("smd_cli.runs.warm_cache.warm_start", lambda *a, **k: pytest.fail("the warm start ran"))
    assert smd("train", *TINY, "steps=2", "resume=true", f"hydra.run.dir={run}", f"cache_dir={cache}") == 2
    assert said(capsys) == (f"config error: resume=True: {run / 'metrics.jsonl'}:1: not valid JSON (Unterminated string "
                            "starting at); only a torn last line (a write cut short by a kill) is dropped on its own: restore the "
                            "file or repair that line, then resume (or start a new run)")


# -- misleading output (issue 40's probe) ------------------------------------------------------------------------

@pytest.mark.parametrize("stage, args, shown", [
    ("train", ["compression=adaptive", "eviction=none"], "compression=adaptive is not allowed with eviction=none: it keeps every "
     "KV entry whatever the compression, so the controller would log a compression nothing applies"),  # before: logged 0.3
    ("train", ["compression=adaptive", "sampling.max_new_tokens=1"], "sampling.max_new_tokens=1 is not allowed with "
     "compression=adaptive: at least 2 (the first response token is predicted by the dense prefill"),  # before: p5 1.0 drove it
    ("plan", ["compression=adaptive", "adaptive.min_compression=0.8", "adaptive.max_compression=0.5"],
     "adaptive.min_compression=0.8 is not allowed: at most adaptive.max_compression=0.5"),  # before: planned, train refused
    ("ablate", ["algo=smd,dense", "compression=adaptive"], "ablate run algo=dense: compression=adaptive is not allowed with "
     "algo=dense: it samples without eviction"),  # before: passed the sweep's pre-check, failed when the member ran
], ids=["adaptive without eviction", "adaptive with one token", "plan", "sweep"])
def test_adaptive_settings_train_refuses_are_refused_by_every_stage_before_anything_runs(tmp_path, capsys, monkeypatch, stage, args, shown):
    monkeypatch.setattr(sweep, "member_command", lambda *a: pytest.fail("no run may start"))
    assert smd(stage, *TINY, *args, f"hydra.run.dir={tmp_path / stage}") == 2
    assert said(capsys).startswith(f"config error: {shown}")


def test_an_unjudged_learner_row_says_why_and_adaptive_keys_under_a_fixed_compression_are_noted(tmp_path, cache, capsys):
    """Before: `algo=dense kv.quant=int8` printed a "parity" row (1.8e-3) with no word that it is not judged or that the
    cache is int8; `adaptive.target=0.5` with a fixed compression was ignored without a note."""
    assert smd("train", *TINY, "steps=1", "algo=dense", "kv.quant=int8", "adaptive.target=0.5", f"hydra.run.dir={tmp_path / 'run'}",
               f"cache_dir={cache}") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("note: adaptive.target=0.5: read only with compression=adaptive; this run's compression is fixed at 0.5, so nothing "
            "reads them") in out
    assert "sampler: no eviction, KV cache int8" in out and "│ parity:" not in out
    assert "learner vs sampler, not judged (the sampler's KV cache is int8, the dense learner reads full precision)" in out


def test_eval_of_one_example_says_it_has_no_standard_error(trained, tmp_path, cache, capsys):
    assert smd("eval", f"checkpoint={trained / 'final'}", "task.prompt_tokens=48", "eval.limit=1", "progress=false",
               f"cache_dir={cache}", f"hydra.run.dir={tmp_path / 'eval'}") == 0
    out = capsys.readouterr().out
    assert "(one example: no standard error)" in out and "nan" not in out  # before: `1.0000 ± nan`
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())["metric_stderr"] is None
