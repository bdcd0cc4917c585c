"""Scoring responses: the learner's forward (dense or replaying a shadow mask), then the vocabulary, in chunks.

`response_hidden` runs the model's backbone over prompt + response and returns the final hidden states at
the R positions that predict the response tokens (columns P-1 .. T-2): [B, R, Hd]. No logits exist yet.

`vocab_terms` projects those states through the LM head a chunk of tokens at a time (float32 inside the
chunk) and reduces each chunk at once to what the learner needs per token: the log-prob of the sampled
token, the entropy (a diagnostic) and, given the dense teacher's hidden states, the full-vocabulary
KL(teacher || student) of SMD. Under autograd every chunk is checkpointed: backward recomputes the chunk's
logits instead of keeping them, so the memory spent over the vocabulary is one chunk's (`chunk_tokens`),
whatever the batch, the response length or the vocabulary. Only real response tokens are scored.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from smd_cli.attention.dispatch import PromptTap, use_smd_attention
from smd_cli.attention.kv_quant import CacheReads
from smd_cli.attention.shadow import Replay, check_evict_at, none_evicted, position_ids_from_mask
from smd_cli.model import row_floor
from smd_cli.rollout import sampling
from smd_cli.rollout.sampler import prompt_groups
from smd_cli.runtime.distributed import layer_pass

CHUNK_LOGITS = 1 << 23  # logits per vocabulary chunk by default: 32 MiB in float32
TEACHER_ROWS = 32  # fewest rows a no-grad view after a shared prompt runs at once (fewer calls on small batches)


def chunk_tokens(vocab_size: int, chunk: int | None = None) -> int:
    """Tokens per vocabulary chunk: `chunk`, or as many as fit `CHUNK_LOGITS` logits."""
    return int(chunk) if chunk else max(1, CHUNK_LOGITS // vocab_size)


def _decoder_layout(model) -> bool:
    backbone = model.base_model
    return all(hasattr(backbone, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb"))


def response_hidden(model, input_ids, attention_mask, prompt_length: int, evict_at=None, backend: str = "auto",
                    quant: CacheReads | None = None) -> torch.Tensor:
    """Final hidden states at the positions predicting the R response tokens (P-1 .. T-2): [B, R, Hd].

    Dense when `evict_at` is None; otherwise the shadow replay of the rollout's evictions (DESIGN.md
    section 2), which gradient checkpointing's recompute replays too. Works with or without autograd.
    Rows that share a prompt (`prompt_groups`) compute it once (`shared_prompt_views`). `quant`: the rollout's 8-bit
    cache (`RolloutBatch.cache_reads`), which the replay's response rows read their keys and values through."""
    response_width = input_ids.shape[1] - prompt_length
    if response_width < 1:
        raise ValueError(f"no response columns: input width {input_ids.shape[1]}, prompt_length {prompt_length}")
    use_smd_attention(row_floor.apply(model))
    if evict_at is not None:
        check_evict_at(evict_at, input_ids, attention_mask, prompt_length)
    groups = prompt_groups(input_ids, attention_mask, prompt_length) if _decoder_layout(model) else None
    if groups is not None:
        return shared_prompt_views(model, input_ids, attention_mask, prompt_length, groups, [(evict_at, True)], backend, quant)[0]
    extra = {}
    if evict_at is None and getattr(model.config, "smd_attention_dtype", None):  # widened attention: the prompt rows apart, as
        evict_at = none_evicted_at(model.config, attention_mask)                 # the sampler's prefill computed them (`replay`)
    if evict_at is not None:
        extra["shadow"] = Replay.of(evict_at, attention_mask, prompt_length, backend, quant)
    out = model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask),
                           use_cache=False, **extra)
    return out.last_hidden_state[:, prompt_length - 1 : -1]  # [B, R, Hd]


def none_evicted_at(config, attention_mask) -> torch.Tensor:
    """The shadow mask [B, L, Hkv, T] of a dense rollout (nothing evicted; `shadow.none_evicted`)."""
    rows, width = attention_mask.shape
    shape = (rows, config.num_hidden_layers, config.num_key_value_heads, width)
    return none_evicted(torch.empty(shape, dtype=torch.int32, device=attention_mask.device), attention_mask)


def shadow_and_teacher_hidden(model, input_ids, attention_mask, prompt_length: int, evict_at, backend: str = "auto",
                              quant: CacheReads | None = None):
    """SMD's two views in one pass over the layers: the shadow replay's response hidden states [B, R, Hd] (with
    autograd, as `response_hidden`) and the dense teacher's [B, R, Hd] (no gradient).

    The teacher costs only its response rows: every prompt row sees the same keys in both views (evictions
    start after the prefill), so each layer's prompt keys and values are the replay's, handed over by the
    attention (`PromptTap`) and used at once by the teacher's response rows in that layer, which are the only
    rows that differ. Memory: one layer's prompt K/V besides the replay's own. Models without the usual
    decoder layout (`embed_tokens`, `layers`, `norm`, `rotary_emb`) get a full dense teacher forward instead.
    Rows that share a prompt compute it once for both views (`shared_prompt_views`)."""
    backbone, P = model.base_model, prompt_length
    if not _decoder_layout(model):
        with torch.no_grad():
            teacher = response_hidden(model, input_ids, attention_mask, P, None, backend)
        return response_hidden(model, input_ids, attention_mask, P, evict_at, backend, quant), teacher
    use_smd_attention(row_floor.apply(model))
    check_evict_at(evict_at, input_ids, attention_mask, P)
    groups = prompt_groups(input_ids, attention_mask, P)
    if groups is not None:
        shadow_rows, teacher = shared_prompt_views(model, input_ids, attention_mask, P, groups, [(evict_at, True), (None, False)], backend,
                                                   quant)
        return shadow_rows, teacher
    shadow = Replay.of(evict_at, attention_mask, P, backend, quant)
    positions = position_ids_from_mask(attention_mask)
    hidden = backbone.embed_tokens(input_ids)  # [B, T, Hd]
    rotary = backbone.rotary_emb(hidden, positions)
    with torch.no_grad():
        teacher = backbone.embed_tokens(input_ids[:, P:])  # [B, R, Hd]: the response rows only
        teacher_rotary = backbone.rotary_emb(teacher, positions[:, P:])
    context = dict(attention_mask=attention_mask, rotary=rotary, teacher_rotary=teacher_rotary, positions=positions, shadow=shadow, P=P)
    for layer in backbone.layers[: model.config.num_hidden_layers]:
        hidden, teacher = layer_pass(layer, _replay_then_teacher, hidden, teacher, context=context)
    hidden = backbone.norm(hidden)
    with torch.no_grad():
        teacher = torch.cat([hidden[:, P - 1 : P].detach(), backbone.norm(teacher)[:, :-1]], 1)  # row P-1 is shared
    return hidden[:, P - 1 : -1], teacher


def _replay_then_teacher(layer, hidden, teacher, context):
    """One layer of `shadow_and_teacher_hidden`: the replay over every row [B, T, Hd], then the teacher's response
    rows [B, R, Hd] on the replay's prompt keys and values (no gradient). Called through `layer_pass`, so that
    the layer runs as one forward (and one backward) however many calls it makes; `layer.forward` skips module
    hooks (FSDP2's run once, around the pass) but not transformers' gradient checkpointing."""
    c, tap = context, PromptTap(context["P"], armed=True)
    hidden = layer.forward(hidden, attention_mask=c["attention_mask"], position_embeddings=c["rotary"], position_ids=c["positions"],
                           shadow=c["shadow"], prompt_tap=tap)
    with torch.no_grad():
        teacher = layer.forward(teacher, attention_mask=c["attention_mask"], position_embeddings=c["teacher_rotary"],
                                position_ids=c["positions"][:, c["P"]:], prompt_kv=tap.take())
    return hidden, teacher


def shared_prompt_views(model, input_ids, attention_mask, prompt_length: int, groups, views, backend: str = "auto",
                        quant: CacheReads | None = None) -> list[torch.Tensor]:
    """The response hidden states [N, R, Hd] of several views of rows whose prompts repeat, each prompt computed once.

    Every prompt row is the same in every view and for every sample of a prompt (causal attention: a prompt
    never sees a response; evictions start after the prefill), so the distinct prompts [U, P] go through each
    layer once, and each view's response rows [N, R] then attend to their prompt's keys and values (handed over
    by the attention, `PromptTap`, with their gradient) followed by their own: densely, or under the view's
    shadow mask, replayed by `backend` (flex over the [R, T] grid of the response rows, or SDPA). `views`:
    (evict_at or None, with gradient) per view. GRPO's G samples share each prompt, so the prompt, most of a
    long-context sequence, costs 1/G of a forward and backward: the same sums as one forward per row, in another
    order (equal to float rounding, tested). Each layer runs all its calls as one forward (`layer_pass`)."""
    backbone, P = model.base_model, prompt_length
    first, owner = groups
    positions = position_ids_from_mask(attention_mask)  # [N, T]
    prompt_mask, prompt_positions = attention_mask[first, :P], positions[first, :P]
    hidden = backbone.embed_tokens(input_ids[first, :P])  # [U, P, Hd]
    rotary = backbone.rotary_emb(hidden, prompt_positions)
    replays = [None if evict_at is None else Replay.of(evict_at, attention_mask, P, backend, quant) for evict_at, _ in views]
    rows = []
    for _, grad in views:
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            rows.append(backbone.embed_tokens(input_ids[:, P:]))  # [N, R, Hd]
    context = dict(prompt_mask=prompt_mask, rotary=rotary, prompt_positions=prompt_positions, attention_mask=attention_mask,
                   rows_rotary=backbone.rotary_emb(rows[0], positions[:, P:]), positions=positions, owner=owner, P=P,
                   grads=[grad and torch.is_grad_enabled() for _, grad in views], replays=replays, step=max(len(first), TEACHER_ROWS))
    for layer in backbone.layers[: model.config.num_hidden_layers]:
        hidden, *rows = layer_pass(layer, _prompt_then_rows, hidden, *rows, context=context)
    last = backbone.norm(hidden[:, P - 1 :])[owner]  # [N, 1, Hd]: the prompt's last row predicts the first response token
    out = []
    for (_, grad), response in zip(views, rows):
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            out.append(torch.cat([last if grad else last.detach(), backbone.norm(response[:, :-1])], 1))  # [N, R, Hd]
    return out


def _prompt_then_rows(layer, hidden, *rows, context):
    """One layer of `shared_prompt_views`: the distinct prompts [U, P, Hd], then each view's response rows [N, R, Hd]
    on their prompt's keys and values. Called through `layer_pass` (one forward of the layer for all its calls)."""
    c = context
    tap = PromptTap(c["P"], armed=True, keep_grad=True)
    hidden = layer.forward(hidden, attention_mask=c["prompt_mask"], position_embeddings=c["rotary"], position_ids=c["prompt_positions"],
                           prompt_tap=tap, prompt_rows=True)
    key, value = tap.take()  # [U, Hkv, P, D]: each distinct prompt's, expanded to its rows by the attention
    positions, owner, out = c["positions"][:, c["P"]:], c["owner"], []
    for response, grad, replay in zip(rows, c["grads"], c["replays"]):
        if grad:
            out.append(layer.forward(response, attention_mask=c["attention_mask"], position_embeddings=c["rows_rotary"], position_ids=positions,
                                     prompt_kv=(key, value, owner), shadow=replay))
            continue
        with torch.no_grad():  # nothing is kept for a backward: a few rows at a time, so that the rows' copies of
            parts = []         # their prompt's keys and values stay about the size of the prompts' own
            for s in (slice(r, r + c["step"]) for r in range(0, owner.shape[0], c["step"])):
                parts.append(layer.forward(response[s], attention_mask=c["attention_mask"][s], position_embeddings=tuple(t[s] for t in c["rows_rotary"]),
                                           position_ids=positions[s], prompt_kv=(key.detach(), value.detach(), owner[s]),
                                           shadow=None if replay is None else replay.rows(s)))
            out.append(torch.cat(parts))
    return (hidden, *out)


def response_logits(model, input_ids, attention_mask, prompt_length: int, evict_at=None, backend: str = "auto",
                    quant: CacheReads | None = None) -> torch.Tensor:
    """Logits predicting the R response tokens, [B, R, V] (tests and small models; the learner uses
    `vocab_terms`, which never holds them all)."""
    return model.get_output_embeddings()(response_hidden(model, input_ids, attention_mask, prompt_length, evict_at, backend, quant))


def _terms(head, hidden, tokens, scale: float, teacher, ids=None, start=None, count=None, width: int = 0):
    """One chunk: hidden [c, Hd], tokens [c], teacher [c, Hd] or None, and the sampling support (`Support`'s
    `ids` [M], this chunk's `start` [c] and `count` [c], `width`) or None -> (log-prob [c], entropy [c],
    KL(teacher || student) [c] or None, teacher log-prob [c] or None, agreement sum_v min(p_teacher, p_student) [c]
    or None, `smd_cli.learner.agreement`), all over the support when it is given (the
    teacher restricted to the sampler's support too). The log-prob is `sampling.logprob`, the sampler's formula."""
    logits = sampling.scaled(head(hidden), scale)  # [c, V]
    beyond = None
    if ids is not None:  # OUTSIDE beyond the sampler's kept set: the logits of the truncated policy
        beyond = ~sampling.inside(ids, start, count, tokens, logits.shape[-1], width)
        logits = logits.masked_fill(beyond, sampling.OUTSIDE)
    logp, log_z = sampling.logprob(logits, tokens)  # [c] each
    with torch.no_grad():
        probs = torch.softmax(logits, dim=-1)
        entropy = log_z - (probs[:, None, :] @ logits.detach()[:, :, None]).view(-1)  # sum_v p log(1/p)
        del probs
    if teacher is None:
        return logp, entropy, None, None, None
    with torch.no_grad():  # the teacher is a constant (stop-gradient)
        log_t = sampling.scaled(head(teacher), scale)
        if beyond is not None:
            log_t = log_t.masked_fill(beyond, sampling.OUTSIDE)
        log_t -= torch.logsumexp(log_t, dim=-1, keepdim=True)  # [c, V] teacher log-probs
        teacher_logp = log_t.gather(-1, tokens[:, None]).squeeze(-1)
        p_t = log_t.exp()
        neg_entropy_t = (p_t[:, None, :] @ log_t[:, :, None]).view(-1)
        del log_t
        # the agreement sum_v min(p_t, p_student) (smd_cli.learner.agreement), in the room log_t left
        shared = (logits.detach() - log_z.detach()[:, None]).exp_()
        agreement = torch.minimum(shared, p_t, out=shared).sum(-1)
        del shared
    # KL(t || s) = sum_v p_t log p_t - sum_v p_t (logits_v - log_z)
    kl = neg_entropy_t - (p_t[:, None, :] @ logits[:, :, None]).view(-1) + log_z
    return logp, entropy, kl, teacher_logp, agreement


def vocab_terms(head, hidden, tokens, mask, temperature: float = 1.0, teacher=None, chunk: int | None = None,
                support: sampling.Support | None = None) -> dict[str, torch.Tensor]:
    """Per-token terms of the response, [B, R] each, 0 where `mask` [B, R] is False:
    `logp` (differentiable when `hidden` is), `entropy` (detached), and with `teacher` [B, R, Hd] (the dense
    forward's hidden states, held constant) `kl` = KL(teacher || student) over the full vocabulary
    (differentiable), `teacher_logp` and `agreement` = sum_v min(p_teacher, p_student) (`smd_cli.learner.agreement`; both
    detached). Temperature 0 (greedy) counts as 1. With `support` (the
    rollout's `sampling_support` of these rows, top-k / top-p) every term is over each token's recorded kept set
    instead of the full vocabulary: the truncated, renormalised distributions (`smd_cli.rollout.sampling`), whatever the
    view's logits."""
    scale = 1.0 if temperature == 0 else float(temperature)
    rows = mask.reshape(-1).nonzero().squeeze(-1)  # real response tokens, flattened
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])[rows]  # [n, Hd]
    flat_teacher = None if teacher is None else teacher.reshape(-1, teacher.shape[-1])[rows]
    flat_tokens = tokens.reshape(-1)[rows].long()
    if support is not None:
        flat_start, flat_count = support.start.reshape(-1)[rows], support.count.reshape(-1)[rows]
    step = chunk_tokens(head.weight.shape[0], chunk)
    checkpointed = torch.is_grad_enabled() and hidden.requires_grad
    pieces = []
    for start in range(0, rows.numel(), step):
        args = (head, flat_hidden[start : start + step], flat_tokens[start : start + step], scale,
                None if flat_teacher is None else flat_teacher[start : start + step])
        if support is not None:
            args += (support.ids, flat_start[start : start + step], flat_count[start : start + step], support.width)
        pieces.append(checkpoint(_terms, *args, use_reentrant=False) if checkpointed else _terms(*args))
    names = ("logp", "entropy", "kl", "teacher_logp", "agreement")
    out = {}
    for k, name in enumerate(names):
        if teacher is None and name in ("kl", "teacher_logp", "agreement"):
            continue
        values = torch.cat([p[k] for p in pieces]) if pieces else hidden.new_zeros(0, dtype=torch.float32)
        full = torch.zeros(mask.numel(), dtype=values.dtype, device=hidden.device)
        full = full.index_put((rows,), values)  # out of place: keeps the graph to `values`
        out[name] = full.view(mask.shape) if name in ("logp", "kl") else full.view(mask.shape).detach()
    return out
