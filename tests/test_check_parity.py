"""`smd check-parity`, the lr = 0 protocol: it passes on every built-in eviction policy, with top-p and top-k too,
and fails (exit 1) on a deliberately wrong mask: a policy plug-in that alters the keys it keeps (something a
shadow mask cannot record), and a rollout whose recorded shadow mask was corrupted. The float64 replay names
both as mask errors, not rounding."""

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from smd_cli.cli import main
from smd_cli.eviction.snapkv import SnapKV
from smd_cli.runtime.failures import ParityFailed
from smd_cli.stages import check_parity as stage

CONF = Path(__file__).resolve().parents[1] / "conf"
SMALL = ["model.warmstart.steps=0", "task.prompt_tokens=48", "num_prompts=2", "num_generations=2", "sampling.max_new_tokens=6",
         "progress=false", "device=cpu"]


def config(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("check_parity", overrides=[*SMALL, f"+run_dir={tmp_path}", f"cache_dir={tmp_path / 'cache'}", *overrides])


class RoundedKeys(SnapKV):
    """A 'policy' that also rounds the keys it is shown to bfloat16 (a KV-quantising press): the cache holds keys the
    learner's replay never sees, which no shadow mask can express."""

    def prefill_scores(self, view):
        view.key.copy_(view.key.to(torch.bfloat16).float())
        return super().prefill_scores(view)


def test_every_built_in_policy_passes_and_the_json_says_so(tmp_path):
    report = stage.run(config(tmp_path, "policies=all", "sampling.top_p=0.9", "sampling.top_k=40", "parity.micro_batch_size=3"))
    written = json.loads((tmp_path / "parity.json").read_text())
    assert written["passed"] is True and written["bound"] == 1e-5 and written["judged"] == ["shadow", "physical"]
    assert sorted(written["policies"]) == ["h2o", "knorm", "none", "random", "recent", "snapkv"]
    for name, found in written["policies"].items():
        views = found["views"]
        assert set(views) == {"shadow", "dense", "physical", "shadow_float64"}, name
        assert views["shadow"]["max_abs_diff"] <= 1e-5 and views["physical"]["max_abs_diff"] <= 1e-5, name
        assert views["shadow_float64"]["max_abs_diff"] <= 1e-5 and 0 < views["shadow_float64"]["rounding"] <= 1e-5, name
        if name != "none":  # the dense learner feels the eviction: reported, not judged
            assert views["dense"]["max_abs_diff"] > 1e-3, name
        assert 0 < found["tokens"] <= 2 * 2 * 6 and found["sampling_support"] is True, name  # top-p / top-k: replayed
    assert report == written


def test_a_policy_that_alters_keys_fails_and_float64_calls_it_a_mask_error(tmp_path):
    cfg = config(tmp_path, f"eviction._target_={__name__}.RoundedKeys")
    with pytest.raises(ParityFailed, match="the float64 replay misses the sampler too") as err:
        stage.run(cfg)
    assert "a mask or KV error" in str(err.value) and str(tmp_path / "parity.json") in str(err.value)
    found = json.loads((tmp_path / "parity.json").read_text())["policies"]["RoundedKeys"]
    assert found["passed"] is False and "shadow" in found["failed"] and "shadow_float64" in found["failed"]
    wide = found["views"]["shadow_float64"]
    assert wide["max_abs_diff"] > 10 * wide["rounding"] and wide["max_abs_diff"] > 1e-4


def test_a_corrupted_shadow_mask_exits_1_through_the_cli(tmp_path, monkeypatch, capsys):
    """The recorded mask shows the learner a prompt key the sampler had evicted."""
    real = stage.generate

    def corrupted(*args, **kwargs):
        batch = real(*args, **kwargs)
        width = batch.input_ids.shape[1]
        evicted = (batch.evict_at == batch.prompt_length) & (torch.arange(width) < batch.prompt_length)
        assert evicted.any()  # SnapKV at c = 0.5 evicted prompt keys at prefill
        batch.evict_at = torch.where(evicted, width, batch.evict_at)  # ... which the corrupted mask calls never evicted
        return batch

    monkeypatch.setattr(stage, "generate", corrupted)
    with pytest.raises(SystemExit) as done:
        main(["check-parity", *SMALL, f"hydra.run.dir={tmp_path}", f"cache_dir={tmp_path / 'cache'}", "parity.physical=false"])
    assert done.value.code == 1
    out = " ".join(capsys.readouterr().err.split())
    assert "parity check failed:" in out and "a mask or KV error" in out
    assert json.loads((tmp_path / "parity.json").read_text())["passed"] is False


def test_a_tight_bound_fails_as_rounding_not_as_a_mask_error(tmp_path):
    with pytest.raises(ParityFailed, match="rounding, not a mask error"):
        stage.run(config(tmp_path, "parity.bound=1e-9", "parity.physical=false"))


@pytest.mark.parametrize("override, message", [
    ("parity.bound=0", "parity.bound=0 is not allowed"),
    ("policies=[snapkv,nope]", "policies=['snapkv', 'nope'] is not allowed: null .the composed eviction., all, or a list of "
                               "conf/eviction/ option names: h2o, knorm, none, random, recent, snapkv"),
    ("sampling.top_k=-1", "sampling.top_k=-1 is not allowed"),
    ("sampling.top_k=513", "sampling.top_k=513 is not allowed: an integer >= 0 and <= 512 .0 = no top-k; the learner replays the "
                           "sampler's kept tokens"),
])
def test_bad_values_are_named(tmp_path, override, message):
    with pytest.raises(Exception, match=message.replace("[", r"\[")):
        stage.run(config(tmp_path, override))


def test_a_dtype_without_a_contract_bound_asks_for_one(tmp_path):
    """`parity.bound: null` is the compute dtype's contract bound (1e-5 in float32, test_check_parity's first test); float16
    has none, and the stage names it before loading the model."""
    with pytest.raises(Exception, match=r"parity.bound=null: float16 compute has no contract bound .* set parity.bound="):
        stage.run(config(tmp_path, "model.cpu_dtype=float16"))
