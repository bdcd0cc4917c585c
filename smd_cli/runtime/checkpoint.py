"""Training checkpoints: written atomically, loaded safely, found again for `resume`.

Layout of a run directory:

    RUN/checkpoints/step_000020/model/             save_pretrained (safetensors) + the tokenizer
    RUN/checkpoints/step_000020/trainer_state.pt   step, optimizer state, RNG states, plain extras
    RUN/final/                                      save_pretrained of the last weights (for `smd eval`)

A checkpoint is written into a temporary `checkpoints/.step_N.PID@HOST.tmp/` and renamed to `step_N/` only
when complete (`integrity.write_dir`), so a run killed mid-write leaves the previous checkpoints intact and a
leftover `*.tmp` folder, which every listing ignores and the next save (or resume) removes. The last file written is `MANIFEST.json` (sizes
and SHA-256 of the rest, read back from disk): a checkpoint is complete when it has one and intact when
its files still match it (`newest_intact`; a malformed manifest is corruption too); a corrupt one is moved aside to `step_N.corrupt`, never
trusted and never deleted. Loading never unpickles code: weights go through
safetensors (`from_pretrained(..., use_safetensors=True)`), the rest through
`torch.load(weights_only=True)`, which is why RNG states are stored as tensors and plain types.
A save that fails (a full disk above all) removes its partial folder and raises `OSError` naming the cause.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from smd_cli.runtime.integrity import MANIFEST, DiskFull, FileTooLarge, Unwritable, WriteFailed, append_line, verify, write_dir
from smd_cli.runtime.records import to_json

FORMAT = 2
_STEP = re.compile(r"^step_(\d{6,})$")


class ForeignCheckpoint(ValueError):
    """A trainer_state.pt that `smd train` did not write: code to unpickle, or not a torch file at all."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path  # RUN/checkpoints/step_N
    step: int


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def is_complete(path: Path) -> bool:
    """A finished checkpoint: its manifest (the last file a save writes) is there. `verify` says if it is intact."""
    return (path / MANIFEST).is_file()


def list_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """Complete checkpoints of a run, oldest first; temporary and half-written folders are ignored."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [Checkpoint(p, int(m.group(1))) for p in root.iterdir() if (m := _STEP.match(p.name)) and is_complete(p)]
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def unreadable_weights(path: Path) -> list[str]:
    """Problems with the safetensors files under `path` that a manifest cannot see (one written with a broken header and
    checksummed as it was): each file's header is parsed (no tensor is read)."""
    from safetensors import safe_open

    problems = []
    for file in sorted(Path(path).rglob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                f.keys()
        except Exception as err:  # SafetensorError, OSError: the header is not one safetensors wrote
            problems.append(f"{file.relative_to(path)} cannot be read as safetensors ({type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''})")
    return problems


def newest_intact(run_dir: Path, max_step: int | None = None) -> tuple[Checkpoint | None, list[tuple[Checkpoint, list[str]]]]:
    """The newest checkpoint (at most `max_step`) whose files match its manifest and whose weights' headers parse
    (`unreadable_weights`), and the newer ones that do not (each with its problems), newest first. Reads every byte
    of the checkpoints it verifies."""
    corrupt = []
    for found in reversed(list_checkpoints(run_dir)):
        if max_step is not None and found.step > max_step:
            continue
        problems = verify(found.path) or unreadable_weights(found.path)
        if not problems:
            return found, corrupt
        corrupt.append((found, problems))
    return None, corrupt


def set_aside(checkpoint: Checkpoint) -> Path:
    """Rename a corrupt checkpoint to `step_N.corrupt` (then `.corrupt-2`, ...): out of every listing, nothing deleted."""
    target, n = checkpoint.path.with_name(checkpoint.path.name + ".corrupt"), 1
    while target.exists():
        n += 1
        target = checkpoint.path.with_name(f"{checkpoint.path.name}.corrupt-{n}")
    os.replace(checkpoint.path, target)
    return target


def remove_partial(run_dir: Path) -> list[Path]:
    """Delete what an interrupted save left behind (`.step_N.tmp`, `step_N.old`); returns what was removed."""
    root = checkpoints_dir(run_dir)
    leftovers = [p for p in root.iterdir() if p.name.endswith((".tmp", ".old"))] if root.is_dir() else []
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return leftovers


def rng_state() -> dict:
    """Python, torch (CPU and CUDA) and numpy RNG states as tensors and plain types (weights_only-safe)."""
    version, words, gauss = random.getstate()
    state = {"python": {"version": version, "words": torch.tensor(words, dtype=torch.int64), "gauss": gauss},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached": float(cached)}
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned (a CUDA state only where the same number of devices is present)."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(w) for w in py["words"].tolist()), py["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"]))


@contextmanager
def _no_hf_progress_bars():
    """Silence transformers' per-shard progress bars, which would interleave with the training bar."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def save_model(path: Path, model, tokenizer=None, state_dict: dict | None = None) -> None:
    """`save_pretrained` (safetensors) of the model (of `state_dict` in its layout when given: the full weights
    of a sharded model), and of the tokenizer when it has one."""
    with _no_hf_progress_bars():
        model.save_pretrained(path, state_dict=state_dict)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(path)


def save_checkpoint(run_dir: Path, step: int, model, optimizer, tokenizer=None, extra: dict | None = None,
                    keep_last: int | None = None, model_state: dict | None = None, optimizer_state: dict | None = None,
                    protect: int | None = None) -> Path:
    """Write `RUN/checkpoints/step_{step:06d}` atomically, then keep only the newest `keep_last` (None: all), and
    the newest at or before step `protect` (a run whose later weights are suspect keeps its last good ones).

    `extra` holds plain types only (numbers, strings, lists, dicts) so that it loads with weights_only.
    `model_state` and `optimizer_state` stand for the model's and the optimizer's own when given: the full
    states of a sharded run (`smd_cli.runtime.distributed`), in the one-process layout, so any world size resumes it."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    remove_partial(run_dir)
    final = root / f"step_{step:06d}"
    optimizer_state = optimizer.state_dict() if optimizer_state is None else optimizer_state
    state = {"format": FORMAT, "step": step, "optimizer": optimizer_state, "rng": rng_state(), "extra": extra or {}}

    def write(folder: Path) -> None:
        save_model(folder / "model", model, tokenizer, model_state)
        torch.save(state, folder / "trainer_state.pt")

    _write_dir(final, write, f"checkpoint step {step}")
    if keep_last:  # the checkpoint just written (intact: its manifest was read back from disk) is always kept
        found = list_checkpoints(run_dir)
        kept = found[-keep_last:] + [c for c in found if protect is not None and c.step <= protect][-1:]
        for old in found:
            if old not in kept:
                shutil.rmtree(old.path)
    return final


_SAFE = "the partial write was removed and earlier checkpoints are intact"


def _write_dir(final: Path, write, what: str) -> None:
    """`integrity.write_dir` (a full disk, a file-size limit or a read-only place named, with what is still safe); any
    other failure is `integrity.WriteFailed` (an OSError) saying the same."""
    try:
        write_dir(final, write, what, hint=f"{_SAFE}: make room (or raise the limit), then continue with resume=true")
    except (DiskFull, FileTooLarge, Unwritable):
        raise
    except Exception as err:
        raise WriteFailed(f"writing {what} to {final} failed ({type(err).__name__}: {err}); {_SAFE}") from err


def save_final(run_dir: Path, model, tokenizer=None, model_state: dict | None = None) -> Path:
    """`RUN/final`: the last weights in save_pretrained form (what `smd eval checkpoint=RUN/final` reads)."""
    final = Path(run_dir) / "final"
    _write_dir(final, lambda folder: save_model(folder, model, tokenizer, model_state), "the final weights")
    return final


def load_trainer_state(checkpoint: Checkpoint, mmap: bool = False) -> dict:
    """The trainer state of a checkpoint, read with `torch.load(weights_only=True)` (no code runs); `mmap`
    maps the tensors instead of reading them (cheap when only `extra` is needed)."""
    path = checkpoint.path / "trainer_state.pt"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:  # torch's own words would suggest weights_only=False: never here
        found = next((line.strip() for line in str(err).splitlines() if "Unsupported" in line or "global" in line.lower()), "")
        raise ForeignCheckpoint(f"{path} is not a checkpoint this tool wrote: it holds Python objects that smd never loads, only "
                         f"tensors and plain values{f' ({found})' if found else ''}; remove it or resume from another run") from None
    except (RuntimeError, EOFError, OSError) as err:  # not a torch zip file, or cut short
        raise ForeignCheckpoint(f"{path} is not a checkpoint this tool wrote: it cannot be read as one ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''})") from None
    if not isinstance(state, dict):
        raise ForeignCheckpoint(f"{path} is not a checkpoint this tool wrote: it holds {type(state).__name__}, not its state")
    if state.get("format") != FORMAT or state.get("step") != checkpoint.step:
        raise ValueError(f"{checkpoint.path}: trainer_state.pt has format {state.get('format')} and step {state.get('step')}; "
                         f"expected format {FORMAT} and step {checkpoint.step}")
    return state


def check_config(checkpoint: Checkpoint, config: dict, ignore: tuple[str, ...] = ()) -> None:
    """ValueError unless the checkpoint was trained with `config` (but for the `ignore`d top-level keys)."""
    saved = load_trainer_state(checkpoint, mmap=True)["extra"].get("config", {})
    differences = config_differences(saved, config, ignore)
    if differences:
        raise ValueError(f"{checkpoint.path.parent.parent} was trained with other settings ({'; '.join(differences[:5])})")


@torch.no_grad()
def load_weights(model, model_dir: Path, trust_remote_code: bool = False) -> None:
    """Copy the safetensors weights saved in `model_dir` into `model`, exactly (same dtype, bit for bit).

    Goes through `from_pretrained(use_safetensors=True)`, which handles shards, tied weights and any
    checkpoint key conversions; the copy keeps `model`'s own parameters, so an optimizer built on them
    stays attached."""
    dtype = next(model.parameters()).dtype
    with _no_hf_progress_bars():
        try:
            loaded = type(model).from_pretrained(model_dir, use_safetensors=True, dtype=dtype, trust_remote_code=trust_remote_code)
        except Exception as err:  # a broken header, a missing shard: named, never a traceback
            raise ForeignCheckpoint(f"{model_dir}: its weights cannot be loaded ({type(err).__name__}: "
                                    f"{str(err).splitlines()[0] if str(err) else ''})") from None
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if missing or unexpected:
        raise ValueError(f"{model_dir}: weights do not match the model (missing {missing[:5]}, unexpected {unexpected[:5]})")


def config_differences(saved: dict, current: dict, ignore: tuple[str, ...] = (), prefix: str = "") -> list[str]:
    """`key: saved -> current` for every nested setting that differs, skipping top-level keys in `ignore`."""
    out = []
    for key in sorted(set(saved) | set(current)):
        if not prefix and key in ignore:
            continue
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, (), f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def resume_run(checkpoint: Checkpoint, model, trust_remote_code: bool = False,
               launched_in: Path | None = None) -> tuple[dict, dict, dict]:
    """Restore `checkpoint`'s weights into `model` (verified and config-checked by the caller: `newest_intact`,
    `check_config`). Returns the rest of its `extra`, its RNG states (set them right before the step loop, so
    that nothing in between draws from them) and the optimizer's state dict (for `optimizer.load_state_dict`,
    once the optimizer is built). With `launched_in`, the resumption is appended to `RUN/resumes.jsonl`."""
    state = load_trainer_state(checkpoint)
    extra = dict(state["extra"])
    extra.pop("config", None)
    load_weights(model, checkpoint.path / "model", trust_remote_code)
    if launched_in is not None:
        append_line(checkpoint.path.parent.parent / "resumes.jsonl",
                    to_json({"from_step": checkpoint.step, "launched_in": str(launched_in), "time": time.time()}), "the run's resumes.jsonl")
    return extra, state["rng"], state["optimizer"]


def resume_target(resume: bool | str | None, current_run: Path, named: bool = False) -> Path | None:
    """The run directory to continue for `resume`: False/None -> None; a path -> that run directory, which must
    hold a complete checkpoint; True -> the current run directory if it has a checkpoint; else, only when the
    current directory was not `named` by the user (a fresh timestamped one), the sibling run (same parent)
    whose newest checkpoint is newest; else None (start at step 0 in the current directory)."""
    if resume is None or resume is False:
        return None
    if resume is not True:
        path = Path(str(resume))
        if latest_checkpoint(path) is None:
            raise FileNotFoundError(f"{path} holds no complete checkpoint (expected {checkpoints_dir(path)}/step_NNNNNN/)")
        return path
    current_run = Path(current_run)
    if latest_checkpoint(current_run) is not None:
        return current_run
    if named:
        return None
    parent = current_run.parent
    candidates = [(latest_checkpoint(d), d) for d in parent.iterdir() if d.is_dir() and d != current_run] if parent.is_dir() else []
    candidates = [(c.path.stat().st_mtime, d) for c, d in candidates if c is not None]
    return max(candidates)[1] if candidates else None
