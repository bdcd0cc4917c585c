"""Children die with their parent (`smd_cli.runtime.lifetime`): `kill -9` of `smd ablate` (or of `smd reproduce` above it)
leaves no process of the sweep alive, so that the sweep started again is not refused by an orphan holding a run
directory's lock. Linux only (a parent-death signal)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from smd_cli.runtime import integrity

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
ROOT = Path(__file__).resolve().parents[1]
TINY = ["steps=1", "grpo.prompts_per_step=2", "grpo.num_generations=2", "eval.num_prompts=2", "task.prompt_tokens=40",
        "model.warmstart.steps=2", "progress=false"]


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by whoever adopted it, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every live process below `pid`."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found and alive(child):
                try:
                    found[child] = (Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
                except OSError:
                    continue
                frontier.append(child)
    return found


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_a_child_started_with_child_env_dies_with_its_parent():
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time; from smd_cli.runtime import lifetime\n"
        "subprocess.Popen([sys.executable, '-c', 'from smd_cli.runtime.lifetime import die_with_parent; die_with_parent(); "
        "import time; time.sleep(120)'], env=lifetime.child_env())\n"
        "time.sleep(120)")], cwd=ROOT)
    try:
        child = wait_for(lambda: next(iter(descendants(parent.pid)), None), 30, "the child")
        time.sleep(0.5)  # past its die_with_parent()
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        wait_for(lambda: not alive(child), 5, f"child {child} to die with its parent")
    finally:
        parent.kill()


def start_and_kill(command: list[str], env: dict, ready, what: str) -> dict[int, str]:
    """Start `command`, wait until `ready(tree)`, kill -9 it and wait until none of its process tree is alive;
    returns the tree it had."""
    sweep = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        tree = wait_for(lambda: (found := descendants(sweep.pid)) and ready(found) and found, 180, what)
        os.kill(sweep.pid, signal.SIGKILL)
        sweep.wait()
        wait_for(lambda: not any(alive(pid) for pid in tree), 10, f"no process of the sweep alive ({tree})")
        return tree
    finally:
        sweep.kill()


@pytest.mark.slow
def test_kill_9_of_a_parallel_sweep_leaves_nothing_running_and_a_restart_is_not_refused(tmp_path):
    env = {**os.environ, "SMD_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "smd_cli.cli", "ablate", "lambda=0.1,0.8", *TINY, "hydra/launcher=joblib",
               "hydra.launcher.n_jobs=3", f"hydra.run.dir={tmp_path / 'sweep'}"]
    # the sweep, joblib's three worker processes (one idle: two members) and its resource trackers, a `smd train` in two
    tree = start_and_kill(command, env, lambda found: sum("smd_cli.cli train" in c for c in found.values()) == 2, "two members")
    assert sum("smd_cli.cli train" in c for c in tree.values()) == 2 and sum("LokyProcess" in c for c in tree.values()) == 3
    # what a restart takes first: the sweep's and each member's run-directory lock, free (no orphan holds one)
    members = sorted((tmp_path / "sweep" / "runs").iterdir())
    assert len(members) == 2
    for run_dir in [tmp_path / "sweep", *members]:
        integrity.hold(run_dir, "test")
    integrity.release_all()


def test_a_script_run_through_lifetime_imports_its_neighbours(tmp_path):
    """`python -m smd_cli.runtime.lifetime bench/X.py` puts the script's folder first on sys.path, as `python bench/X.py` does
    (`smd reproduce` runs bench/step_overhead.py so, which imports bench/decode_speed.py)."""
    (tmp_path / "neighbour.py").write_text("VALUE = 41\n")
    (tmp_path / "script.py").write_text("import sys\nfrom neighbour import VALUE\nprint(VALUE + int(sys.argv[1]))\n")
    done = subprocess.run([sys.executable, "-m", "smd_cli.runtime.lifetime", str(tmp_path / "script.py"), "1"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "42"
