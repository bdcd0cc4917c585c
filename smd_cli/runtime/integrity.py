"""The one way smd writes to disk: atomic writes, locks, abandoned temporaries, named failures, manifests.

Every writer (run directories, checkpoints, `final/`, the weights and warm-start caches, sweeps, the
shadow masks) goes through here:

- `write_file(path, content, what)` writes a file through a temporary beside it and a rename;
  `write_dir(final, write, what)` a folder, its `MANIFEST.json` last, renamed into place (`replace_dir`).
  Readers never see half a file or half a folder.
- A temporary is named `.NAME.PID@HOST.tmp`, and its writer holds an `flock` on it from its creation to its rename.
  One that no process holds (its owner was killed, on this host or another: a container restarted under a new
  hostname) is removed at the next write beside it (`clean_temporaries`), so a killed write costs its bytes only until
  then. Where the file system has no flock, the owner's pid decides on this host, and another host's temporary is
  left for a day (`STALE`).
- Nothing is written through a symbolic link: a file or folder that smd writes or replaces whole (`write_file`,
  `write_dir`, a lock, an appended log, `open_new`) that is a link is `Unwritable`, naming it and where it points; the
  link and its target are left as they are. (A folder *above* them may be a link you made: checkpoints on another disk.)
- A write that fails removes its temporary and says why: a full disk is `DiskFull` (an OSError with errno
  ENOSPC: the CLI prints `disk full: ...`; torch and safetensors say it in their own words, read here: torch's
  "unexpected pos" or "file write failed" with less than `LOW_SPACE` free), a file-size limit (`ulimit -f`, a quota
  per file) is `FileTooLarge` (errno EFBIG, or torch's words under a finite RLIMIT_FSIZE), a place that cannot be
  written (a read-only file system, no permission, a file where a folder must be, a link) is `Unwritable` (a
  ValueError naming the path, which a stage reports as a config error naming its key).
- `write_manifest(dir)` records the size and SHA-256 of every file under `dir` in `dir/MANIFEST.json`, read
  back from disk after writing; `verify(dir)` checks the manifest's shape (`read_object`) and recomputes
  them, naming every file that is missing, truncated or changed. A malformed manifest is a problem, never
  a crash: the directory is not trusted.
- `hold(dir)` locks a directory for the rest of the process (`dir/.lock`, `fcntl.flock`): another process
  gets `Locked` naming the holder's pid, host and start time, or with `wait=True` says whom it waits for
  and waits. `exclusive(path)` holds a lock file for a block (one process fills a cache entry, the others
  wait, saying for whom). The kernel releases a flock when its process dies, so a killed holder's lock is
  taken over without any clean-up. `handed_down(dir)` passes a held lock to a child process (a sweep's
  member), which then holds it too (`hold` recognises the inherited descriptor).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import json
import os
import re
import resource
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

MANIFEST = "MANIFEST.json"
LOCK = ".lock"
INHERITED = "SMD_LOCK_FD"  # a held lock's descriptor, handed to a child process (`handed_down`)
LOW_SPACE = 64 << 20  # bytes: a write that fails with less free than this failed for want of space
_BLOCK = 1 << 22
_HOST = re.sub(r"[^A-Za-z0-9-]+", "-", socket.gethostname()) or "host"
_OWNER = re.compile(r"\.(\d+)@([A-Za-z0-9-]+)\.tmp$")
_FULL = ("no space left", "os error 28", "storagefull", "quota exceeded", "os error 122")
_TOO_LARGE = ("file too large", "os error 27", "filetoolarge")
_TORN_WRITE = ("unexpected pos", "file write failed", "failed writing", "iostream error")  # torch's words for a write cut short
STALE = 24 * 3600  # seconds: another host's temporary, where no flock can tell, is abandoned this long after its last change
GRACE = 60  # seconds: a temporary no one holds, younger than this, may be one whose writer is taking its lock
_READ_ONLY = ("read-only file system", "os error 30")
_DENIED = ("permission denied", "os error 13")


class DiskFull(OSError):
    """The disk filled during a write (errno ENOSPC); the partial write was removed."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)


class FileTooLarge(OSError):
    """A file-size limit (`ulimit -f`, RLIMIT_FSIZE) stopped a write (errno EFBIG); the partial write was removed."""

    def __init__(self, message: str):
        super().__init__(errno.EFBIG, message)


class WriteFailed(OSError):
    """A write failed for a reason none of the named ones covers; says what was being written and what is still safe."""


class Unwritable(ValueError):
    """A place that cannot be written: a read-only file system, no permission, or a file where a folder must be."""


class Malformed(ValueError):
    """A JSON record smd wrote (a manifest, `weights.json`) that does not have the shape it was written with."""


# -- failures named ---------------------------------------------------------------------------------------------

def _existing(path: Path) -> Path:
    """`path` or its nearest existing ancestor."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def named_failure(err: BaseException, path: Path, what: str) -> Exception | None:
    """`DiskFull` or `Unwritable` for an error met writing `what` to `path`, or None when it is neither."""
    path = Path(path)
    code, text = getattr(err, "errno", None), str(err).lower()
    place = _existing(path.parent)
    if code == errno.ENOTDIR or place.is_file():
        return Unwritable(f"{place} is a file, not a folder: {what} cannot be written under it ({path})")
    if code == errno.EROFS or any(s in text for s in _READ_ONLY):
        return Unwritable(f"{place} is on a read-only file system: {what} cannot be written there ({path})")
    if code in (errno.EACCES, errno.EPERM) or any(s in text for s in _DENIED):
        return Unwritable(f"{place} is not writable (permission denied): {what} cannot be written there ({path})")
    if code is None and not os.access(place, os.W_OK):  # a library's own words for EROFS or EACCES
        return Unwritable(f"{place} is not writable (a read-only file system or no permission): {what} cannot be written "
                          f"there ({path})")
    try:
        free = shutil.disk_usage(place).free
    except OSError:
        free = None
    # torch's zip writer says only "unexpected pos" (or "file write failed") when a write is cut short: with little space
    # left that is a full disk, under a finite file-size limit that limit; any other error is not one of these
    torn = isinstance(err, RuntimeError) and any(s in text for s in _TORN_WRITE)
    if code in (errno.ENOSPC, errno.EDQUOT) or any(s in text for s in _FULL) or (torn and free is not None and free < LOW_SPACE):
        left = "" if free is None else f" ({free / 2**20:.0f} MiB free there)"
        return DiskFull(f"no space left on device while writing {what} to {path}{left}")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if code == errno.EFBIG or any(s in text for s in _TOO_LARGE) or (torn and limit != resource.RLIM_INFINITY):
        said = "" if limit == resource.RLIM_INFINITY else f" (this process may write files of at most {limit:,} bytes: `ulimit -f`)"
        return FileTooLarge(f"a file-size limit stopped the write of {what} to {path}{said}")
    return None


@contextmanager
def named_failures(path: Path, what: str, hint: str = ""):
    """Re-raise an error of the block as `DiskFull` / `FileTooLarge` / `Unwritable` when it is one (`hint` appended)."""
    try:
        yield
    except (DiskFull, FileTooLarge, Unwritable):
        raise
    except Exception as err:
        named = named_failure(err, path, what)
        if named is None:
            raise
        if hint:
            named = type(named)(f"{named.args[-1]}; {hint}")
        raise named from err


def make_dir(path: Path, what: str = "a folder") -> Path:
    """`path` as a folder (made with its parents), or `Unwritable` / `DiskFull` naming why it cannot be."""
    path = Path(path)
    if _existing(path).is_file():
        raise Unwritable(f"{_existing(path)} is a file, not a folder: {what} cannot be written under it ({path})")
    with named_failures(path / "_", what):
        path.mkdir(parents=True, exist_ok=True)
    return path


# -- temporaries ----------------------------------------------------------------------------------------------------

def temporary(final: Path) -> Path:
    """This process's temporary for `final`, beside it: `.NAME.PID@HOST.tmp`."""
    final = Path(final)
    return final.with_name(f".{final.name}.{os.getpid()}@{_HOST}.tmp")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _lock_state(path: Path) -> str:
    """"held" when a process holds the flock of `path` (a temporary being written), "free" when none does, "unknown"
    where this file system cannot tell (no flock, or exclusive locks only on files open for writing: NFS)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_DIRECTORY if path.is_dir() else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return "unknown"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return "free"
    except OSError as err:
        return "held" if err.errno in (errno.EAGAIN, errno.EACCES) else "unknown"
    finally:
        os.close(fd)  # drops the flock this probe took


def _age(path: Path) -> float:
    """Seconds since `path` (a folder: anything in it) last changed."""
    try:
        times = [path.lstat().st_mtime] + ([p.lstat().st_mtime for p in path.rglob("*")] if path.is_dir() and not path.is_symlink() else [])
    except OSError:
        return 0.0
    return time.time() - max(times)


def abandoned(parent: Path, name: str | None = None) -> list[Path]:
    """Temporaries in `parent` (of `name` when given) that no live process is writing: none holds its flock and its
    owner on this host is dead or it is older than `GRACE` (another host's owner, or a container restarted under a new
    hostname, killed mid-write); without flock, its owner on this host is dead, or another host's is older than `STALE`.
    A temporary that carries no owner (written before temporaries were named by pid) is abandoned."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    found = []
    for path in parent.iterdir():
        if not (path.name.startswith(f".{name}." if name else ".") and path.name.endswith(".tmp")):
            continue
        owner = _OWNER.search(path.name)
        if owner is None:
            found.append(path)
            continue
        state = _lock_state(path)
        here = owner.group(2) == _HOST
        dead_here = here and not _alive(int(owner.group(1)))
        if state == "free" and (dead_here or _age(path) > GRACE):
            found.append(path)
        elif state == "unknown" and (dead_here or (not here and _age(path) > STALE)):
            found.append(path)
    return sorted(found)


def clean_temporaries(parent: Path, name: str | None = None) -> list[Path]:
    """Remove `abandoned(parent, name)`; returns what was removed."""
    removed = abandoned(parent, name)
    for path in removed:
        _remove(path)
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _claim(tmp: Path, folder: bool) -> int:
    """Make this process's temporary `tmp` (a folder, or an empty file) and take its flock, held until the descriptor
    returned is closed (after the rename): while it is held, no other process takes the temporary for abandoned."""
    _remove(tmp)  # this pid's name: only a dead process that had this pid can have left it
    if folder:
        tmp.mkdir()
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    else:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass  # no flock here (`_lock_state` says "unknown"): the pid and host in the name decide
    return fd


# -- links ------------------------------------------------------------------------------------------------------------

def refuse_link(path: Path, what: str) -> None:
    """`Unwritable` when `path` is a symbolic link: smd neither writes through one nor replaces it (the link and what
    it points to stay as they are)."""
    path = Path(path)
    if path.is_symlink():
        raise Unwritable(f"{path} is a symbolic link (to {os.readlink(path)}): smd does not write {what} through a link, "
                         "nor replace one; remove the link (or choose another directory)")


def links_problem(directory: Path) -> str | None:
    """Why `directory` cannot take a run (None when it can): a file that smd or Hydra writes there by name is a
    symbolic link (it would be written through, outside the run), or `final` or `.hydra` is one (replaced or filled
    whole). A link to a folder that only holds files smd makes anew, such as checkpoints/ on another disk, is fine."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    hydra = directory / ".hydra"
    for entry in [*directory.iterdir(), *(hydra.iterdir() if hydra.is_dir() and not hydra.is_symlink() else ())]:
        if entry.is_symlink() and (not entry.is_dir() or entry.name in ("final", ".hydra")):
            return (f"{entry} is a symbolic link (to {os.readlink(entry)}): smd and Hydra write a run's files by name and "
                    "never through a link; remove the link, or choose another directory")
    return None


def open_new(path: Path, what: str, append: bool = False):
    """`path` opened for writing in binary (emptied, or with `append` at its end), never through a link
    (`Unwritable` naming it); a full disk or an unwritable place named."""
    path = Path(path)
    refuse_link(path, what)
    make_dir(path.parent, what)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if append else os.O_TRUNC)
    with named_failures(path, what):
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as err:
            if err.errno == errno.ELOOP:  # made a link since the check above
                refuse_link(path, what)
            raise
    return os.fdopen(fd, "ab" if append else "wb")


def append_line(path: Path, line: str, what: str | None = None) -> None:
    """Append `line` and a newline to `path` (a log: metrics.jsonl, resumes.jsonl), never through a link."""
    with open_new(path, what or path.name, append=True) as f:
        f.write((line + "\n").encode())


# -- atomic writes ----------------------------------------------------------------------------------------------------

def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, content: str | bytes | Callable[[Path], None], what: str | None = None) -> Path:
    """Write `path` atomically: `content` (text, bytes, or a function writing the file it is given, e.g.
    safetensors' `save_file`) goes to a temporary beside it, flushed, then renamed over `path` (never over a link)."""
    path = Path(path)
    what = what or path.name
    refuse_link(path, what)
    make_dir(path.parent, what)
    clean_temporaries(path.parent, path.name)
    tmp, fd = temporary(path), None
    try:
        with named_failures(path, what):
            fd = _claim(tmp, folder=False)
            if callable(content):
                content(tmp)
            else:
                with open(tmp, "w" if isinstance(content, str) else "wb") as f:
                    f.write(content)
            _fsync(tmp)
            os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    finally:
        if fd is not None:
            os.close(fd)
    return path


@contextmanager
def atomic_text(path: Path, what: str | None = None):
    """A text file to write in the block (e.g. with `csv.writer`; newlines as written), published atomically at its end
    (`write_file`); nothing is published when the block fails."""
    buffer = io.StringIO(newline="")
    yield buffer
    write_file(path, buffer.getvalue(), what)


def write_dir(final: Path, write: Callable[[Path], None], what: str, hint: str = "") -> Path:
    """Write the folder `final` atomically: `write(tmp)` fills a temporary folder beside it, every file is flushed,
    `MANIFEST.json` goes last, and the folder is renamed to `final` (replacing an older one, never a link). On any
    failure the temporary is removed; a full disk or a read-only place is named (`hint` says what is still safe)."""
    final = Path(final)
    refuse_link(final, what)
    make_dir(final.parent, what)
    clean_temporaries(final.parent, final.name)
    tmp, fd = temporary(final), None
    try:
        with named_failures(final, what, hint):
            fd = _claim(tmp, folder=True)
            write(tmp)
            for path in tmp.rglob("*"):
                if path.is_file():
                    _fsync(path)
            write_manifest(tmp)
            replace_dir(tmp, final)
    except BaseException:
        _remove(tmp)
        raise
    finally:
        if fd is not None:
            os.close(fd)
    return final


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a fully written folder `tmp` to `final`, replacing an older one only after the move (a link: refused)."""
    refuse_link(final, final.name)
    old = final.with_name(final.name + ".old")
    if final.exists():
        if old.exists() or old.is_symlink():
            _remove(old)
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists() or old.is_symlink():
        _remove(old)


# -- manifests --------------------------------------------------------------------------------------------------------

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


def read_object(path: Path, fields: dict[str, type | tuple[type, ...]]) -> dict:
    """The JSON object in `path`, with each of `fields` present and of its type; `Malformed` naming the file and
    what is wrong otherwise (a missing file is FileNotFoundError)."""
    path = Path(path)
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise Malformed(f"{path} is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise Malformed(f"{path} is malformed: it holds a JSON {type(value).__name__}, not an object")
    for key, kind in fields.items():
        if not isinstance(value.get(key), kind) or (isinstance(value.get(key), bool) and kind is not bool):
            raise Malformed(f"{path} is malformed: {key!r} is {json.dumps(value.get(key))[:60]}, not "
                            f"{' or '.join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))}")
    return value


def read_manifest(root: Path) -> dict[str, dict]:
    """`root`'s manifest as {relative path: {"bytes": int, "sha256": hex}}, checked entry by entry (`Malformed`)."""
    path = Path(root) / MANIFEST
    files = read_object(path, {"files": dict})["files"]
    for name, entry in files.items():
        parts = Path(name).parts
        if Path(name).is_absolute() or ".." in parts or not parts:
            raise Malformed(f"{path} is malformed: {name!r} is not a path inside {root}")
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and entry["bytes"] >= 0
                and isinstance(entry.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])):
            raise Malformed(f"{path} is malformed: the entry of {name!r} is not {{\"bytes\": N, \"sha256\": HEX}}")
    return files


def verify(root: Path) -> list[str]:
    """Problems with `root` against its manifest (empty: intact). Sizes are compared before any hashing."""
    root = Path(root)
    try:
        files = read_manifest(root)
    except FileNotFoundError:
        return [f"{root / MANIFEST} is missing"]
    except (Malformed, OSError) as err:
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


# -- locks --------------------------------------------------------------------------------------------------------------

class Locked(RuntimeError):
    """Another live process holds the lock."""


_held: dict[Path, int] = {}  # lock file -> open descriptor, for the life of this process


def _open_lock(path: Path, what: str) -> int:
    refuse_link(path, what)  # O_CREAT would follow it and write the holder's name wherever it points
    make_dir(path.parent, what)
    with named_failures(path, what):
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            if err.errno == errno.ELOOP:
                refuse_link(path, what)
            raise


def _holder(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process that did not say which"


def _sign(fd: int, purpose: str) -> None:
    """Name this process in the lock file it holds (what a waiting process prints)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')} ({purpose})\n".encode(), 0)


def _take(fd: int, path: Path, purpose: str, wait: bool, say: Callable[[str], None] | None) -> bool:
    """flock `fd`; without `wait` False when another process holds it, else say whom we wait for, and wait."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as err:
        if err.errno not in (errno.EAGAIN, errno.EACCES):
            raise
    if not wait:
        return False
    (say or _print)(f"waiting for {_holder(fd)} to release {path}")
    fcntl.flock(fd, fcntl.LOCK_EX)
    return True


def _print(text: str) -> None:
    print(text, flush=True)


def _inherited(path: Path) -> int | None:
    """The descriptor of `path` a parent process handed down while holding its lock (`handed_down`), if any."""
    given = os.environ.get(INHERITED, "")
    if not given.isdigit():
        return None
    try:
        mine, lock = os.fstat(int(given)), os.lstat(path)
    except OSError:
        return None
    return int(given) if (mine.st_dev, mine.st_ino) == (lock.st_dev, lock.st_ino) else None


def hold(directory: Path, purpose: str = "run", wait: bool = False, say: Callable[[str], None] | None = None) -> Path:
    """Lock `directory` for this process (idempotent within it). Another process holding it: `Locked` naming it,
    or with `wait`, a line saying whom this one waits for (`say`, default print), then the wait."""
    path = Path(directory).resolve() / LOCK  # the folder resolved, not the lock file: a link there is refused, not followed
    if path in _held:
        return path
    fd = _inherited(path) if path.exists() else None
    if fd is not None:  # the parent's lock, which keeps naming the parent (it holds it for as long as this process lives)
        _held[path] = fd
        return path
    fd = _open_lock(path, f"the lock of {directory}")
    if not _take(fd, path, purpose, wait, say):
        holder = _holder(fd)
        os.close(fd)
        raise Locked(f"{directory} is in use by another {purpose} process ({holder}); wait for it to finish, "
                     "or choose another directory")
    _sign(fd, purpose)
    _held[path] = fd
    return path


def handed_down(directory: Path) -> tuple[dict[str, str], tuple[int, ...]]:
    """(environment, descriptors) that pass this process's lock of `directory` (`hold`) on to a child process
    (`subprocess.Popen(env=..., pass_fds=...)`): the child's `hold` of the same directory then succeeds while
    this process keeps it locked, and nobody else can take it in between."""
    fd = _held[Path(directory).resolve() / LOCK]
    return {INHERITED: str(fd)}, (fd,)


def release(directory: Path) -> None:
    """Drop this process's lock of `directory`, if it holds one."""
    fd = _held.pop(Path(directory).resolve() / LOCK, None)
    if fd is not None:
        os.close(fd)


def release_all() -> None:
    """Drop every lock this process holds (a stage's end; closing a descriptor drops its flock)."""
    while _held:
        os.close(_held.popitem()[1])


@contextmanager
def exclusive(path: Path, purpose: str = "a cache entry", say: Callable[[str], None] | None = None):
    """Hold the lock file `path` for the block, e.g. while this process fills a cache entry; a process that finds it
    held says whom it waits for (`say`, default print: the holder's pid, host and start time) and waits."""
    path = Path(path)
    fd = _open_lock(path, f"the lock for {purpose}")
    try:
        _take(fd, path, purpose, True, say)
        _sign(fd, purpose)
        yield
    finally:
        os.close(fd)
