"""CUDA-only steps that can fail at run time fall back to the CPU-tested path with one warning naming what failed,
instead of stopping a training run: the decode step's CUDA-graph capture (imitated here: a fake `torch.cuda` whose
capture raises, so `DecodeGraphs` runs its CUDA code on the CPU), and optim=adamw8bit whose bitsandbytes does not
import. The third, a failed flex_attention compile, is tests/test_flex_compiled.py's."""

import sys
import types
import warnings
from contextlib import nullcontext

import pytest
import torch

from smd_cli.eviction.snapkv import SnapKV
from smd_cli.model.build import build_tiny_model
from smd_cli.rollout import cuda_graphs
from smd_cli.rollout import sampler as rollout
from smd_cli.rollout.sampler import generate


class _Stream:
    def wait_stream(self, other):
        pass


def fake_cuda(capture_error: str | None):
    """Just enough of `torch.cuda` for `DecodeGraphs` on the CPU: streams are no-ops; the capture raises `capture_error`."""

    class Graph:
        pass

    def graph(g, capture_error_mode=None):
        if capture_error is None:
            raise AssertionError("this fake cannot replay a graph: give it a capture error")
        raise RuntimeError(capture_error)

    namespace = types.SimpleNamespace(current_stream=_Stream, Stream=_Stream, stream=lambda s: nullcontext(), get_sync_debug_mode=lambda: 0,
                                      set_sync_debug_mode=lambda mode: None, CUDAGraph=Graph, graph=graph,
                                      set_stream=lambda s: None, synchronize=lambda: None)
    return types.SimpleNamespace(**{name: getattr(torch, name) for name in ("Tensor",)}, cuda=namespace)


def test_a_failed_graph_capture_warns_once_and_decodes_eagerly(tiny_tokenizer, monkeypatch):
    model = build_tiny_model(len(tiny_tokenizer), seed=0).eval()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, len(tiny_tokenizer), (n,), generator=generator).tolist() for n in (24, 33, 41)]
    kwargs = dict(max_new_tokens=8, temperature=1.0, eos_token_id=-1, pad_token_id=0)
    eager = generate(model, prompts, policy=SnapKV(0.5, sink=2, window=4), generator=torch.Generator().manual_seed(5), compile=False, **kwargs)
    monkeypatch.setattr(cuda_graphs, "torch", fake_cuda("operation not permitted when stream is capturing"))
    monkeypatch.setattr(rollout, "_use_graphs", lambda *args: True)  # the rollout's CUDA branch, on the CPU
    calls = []
    call = cuda_graphs.DecodeGraphs.__call__
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "__call__", lambda self, key, step: (calls.append(key), call(self, key, step))[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed = generate(model, prompts, policy=SnapKV(0.5, sink=2, window=4), generator=torch.Generator().manual_seed(5), **kwargs)
    fallbacks = [str(w.message) for w in caught if "CUDA-graph" in str(w.message)]
    assert len(calls) == kwargs["max_new_tokens"] - 1  # every decode step went through DecodeGraphs
    assert fallbacks == ["CUDA-graph capture of the decode step is off for this rollout (RuntimeError: operation not permitted when "
                         "stream is capturing); decoding eagerly"]
    assert torch.equal(graphed.input_ids, eager.input_ids) and torch.equal(graphed.evict_at, eager.evict_at)
    assert torch.equal(graphed.logprobs, eager.logprobs)


def test_adamw8bit_without_bitsandbytes_falls_back_to_adamw_with_one_warning(monkeypatch):
    from hydra import compose, initialize_config_dir

    from smd_cli.cli import CONF_DIR
    from smd_cli.config.factories import optimizer_factory

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ModuleNotFoundError
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["optim=adamw8bit", "optim.offload=true"])
    with pytest.warns(RuntimeWarning, match=r"optim=adamw8bit: bitsandbytes did not import \(ModuleNotFoundError: .*\); training with "
                                            r"torch.optim.AdamW \(fused\)") as caught:
        make, name = optimizer_factory(cfg, torch.device("cpu"))
    assert len(caught) == 1 and name.startswith("AdamW (fused; bitsandbytes did not import: ModuleNotFoundError")
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = make([weight])
    assert type(optimizer) is torch.optim.AdamW
    group = optimizer.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["weight_decay"], group["fused"]) == (1e-6, (0.9, 0.999), 0.0, True)  # adamw8bit's


def test_training_with_the_flex_replay_on_the_cpu_is_refused_at_once():
    """Not a run-time fallback: flex_attention has no CPU backward, so `model.replay=flex` cannot train there (auto is SDPA)."""
    from hydra import compose, initialize_config_dir

    from smd_cli.cli import CONF_DIR
    from smd_cli.config.validation import ConfigError
    from smd_cli.stages import train

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["model.replay=flex", "device=cpu"])
    with pytest.raises(ConfigError, match="model.replay='flex' trains only on CUDA"):
        train.validate(cfg)
