"""Held-out evaluations before training, computed once: the same weights evaluated the same way give the same numbers.

`smd train` evaluates its starting weights before GRPO (`eval/*_before`): with a dense cache and under eviction, on
the held-out prompts. Those numbers depend on the weights and on how they are evaluated, not on the algorithm, its
loss or its learning rate, so a table of eight algorithms on one starting point evaluates it eight times. Here the
first run stores its summary under a key and the others read it back.

The key (`key`) is a sha256 over everything the evaluation reads: the weights' bytes (every parameter and buffer by
name, dtype and shape, `weights_digest`), the held-out examples and their prompt token ids (the task, its data and
the tokenizer with its chat template), the evaluation's settings and the run's sampling, eviction, compression, KV
quantisation and precision settings (the seed too when the evaluation samples), the torch thread count, the CPU's
vector ISA, the device type, the versions of torch and transformers, and the source of `smd_cli` itself. Change any
one and the key changes: a stored entry is never read for another evaluation. Greedy decoding is deterministic on
one machine, and so is a seeded sampled one (one noise row per example, `smd_cli.evaluation.batch`), so a hit is the number
the evaluation would have computed. Entries are small JSON files under `CACHE/evals/`, written atomically and sealed
with the SHA-256 of their content (`smd_cli.runtime.records.sealed`): an entry changed since it was written, or holding a value
out of its range (`records.check_values`), is `records.Damaged` on `load`, named by the caller and evaluated again.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
from functools import lru_cache
from pathlib import Path

import torch

from smd_cli.runtime import records
from smd_cli.runtime.provenance import package_versions
from smd_cli.runtime.records import write_json

PACKAGE = Path(__file__).resolve().parent


@lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 over the source of every module of `smd_cli` (path and bytes)."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        h.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def weights_digest(model) -> str:
    """sha256 over the model's parameters and buffers: name, dtype, shape and bytes of each, in state-dict order (a
    tied weight under each of its names)."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def key(model, examples: list[dict], prompts: list[list[int]], settings: dict) -> str:
    """The key of an evaluation of `model` on `examples` (encoded as `prompts`) under `settings` (plain JSON: the
    evaluation's, sampling, eviction, compression, KV and precision settings), with the code, versions and machine."""
    parts = {
        "weights": weights_digest(model),
        "examples": hashlib.sha256(json.dumps(examples, sort_keys=True, default=str).encode()).hexdigest(),
        "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
        "settings": settings,
        "code": code_digest(),
        "versions": {k: v for k, v in package_versions().items() if k in ("torch", "transformers")},
        "machine": [platform.machine(), torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), str(next(model.parameters()).device.type)],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def path(cache_dir: str | Path, digest: str) -> Path:
    return Path(cache_dir) / "evals" / f"{digest}.json"


def load(cache_dir: str | Path, digest: str) -> dict[str, float] | None:
    """The stored summary of the evaluation `digest`, or None when there is none; `records.Damaged` naming the entry when
    it does not read back as it was written (unreadable, changed since, another key's, a value out of range)."""
    where = path(cache_dir, digest)
    if not where.is_file():
        return None
    try:
        record = records.read_sealed(where)
    except OSError as err:
        raise records.Damaged(f"{where}: unreadable ({err})") from None
    summary = record.get("summary")
    if record.get("key") != digest or not isinstance(summary, dict) or not all(_finite(v) for v in summary.values()):
        raise records.Damaged(f"{where}: not the entry of evaluation {digest[:12]} (its key or summary is not what was stored)")
    return records.check_values(summary, str(where))


def store(cache_dir: str | Path, digest: str, summary: dict[str, float]) -> bool:
    """Keep `summary` under `digest` (atomically); not when a value is not a finite number (JSON would change it)."""
    if not all(_finite(v) for v in summary.values()):
        return False
    write_json(path(cache_dir, digest), records.sealed({"key": digest, "summary": summary}))
    return True


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
