"""The one attention implementation of every smd model, chosen per forward by its keyword arguments.

Registered with transformers' `AttentionInterface` as `ATTENTION` and set on a model once, for good
(`use_smd_attention`), never swapped in and out around a forward: gradient checkpointing recomputes each
layer during `backward()`, after any such context would have ended, and must run the same attention as the
forward did. What differs between forwards travels in the forward's own keyword arguments, which the
recompute receives again:

| keyword                      | attention                                                             |
|------------------------------|-----------------------------------------------------------------------|
| `rollout_state=RolloutState` | the evicting rollout: attend, evict, record (`smd_cli.rollout_attention`) |
| `shadow=Replay`              | the learner's replay of a shadow mask (`smd_cli.shadow`)              |
| neither                      | dense causal attention with left padding (`smd_cli.kernels`)          |

and, for SMD's dense teacher (`smd_cli.scoring.shadow_and_teacher_hidden`), which runs only the response
rows: `prompt_tap=PromptTap` on a replay makes the layer hand over its prompt keys and values once (armed per
layer, so a checkpoint recompute does not), and `prompt_kv=(key, value)` puts them in front of the
response rows' own keys for a dense pass over the whole sequence.

The registered mask function hands the 2-D padding mask [B, S] through unchanged: no [T, T] mask is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from smd_cli import kernels
from smd_cli.rollout_attention import rollout_attention
from smd_cli.shadow import replay

ATTENTION = "smd"


def dense(query, key, value, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Causal attention of q new tokens over S keys (the last q of them are the new tokens themselves),
    with a 2-D padding mask [B, S] or None. Full sequences take the mask-free causal kernel; decode steps
    (and any q < S) mask padding keys with the query groups folded. Returns [B, H, q, D]."""
    rows, width = query.shape[2], key.shape[2]
    if rows == width:
        pad = None if attention_mask is None else kernels.left_padding(attention_mask)
        return kernels.causal(query, key, value, scaling, pad)
    columns = torch.arange(width, device=query.device)
    mask = columns <= torch.arange(width - rows, width, device=query.device)[:, None]  # [q, S] causal
    mask = mask[None, None] if attention_mask is None else mask[None, None] & attention_mask.bool()[:, None, None, :]
    return kernels.grouped(query, key, value, mask, scaling)


@dataclass
class PromptTap:
    """The prompt keys and values [B, Hkv, P, D] of the layer that last ran armed (detached: no gradient)."""

    prompt_length: int
    armed: bool = False
    kv: tuple | None = None

    def take(self) -> tuple:
        kv, self.kv = self.kv, None
        return kv


def smd_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature; returns ([B, q, H, D], None)."""
    if dropout:
        raise ValueError("smd attention has no dropout (set the model's attention_dropout to 0)")
    scaling = module.scaling if scaling is None else scaling
    if kwargs.get("rollout_state") is not None:
        out = rollout_attention(module.layer_idx, query, key, value, scaling, kwargs["rollout_state"])
    elif kwargs.get("shadow") is not None:
        tap = kwargs.get("prompt_tap")
        if tap is not None and tap.armed:
            P = tap.prompt_length
            tap.kv, tap.armed = (key[:, :, :P].detach(), value[:, :, :P].detach()), False
        out = replay(module.layer_idx, query, key, value, scaling, kwargs["shadow"])
    elif kwargs.get("prompt_kv") is not None:
        prompt_key, prompt_value = kwargs["prompt_kv"]
        out = dense(query, torch.cat([prompt_key, key], 2), torch.cat([prompt_value, value], 2), attention_mask, scaling)
    else:
        out = dense(query, key, value, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def _padding_mask(batch_size=None, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, **kwargs):
    """Mask function of `ATTENTION`: the 2-D padding mask as it came (the attention builds what it needs)."""
    return attention_mask


AttentionInterface.register(ATTENTION, smd_attention)
AttentionMaskInterface.register(ATTENTION, _padding_mask)


def use_smd_attention(model):
    """Set `ATTENTION` as `model`'s attention implementation (idempotent); returns the model."""
    if model.config._attn_implementation != ATTENTION:
        model.config._attn_implementation = ATTENTION
    return model
