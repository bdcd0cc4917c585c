"""The evaluations before training, computed once (`smd_cli/evaluation/cache.py`, `eval.reuse_before`): a second run of the
same starting weights reads the first run's numbers, which equal what it computes with the cache off; anything the
evaluation reads changes the key."""

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from smd_cli.cli import CONF_DIR, register_recipes
from smd_cli.evaluation import cache as eval_cache
from smd_cli.model.build import build_tiny_model
from smd_cli.runtime import records
from smd_cli.stages import train

TINY_RUN = ["steps=1", "grpo.prompts_per_step=2", "grpo.num_generations=2", "eval.num_prompts=8", "task.prompt_tokens=48",
            "model.warmstart.steps=5", "progress=false", "checkpoint.every=0", "checkpoint.at_end=false"]


def run(tmp_path, name, *overrides):
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[*TINY_RUN, *overrides, f"+run_dir={tmp_path / name}", f"cache_dir={tmp_path / 'cache'}"])
    return train.run(cfg)


def before(summary):
    return {k: v for k, v in summary.items() if k.startswith("eval") and k.endswith("_before")}


def test_a_second_run_reads_the_evaluations_before_that_it_would_compute(tmp_path, capsys):
    first = run(tmp_path, "smd", "algo=smd")
    assert len(list((tmp_path / "cache" / "evals").glob("*.json"))) == 1 and "read from" not in capsys.readouterr().out
    second = run(tmp_path, "naive", "algo=naive_sparse", "optim.lr=3e-3")  # another algorithm, the same start and evaluation
    assert "held-out evaluations before GRPO: read from" in capsys.readouterr().out
    computed = run(tmp_path, "naive_off", "algo=naive_sparse", "optim.lr=3e-3", "eval.reuse_before=false")
    assert "read from" not in capsys.readouterr().out
    assert {"eval/reward_before", "eval/exact_before", "eval/evict/reward_before", "eval/evict/greedy_reward_before"} <= set(before(first))
    assert before(second) == before(first) == before(computed)  # bit for bit: what the cache returns is what the run computes
    assert second["eval/evict/reward_after"] == computed["eval/evict/reward_after"]  # and the run goes on the same
    other = run(tmp_path, "c07", "algo=smd", "compression=0.7")  # another evaluation: computed, stored beside the first
    assert "read from" not in capsys.readouterr().out and len(list((tmp_path / "cache" / "evals").glob("*.json"))) == 2
    assert other["eval/reward_before"] == first["eval/reward_before"]  # the dense evaluation does not see the compression


def test_the_key_changes_with_the_weights_the_prompts_and_the_settings():
    model = build_tiny_model(64, seed=0, num_hidden_layers=1, hidden_size=16, intermediate_size=32, head_dim=8)
    examples, prompts, settings = [{"id": "a", "prompt": "x", "reference": "1"}], [[3, 4, 5]], {"eval": {"num_prompts": 1}}
    base = eval_cache.key(model, examples, prompts, settings)
    assert base == eval_cache.key(model, examples, prompts, dict(settings))
    with torch.no_grad():
        p = next(model.parameters())
        p.view(-1)[0] = torch.nextafter(p.view(-1)[0], torch.tensor(float("inf")))  # one bit of one weight
    assert eval_cache.key(model, examples, prompts, settings) != base
    with torch.no_grad():
        p.view(-1)[0] = torch.nextafter(p.view(-1)[0], torch.tensor(float("-inf")))
    assert eval_cache.key(model, examples, prompts, settings) == base
    assert eval_cache.key(model, examples, [[3, 4, 6]], settings) != base
    assert eval_cache.key(model, [{**examples[0], "reference": "2"}], prompts, settings) != base
    assert eval_cache.key(model, examples, prompts, {"eval": {"num_prompts": 2}}) != base


def sealed(body) -> str:
    """A cache entry as the cache writes one (`records.sealed`): this test's content, correctly sealed."""
    return json.dumps(records.sealed(body))


@pytest.mark.parametrize("content", ["{not json", sealed({"key": "another", "summary": {"eval/reward_before": 0.5}}),
                                     sealed({"key": "K", "summary": {"eval/reward_before": None}}), json.dumps(["K"]),
                                     json.dumps({"key": "K", "summary": {"eval/reward_before": 0.5}}),  # not sealed
                                     sealed({"key": "K", "summary": {"eval/reward_before": 7.5}})])  # sealed, out of range
def test_an_unreadable_foreign_or_edited_entry_is_named_and_never_read(tmp_path, content):
    (tmp_path / "evals").mkdir()
    (tmp_path / "evals" / "K.json").write_text(content)
    with pytest.raises(records.Damaged, match=f"{tmp_path / 'evals' / 'K.json'}: "):
        eval_cache.load(tmp_path, "K")
    assert eval_cache.load(tmp_path, "absent") is None
    assert eval_cache.store(tmp_path, "K", {"eval/reward_before": 0.25}) and eval_cache.load(tmp_path, "K") == {"eval/reward_before": 0.25}
    assert not eval_cache.store(tmp_path, "N", {"eval/reward_before": float("nan")})  # JSON would turn it into null


def test_an_entry_edited_on_disk_is_named_and_evaluated_again_by_smd_train(tmp_path, capsys):
    """Issue 40's probe: an eval-cache entry edited to a held-out reward of 7.5 printed "before 7.5" (the entries had no
    checksum). Now the run names the entry, evaluates again, and its numbers are the first run's."""
    first = run(tmp_path, "first", "algo=smd")
    (entry,) = (tmp_path / "cache" / "evals").glob("*.json")
    edited = entry.read_text().replace(f'"eval/reward_before": {first["eval/reward_before"]}', '"eval/reward_before": 7.5')
    assert edited != entry.read_text()
    entry.write_text(edited)
    capsys.readouterr()
    second = run(tmp_path, "second", "algo=smd")
    said = capsys.readouterr().out
    assert f"{entry}: does not match its SHA-256 (changed since it was written); evaluating again" in " ".join(said.split())
    assert "read from" not in said and before(second) == before(first)
    assert eval_cache.load(tmp_path / "cache", entry.stem)["eval/reward_before"] == first["eval/reward_before"]  # rewritten
