"""`smd eval` as a function and once through the CLI: a checkpoint whose answers are known scores exactly
what it should, the summary is the mean (and standard error) of the per-example rows, eviction shrinks
the KV cache, sampling is seeded, and bad values are named."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from smd_cli.config.validation import ConfigError
from smd_cli.model.build import build_tiny_model, build_tiny_tokenizer
from smd_cli.stages import evaluate as stage

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
PROBLEMS = [("What is 7000 + 777?", "#### 7,777"), ("What is 3 * 5?", "#### 15"),
            ("What is 7777 * 1?", "#### 7777"), ("What is 9 - 4?", "#### 5")]


def config(tmp_path, *overrides):
    small = ["model.warmstart.steps=0", "progress=false", "device=cpu", "eval.max_new_tokens=4", "eval.batch_size=2",
             f"+run_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("eval", overrides=[*small, *overrides])


def rows_of(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "predictions.jsonl").read_text().splitlines()]


@pytest.fixture
def gsm8k(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in PROBLEMS))
    return ["task=gsm8k", f"task.data_files='{path}'"]


@pytest.fixture
def sevens(tmp_path) -> Path:
    """A tiny checkpoint that always says "7": every token embeds alike, so the final hidden state c is the
    same at every position, and the (untied) output head scores c only for the token "7"."""
    tok = build_tiny_tokenizer()
    model = build_tiny_model(len(tok), seed=1, tie_word_embeddings=False).eval()
    seven = tok("7", add_special_tokens=False)["input_ids"][0]
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight[5].expand_as(model.model.embed_tokens.weight))
        c = model.model(input_ids=torch.tensor([[5]])).last_hidden_state[0, 0]  # [D]
        model.lm_head.weight.zero_()
        model.lm_head.weight[seven] = c
    path = tmp_path / "train_run" / "checkpoints" / "step_2" / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)  # as `smd train` saves it
    return path.parent


def test_checkpoint_scores_what_it_answers(tmp_path, gsm8k, sevens):
    summary = stage.run(config(tmp_path, *gsm8k, f"checkpoint={sevens}"))  # a folder holding model/
    rows = rows_of(tmp_path)
    assert [r["completion"] for r in rows] == ["7777"] * 4  # 4 new tokens, all "7"
    assert [r["accuracy"] for r in rows] == [1.0, 0.0, 1.0, 0.0]  # 7,777 and 7777 are right
    assert summary["metric_name"] == "accuracy" and summary["metric"] == summary["accuracy"] == 0.5
    assert summary["metric_stderr"] == pytest.approx(math.sqrt(1 / 3) / 2)  # sd of [1, 1, 0, 0] / sqrt(4)
    assert summary["n"] == 4 and summary["finished_fraction"] == 0.0 and summary["response_tokens_mean"] == 4
    assert summary["kv/bytes_peak"] == summary["kv/bytes_peak_dense"] > 0 and summary["memory/peak_rss_bytes"] > 0
    assert summary["tokens_per_second"] > 0 and summary["checkpoint"] == str(sevens)
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == pytest.approx(summary)
    assert not (tmp_path / "cache").exists()  # a checkpoint is never warm-started


def test_base_model_limit_and_mean_of_rows(tmp_path, gsm8k):
    summary = stage.run(config(tmp_path, *gsm8k, "eval.limit=3"))
    rows = rows_of(tmp_path)
    assert [r["id"] for r in rows] == ["gsm8k-test-0", "gsm8k-test-1", "gsm8k-test-2"]
    assert [r["reference"] for r in rows] == ["7777", "15", "7777"]
    assert summary["n"] == 3 and summary["metric"] == sum(r["accuracy"] for r in rows) / 3
    assert all(r["response_tokens"] == 4 or r["finished"] for r in rows)


def test_eviction_shrinks_the_cache_and_sampling_is_seeded(tmp_path):
    needle = ["task.prompt_tokens=64", "eval.limit=4", "eval.batch_size=4"]
    dense = stage.run(config(tmp_path / "dense", *needle))
    sampled = [stage.run(config(tmp_path / f"s{i}", *needle, "eviction=snapkv", "compression=0.5", "eval.temperature=1.0"))
               for i in range(2)]
    assert sampled[0]["eviction"] == "SnapKV" and sampled[0]["compression"] == 0.5 and dense["eviction"] == "none"
    assert sampled[0]["kv/bytes_peak"] < 0.75 * dense["kv/bytes_peak"]
    assert rows_of(tmp_path / "s0") == rows_of(tmp_path / "s1")  # same seed, same samples
    assert sampled[0]["metric"] == sum(r["reward"] for r in rows_of(tmp_path / "s0")) / 4


@pytest.mark.parametrize("override, message", [
    ("eval.batch_size=0", "eval.batch_size=0 is not allowed: an integer >= 1"),
    ("eval.limit=-1", r"eval.limit=-1 is not allowed: null \(the whole split\) or an integer >= 1"),
    ("eval.temperature=-0.5", r"eval.temperature=-0.5 is not allowed: >= 0 \(0 = greedy\)"),
    ("eval.top_p=0", r"eval.top_p=0 is not allowed: in \(0, 1\]"),
    ("checkpoint=/no/such/dir", "checkpoint='/no/such/dir' is not allowed: an existing directory"),
    ("compression=1.0", r"compression=1.0 is not allowed"),
    ("split=dev", "task=vote split 'dev'"),
])
def test_bad_values_are_named(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        stage.run(config(tmp_path, "eval.limit=2", override))


def test_checkpoint_without_weights_or_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a save_pretrained directory: no config.json"):
        stage.run(config(tmp_path, f"checkpoint={tmp_path / 'empty'}"))
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="has config.json but no \\*.safetensors weights"):
        stage.run(config(tmp_path, f"checkpoint={tmp_path / 'empty'}"))


@pytest.mark.slow
def test_cli_eval_gsm8k_end_to_end(tmp_path, gsm8k):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "SMD_CACHE_DIR": str(tmp_path / "cache")}
    script = Path(sys.executable).with_name("smd")  # the installed entry point
    smd = [str(script), "eval"] if script.is_file() else [sys.executable, "-m", "smd_cli.cli", "eval"]
    args = [*gsm8k, "model=tiny", "eval.limit=3", "eval.max_new_tokens=4", "device=cpu",
            f"hydra.run.dir={tmp_path / 'run'}"]
    done = subprocess.run([*smd, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    rows = rows_of(tmp_path)
    assert summary["n"] == len(rows) == 3 and summary["metric"] == sum(r["accuracy"] for r in rows) / 3
    assert "smd eval: gsm8k/test" in done.stdout and "accuracy" in done.stdout
    assert not (tmp_path / "cache" / "warmstart").exists()  # the tiny warm start is for the generated tasks only
    bad = subprocess.run([*smd, *args, "eval.batch_size=0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "eval.batch_size=0 is not allowed" in bad.stderr
