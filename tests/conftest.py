import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
torch.set_num_threads(1)  # the tiny model is fastest on one thread (and cores are shared)

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


def smd(*args) -> int:
    """`smd ARGS` run in this process (monkeypatches apply, capsys sees its output); its exit status."""
    from smd_cli.cli import main

    try:
        main(list(args))
    except SystemExit as done:
        return done.code
    return 0


@pytest.fixture(autouse=True)
def _release_run_locks():
    """Each test is its own "process" as far as run-directory locks go (the CLI releases them at a stage's end)."""
    yield
    from smd_cli.runtime.integrity import release_all

    release_all()


@pytest.fixture(autouse=True)
def _absl_logs_to_the_real_stderr():
    """absl's log handler (imported with rouge-score) writes to the sys.stderr of its import, and closes that stream
    when a later in-process `smd` run lets Hydra reconfigure logging: under pytest, a test's capture file, which
    breaks every test after it. Pointed at the process's own stderr, it closes nothing."""
    absl = sys.modules.get("absl.logging")
    if absl is not None:
        absl.get_absl_handler().python_handler.stream = sys.__stderr__
    yield


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from smd_cli.model.build import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture
def tiny_model(tiny_tokenizer):
    """A fresh random tiny Qwen3 (2 layers, 4 heads, 2 KV heads), float32, eval mode."""
    from smd_cli.model.build import build_tiny_model

    return build_tiny_model(len(tiny_tokenizer), seed=0).eval()


@pytest.fixture
def shared_data():
    if not SHARED_DATA.is_dir():
        pytest.skip(f"reference data not found at {SHARED_DATA}")
    return SHARED_DATA


def pytest_collection_modifyitems(items):
    """The two end-to-end reproductions (minutes each) first, the rest in collection order (a stable sort): one worker
    starts them while the other works through the rest, and neither starts last with the other idle (`make test`'s
    --dist worksteal; measured on a fresh clone: 7 min 37 s, against 9+ min with every slow test first)."""
    longest = ("test_quick_small_reproduce", "test_quick_reproduce_end_to_end")
    items.sort(key=lambda item: not item.name.startswith(longest))
