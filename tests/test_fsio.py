"""One way to write files (`smd_cli.runtime.integrity`), through the entry points that write: the real model's weights cache
(`load_model` with a fake GGUF package whose dequantisation writes a tiny model), the warm-start cache, run
directories and checkpoints (`smd train`), the shadow masks (`smd rollout`) and sweeps sharing a runs directory
(`smd ablate`). Each failure is named (`disk full`, `read-only`, `a file, not a folder`, `malformed`), a killed
write leaves nothing behind after the next use, a waiting process says for whom, and the lock comes first."""

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from safetensors import SafetensorError

from smd_cli.cli import CONF_DIR
from smd_cli.config.validation import ConfigError
from smd_cli.model import weights
from smd_cli.runs import model_loading, run_dirs, sweep
from smd_cli.runtime import integrity
from smd_cli.stages import rollout as rollout_stage
from tests.conftest import smd

ROOT = CONF_DIR.parent
PACKAGE = "smd_fake_gguf_pkg"
GGUF = "fake.Q4_1.gguf"
TRAIN = ["grpo.prompts_per_step=2", "grpo.num_generations=2", "eval.num_prompts=0", "task.prompt_tokens=40",
         "model.warmstart.steps=2", "progress=false", "checkpoint.keep_last=null"]
# what safetensors (Rust) raises when the disk fills
FULL = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'


# -- a fake GGUF package: the weights cache without a minute of dequantisation --------------------------------------

@pytest.fixture
def gguf(tmp_path, monkeypatch):
    """A package shipping a (fake) GGUF file; its 'dequantisation' saves a tiny Qwen3 and its tokenizer. Returns
    (the list of folders written so far, the cache entry's path)."""
    site = tmp_path / "site"
    (site / PACKAGE).mkdir(parents=True)
    (site / PACKAGE / "__init__.py").write_text("")
    (site / PACKAGE / GGUF).write_bytes(b"GGUF fake weights")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(model_loading, "_SOURCES", {})
    built = []

    def dequantise(gguf_path, out):
        from smd_cli.model.build import build_tiny_model, build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
        build_tiny_model(len(tokenizer), seed=0).save_pretrained(out)
        tokenizer.save_pretrained(out)
        built.append(out)

    monkeypatch.setattr(weights, "_write_dequantised", dequantise)
    digest = integrity.sha256(site / PACKAGE / GGUF)
    return built, tmp_path / "cache" / "models" / digest[:16]


def real_model_config(tmp_path, cache=None, *overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("rollout", overrides=["model=smollm2_135m", "model.source=gguf", f"model.gguf.package={PACKAGE}",
                                             f"model.gguf.file={GGUF}", f"cache_dir={cache or tmp_path / 'cache'}", "device=cpu",
                                             "progress=false", *overrides])


def load(cfg):
    import torch

    model_loading._SOURCES.clear()
    return model_loading.load_model(cfg, None, torch.device("cpu"), progress=False)


def test_a_read_only_cache_holding_valid_weights_is_read_and_one_without_them_is_named(tmp_path, gguf, monkeypatch):
    built, entry = gguf
    load(real_model_config(tmp_path))
    assert len(built) == 1 and not integrity.verify(entry)
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):  # what a read-only mount answers to anything that writes
        if str(path).startswith(str(tmp_path / "cache")) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    model, _ = load(real_model_config(tmp_path))  # before: OSError EROFS opening the lock file
    assert len(built) == 1 and model.config.smd_weights["source"] == "gguf"
    (tmp_path / "cache" / "models").rename(tmp_path / "cache" / "elsewhere")  # the read-only cache lacks the weights
    with pytest.raises(ConfigError, match=r"cache_dir='.*cache' is not allowed: .*cache/models is on a read-only file system: "
                                          r"the lock for building the weights .*86e1.* cannot be written there"):
        load(real_model_config(tmp_path))


def test_a_really_read_only_cache_serves_the_warm_start_it_holds(tmp_path, capsys):
    cache = tmp_path / "cache"
    args = [*TRAIN, "steps=0", f"cache_dir={cache}"]
    assert smd("train", *args, f"hydra.run.dir={tmp_path / 'a'}") == 0
    made = subprocess.run(f"mount --bind {cache} {cache} && mount -o remount,bind,ro {cache}", shell=True, capture_output=True, text=True)
    if made.returncode != 0:
        subprocess.run(["umount", str(cache)], capture_output=True)
        pytest.skip(f"cannot make a read-only mount here ({made.stderr.strip()[:80]})")
    try:
        capsys.readouterr()
        assert smd("train", *args, f"hydra.run.dir={tmp_path / 'b'}") == 0  # before: OSError EROFS opening the lock file
        assert "warm start: reusing" in capsys.readouterr().out
        code = smd("train", *args, "model.warmstart.steps=3", f"hydra.run.dir={tmp_path / 'c'}")  # not in the cache
        said = " ".join(capsys.readouterr().err.split())
        assert code == 2 and f"config error: cache_dir='{cache}' is not allowed: {cache / 'warmstart'} is on a read-only file system" in said, said
    finally:
        subprocess.run(["umount", str(cache)], capture_output=True)


@pytest.mark.parametrize("where", ["cache_dir", "SMD_CACHE_DIR"])
def test_a_cache_dir_that_is_a_file_is_a_config_error(tmp_path, gguf, monkeypatch, capsys, where):
    afile = tmp_path / "not_a_folder"
    afile.write_text("x")
    if where == "SMD_CACHE_DIR":
        monkeypatch.setenv("SMD_CACHE_DIR", str(afile))
        cfg = real_model_config(tmp_path, "${oc.env:SMD_CACHE_DIR}")
        key = r"cache_dir \(from SMD_CACHE_DIR\)"
    else:
        cfg = real_model_config(tmp_path, afile)
        key = "cache_dir"
    with pytest.raises(ConfigError, match=rf"{key}='{afile}' is not allowed: {afile} is a file, not a folder"):
        load(cfg)  # before: NotADirectoryError
    # the tiny model's warm-start cache, through the CLI
    code = smd("train", *TRAIN, "steps=1", f"hydra.run.dir={tmp_path / 'run'}", *([f"cache_dir={afile}"] if where == "cache_dir" else []))
    said = " ".join(capsys.readouterr().err.split())
    assert code == 2 and re.search(rf"config error: {key}='{afile}' is not allowed: {afile} is a file, not a folder", said), said


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), SafetensorError(FULL)], ids=["errno", "safetensors"])
def test_a_full_disk_while_dequantising_is_named_and_leaves_nothing(tmp_path, gguf, monkeypatch, error):
    built, entry = gguf

    def full(gguf_path, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise error

    monkeypatch.setattr(weights, "_write_dequantised", full)
    with pytest.raises(OSError) as raised:
        load(real_model_config(tmp_path))
    assert raised.value.errno == errno.ENOSPC
    assert f"no space left on device while writing the dequantised weights of {GGUF} to {entry}" in str(raised.value)
    assert sorted(p.name for p in entry.parent.iterdir()) == [f".{entry.name}.lock"]  # no temporary, no entry


def test_a_dequantisation_killed_by_sigkill_leaves_no_temporary_after_the_next_use(tmp_path, gguf, capsys):
    built, entry = gguf
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(tmp_path / 'site')!r})
        from pathlib import Path
        from smd_cli.model import weights
        def slow(gguf_path, out):
            (out / "model.safetensors").write_bytes(b"x" * 4096)
            print("writing", flush=True)
            time.sleep(60)
        weights._write_dequantised = slow
        weights.resolve("HuggingFaceTB/SmolLM2-135M-Instruct", {{"package": {PACKAGE!r}, "file": {GGUF!r}}},
                        {str(tmp_path / 'cache')!r}, "gguf", progress=False)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    left = [p.name for p in entry.parent.glob(".*.tmp")]
    assert left == [f".{entry.name}.{proc.pid}@{integrity._HOST}.tmp"]  # what a kill -9 leaves (517 MB for SmolLM2)
    load(real_model_config(tmp_path, None, "progress=true"))
    assert not list(entry.parent.glob(".*.tmp")) and not integrity.verify(entry) and len(built) == 1
    assert f"removed 1 temporary folder(s) a killed build left: {left[0]}" in capsys.readouterr().out


def test_only_temporaries_of_dead_owners_on_this_host_are_abandoned(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    names = {"mine": f".x.{os.getpid()}@{integrity._HOST}.tmp", "dead": f".x.{dead.pid}@{integrity._HOST}.tmp",
             "other host": f".x.{dead.pid}@another-host.tmp", "old style": ".x.k2j4h1.tmp", "other entry": f".y.{dead.pid}@{integrity._HOST}.tmp"}
    for name in names.values():
        (tmp_path / name).mkdir()
    assert [p.name for p in integrity.abandoned(tmp_path, "x")] == sorted([names["dead"], names["old style"]])


def aged(path: Path, seconds: float) -> Path:
    """`path` (and what is in it) last changed `seconds` ago."""
    for p in [path, *path.rglob("*")]:
        os.utime(p, (time.time() - seconds,) * 2, follow_symlinks=False)
    return path


def test_a_killed_build_of_another_hostname_is_removed_once_no_process_holds_it(tmp_path, gguf, capsys):
    """Issue 40: temporaries were removed only when named by this host, so after a container restart (a new hostname) a
    killed weights-cache build stayed on disk for good. Its writer's flock is gone: the next build removes it."""
    built, entry = gguf
    entry.parent.mkdir(parents=True)
    left = entry.with_name(f".{entry.name}.4242@old-container.tmp")
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"x" * 4096)
    aged(left, integrity.GRACE + 5)
    load(real_model_config(tmp_path, None, "progress=true"))
    assert not left.exists() and f"removed 1 temporary folder(s) a killed build left: {left.name}" in capsys.readouterr().out


def test_a_temporary_whose_writer_holds_it_is_never_abandoned_whatever_its_host_or_age(tmp_path):
    held = tmp_path / ".x.4242@another-host.tmp"
    held.mkdir()
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, time
        fd = os.open({str(held)!r}, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("holding", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "holding"
        aged(held, integrity.STALE + 5)
        young = tmp_path / ".x.4243@another-host.tmp"
        young.mkdir()  # nobody holds it, but it may be a writer about to take its lock
        assert integrity.abandoned(tmp_path, "x") == []
    finally:
        writer.kill()
        writer.wait()
    assert integrity.abandoned(tmp_path, "x") == [held]  # its writer died (the kernel dropped the flock)

    def write(folder):  # while a write is under way its temporary is held, even in the eyes of this very process
        assert integrity.abandoned(tmp_path, "y") == [] and len(list(tmp_path.glob(".y.*.tmp"))) == 1
        aged(folder, integrity.STALE + 5)
        assert integrity.abandoned(tmp_path, "y") == []

    integrity.write_dir(tmp_path / "y", write, "a folder")
    assert not integrity.verify(tmp_path / "y")


def test_nothing_is_written_through_a_link_or_over_one(tmp_path):
    """Issue 40: RUN/.lock linked elsewhere was written through (O_CREAT follows links), a log opened for writing
    truncated its link's target, and RUN/final as a link ended in a chained traceback that left final.old."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    (outside / "model").mkdir()
    (outside / "model" / "weights").write_text("old weights")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(outside / "precious.txt")
    (run / "console.log").symlink_to(outside / "precious.txt")
    (run / "summary.json").symlink_to(outside / "precious.txt")
    (run / "final").symlink_to(outside / "model")
    with pytest.raises(integrity.Unwritable, match=re.escape(f"{run / '.lock'} is a symbolic link (to {outside / 'precious.txt'})")):
        integrity.hold(run)
    with pytest.raises(ConfigError, match="is a symbolic link"):  # what a stage says
        run_dirs.lock_run_dir(run)
    with pytest.raises(integrity.Unwritable, match="console.log is a symbolic link"):
        integrity.open_new(run / "console.log", "a run's console.log")
    with pytest.raises(integrity.Unwritable, match="console.log is a symbolic link"):
        integrity.append_line(run / "console.log", "a line")
    with pytest.raises(integrity.Unwritable, match="summary.json is a symbolic link"):
        integrity.write_file(run / "summary.json", "{}")
    with pytest.raises(integrity.Unwritable, match="final is a symbolic link"):
        integrity.write_dir(run / "final", lambda folder: (folder / "weights").write_text("new"), "the final weights")
    assert (outside / "precious.txt").read_text() == "keep me" and (outside / "model" / "weights").read_text() == "old weights"
    assert sorted(p.name for p in run.iterdir()) == [".lock", "console.log", "final", "summary.json"]  # no final.old, no temporary
    assert all((run / name).is_symlink() for name in (".lock", "console.log", "final", "summary.json"))


def test_a_sweep_members_console_log_linked_elsewhere_is_not_written(tmp_path):
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("keep me")
    (tmp_path / "member").mkdir()
    (tmp_path / "member" / "console.log").symlink_to(outside)
    with pytest.raises(integrity.Unwritable, match="console.log is a symbolic link"):
        sweep.run_logged([sys.executable, "-c", "print('output')"], tmp_path / "member" / "console.log", stream=False)
    assert outside.read_text() == "keep me"


@pytest.mark.parametrize("error, free, named", [
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), 10 << 20, None),  # before: "disk full"
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 584960 vs 584852"), 10 << 20, integrity.DiskFull),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 584960 vs 584852"), 10 << 30, None),
    (OSError(errno.EFBIG, "File too large"), 10 << 30, integrity.FileTooLarge),
    (RuntimeError('Error while serializing: IoError(Os { code: 27, kind: FileTooLarge, message: "File too large" })'), 10 << 30,
     integrity.FileTooLarge),
], ids=["other error, low space", "torch's words, low space", "torch's words, space", "EFBIG", "safetensors EFBIG"])
def test_only_a_write_that_ran_out_of_room_is_called_disk_full(tmp_path, monkeypatch, error, free, named):
    monkeypatch.setattr(integrity.shutil, "disk_usage", lambda place: SimpleNamespace(free=free))
    found = integrity.named_failure(error, tmp_path / "file", "a checkpoint")
    assert (found is None) if named is None else isinstance(found, named), found


def test_a_malformed_weights_record_is_named_or_rebuilt(tmp_path, gguf):
    built, entry = gguf
    load(real_model_config(tmp_path))
    named = tmp_path / "named"
    entry.rename(named)
    (named / "weights.json").write_text("[]")  # valid JSON, not the record
    with pytest.raises(ConfigError, match=r"weights.json is malformed: it holds a JSON list, not an object"):
        load(real_model_config(tmp_path, None, f"model.name_or_path={named}"))  # before: AttributeError
    named.rename(entry)
    (entry / "weights.json").write_text(json.dumps({"source": "gguf", "name": 3, "precision": "p"}))
    integrity.write_manifest(entry)  # the manifest matches: only the record's shape is wrong
    model, _ = load(real_model_config(tmp_path))
    assert len(built) == 2 and model.config.smd_weights["name"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_process_waiting_for_the_weights_says_for_which_pid(tmp_path, gguf, capsys):
    built, entry = gguf
    lock = entry.with_name(f".{entry.name}.lock")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from smd_cli.runtime import integrity
        with integrity.exclusive(__import__("pathlib").Path({str(lock)!r})):
            print("holding", flush=True)
            time.sleep(1.5)
    """)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert holder.stdout.readline().strip() == "holding"
    assert lock.read_text().startswith(f"pid {holder.pid} on {socket.gethostname()} since ")  # the lock names its holder
    load(real_model_config(tmp_path, None, "progress=true"))
    holder.wait()
    said = capsys.readouterr().out
    assert f"weights: waiting for pid {holder.pid} on {socket.gethostname()} since " in said and f"to release {lock}" in said


# -- checkpoints, shadow masks, JSON ----------------------------------------------------------------------------------

def test_a_checkpoint_whose_manifest_is_malformed_is_set_aside_on_resume(tmp_path, capsys):
    run = tmp_path / "run"
    args = [*TRAIN, f"hydra.run.dir={run}", f"cache_dir={tmp_path / 'cache'}", "checkpoint.every=1", "steps=2"]
    assert smd("train", *args) == 0
    (run / "checkpoints" / "step_000002" / "MANIFEST.json").write_text('{"files": []}')  # valid JSON, not a manifest
    capsys.readouterr()
    assert smd("train", *args, "resume=true") == 0  # before: AttributeError in newest_intact
    said = " ".join(capsys.readouterr().out.split())
    assert "step_000002 is corrupt (" in said and "MANIFEST.json is malformed: 'files' is [], not dict" in said, said
    assert "resuming from the newest intact checkpoint, step_000001" in said
    assert (run / "checkpoints" / "step_000002.corrupt").is_dir() and not integrity.verify(run / "checkpoints" / "step_000002")
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), SafetensorError(FULL)], ids=["errno", "safetensors"])
def test_a_full_disk_while_writing_the_shadow_masks_says_disk_full(tmp_path, monkeypatch, capsys, error):
    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half")
        raise error

    monkeypatch.setattr(rollout_stage, "save_file", full)
    run = tmp_path / "run"
    code = smd("rollout", "model.warmstart.steps=0", "task.prompt_tokens=48", "num_prompts=1", "num_generations=2", "progress=false",
               "device=cpu", "sampling.max_new_tokens=4", f"hydra.run.dir={run}", f"cache_dir={tmp_path / 'cache'}")
    said = " ".join(capsys.readouterr().err.split())
    assert code == 1 and f"disk full: no space left on device while writing the shadow masks to {run / 'shadow_masks.safetensors'}" in said, said
    assert not list(run.glob(".*.tmp")) and not (run / "shadow_masks.safetensors").exists()


def test_a_stage_summary_with_a_non_finite_number_is_valid_json(tmp_path, monkeypatch):
    # a task whose prompts name no answer-bearing tokens: the share of them kept is 0/0
    monkeypatch.setattr(rollout_stage, "evidence_kept", lambda *a: {"evidence/kept": float("nan")})
    run = tmp_path / "run"
    assert smd("rollout", "model.warmstart.steps=0", "task.prompt_tokens=48", "num_prompts=1", "num_generations=2", "progress=false",
               "device=cpu", "sampling.max_new_tokens=4", f"hydra.run.dir={run}", f"cache_dir={tmp_path / 'cache'}") == 0
    summary = json.loads((run / "summary.json").read_text(), parse_constant=lambda name: pytest.fail(f"bare {name} in summary.json"))
    assert "evidence/kept" in summary and summary["evidence/kept"] is None and summary["rollout/rows"] == 2


def test_json_files_never_hold_bare_nan(tmp_path):
    from smd_cli.runtime.records import MetricsLog, write_json, write_jsonl

    write_json(tmp_path / "summary.json", {"eval/reward": float("nan"), "kl": float("inf"), "nested": [float("-inf"), 1.5]})
    write_jsonl(tmp_path / "rows.jsonl", [{"reward": float("nan")}])
    log = MetricsLog(tmp_path, tensorboard=False)
    log.log(1, {"loss": float("nan")})

    def strict(text):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name} written"))

    assert strict((tmp_path / "summary.json").read_text()) == {"eval/reward": None, "kl": None, "nested": [None, 1.5]}
    assert strict((tmp_path / "rows.jsonl").read_text()) == {"reward": None}
    assert strict((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": None}


# -- sweeps sharing a runs directory ------------------------------------------------------------------------------------

# Stands in for `smd train`: writes a completed summary (its reward NaN, as a run with no finite reward has), then, in
# the first sweep, lingers as a real run's last seconds would (still holding its directory) until told to end.
FAKE_TRAIN = r"""
import json, os, pathlib, sys, time
args = dict(a.split("=", 1) for a in sys.argv[1:])
run = pathlib.Path(args["hydra.run.dir"])
with open(run.parents[1] / "calls.txt", "a") as f:
    f.write(run.name + "\n")
print(f"member output of sweep {os.environ.get('SWEEP')}", flush=True)
(run / "summary.json").write_text(json.dumps({"status": "completed", "eval/reward_before": 0.25, "eval/reward_after": float("nan")}))
(run.parents[1] / "member_done").write_text("")
while os.environ.get("LINGER") and not (run.parents[1] / "release").exists():
    time.sleep(0.05)
"""


def _sweep_command(script: Path, out: Path, runs: Path) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from smd_cli.runs import sweep
        sweep.member_command = lambda overrides, run_dir: [sys.executable, {str(script)!r}, *overrides, f"hydra.run.dir={{run_dir}}"]
        from smd_cli.cli import main
        main(["ablate", "progress=false", "hydra.run.dir={out}", "ablate.sweep=['lambda=0.1']", "ablate.runs_dir={runs}"])
    """)]


@pytest.mark.slow  # two sweeps at once: a second process that imports torch and Hydra (about 15 s on 2 shared cores)
def test_two_sweeps_sharing_a_runs_directory_run_a_member_once_and_lose_nothing(tmp_path, monkeypatch, capsys):
    script, runs = tmp_path / "fake_train.py", tmp_path / "runs"
    script.write_text(FAKE_TRAIN)
    first = subprocess.Popen(_sweep_command(script, tmp_path / "first", runs), cwd=ROOT, env={**os.environ, "SWEEP": "first", "LINGER": "1"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    started, member = threading.Event(), sweep.run_member

    def second_member(cfg):  # the second sweep reaches the member: the first's run ends 2 s later
        started.set()
        return member(cfg)

    def release():
        started.wait(300)
        time.sleep(2)
        (tmp_path / "release").write_text("")

    monkeypatch.setattr(sweep, "run_member", second_member)
    threading.Thread(target=release, daemon=True).start()
    try:
        deadline = time.time() + 60
        while not (tmp_path / "member_done").exists():  # the first sweep's member has written its result, and lingers
            assert first.poll() is None and time.time() < deadline, first.stderr.read() if first.poll() is not None else "timeout"
            time.sleep(0.1)
        monkeypatch.setenv("SWEEP", "second")
        monkeypatch.setattr(sweep, "member_command", lambda overrides, run_dir: [sys.executable, str(script), *overrides, f"hydra.run.dir={run_dir}"])
        assert smd("ablate", "progress=false", f"hydra.run.dir={tmp_path / 'second'}", "ablate.sweep=['lambda=0.1']", f"ablate.runs_dir={runs}") == 0
    finally:
        (tmp_path / "release").write_text("")
        first.wait(timeout=120)
    assert first.returncode == 0, first.stderr.read()
    said = capsys.readouterr().out
    assert f"waiting for pid {first.pid} on {socket.gethostname()} since " in said and "finished by another sweep meanwhile" in said
    (member,) = [p for p in runs.iterdir() if p.is_dir()]
    assert (tmp_path / "calls.txt").read_text().split() == [member.name]  # run once (before: twice, the second over the first)
    assert "member output of sweep first" in (member / "console.log").read_text()  # not truncated by the second sweep
    for sweep_dir in ("first", "second"):  # both report it finished, and write strict JSON (NaN as null)
        summary = json.loads((tmp_path / sweep_dir / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
        assert [(r["status"], r["eval/reward_after"], r["eval/reward_before"]) for r in summary["runs"]] == [("ok", None, 0.25)]


def test_a_held_lock_is_handed_down_to_a_child_and_to_no_one_else(tmp_path):
    integrity.hold(tmp_path, "sweep")
    env, fds = integrity.handed_down(tmp_path)
    code = "import sys; from smd_cli.runtime import integrity; integrity.hold(sys.argv[1], 'child')"
    child = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env={**os.environ, **env}, pass_fds=fds, capture_output=True,
                           text=True, cwd=ROOT)
    assert child.returncode == 0, child.stderr
    stranger = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert stranger.returncode == 1 and f"is in use by another child process (pid {os.getpid()} on " in stranger.stderr
