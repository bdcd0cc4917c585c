"""Mixed precision: bf16 compute with float32 master weights. At the recipes' lr 1e-6, every trainable
matrix moves (its masters, > 90 % of the entries after three steps) where bf16 weights updated in place
stay put; gradients accumulate in float32 across micro-batches; checkpoints carry the masters; and the
SMD replay keeps its parity in bf16 up to kernel rounding."""

import pytest
import torch

from smd_cli.eviction.snapkv import SnapKV
from smd_cli.learner.forward import response_logits
from smd_cli.learner.step import Algorithm, learner_step
from smd_cli.model.build import build_tiny_model
from smd_cli.model import precision
from smd_cli.model.precision import MasterWeights, build_optimizer
from smd_cli.rollout.sampler import generate
from smd_cli.rollout.sampling import token_logprobs
from smd_cli.tasks.synthetic import NeedleRetrieval

ADVANTAGES = torch.tensor([1.0, -0.5, 0.25, 2.0, -1.0, 0.0, 0.5, -2.0])


def bf16_model(tokenizer):
    return build_tiny_model(len(tokenizer), seed=0, dtype=torch.bfloat16).eval()


def rollout(model, tokenizer, policy=None, seed=0):
    task = NeedleRetrieval(prompt_tokens=48)
    prompts = [task.encode_prompt(task.example("train", i), tokenizer) for i in range(2) for _ in range(4)]
    return generate(model, prompts, policy=policy, max_new_tokens=5, generator=torch.Generator().manual_seed(seed),
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def moved_fraction(before: dict, after: dict) -> dict[str, float]:
    return {name: float((after[name] != before[name]).float().mean()) for name in before if before[name].dim() == 2}


def test_at_lr_1e6_masters_move_where_bf16_weights_do_not(tiny_tokenizer):
    model = bf16_model(tiny_tokenizer)
    optimizer = build_optimizer(model, lambda params: torch.optim.AdamW(params, lr=1e-6))
    assert isinstance(optimizer, MasterWeights)
    masters = {name: master for (name, _), (_, master) in zip(model.named_parameters(), optimizer.pairs)}
    before = {name: m.detach().clone() for name, m in masters.items()}
    for step in range(3):
        learner_step(model, optimizer, rollout(model, tiny_tokenizer, seed=step), ADVANTAGES, Algorithm("dense"))
    moved = moved_fraction(before, {name: m.detach() for name, m in masters.items()})
    assert len(moved) == 1 + 2 * 7 and min(moved.values()) > 0.9, moved  # embedding + 7 matrices per layer

    plain = bf16_model(tiny_tokenizer)  # the failure mode: AdamW on the bf16 weights themselves
    before = {name: p.detach().clone() for name, p in plain.named_parameters()}
    adamw = torch.optim.AdamW(plain.parameters(), lr=1e-6)
    for step in range(3):
        learner_step(plain, adamw, rollout(plain, tiny_tokenizer, seed=step), ADVANTAGES, Algorithm("dense"))
    assert max(moved_fraction(before, dict(plain.named_parameters())).values()) < 0.1


def test_master_gradients_accumulate_micro_batches_in_float32(tiny_tokenizer):
    """Each micro-batch's bf16 gradient is added into the float32 master gradient and freed: the masters hold the sum
    over micro-batches, as a second copy of the model without masters computes it (each micro-batch's own bf16
    gradient, summed in float64). A master that kept only the last micro-batch's gradient (`copy_` for `add_`)
    fails this."""
    model = bf16_model(tiny_tokenizer)
    optimizer = MasterWeights(model, lambda params: torch.optim.SGD(params, lr=0.0))
    batch = rollout(model, tiny_tokenizer)
    learner_step(model, optimizer, batch, ADVANTAGES, Algorithm("dense", micro_batch_size=3, max_grad_norm=1e9))
    assert all(p.grad is None for p in model.parameters())  # bf16 gradients are freed as soon as they are added
    # zero_grad ran after the step; replay the accumulation by hand to check it is float32 and complete
    reference = bf16_model(tiny_tokenizer).train()  # the same weights, no masters: its gradients stay where backward puts them
    model.train()
    micro_batches = (slice(0, 3), slice(3, 6), slice(6, 8))
    expected = [torch.zeros(p.shape, dtype=torch.float64) for p in reference.parameters()]
    for rows in micro_batches:
        for net in (model, reference):
            logits = response_logits(net, batch.input_ids[rows], batch.attention_mask[rows], batch.prompt_length)
            logits.float().square().mean().backward()
        for total, p in zip(expected, reference.parameters()):
            total += p.grad.double()
            p.grad = None
    grads = [master.grad.clone() for _, master in optimizer.pairs]
    assert all(g.dtype == torch.float32 for g in grads) and all(p.grad is None for p in model.parameters())
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7 * float(want.abs().max()))


def test_master_state_round_trips_exactly(tiny_tokenizer):
    model = bf16_model(tiny_tokenizer)
    optimizer = MasterWeights(model, lambda params: torch.optim.AdamW(params, lr=1e-3))
    learner_step(model, optimizer, rollout(model, tiny_tokenizer), ADVANTAGES, Algorithm("dense"))
    state = optimizer.state_dict()
    fresh_model = bf16_model(tiny_tokenizer)
    fresh = MasterWeights(fresh_model, lambda params: torch.optim.AdamW(params, lr=1e-3))
    fresh.load_state_dict(state)
    for (p, m), (q, n) in zip(optimizer.pairs, fresh.pairs):
        assert torch.equal(m, n) and torch.equal(p, q)
    with pytest.raises(ValueError, match="master weights"):
        fresh.load_state_dict({"optimizer": state["optimizer"], "masters": state["masters"][:-1]})


def test_smd_parity_in_bf16_is_kernel_rounding(tiny_tokenizer):
    """The rollout and the replay compute in the same dtype: their gap is rounding, far below the mismatch."""
    model = bf16_model(tiny_tokenizer)
    batch = rollout(model, tiny_tokenizer, SnapKV(compression=0.5, sink=2, window=6))
    tokens, mask = batch.input_ids[:, batch.prompt_length:], batch.response_mask
    with torch.no_grad():
        args = (model, batch.input_ids, batch.attention_mask, batch.prompt_length)
        shadow = (token_logprobs(response_logits(*args, batch.evict_at), tokens) - batch.logprobs)[mask].abs().max()
        dense = (token_logprobs(response_logits(*args), tokens) - batch.logprobs)[mask].abs().max()
    print(f"bf16 parity: shadow {float(shadow):.3e}, dense mismatch {float(dense):.3e}")
    assert shadow <= 0.05 and dense > 10 * shadow


def test_a_closed_master_optimizer_lets_another_be_built_on_the_same_model(tiny_tokenizer):
    """Two optimizers over one bf16 model, one after the other (bench/gpu_check.py's learner check does this): the
    first one's gradient hooks go with `close()`, else the second step reads a bf16 gradient the first hook has
    already freed (the TypeError the first GPU run met) and the first masters' float32 state is never freed."""
    model = bf16_model(tiny_tokenizer)
    first = build_optimizer(model, lambda params: torch.optim.AdamW(params, lr=1e-6))
    learner_step(model, first, rollout(model, tiny_tokenizer), ADVANTAGES, Algorithm("dense"))
    first.close()
    held = [m.grad.clone() for _, m in first.pairs]
    second = build_optimizer(model, lambda params: torch.optim.AdamW(params, lr=1e-6))
    before = [m.detach().clone() for _, m in second.pairs]
    learner_step(model, second, rollout(model, tiny_tokenizer, seed=1), ADVANTAGES, Algorithm("dense"))
    assert min(float((m.detach() != b).float().mean()) for (_, m), b in zip(second.pairs, before) if b.dim() == 2) > 0.5
    assert all(torch.equal(m.grad, h) for (_, m), h in zip(first.pairs, held))  # the closed one is fed no more


def test_cpu_dtype_auto_is_bf16_only_where_the_cpu_has_it(monkeypatch, tmp_path):
    """`model.cpu_dtype=auto`: bfloat16 where /proc/cpuinfo lists avx512_bf16 or amx_bf16, else `model.dtype`; a set
    cpu_dtype is used as it is."""
    real_open = open
    for flags, native in (("fpu avx512f avx512_bf16 sse", True), ("fpu amx_bf16", True), ("fpu avx512f avx2", False)):
        info = tmp_path / "cpuinfo"
        info.write_text(f"processor : 0\nflags : {flags}\n")
        monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(info if path == "/proc/cpuinfo" else path, *a, **k))
        assert precision.native_bf16() is native
        assert precision.cpu_compute_dtype("auto", "float32") == ("bfloat16" if native else "float32")
        assert precision.cpu_compute_dtype("float64", "float32") == "float64" and precision.cpu_compute_dtype(None, "float32") == "float32"
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: (_ for _ in ()).throw(FileNotFoundError(path)))
    assert precision.native_bf16() is False  # no /proc/cpuinfo (macOS, Windows): float32
