"""Gradient checkpointing recomputes every layer during backward; the shadow replay must be what it
recomputes. For every algorithm (and with a reference KL), the gradients `learner_step` produces with
checkpointing on equal those without it (float32, 1e-6), and the replay really ran twice per layer."""

import copy

import pytest
import torch

from smd_cli.attention import dispatch as attention
from smd_cli.eviction.snapkv import SnapKV
from smd_cli.learner.step import ALGORITHMS, Algorithm, learner_step
from smd_cli.model.build import build_tiny_model, enable_checkpointing
from smd_cli.rollout.sampler import generate
from smd_cli.tasks.synthetic import NeedleRetrieval

ADVANTAGES = torch.tensor([1.0, -0.5, 0.25, 2.0, -1.0, 0.0, 0.5, -2.0])


class GradientCapture:
    """An optimizer that records the gradients it is handed and changes nothing."""

    def __init__(self, params):
        self.params = list(params)
        self.param_groups = [{"params": self.params}]
        self.grads = None

    def step(self):
        self.grads = [p.grad.detach().clone() for p in self.params]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    return build_tiny_model(len(tiny_tokenizer), seed=2).eval()


def rollout(model, tokenizer, policy):
    task = NeedleRetrieval(prompt_tokens=40)
    prompts = [task.encode_prompt(task.example("train", i), tokenizer) for i in range(2) for _ in range(4)]
    prompts[1] = prompts[1][5:]  # a shorter prompt: left padding in the batch
    return generate(model, prompts, policy=policy, max_new_tokens=6, generator=torch.Generator().manual_seed(3),
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def gradients(model, batch, algo, ref_model):
    capture = GradientCapture(model.parameters())
    learner_step(model, capture, batch, ADVANTAGES, algo, ref_model)
    return capture.grads


@pytest.mark.parametrize("name, settings", [(name, {}) for name in ALGORITHMS] + [("smd", {"beta": 0.05}), ("sparse_rl", {"beta": 0.05})])
def test_gradients_are_the_same_with_checkpointing(model, tiny_tokenizer, monkeypatch, name, settings):
    batch = rollout(model, tiny_tokenizer, None if name == "dense" else SnapKV(compression=0.5, sink=2, window=6))
    algo = Algorithm(name, max_grad_norm=1e9, micro_batch_size=5, lam=0.3, **settings)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    plain = gradients(model, batch, algo, ref)

    checkpointed = copy.deepcopy(model)
    enable_checkpointing(checkpointed)
    replays = []
    for name_ in ("replay", "replay_rows"):  # the whole replayed sequence, or its response rows after a shared prompt; with
        # gradient only (the forward and its recompute; the reference policy's no-grad pass is not counted)
        monkeypatch.setattr(attention, name_, lambda layer, *args, _f=getattr(attention, name_):
                            (replays.append(layer) if torch.is_grad_enabled() else None) or _f(layer, *args))
    recomputed = gradients(checkpointed, batch, algo, ref)

    worst = max(float((a - b).abs().max()) for a, b in zip(plain, recomputed))
    assert worst <= 1e-6, f"{name}: gradients differ by {worst:.2e} with checkpointing"
    assert max(float(g.abs().max()) for g in plain) > 1e-3  # the gradients compared are not trivially zero
    if name == "smd":  # 2 micro-batches x 2 layers, each replayed in the forward and again in the recompute
        assert replays.count(0) == replays.count(1) == 2 * 2
