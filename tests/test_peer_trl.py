"""bench/peer_trl.py without TRL or any training: its `smd train` overrides compose and validate, and both
sides get the same 256-token prompts and the same reward."""

import importlib.util
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from smd_cli.cli import CONF_DIR
from smd_cli.model.build import tiny_config
from smd_cli.stages.train import validate

# loaded by file (bench/ is no package), under the name its `task._target_` uses
_spec = importlib.util.spec_from_file_location("peer_trl", Path(__file__).resolve().parents[1] / "bench" / "peer_trl.py")
peer_trl = sys.modules.setdefault("peer_trl", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(peer_trl)


@pytest.mark.parametrize("algo", sorted(peer_trl.SMD_ALGOS))
def test_smd_overrides_compose_and_give_trl_the_same_prompts(algo, tiny_tokenizer):
    cmd = peer_trl.smd_command(algo, steps=3, prompt_tokens=256, run_dir=Path("/nonexistent"))
    assert cmd[1:4] == ["-m", "smd_cli.cli", "train"]
    overrides = [a for a in cmd[4:] if not a.startswith("hydra.")]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    validate(cfg)
    assert (cfg.algo.name, cfg.grpo.prompts_per_step, cfg.grpo.num_generations, cfg.sampling.max_new_tokens) == (algo, 2, 8, 8)
    assert cfg.model.warmstart.steps == 0 and cfg.eval.num_prompts == 0 and cfg.grpo.beta == 0 and cfg.optim.lr == peer_trl.LR
    # smd builds the model that bench/peer_trl.py saves for TRL: build_tiny_model(seed=0) with tiny_config's defaults
    assert cfg.seed == peer_trl.SEED and cfg.model.name_or_path is None
    assert tiny_config(vocab_size=7, **cfg.model.config).to_dict() == tiny_config(vocab_size=7).to_dict()
    task = instantiate(cfg.task)
    assert type(task).__name__ == "DigitNeedle"
    example = task.example(task.train_split, 0)
    smd_ids = task.encode_prompt(example, tiny_tokenizer)
    trl_ids = tiny_tokenizer(tiny_tokenizer.bos_token + example["prompt"])["input_ids"]  # what TRL tokenizes
    assert len(smd_ids) == 256 and trl_ids == smd_ids
    assert example["prompt"] == peer_trl.NeedleRetrieval(prompt_tokens=255).example("train", 0)["prompt"]


def test_reward_is_the_digit_fraction_on_both_sides():
    assert peer_trl.digit_fraction("") == 0.0
    assert peer_trl.digit_fraction(" v40 f1") == pytest.approx(3 / 7)
    assert peer_trl.DigitNeedle().reward(" ab12", {"reference": " ANSWER v1"}) == pytest.approx(0.4)
