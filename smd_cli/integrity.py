"""What makes a directory on disk trustworthy: checksums written with it, and one writer at a time.

`write_manifest(dir)` records the size and SHA-256 of every file under `dir` in `dir/MANIFEST.json`,
read back from disk after writing (so it describes the bytes that landed); `verify(dir)` recomputes them
and names every file that is missing, truncated or changed. Checkpoints, `final/` and the warm-start cache
carry one.

`hold(path)` takes an advisory lock (`fcntl.flock`) on `path/.lock` for the rest of the process: a
second process that asks for it gets `Locked`, naming the holder's pid, host and start time. The kernel
releases a flock when its process dies, so the lock file a killed run leaves behind is recognised as
stale and taken over without any clean-up.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

MANIFEST = "MANIFEST.json"
_BLOCK = 1 << 22


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(root: Path) -> dict:
    """Checksum every file under `root` into `root/MANIFEST.json` (written last, flushed to disk)."""
    root = Path(root)
    files = {str(p.relative_to(root)): {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in _files(root)}
    manifest = {"algorithm": "sha256", "files": files}
    with open(root / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    return manifest


def verify(root: Path) -> list[str]:
    """Problems with `root` against its manifest (empty: intact). Sizes are compared before any hashing."""
    root = Path(root)
    try:
        files = json.loads((root / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return [f"{root / MANIFEST} is missing"]
    except (ValueError, KeyError, TypeError) as err:
        return [f"{root / MANIFEST} is unreadable ({err})"]
    problems = []
    for name, expected in sorted(files.items()):
        path = root / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != expected["bytes"]:
            problems.append(f"{name} has {path.stat().st_size} bytes, {expected['bytes']} were written")
        elif sha256(path) != expected["sha256"]:
            problems.append(f"{name} does not match its SHA-256 (changed on disk since it was written)")
    return problems


class Locked(RuntimeError):
    """Another live process holds the lock."""


_held: dict[Path, int] = {}  # lock file -> open descriptor, for the life of this process


def hold(directory: Path, purpose: str = "run") -> Path:
    """Lock `directory` for this process (idempotent within it); `Locked` if another process holds it."""
    path = (Path(directory) / ".lock").resolve()
    if path in _held:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if err.errno in (errno.EAGAIN, errno.EACCES):
            raise Locked(f"{directory} is in use by another {purpose} process ({holder}); wait for it to finish, "
                         "or choose another directory") from None
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
    _held[path] = fd
    return path


def release_all() -> None:
    """Drop every lock this process holds (a stage's end; closing a descriptor drops its flock)."""
    while _held:
        os.close(_held.popitem()[1])


@contextmanager
def exclusive(path: Path):
    """Block until this process alone holds `path` (a lock file), e.g. while one process fills a cache entry."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
