"""Every config and recipe composes with Hydra's compose API, and bad values fail with clear messages."""


import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException
from hydra.utils import instantiate

from smd_cli.cli import CONF_DIR, RECIPES_DIR, register_recipes

PRIMARY = sorted(p.stem for p in CONF_DIR.glob("*.yaml"))
GROUP_FILES = sorted(p for p in CONF_DIR.rglob("*.yaml") if p.parent != CONF_DIR and "hydra" not in p.parts)
RECIPES = sorted(p.stem for p in RECIPES_DIR.rglob("*.yaml"))
INSTANTIABLE = {"task", "eviction"}  # optim needs parameters; model and algo are plain settings


@pytest.fixture(scope="module")
def hydra_conf():
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


def test_the_config_tree_is_what_we_think():
    assert PRIMARY == ["ablate", "check_parity", "eval", "plan", "prepare_data", "reproduce", "rollout", "train"]
    groups = {}
    for p in GROUP_FILES:
        groups.setdefault(p.parent.name, []).append(p.stem)
    assert sorted(groups) == ["algo", "eviction", "model", "optim", "scale", "task"]
    assert sorted(groups["algo"]) == ["dense", "icepop", "mis", "naive_sparse", "smd", "sparse_rl", "tis", "trm"]
    assert sorted(groups["eviction"]) == ["h2o", "knorm", "none", "random", "recent", "snapkv"]
    assert sorted(groups["task"]) == ["govreport", "gsm8k", "hotpotqa", "multi_needle", "needle", "passkey", "ruler", "tldr", "vote"]
    assert sorted(groups["model"]) == ["hub", "qwen3_4b", "qwen3_4b_random", "smollm2_135m", "tiny"]
    assert sorted(groups["scale"]) == ["paper", "small", "tiny"]
    assert len(GROUP_FILES) == 33  # 8 algo + 6 eviction + 9 task + 5 model + 2 optim + 3 scale
    assert RECIPES == ["ablate_compression", "ablate_lambda", "ablate_selection", "govreport", "gsm8k", "hotpotqa", "main_table",
                       "paper_ablate_compression", "paper_ablate_lambda", "paper_ablate_selection", "paper_main_table", "small_ablate_compression",
                       "small_ablate_lambda", "small_ablate_selection", "small_main_table", "tiny_naive_sparse", "tiny_smd", "tldr"]


@pytest.mark.parametrize("name", PRIMARY)
def test_primary_configs_compose(hydra_conf, name):
    cfg = compose(config_name=name)
    assert cfg.seed == 0 and cfg.stage_help


@pytest.mark.parametrize("path", GROUP_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_group_option_composes(hydra_conf, path):
    group, name = path.parent.name, path.stem
    overrides = [f"{group}={name}"]
    if group == "eviction":
        overrides.append("algo=smd")  # algo=dense pins eviction=none
    cfg = compose(config_name="train", overrides=overrides)
    if group == "algo":
        assert cfg.algo.name == name
    if group in INSTANTIABLE:
        obj = instantiate(cfg[group])
        assert type(obj).__module__.startswith("smd_cli.")


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_composes(hydra_conf, name):
    cfg = compose(config_name="train", overrides=[f"+recipe={name}"])
    assert cfg.algo.name in ("dense", "naive_sparse", "sparse_rl", "tis", "smd")
    instantiate(cfg.task)


def test_unknown_group_option_names_the_choices(hydra_conf):
    with pytest.raises(MissingConfigException) as err:
        compose(config_name="train", overrides=["task=nonexistent"])
    assert "task/nonexistent" in str(err.value) and "gsm8k" in str(err.value)


def test_interpolations_follow_top_level_keys(hydra_conf):
    cfg = compose(config_name="train", overrides=["algo=smd", "compression=0.7", "lambda=0.3"])
    assert cfg.eviction.compression == 0.7 and cfg["lambda"] == 0.3
    assert cfg.sampling.max_new_tokens == cfg.task.max_new_tokens
