"""Every key of every stage's composed config has a rule (`smd_cli.config.rules`), and a wrong type or value of any
of them is a config error naming it, never a traceback: generated from the configs (every stage, every config
group option, every recipe), not from a list of keys. A key added to a YAML file without a rule fails here, by name."""

import copy
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from smd_cli.cli import CONF_DIR, RECIPES_DIR, register_recipes
from smd_cli.config import rules
from smd_cli.config.validation import ConfigError
from smd_cli.stages import ablate, check_parity, evaluate, plan, prepare_data, reproduce, rollout, train

STAGES = {"train": train, "ablate": ablate, "plan": plan, "eval": evaluate, "rollout": rollout, "check_parity": check_parity,
          "prepare_data": prepare_data, "reproduce": reproduce}
GROUP_FILES = sorted(p for p in CONF_DIR.rglob("*.yaml") if p.parent != CONF_DIR and "hydra" not in p.parts)
RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
# values of every kind a command line can give: a word, a list, a mapping, a boolean, a negative number, NaN, null
PANEL = ["abc", [1, 2], {"a": 1}, True, -1, math.nan, None]


def kind(value) -> str:
    return ("null" if value is None else "bool" if isinstance(value, bool) else "number" if isinstance(value, (int, float))
            else "str" if isinstance(value, str) else "list" if isinstance(value, list) else "mapping")


@pytest.fixture(scope="module")
def variants():
    """(stage, overrides, composed config): every stage alone; `smd train` (whose keys ablate and plan share) with
    every option of every config group and with every recipe. eval, rollout and prepare-data compose the same
    model, task and eviction files as train, so their options' keys are train's."""
    register_recipes()
    out = []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for stage in STAGES:
            out.append((stage, [], compose(config_name=stage)))
        for path in GROUP_FILES:
            overrides = [f"{path.parent.name}={path.stem}"]
            overrides += ["algo=smd"] if path.parent.name == "eviction" else []  # algo=dense pins eviction=none
            overrides += ["task=gsm8k"] if overrides == ["scale=paper"] else []  # the paper settings live in paper tasks
            out.append(("train", overrides, compose(config_name="train", overrides=overrides)))
        out += [("train", [f"+recipe={r}"], compose(config_name="train", overrides=[f"+recipe={r}"])) for r in RECIPES]
    return out


def settings(variants) -> dict[tuple[str, str], tuple]:
    """(stage, key) -> (rule, the first composed config and default value it was seen with, its overrides)."""
    seen = {}
    for stage, overrides, cfg in variants:
        for key, value, rule in rules.leaves(rules.resolved(cfg), stage):
            seen.setdefault((stage, key), (rule, cfg, value, overrides))
    return seen


def test_every_key_of_every_composed_config_has_a_rule_and_accepts_its_default(variants):
    assert len(variants) == len(STAGES) + len(GROUP_FILES) + len(RECIPES) == 8 + 33 + 18
    seen = settings(variants)
    missing = sorted({key for (stage, key), (rule, *_) in seen.items() if rule is None})
    assert not missing, f"config keys without a rule in smd_cli/config/rules.py: {missing}"
    refused = [(stage, key, value, overrides) for (stage, key), (rule, _, value, overrides) in seen.items() if not rule(value)]
    assert not refused, f"defaults refused by their own rule: {refused}"
    assert len({key for _, key in seen}) >= 170


def test_every_key_refuses_a_wrong_type_with_a_config_error_naming_it(variants):
    """For every key (each of its rules once: a stage may have its own) and every value of PANEL: a value its rule
    refuses is the config error `KEY=VALUE is not allowed: ALLOWED`, the first the stage reports (a key that
    interpolates it comes after); a value its rule accepts passes through the stage's own `validate` (which may
    still refuse it with a ConfigError, never another exception). Each key refuses some value of another kind than
    its default's. Every stage's `validate` is seen refusing through the rules."""
    checked, empty, done, stages = 0, [], set(), set()
    for (stage, key), (rule, cfg, default, _) in settings(variants).items():
        if (key, id(rule)) in done:
            continue
        done.add((key, id(rule)))
        plain, config = OmegaConf.to_container(cfg, resolve=False), rules.resolved(cfg)
        derived = frozenset(rules.interpolated(plain))
        refused_kinds = set()
        for value in PANEL:
            if rule(value):  # accepted: the stage's own checks run on it, and raise nothing but a ConfigError
                try:
                    STAGES[stage].validate(OmegaConf.create(_set(plain, key, value)))
                except ConfigError:
                    pass
            else:
                found = rules.problems(_set(config, key, value), stage, derived)
                assert found and found[0] == (key, value, rule.allowed), (stage, key, value, found)
                refused_kinds.add(kind(value))
                if stage not in stages:  # once per stage: through its `validate`, as the CLI meets it
                    with pytest.raises(ConfigError) as err:
                        STAGES[stage].validate(OmegaConf.create(_set(plain, key, value)))
                    assert str(err.value) == f"{key}={value!r} is not allowed: {rule.allowed}"
                    stages.add(stage)
            checked += 1
        others = {kind(v) for v in PANEL} - {kind(default)}
        if not rule.record and not refused_kinds & others:
            empty.append((stage, key))
    assert not empty, f"keys whose rule refuses no value of another kind than their default's: {empty}"
    assert checked >= 7 * 170 and stages == set(STAGES)


def _set(config: dict, key: str, value) -> dict:
    """A copy of a plain config with the dotted `key` set to `value`."""
    out = copy.deepcopy(config)
    node = out
    *parents, last = key.split(".")
    for part in parents:
        node = node[part]
    node[last] = value
    return out


def test_the_rules_name_what_is_allowed():
    def message(stage, key, value):
        found = rules.problems({key.split(".")[0]: _nest(key.split(".")[1:], value)}, stage)
        return f"{found[0][0]}={found[0][1]!r} is not allowed: {found[0][2]}" if found else None

    assert message("plan", "plan.device_gb", [80, None]) == ("plan.device_gb=[80, None] is not allowed: a non-empty list of "
                                                             "finite sizes > 0 in GiB, e.g. [80, 141]")
    assert message("plan", "plan.device_gb", [True]).startswith("plan.device_gb=[True] is not allowed")  # True is not 1 GiB
    assert message("plan", "plan.device_gb", [math.inf]).startswith("plan.device_gb=[inf] is not allowed")
    assert message("train", "lambda", "abc") == "lambda='abc' is not allowed: a finite number >= 0 (the SMD distillation weight)"
    assert message("train", "steps", 2.5) == "steps=2.5 is not allowed: an integer >= 0"
    assert message("rollout", "sampling.temperature", 0) is None and message("train", "sampling.temperature", 0) is not None
    assert message("train", "grpo", 5) == "grpo=5 is not allowed: a group of settings (KEY.NAME=VALUE), not a single value"
    assert message("train", "grpo.epsilon", {"a": 1}) == "grpo.epsilon={'a': 1} is not allowed: a clip range in (0, 1)"
    assert message("reproduce", "only", []) == ("only=[] is not allowed: null (all of the scale's tables) or a non-empty list "
                                                "of tables, e.g. [main, lambda]")
    assert message("train", "model.config.hidden_size", "64x") == ("model.config.hidden_size='64x' is not allowed: an integer "
                                                                  ">= 1 (a field of the model's transformers config)")
    assert message("train", "+unknown", 5) is None  # a key added with +KEY=... has no rule and is left alone
    assert Path(rules.__file__).name == "rules.py"


def _nest(parts, value):
    return value if not parts else {parts[0]: _nest(parts[1:], value)}
