"""The one attention implementation of every smd model, chosen per forward by its keyword arguments.

Registered with transformers' `AttentionInterface` as `ATTENTION` and set on a model once, for good
(`use_smd_attention`), never swapped in and out around a forward: gradient checkpointing recomputes each
layer during `backward()`, after any such context would have ended, and must run the same attention as the
forward did. What differs between forwards travels in the forward's own keyword arguments, which the
recompute receives again:

| keyword                      | attention                                                             |
|------------------------------|-----------------------------------------------------------------------|
| `rollout_state=RolloutState` | the evicting rollout: attend, evict, record (`smd_cli.attention.evicting`) |
| `shadow=Replay`              | the learner's replay of a shadow mask (`smd_cli.attention.shadow`)              |
| neither                      | dense causal attention with left padding (`smd_cli.attention.kernels`)          |

and `prompt_rows=True` marks a forward of prompts alone (a prefill, the learner's prompts computed once): its
attention is never widened (`kernels.causal`), since every forward of a prompt sums it in the same order.

and, for forwards that run the response rows apart from their prompt (SMD's dense teacher; the learner that
computes each prompt once for its G samples, `smd_cli.learner.forward`): `prompt_tap=PromptTap` makes a layer hand over
its prompt keys and values once (armed per layer, so a checkpoint recompute does not), and
`prompt_kv=(key, value[, owner])` puts them (row `owner[i]`'s for row i) in front of the response rows' own
keys, for a dense pass over the whole sequence or, with `shadow=`, the replay's response rows.

The registered mask function hands the 2-D padding mask [B, S] through unchanged: no [T, T] mask is built.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from smd_cli.attention import kernels
from smd_cli.attention.evicting import rollout_attention
from smd_cli.attention.shadow import replay, replay_rows

ATTENTION = "smd"


def dense(query, key, value, attention_mask: torch.Tensor | None, scaling: float, prompt_rows: bool = False) -> torch.Tensor:
    """Causal attention of q new tokens over S keys (the last q of them are the new tokens themselves),
    with a 2-D padding mask [B, S] or None. Full sequences take the mask-free causal kernel (not widened when they are
    `prompt_rows`, a prefill); decode steps (and any q < S) mask padding keys with the query groups folded.
    Returns [B, H, q, D]."""
    rows, width = query.shape[2], key.shape[2]
    if rows == width:
        pad = None if attention_mask is None else kernels.left_padding(attention_mask)
        return kernels.causal(query, key, value, scaling, pad, widen=not prompt_rows)
    columns = torch.arange(width, device=query.device)
    mask = columns <= torch.arange(width - rows, width, device=query.device)[:, None]  # [q, S] causal
    mask = mask[None, None] if attention_mask is None else mask[None, None] & attention_mask.bool()[:, None, None, :]
    return kernels.grouped(query, key, value, mask, scaling)


@dataclass
class PromptTap:
    """The prompt keys and values [B, Hkv, P, D] of the layer that last ran armed: detached (SMD's no-grad
    teacher reads them) or, with `keep_grad`, as they are (a learner that computes a shared prompt once)."""

    prompt_length: int
    armed: bool = False
    kv: tuple | None = None
    keep_grad: bool = False

    def capture(self, key: torch.Tensor, value: torch.Tensor) -> None:
        P = self.prompt_length
        key, value = key[:, :, :P], value[:, :, :P]
        self.kv = (key, value) if self.keep_grad else (key.detach(), value.detach())
        self.armed = False

    def take(self) -> tuple:
        kv, self.kv = self.kv, None
        return kv


def smd_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature; returns ([B, q, H, D], None)."""
    if dropout:
        raise ValueError("smd attention has no dropout (set the model's attention_dropout to 0)")
    scaling = module.scaling if scaling is None else scaling
    tap, shadow = kwargs.get("prompt_tap"), kwargs.get("shadow")
    if tap is not None and tap.armed:
        tap.capture(key, value)
    wide = getattr(module.config, "smd_attention_dtype", None)  # `model.attention_dtype` (`models.set_attention_dtype`)
    with kernels.widened(None if wide is None else getattr(torch, wide)):
        out = _attend(module, query, key, value, attention_mask, scaling, shadow, kwargs)
    return out.transpose(1, 2).contiguous(), None


def _attend(module, query, key, value, attention_mask, scaling, shadow, kwargs) -> torch.Tensor:
    if kwargs.get("rollout_state") is not None:
        return rollout_attention(module.layer_idx, query, key, value, scaling, kwargs["rollout_state"])
    if kwargs.get("prompt_kv") is not None:  # response rows whose prompt ran elsewhere: its keys first
        prompt_key, prompt_value, *owner = kwargs["prompt_kv"]
        if owner:  # one prompt for several rows: each row's copy, made here (a checkpoint keeps only the prompts')
            prompt_key, prompt_value = prompt_key[owner[0]], prompt_value[owner[0]]
        key, value = torch.cat([prompt_key, key], 2), torch.cat([prompt_value, value], 2)
        if shadow is not None:
            return replay_rows(module.layer_idx, query, key, value, scaling, shadow)
    elif shadow is not None:
        return replay(module.layer_idx, query, key, value, scaling, shadow)
    return dense(query, key, value, attention_mask, scaling, bool(kwargs.get("prompt_rows")))


def _padding_mask(batch_size=None, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, **kwargs):
    """Mask function of `ATTENTION`: the 2-D padding mask as it came (the attention builds what it needs)."""
    return attention_mask


AttentionInterface.register(ATTENTION, smd_attention)
AttentionMaskInterface.register(ATTENTION, _padding_mask)


def cache_argument(model, cache) -> dict:
    """`model(...)`'s keyword for a KV cache: `cache` from transformers 5.2x on, `past_key_values` before (5.17 ignores
    `cache=` silently and would decode every step without its cache)."""
    return {_cache_keyword(type(model)): cache}


@functools.cache
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def use_smd_attention(model):
    """Set `ATTENTION` as `model`'s attention implementation (idempotent); returns the model."""
    if model.config._attn_implementation != ATTENTION:
        model.config._attn_implementation = ATTENTION
    return model
