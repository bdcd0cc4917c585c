"""Sizes are checked before they are allocated (issue 27 item 3), through `smd train`: the planner's step for the
run's device against the machine's memory (`smd_cli.runs.memory_fit.check_fits`, its numbers in the refusal), the
context check with the real encoded prompt (chat template included) for every model, `model=hub` too, and the
architecture check before any warm start. The machine's memory is fixed by the test (4 GiB), so that the refusals
do not depend on what else runs."""

from __future__ import annotations

import re
import time

import pytest
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from smd_cli.runs import memory_fit
from smd_cli.tasks.synthetic import NeedleRetrieval
from tests.conftest import smd
from tests.test_architectures import save_tiny

GiB = 2**30
TINY = ["progress=false", "device=cpu"]


@pytest.fixture
def four_gib(monkeypatch):
    monkeypatch.setattr(memory_fit, "machine_memory", lambda device: (4.0 * GiB, 4.0 * GiB, "test memory"))


def refusal(capsys, *args, tmp_path) -> tuple[str, float]:
    capsys.readouterr()  # what came before (saving a model) is not the refusal
    started = time.perf_counter()
    code = smd("train", *TINY, *args, f"cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}")
    seconds = time.perf_counter() - started
    out = " ".join(capsys.readouterr().err.split())
    assert code == 2, out
    assert not (tmp_path / "cache" / "warmstart").exists() and not (tmp_path / "run" / "summary.json").exists()
    return out, seconds


def prompt_width(out: str) -> int:
    return int(re.search(r"x \(P (\d+) \+ R", out).group(1))


@pytest.mark.parametrize("key,value,rows,response", [
    ("grpo.num_generations", 1_000_000, 16 * 1_000_000, 5),  # vote: 16 prompts per step, 5 new tokens
    ("sampling.max_new_tokens", 1_000_000_000, 16 * 8, 1_000_000_000),
    ("grpo.prompts_per_step", 100_000_000, 100_000_000 * 8, 5),
])
def test_a_step_that_cannot_fit_is_refused_with_the_planners_numbers(key, value, rows, response, tmp_path, capsys, four_gib):
    out, seconds = refusal(capsys, f"{key}={value}", tmp_path=tmp_path)
    assert out.startswith(f"config error: {key}={value} is not allowed: the planner (`smd plan`) predicts ")
    assert f"for {rows} rows x (P " in out and f" + R {response}); " in out
    noise = 8 * rows * response / GiB  # a float64 uniform per row and new token, drawn for the whole step
    assert f"on the host, sampling noise {noise:,.2f}, held-out prompts {36 * 128 * prompt_width(out) / GiB:,.2f} GiB" in out
    assert out.endswith("more than the 4.00 GiB of test memory. Lower it (`smd plan plan.device=cpu ...` shows every term "
                        "and the batch sizes that fit)")
    peak = float(re.search(r"step peak ([\d,.]+) GiB", out).group(1).replace(",", ""))
    assert peak > 4.0 and seconds < 30, (peak, seconds)  # was: minutes of growth, or a 64 GB allocation's traceback


def test_held_out_prompts_that_cannot_fit_name_eval_num_prompts(tmp_path, capsys, four_gib):
    out, _ = refusal(capsys, "eval.num_prompts=1000000000", tmp_path=tmp_path)
    assert out.startswith("config error: eval.num_prompts=1000000000 is not allowed: the planner")
    assert f"held-out prompts {36 * 1_000_000_000 * prompt_width(out) / GiB:,.2f} GiB" in out  # their token ids alone


def test_a_hub_model_is_held_to_its_own_positions(tmp_path, tiny_tokenizer, capsys, four_gib):
    path = save_tiny(tmp_path / "llama", tiny_tokenizer, LlamaConfig, LlamaForCausalLM, max_position_embeddings=64)
    out, seconds = refusal(capsys, "model=hub", f"model.name_or_path={path}", "task=needle", "task.prompt_tokens=100", tmp_path=tmp_path)
    assert out == "config error: task.prompt_tokens=100 is not allowed: it exceeds model=hub's 64 positions (max_position_embeddings)"
    assert seconds < 30  # was: no check for model=hub (task.prompt_tokens=1e8 was OOM-killed at 15 GB)


def test_the_chat_template_counts_toward_the_positions(tmp_path, tiny_tokenizer, capsys, four_gib):
    path = tmp_path / "llama"
    tiny_tokenizer.save_pretrained(path)
    (path / "chat_template.jinja").write_text("{% for m in messages %}<|user|>\n{{ m['content'] }}\n{% endfor %}<|assistant|>\n")
    example = NeedleRetrieval(prompt_tokens=40, max_new_tokens=4).example("train", 0)
    messages = [{"role": "user", "content": example["prompt"]}]
    encoded = len(AutoTokenizer.from_pretrained(path).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    positions = encoded + 2  # the prompt fits, its 4 new tokens do not; the nominal 40 + 4 fit easily
    save_tiny(path, tiny_tokenizer, LlamaConfig, LlamaForCausalLM, max_position_embeddings=positions)
    (path / "chat_template.jinja").write_text("{% for m in messages %}<|user|>\n{{ m['content'] }}\n{% endfor %}<|assistant|>\n")
    assert 40 + 4 < positions and encoded > 60  # the template's 20-odd byte tokens (was: only the nominal 44 was checked)
    out, _ = refusal(capsys, "model=hub", f"model.name_or_path={path}", "task=needle", "task.prompt_tokens=40", "task.max_new_tokens=4",
                     tmp_path=tmp_path)
    assert out == (f"config error: task.prompt_tokens=40 is not allowed: its prompts encode to {encoded} tokens (chat template and the "
                   f"task's words included), which with sampling.max_new_tokens=4 exceed model=hub's {positions} positions "
                   "(max_position_embeddings)")


def test_an_unsupported_architecture_is_refused_before_the_warm_start(tmp_path, capsys, four_gib):
    out, seconds = refusal(capsys, "+model.config.use_sliding_window=true", "+model.config.sliding_window=16", "+model.config.max_window_layers=0",
                           tmp_path=tmp_path)
    assert out.startswith("config error: model=tiny (Qwen3ForCausalLM, model_type 'qwen3') is not supported: it has sliding-window or "
                          "alternating attention (layer types ['sliding_attention'])")
    assert seconds < 30  # was: refused after the 700-step warm start (minutes)
