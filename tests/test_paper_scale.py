"""The paper-scale path through the user's entry points: both 4B model configs through `load_model` (the
random one at the paper's widths with one layer, the Hub one from a local save_pretrained directory,
offline), gradient checkpointing honoured by every model, and `smd rollout` / `smd train` / `smd eval` on
`model=qwen3_4b_random`."""

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from smd_cli.attention.dispatch import ATTENTION
from smd_cli.cli import CONF_DIR, main, register_recipes
from smd_cli.config.factories import build_task
from smd_cli.model.build import build_tiny_model, build_tiny_tokenizer
from smd_cli.runs.model_loading import load_model
from smd_cli.stages import train

ONE_LAYER = ["model=qwen3_4b_random", "model.config.num_hidden_layers=1", "progress=false"]
SHORT = ["task.prompt_tokens=64", "sampling.max_new_tokens=3"]
NARROW_VOCAB = ["model.config.vocab_size=16384"]


def compose_stage(tmp_path, stage, *overrides):
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=stage, overrides=[*overrides, f"+run_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"])


def checkpointed_layers(model) -> list[bool]:
    return [layer.gradient_checkpointing for layer in model.model.layers]


def test_qwen3_4b_random_loads_at_the_papers_widths(tmp_path):
    cfg = compose_stage(tmp_path, "train", *ONE_LAYER)
    model, tokenizer = load_model(cfg, build_task(cfg), torch.device("cpu"))
    c = model.config
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (2560, 9728, 32, 8, 128)
    assert (c.vocab_size, c.num_hidden_layers, c.tie_word_embeddings) == (151936, 1, True)
    attention = 2560 * 32 * 128 + 2 * 2560 * 8 * 128 + 32 * 128 * 2560 + 2 * 128  # q, k, v, o, q/k norms
    layer = attention + 3 * 2560 * 9728 + 2 * 2560  # + gate, up, down, two RMS norms
    assert sum(p.numel() for p in model.parameters()) == 151936 * 2560 + layer + 2560  # tied embedding, final norm
    assert checkpointed_layers(model) == [True]
    assert c._attn_implementation == ATTENTION
    assert next(model.parameters()).dtype == torch.float32  # model.cpu_dtype: bf16 matmuls are emulated on this CPU
    assert len(tokenizer) <= c.vocab_size


def test_an_architecture_of_its_own_draws_each_weight_once(monkeypatch):
    """`draw_once` (what load_model gives `model=qwen3_4b_random`): one N(0, 0.02) draw per matrix entry, the tied
    head drawn with the embedding, norms 1, reproducible from the seed; the tiny model's own build draws about three
    times as many numbers (torch's init, then transformers')."""
    drawn = []
    for name in ("normal_", "uniform_"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _f=original, **k: drawn.append(t.numel()) or _f(t, *a, **k))
    widths = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=1)
    model = build_tiny_model(4096, seed=5, draw_once=True, **widths)
    matrices = 4096 * 256 + 256 * 4 * 64 + 2 * 256 * 2 * 64 + 4 * 64 * 256 + 3 * 256 * 512  # embedding (= head), q k v o, mlp
    assert sum(drawn) == matrices and model.lm_head.weight is model.model.embed_tokens.weight
    for name, p in model.named_parameters():
        if p.ndim == 2:
            assert abs(float(p.detach().std()) - 0.02) < 0.002 and abs(float(p.detach().mean())) < 0.002, name
        else:
            assert torch.equal(p.detach(), torch.ones_like(p)), name
    again = build_tiny_model(4096, seed=5, draw_once=True, **widths)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    drawn.clear()
    build_tiny_model(4096, seed=5, **widths)
    assert sum(drawn) > 2.5 * matrices


def test_the_hub_config_loads_a_local_checkpoint_offline(tmp_path):
    """model=qwen3_4b goes through from_pretrained; a save_pretrained directory stands in for the Hub."""
    tokenizer = build_tiny_tokenizer()
    saved = build_tiny_model(len(tokenizer), seed=3)
    saved.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    cfg = compose_stage(tmp_path, "eval", "model=qwen3_4b", f"model.name_or_path={tmp_path / 'ckpt'}", "model.cpu_dtype=null")
    model, _ = load_model(cfg, build_task(cfg), torch.device("cpu"))
    assert next(model.parameters()).dtype == torch.bfloat16  # model.dtype, as configured
    assert checkpointed_layers(model) == [True, True]
    assert model.config._attn_implementation == ATTENTION
    torch.testing.assert_close(model.model.norm.weight.float(), saved.model.norm.weight)


@pytest.mark.parametrize("flag, expected", [("true", [True, True]), ("false", [False, False])])
def test_gradient_checkpointing_is_honoured_by_the_tiny_model(tmp_path, flag, expected):
    cfg = compose_stage(tmp_path, "train", f"model.gradient_checkpointing={flag}", "model.warmstart.steps=0")
    model, _ = load_model(cfg, build_task(cfg), torch.device("cpu"))
    assert checkpointed_layers(model) == expected


@pytest.mark.slow
def test_smd_rollout_on_the_random_4b_architecture(tmp_path):
    run_dir = tmp_path / "rollout"
    main(["rollout", *ONE_LAYER, *SHORT, "num_prompts=1", "num_generations=2", f"hydra.run.dir={run_dir}"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["parity/max_abs_diff_shadow"] <= 1e-4  # float32 on the CPU, 32/8 heads, vocabulary 151936
    assert summary["parity/max_abs_diff_physical"] <= 1e-4
    assert summary["kv/kept_fraction"] < 0.8


@pytest.mark.slow
def test_smd_train_and_eval_on_the_random_4b_architecture(tmp_path):
    """A layer at the paper's widths, its vocabulary narrowed to 16384 (the rollout test above keeps 151936): the saved
    and reloaded checkpoint is 0.6 GB, not 2 GB."""
    cfg = compose_stage(tmp_path, "train", *ONE_LAYER, *NARROW_VOCAB, *SHORT, "algo=smd", "steps=1", "grpo.prompts_per_step=1",
                        "grpo.num_generations=2", "eval.num_prompts=0", "checkpoint.every=0",
                        "checkpoint.at_end=false")  # final/ only: no AdamW state
    summary = train.run(cfg)
    assert summary["status"] == "completed"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["mismatch/max_abs_diff"] <= 1e-4 and rows[0]["grad_norm"] > 0
    run_dir = tmp_path / "eval"
    main(["eval", *ONE_LAYER, *NARROW_VOCAB, "task.prompt_tokens=64", "eval.limit=2", f"checkpoint={tmp_path / 'run' / 'final'}", f"hydra.run.dir={run_dir}",
          "eval.max_new_tokens=3"])
    assert json.loads((run_dir / "summary.json").read_text())["n"] == 2


def test_the_random_4b_builds_the_published_architecture(tmp_path):
    hub = compose_stage(tmp_path, "train", "model=qwen3_4b").model.architecture
    assert dict(compose_stage(tmp_path, "train", "model=qwen3_4b_random").model.config) == dict(hub)


@pytest.mark.parametrize("algo", ["dense", "naive_sparse", "sparse_rl", "tis", "smd"])
def test_paper_recipes_compose_with_every_algorithm(tmp_path, algo):
    cfg = compose_stage(tmp_path, "train", "+recipe=gsm8k", f"algo={algo}")
    policy = train.rollout_policy(cfg)  # the recipe's eviction settings work with each algorithm's policy
    assert (policy is None) == (algo == "dense")
    sparse_rl = algo == "sparse_rl"
    assert (cfg.grpo.loss_agg, cfg.grpo.beta) == (("seq_mean_token_mean", 1e-4) if sparse_rl else ("token_mean", 0.0))
