"""`optim.offload`: the float32 masters, their gradients and the optimizer state go to host memory for the rollout and
come back for the learner bit for bit; a run with offload trains exactly what a run without does (the CPU path is
the CUDA path without pinning: there is no pinned memory without CUDA); `smd plan` counts it and prints the fit of
a paper recipe on 80 GiB with and without it."""

import io
import json

import pytest
import torch
from hydra import compose, initialize_config_dir
from rich.console import Console
from safetensors.torch import load_file

from smd_cli.checks.planner import Arch, Run, plan
from smd_cli.cli import CONF_DIR, main, register_recipes
from smd_cli.config.validation import ConfigError
from smd_cli.learner.step import Algorithm, learner_step
from smd_cli.model.build import build_tiny_model
from smd_cli.model.precision import MasterWeights, build_optimizer
from smd_cli.rollout.sampler import generate
from smd_cli.runtime.offload import Offload, offloaded
from smd_cli.stages import plan as plan_stage
from smd_cli.stages import train

TINY_RUN = ["steps=2", "grpo.prompts_per_step=2", "grpo.num_generations=4", "eval.num_prompts=4", "task.prompt_tokens=48",
            "model.warmstart.steps=5", "progress=false"]

ADVANTAGES = torch.tensor([1.0, -0.5, 0.25, 2.0])


def compose_train(tmp_path, *overrides, config_name="train"):
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=[*overrides, f"+run_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"])


def stepped(tokenizer, dtype):
    """A model and its AdamW after one learner step (state exists), gradients set to random values."""
    model = build_tiny_model(len(tokenizer), seed=0, dtype=dtype).eval()
    optimizer = build_optimizer(model, lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, len(tokenizer), (24,), generator=generator).tolist() for _ in range(2) for _ in range(2)]
    batch = generate(model, prompts, max_new_tokens=4, generator=torch.Generator().manual_seed(1), eos_token_id=-1, pad_token_id=0)
    learner_step(model, optimizer, batch, ADVANTAGES, Algorithm("dense"))
    for p in (optimizer.param_groups[0]["params"]):
        p.grad = torch.randn(p.shape, generator=generator, dtype=p.dtype)
    return model, optimizer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_state_round_trips_bit_for_bit(tiny_tokenizer, dtype):
    model, optimizer = stepped(tiny_tokenizer, dtype)
    offload = Offload(optimizer, torch.device("cpu"))
    before = {key: t.clone() for key, t in offload.tensors().items()}
    kinds = {kind for kind, _, _ in before}
    assert kinds == ({"master", "grad", "state"} if dtype == torch.bfloat16 else {"grad", "state"})  # a float32 model's weights stay
    assert {name for kind, _, name in before if kind == "state"} == {"exp_avg", "exp_avg_sq", "step"}
    weights = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):  # twice: the host buffers are reused
        offload.to_host()
        away = offload.tensors()
        assert offload.away and all(away[key].data_ptr() == offload.host[key].data_ptr() for key in away)  # the state lives on the host
        assert all(p.grad is None for p in optimizer.param_groups[0]["params"]) or dtype == torch.bfloat16  # device gradients released
        assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))  # the rollout's weights are untouched
        offload.to_device()
        back = offload.tensors()
        assert not offload.away and set(back) == set(before)
        for key, value in back.items():
            assert value.dtype == before[key].dtype and value.device == before[key].device and torch.equal(value, before[key]), key
            assert value.data_ptr() != offload.host[key].data_ptr(), key  # a fresh tensor, not the host buffer
    if dtype == torch.bfloat16:
        assert isinstance(optimizer, MasterWeights)
        assert all(master is p for (_, master), p in zip(optimizer.pairs, optimizer.param_groups[0]["params"]))  # same Parameters


def test_steps_with_offload_equal_steps_without(tiny_tokenizer):
    """Three rollout + learner steps of bf16 compute over float32 masters, with the state offloaded around every
    rollout and not: the same weights and masters, bit for bit."""
    runs = []
    for offload_on in (False, True):
        model, optimizer = stepped(tiny_tokenizer, torch.bfloat16)
        offload = Offload(optimizer, torch.device("cpu")) if offload_on else None
        for step in range(3):
            with offloaded(offload):
                batch = generate(model, [[5, 6, 7, 8, 9, 10] * 3] * 4, max_new_tokens=4, eos_token_id=-1, pad_token_id=0,
                                 generator=torch.Generator().manual_seed(step))
            learner_step(model, optimizer, batch, ADVANTAGES, Algorithm("dense"))
        runs.append([m.detach().clone() for _, m in optimizer.pairs] + [p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def printed_by_the_stages(monkeypatch) -> io.StringIO:
    """What the stages print through their rich console, captured without swapping sys.stdout."""
    out = io.StringIO()
    console = Console(file=out, width=400)
    for module in (train, plan_stage):
        monkeypatch.setattr(module, "console", console)
    return out


def test_smd_train_with_offload_trains_what_it_trains_without(tmp_path, monkeypatch):
    """Through the stage: two GRPO steps in bf16 compute (masters) with optim.offload=true and false give the same
    checkpoint bit for bit; the state went to the host before each rollout; `smd train` says which kernels it ran."""
    out = printed_by_the_stages(monkeypatch)
    moves = []
    to_host = Offload.to_host
    monkeypatch.setattr(Offload, "to_host", lambda self: (moves.append(1), to_host(self))[1])
    weights = {}
    for offload in ("false", "true"):
        cfg = compose_train(tmp_path / offload, *TINY_RUN, "model.dtype=bfloat16", f"optim.offload={offload}", "optim.lr=1e-2")
        summary = train.run(cfg)
        assert summary["status"] == "completed"
        weights[offload] = load_file(next((tmp_path / offload / "run").rglob("final/model.safetensors")))
    assert len(moves) == 2  # one per step of the offloading run
    assert weights["true"].keys() == weights["false"].keys()
    assert all(torch.equal(weights["true"][k], weights["false"][k]) for k in weights["true"])
    printed = " ".join(out.getvalue().split())
    assert "optim.offload on (host memory during rollouts)" in printed and "optim.offload off" in printed
    assert "shadow replay SDPA, decode eager; optimizer AdamW (fused) over float32 masters" in printed


def test_smd_plan_counts_offload_and_prints_the_fit_both_ways(tmp_path, monkeypatch):
    arch = Arch(layers=36, hidden=2560, intermediate=9728, heads=32, kv_heads=8, head_dim=128, vocab=151936)
    run = Run(arch=arch, compute_bytes=2, device="cuda", algo="smd", rows=64, micro_batch=2, rollout_rows=64, prompt=8192,
              response=512, kept=4096, cache_growth=511, offload=True)
    result, without = plan(run), plan(Run(**{**vars(run), "offload": False}))
    params = arch.params
    assert result.offloaded == (4 + 4 + 8) * params  # masters, their gradients, AdamW's two moments
    assert result.rollout_bytes == without.rollout_bytes - result.offloaded and result.learner_bytes == without.learner_bytes
    printed = printed_by_the_stages(monkeypatch)
    main(["plan", "+recipe=govreport", f"hydra.run.dir={tmp_path}"])
    out = json.loads((tmp_path / "plan.json").read_text())["devices"]["80"]
    assert not out["offload_off"]["fits"] and out["offload_off"]["largest_sampling_batch_size"] < 16
    assert out["offload_on"]["largest_sampling_batch_size"] >= 128  # the recipe's whole rollout chunk decodes at once
    assert "80 GiB: fits with optim.offload=true grpo.micro_batch_size=2 sampling.batch_size=128" in " ".join(printed.getvalue().split())
    with pytest.raises(ConfigError, match="optim.offload='maybe' is not allowed: true or false"):
        plan_stage.run(compose_train(tmp_path / "bad", "optim.offload=maybe", config_name="plan"))
    with pytest.raises(ConfigError, match="optim.offload=True is not allowed: false with 8 processes: FSDP2 already splits"):
        plan_stage.run(compose_train(tmp_path / "fsdp", "+recipe=govreport", "optim.offload=true", "plan.gpus=8", config_name="plan"))
