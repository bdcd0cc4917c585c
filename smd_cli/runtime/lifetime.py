"""Child processes that die with their parent, so that `kill -9` of `smd ablate` or `smd reproduce` leaves
nothing running (no orphaned `smd train` holding its run directory's lock).

Linux's parent-death signal does it: a child asks the kernel (`prctl(PR_SET_PDEATHSIG, SIGKILL)`) to be killed
the moment its parent dies, and checks that the parent is still there (it may have died before the request).
A parent starts its children with `child_env()`, which names it in `SMD_PARENT_PID`; the child calls
`die_with_parent()` first thing (`smd_cli.cli.main` does; a script runs through `python -m smd_cli.runtime.lifetime
SCRIPT ARGS`). A process that a launcher starts for us (joblib's worker processes, forked by whichever thread
submits work, while the signal follows the thread) watches its parent instead (`watch_parent`). Killing is safe
because everything a run writes is atomic: the next run resumes from the last checkpoint. Elsewhere than Linux
these are no-ops.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys
import threading
import time

ENV = "SMD_PARENT_PID"
PR_SET_PDEATHSIG = 1
_watching = False


def child_env(env: dict | None = None) -> dict:
    """The environment for a child that must die with this process."""
    return {**(os.environ if env is None else env), ENV: str(os.getpid())}


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent() -> None:
    """When `SMD_PARENT_PID` names this process's parent: be killed when it dies, and exit now if it already has.
    The variable is removed, so this process's own children name it, not its parent."""
    parent = os.environ.pop(ENV, None)
    if parent is None or not parent.isdigit():
        return
    if _set_pdeathsig(signal.SIGKILL) and os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGKILL)  # the parent died before the request: nobody is left to wait for us


def watch_parent(parent: int, interval: float = 0.1) -> bool:
    """A daemon thread that kills this process as soon as `parent` is no longer its parent; False (nothing
    watched) when `parent` is not this process's parent to begin with (e.g. a cluster job). Once per process."""
    global _watching
    if os.getppid() != parent or _watching:
        return _watching
    _watching = True

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGKILL)  # children started with child_env() follow

    threading.Thread(target=watch, name="smd-watch-parent", daemon=True).start()
    return True


def main(argv: list[str] | None = None) -> None:
    """`python -m smd_cli.runtime.lifetime SCRIPT [ARGS]`: run SCRIPT as __main__, dying with the parent that started us. As with
    `python SCRIPT`, the script's folder comes first on sys.path (bench/step_overhead.py imports bench/decode_speed.py)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: python -m smd_cli.runtime.lifetime SCRIPT [ARGS]")
    die_with_parent()
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
