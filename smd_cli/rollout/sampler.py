"""Batched sampling with an evicting KV cache, recording what every generated token could see.

`generate` left-pads the prompts, prefills, then decodes one token per step for all rows. With a policy,
every forward carries a `RolloutState`, so the model's attention runs the evicting rollout
(`smd_cli.attention.evicting`): each layer attends, then the policy evicts from that layer's `EvictingCache` (evict after the attention has run), and the evictions are
written into the shadow mask `evict_at[N, L, Hkv, T]` (DESIGN.md section 2). Without a policy it is a
plain dense rollout on a `DynamicCache`. The sampler's log-probs are those of the distribution it drew from,
`logit - logsumexp` of `logits / temperature` at the sampled token (`smd_cli.rollout.sampling.logprob`, the learner's
formula too), or with `top_k` / `top_p` that distribution restricted to its support and renormalised, the
support's token set recorded (`sampling_support`, at most `MAX_SUPPORT` tokens a step, `smd_cli.rollout.sampling`) for
every learner view to score the same one (temperature 0 = greedy, scored at temperature 1).
Keys keep their true RoPE positions: every forward gets the rows' real `position_ids`.

The decode loop reads nothing from the device at a step: entry counts, the cache's capacity check and the
rows' eos state stay on the device, and the host looks at them once every `sync_every` steps (`SYNC_EVERY` on
an accelerator; every step on the CPU, where a read costs nothing and stopping early saves work). Between
two looks, rows that have finished keep decoding padding, which changes nothing that is returned: their
tokens are masked as before, and steps run after every row had finished are cut off again (the batch and its
statistics are those of a loop that stopped at once). Sampling draws all its random numbers before the loop,
one uniform per row and token (`draw`), so a row's tokens do not depend on the rows decoded beside it. On CUDA the evicting
rollout's decode step, the same kernels on the same tensors at every step, is captured as a CUDA graph and
replayed (`compile`, eager fallback with one warning).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from smd_cli.attention.dispatch import cache_argument, use_smd_attention
from smd_cli.attention.evicting import RolloutState
from smd_cli.attention.kv_cache import EvictingCache, KVMeter, kv_bytes
from smd_cli.attention.kv_quant import CacheReads, check_kind
from smd_cli.attention.policy import EvictionPolicy
from smd_cli.attention.shadow import position_ids_from_mask
from smd_cli.eviction.none import KeepAll
from smd_cli.model import row_floor
from smd_cli.model.build import fixed_weights
from smd_cli.rollout.cuda_graphs import DecodeGraphs
from smd_cli.rollout.sampling import MAX_SUPPORT, OUTSIDE, Kept, Support, SupportLog, choose, kept_mask, logprob, scaled


@dataclass
class RolloutBatch:
    input_ids: torch.LongTensor  # [N, T] left-padded prompts (width P) then responses (width R)
    attention_mask: torch.LongTensor  # [N, T] 1 on real tokens (prompt, response up to and including eos)
    prompt_length: int  # P
    response_mask: torch.BoolTensor  # [N, R] generated tokens up to and including eos
    logprobs: torch.Tensor  # [N, R] float32 sampler log-probs, 0 where masked
    evict_at: torch.Tensor | None  # [N, L, Hkv, T] int32 shadow mask; None for a dense rollout
    stats: dict[str, float] = field(default_factory=dict)
    visibility: torch.Tensor | None = None  # [N, L, Hkv, T, T] bool, only with record_visibility=True
    sampling_support: Support | None = None  # each token's kept token set under top-k / top-p (`smd_cli.rollout.sampling`),
    # and then `logprobs` are the truncated distribution's; None: nothing truncated
    kv_quant: str = "none"  # the cache's 8-bit format (`smd_cli.attention.kv_quant`): decode steps read keys and values through it
    kv_rounding: torch.Tensor | None = None  # [N, L, 2, Hkv, T, D / 8] uint8 on the host: which way it rounded each element it
    # stored (a bit each: 1/16 of the sequence's bf16 keys and values; the learner takes one layer's to the device at a time)

    def cache_reads(self, rows: slice = slice(None)) -> CacheReads | None:
        """What the learner's shadow view of `rows` needs to read keys and values as this rollout's 8-bit cache held
        them (None: a full-precision cache)."""
        if self.kv_quant == "none":
            return None
        return CacheReads(self.kv_quant, None if self.kv_rounding is None else self.kv_rounding[rows])


def left_pad(prompts: list[list[int]], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as [N, P] token ids and attention mask, padded on the left."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long, device=device)  # [N, P]
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long, device=device)
        mask[row, width - len(prompt):] = 1
    return ids, mask


SYNC_EVERY = 16  # decode steps between two host reads of the device (all-finished, capacity) on an accelerator


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One index per row of probs [N, V] (non-negative, rows not all zero) by inverting the row's CDF at
    `uniforms` [N] in [0, 1): the smallest k with u * sum(p) < p_0 + ... + p_k, so a zero-probability token is
    never drawn. One random number per row and token, whatever the batch: a row's draws depend on its own
    uniforms only, not on which rows are decoded beside it (chunks, ranks). NaN probabilities show as a NaN
    log-prob at the drawn token, which the rollout checks at its periodic synchronisation.

    The CDF is summed in float64: in float32 its entries near 1 are 6e-8 apart, so at V = 151936 a token of
    probability 1e-5 was drawn up to 0.6 % more or less often than its probability (tested)."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [N, V]
    total = cdf[:, -1:]
    target = torch.minimum(uniforms[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def sample(logits: torch.Tensor, temperature: float, top_p: float, uniforms: torch.Tensor | None, top_k: int = 0):
    """Draw one token per row from logits [N, V] (`draw` at `uniforms` [N]; greedy needs none); returns tokens [N],
    the log-prob there of the distribution drawn from [N] (`smd_cli.rollout.sampling.logprob`), and its support (a
    `Kept`, None when nothing is truncated): `logits / T` normalised without top-k / top-p, else that distribution
    restricted to the support of top-k then top-p and renormalised (`smd_cli.rollout.sampling`; T = 0, greedy, counts as 1)."""
    logits = scaled(logits, temperature)  # [N, V]
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)  # [N, V]: what top-k / top-p and `draw` read
    kept = choose(logp, top_p, top_k)
    allowed = None if kept is None else kept_mask(kept, logits.shape[-1])
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
    else:
        probs = logp.exp()
        tokens = draw(probs if allowed is None else probs.masked_fill(~allowed, 0.0), uniforms)
    if allowed is not None:  # the drawn token counts as inside, as it does for the learner (`sampling.inside`)
        logits = logits.masked_fill(~allowed.scatter_(-1, tokens[:, None], True), OUTSIDE)
    return tokens, logprob(logits, tokens)[0], kept


def sampling_noise(rows: int, max_new_tokens: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """The uniforms [rows, max_new_tokens] a rollout samples with, drawn at once from `generator` (on its device;
    the CPU's default generator when None). Row i's tokens depend only on row i of it. Float64: float32 uniforms
    lie on a grid of 2^-24, which gives a token of probability 1e-5 one grid point more or less (0.6 %)."""
    device = generator.device if generator is not None else "cpu"
    return torch.rand(rows, max_new_tokens, generator=generator, device=device, dtype=torch.float64)


def _check(temperature: float, top_p: float, top_k: int, max_new_tokens: int, compile, sync_every) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_SUPPORT:
        raise ValueError(f"top_k must be an integer in [0, {MAX_SUPPORT}] (0 = no top-k; the learner replays the sampler's kept "
                         f"tokens, recorded for at most {MAX_SUPPORT} a step), got {top_k!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not (compile == "auto" or compile is True or compile is False):
        raise ValueError(f"compile must be 'auto', true or false, got {compile!r}")
    if sync_every is not None and (not isinstance(sync_every, int) or sync_every < 1):
        raise ValueError(f"sync_every must be null (auto) or an integer >= 1, got {sync_every!r}")


def prompt_groups(input_ids, attention_mask, prompt_length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows that share their prompt (GRPO's G samples of one prompt, next to each other): (first [U], the row
    where each distinct prompt first appears; owner [N], each row's prompt in 0..U-1), or None when no two
    neighbouring rows share one. Prompt tokens and padding both have to match."""
    prompts = torch.cat([input_ids[:, :prompt_length], attention_mask[:, :prompt_length].long()], dim=1)  # [N, 2P]
    _, owner, counts = torch.unique_consecutive(prompts, dim=0, return_inverse=True, return_counts=True)
    if counts.numel() == prompts.shape[0]:
        return None
    return counts.cumsum(0) - counts, owner


def _progress(enabled: bool, total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("rollout"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), disable=not enabled)
    return progress, progress.add_task("decode", total=total)


@torch.no_grad()
def dense_kv_bytes(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """Bytes a dense `DynamicCache` holds after the same tokens (its peak: it only grows), measured."""
    cache = DynamicCache(config=model.config)
    model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask), **cache_argument(model, cache), use_cache=True, logits_to_keep=1)
    return kv_bytes(cache)


@dataclass
class _Run:
    """The growing batch of one rollout: tokens, masks, sampler log-probs, the cache and its meter."""

    input_ids: torch.Tensor  # [N, P + Rmax]
    attention_mask: torch.Tensor  # [N, P + Rmax]
    prompt_width: int
    positions: torch.Tensor  # [N] RoPE position of each row's next token
    logprobs: torch.Tensor  # [N, Rmax]
    finished: torch.Tensor  # [N] bool
    cache: object
    state: RolloutState | None
    feed_ids: torch.Tensor  # [N, 1] the token fed at a decode step (one buffer for the whole rollout)
    feed_positions: torch.Tensor  # [N, 1] its RoPE positions
    invalid: torch.Tensor  # [] bool: a sampled log-prob was NaN (the model's logits were not finite)
    groups: tuple | None = None  # (first [U], owner [N]) when rows repeat a prompt: its prefill runs once
    supports: SupportLog | None = None  # the kept token sets (top-k / top-p), else None
    graphs: DecodeGraphs | None = None
    meter: KVMeter = field(default_factory=KVMeter)
    steps: int = 0  # decode steps run (the batch keeps those up to the last one where a row was live)

    @classmethod
    def start(cls, model, prompt_ids, prompt_mask, policy, max_new_tokens, pad_token_id, record_visibility, groups=None,
              kv_quant: str = "none") -> "_Run":
        rows, prompt_width = prompt_ids.shape
        device = prompt_ids.device
        input_ids = prompt_ids.new_full((rows, prompt_width + max_new_tokens), pad_token_id)
        attention_mask = torch.zeros_like(input_ids)
        input_ids[:, :prompt_width], attention_mask[:, :prompt_width] = prompt_ids, prompt_mask
        state = None
        if policy is None:
            cache = DynamicCache(config=model.config)
        else:
            capacity = int(policy.budget(prompt_mask.sum(-1)).max()) + policy.cache_growth(max_new_tokens - 1)
            cache = EvictingCache(model.config.num_hidden_layers, capacity, kv_quant)
            state = RolloutState.start(model.config, policy, cache, prompt_mask, max_new_tokens, record_visibility, groups)
        return cls(input_ids, attention_mask, prompt_width, prompt_mask.sum(-1), torch.zeros(rows, max_new_tokens, device=device),
                   torch.zeros(rows, dtype=torch.bool, device=device), cache, state, input_ids.new_zeros(rows, 1),
                   input_ids.new_zeros(rows, 1), torch.zeros((), dtype=torch.bool, device=device), groups)

    def forward(self, model, step: int) -> torch.Tensor:
        """Feed the prompt (step 0) or the last sampled token; returns next-token logits [N, V]."""
        column = self.prompt_width + step  # column of the token sampled at this step
        prefill_rows = slice(None) if step or self.groups is None else self.groups[0]  # a repeated prompt: once
        if step == 0:
            prompt_mask = self.attention_mask[prefill_rows, : self.prompt_width]
            feed = dict(input_ids=self.input_ids[prefill_rows, : self.prompt_width], position_ids=position_ids_from_mask(prompt_mask))
        else:
            self.feed_ids.copy_(self.input_ids[:, column - 1:column])
            torch.sub(self.positions[:, None], 1, out=self.feed_positions)
            feed = dict(input_ids=self.feed_ids, position_ids=self.feed_positions)
        if self.state is None:
            feed["attention_mask"] = self.attention_mask[prefill_rows, :column]
            logits = model(**feed, **cache_argument(model, self.cache), use_cache=True, logits_to_keep=1, prompt_rows=step == 0).logits[:, -1]
            if step == 0 and self.groups is not None:  # every sample of a prompt continues from its prefill's cache
                for layer in self.cache.layers:
                    layer.keys, layer.values = layer.keys[self.groups[1]], layer.values[self.groups[1]]
        else:
            self.cache.begin_step(column - 1, self.attention_mask[:, column - 1].bool())

            def run():
                return model(**feed, rollout_state=self.state, **cache_argument(model, self.cache), use_cache=True, logits_to_keep=1).logits[:, -1]

            if step == 0 or self.graphs is None:
                logits = run()
            else:  # policy step `step - 1` (0 = the first generated token is fed)
                logits = self.graphs(self.state.policy.decode_signature(step - 1), run)
        self.meter.observe(self.cache)
        return logits if step or self.groups is None else logits[self.groups[1]]

    def record(self, step: int, tokens, token_logp, kept: Kept | None, eos_token_id: int, pad_token_id: int, check_nan: bool) -> None:
        live = ~self.finished
        column = self.prompt_width + step
        self.input_ids[:, column] = torch.where(live, tokens, pad_token_id)
        self.attention_mask[:, column] = live.long()
        self.logprobs[:, step] = torch.where(live, token_logp, 0.0)
        if kept is not None:
            if self.supports is None:
                self.supports = SupportLog(*self.logprobs.shape, self.logprobs.device)
            self.supports.add(step, kept, live)
        self.positions += live.long()
        self.finished |= live & (tokens == eos_token_id)
        if check_nan:
            self.invalid |= token_logp.isnan().any()
        self.steps = step + 1

    def synchronise(self) -> bool:
        """The periodic host read: raise if the cache overflowed or sampling met NaN; True once every row has
        finished. One transfer for all flags."""
        if self.supports is not None:
            self.supports.flush()
        flags = [self.finished.all(), self.invalid]
        if self.state is not None:
            flags.append(self.cache.overflowed().to(self.invalid.device))
        done, invalid, *overflow = torch.stack(flags).tolist()
        if overflow and overflow[0]:
            self.cache.check_capacity()
        if invalid:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0 (the model's logits are not finite)")
        return done

    def kept_steps(self) -> int:
        """Steps up to the last one at which a row was live (eos or not): what a loop stopping as soon as every
        row had finished would have run. Reads the device."""
        return int(self.attention_mask[:, self.prompt_width : self.prompt_width + self.steps].sum(-1).max())

    def batch(self, model, measure_dense_kv: bool, steps: int) -> RolloutBatch:
        width = self.prompt_width + steps
        input_ids, attention_mask = self.input_ids[:, :width], self.attention_mask[:, :width]
        response_mask = attention_mask[:, self.prompt_width:].bool()
        bytes_peak, bookkeeping_peak = self.meter.peaks(steps)  # forward s feeds column P + s - 1: `steps` forwards
        stats = {
            "kv/bytes_peak": float(bytes_peak),
            "kv/bookkeeping_bytes": float(bookkeeping_peak),
            "rollout/response_length_mean": float(response_mask.sum(-1).float().mean()),
            "rollout/steps": float(steps),
        }
        evict_at = visibility = None
        if self.state is None:
            stats.update({"kv/bytes_peak_dense": float(bytes_peak), "kv/kept_fraction": 1.0})
        else:
            evict_at, visibility = self.state.finish(attention_mask)
            fed = attention_mask[:, : width - 1]  # the last sampled token is never fed
            dense = dense_kv_bytes(model, input_ids[:, : width - 1], fed) if measure_dense_kv else float("nan")
            real_entries = int(fed.sum()) * model.config.num_hidden_layers * model.config.num_key_value_heads
            stats.update({"kv/bytes_peak_dense": float(dense), "kv/kept_fraction": self.state.entries_peak(steps) / max(real_entries, 1)})
        support = None
        if self.supports is not None:
            support, support_stats = self.supports.support(steps)
            stats.update(support_stats)
        return RolloutBatch(input_ids, attention_mask, self.prompt_width, response_mask, self.logprobs[:, :steps],
                            evict_at, stats, visibility, support, self.cache.layers[0].quant if self.state is not None else "none",
                            None if self.state is None or self.state.rounding is None else self.state.rounding[..., :width, :].cpu().contiguous())


def response_texts(batch: RolloutBatch, tokenizer) -> list[str]:
    """Each row's generated text (eos and other special tokens dropped)."""
    responses = batch.input_ids[:, batch.prompt_length :]  # [N, R]
    return [tokenizer.decode(r[m].tolist(), skip_special_tokens=True) for r, m in zip(responses, batch.response_mask)]


def ended_with_eos(batch: RolloutBatch, eos_token_id: int) -> torch.Tensor:
    """[N] bool: whether each row stopped on eos (False for a row cut at max_new_tokens)."""
    lengths = batch.response_mask.sum(1)
    responses = batch.input_ids[:, batch.prompt_length :]
    last = responses.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
    return (lengths > 0) & (last == eos_token_id)


def concat_rollouts(batches: list[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """One batch from rollouts generated in chunks: prompts re-padded on the left to the widest P, responses
    on the right to the longest R, and shadow masks moved to the new columns (a left shift `d` adds `d` to
    every column and every eviction time; the never-evicted sentinel becomes the new width; padding stays 0).
    Peak statistics take the maximum over chunks, the others the mean weighted by rows.

    Consumes `batches` (emptied as it goes): each chunk is written into preallocated outputs and released,
    so the shadow masks never exist twice over (their bytes: N x L x Hkv x T x 4)."""
    if len(batches) == 1:
        return batches.pop()
    if len({b.evict_at is None for b in batches}) > 1:
        raise ValueError("cannot concatenate dense and evicting rollouts")
    if len({b.sampling_support is None for b in batches}) > 1:
        raise ValueError("cannot concatenate rollouts with and without a truncated sampling support")
    if len({b.kv_quant for b in batches}) > 1:
        raise ValueError(f"cannot concatenate rollouts of different kv.quant ({sorted({b.kv_quant for b in batches})})")
    P = max(b.prompt_length for b in batches)
    R = max(b.logprobs.shape[1] for b in batches)
    rows = [b.input_ids.shape[0] for b in batches]
    stats = {}
    weights = torch.tensor(rows, dtype=torch.float64)
    for key in batches[0].stats:
        values = torch.tensor([b.stats.get(key, float("nan")) for b in batches], dtype=torch.float64)
        stats[key] = float(values.max() if "peak" in key else (values * weights).sum() / weights.sum())
    first = batches[0]
    total, width = sum(rows), P + R
    input_ids = first.input_ids.new_full((total, width), pad_token_id)
    attention_mask = first.attention_mask.new_zeros(total, width)
    response_mask = first.response_mask.new_zeros(total, R)
    logprobs = first.logprobs.new_zeros(total, R)
    support = first.sampling_support
    if support is not None:  # every chunk's ids one after another, each chunk's starts moved past the ones before
        support = Support(torch.cat([b.sampling_support.ids for b in batches]), support.start.new_zeros(total, R),
                          support.count.new_zeros(total, R), max(b.sampling_support.width for b in batches))
    packed = 0
    evict_at = None if first.evict_at is None else first.evict_at.new_zeros((total,) + first.evict_at.shape[1:3] + (width,))
    rounding = None if first.kv_rounding is None else first.kv_rounding.new_zeros((total,) + first.kv_rounding.shape[1:4] + (width,)
                                                                                     + first.kv_rounding.shape[5:])
    start = 0
    while batches:
        b = batches.pop(0)
        n, shift, r = b.input_ids.shape[0], P - b.prompt_length, b.logprobs.shape[1]
        rows_ = slice(start, start + n)
        columns = slice(shift, shift + b.input_ids.shape[1])
        input_ids[rows_, columns], attention_mask[rows_, columns] = b.input_ids, b.attention_mask
        response_mask[rows_, :r], logprobs[rows_, :r] = b.response_mask, b.logprobs
        if support is not None:
            support.start[rows_, :r], support.count[rows_, :r] = b.sampling_support.start + packed, b.sampling_support.count
            packed += b.sampling_support.ids.numel()
        if evict_at is not None:
            old_width = b.input_ids.shape[1]
            moved = evict_at[rows_, ..., columns]
            moved.copy_(b.evict_at).add_(shift)
            moved.masked_fill_(b.evict_at >= old_width, width).masked_fill_(b.evict_at == 0, 0)  # sentinel; padding stays hidden
        if rounding is not None:
            rounding[rows_, ..., columns, :] = b.kv_rounding
        start += n
        del b
    return RolloutBatch(input_ids, attention_mask, P, response_mask, logprobs, evict_at, stats, sampling_support=support,
                        kv_quant=first.kv_quant, kv_rounding=rounding)


def _use_graphs(compile, device: torch.device, policy, record_visibility: bool) -> bool:
    """Whether to capture the decode step: 'auto' and true on CUDA for an evicting rollout (a fixed-capacity
    cache) without the visibility log; true elsewhere warns and decodes eagerly."""
    possible = device.type == "cuda" and policy is not None and not record_visibility
    if compile is True and not possible:
        warnings.warn("compile=true: CUDA graphs need a CUDA device and an evicting rollout without record_visibility; "
                      "decoding eagerly", RuntimeWarning, stacklevel=3)
    return compile is not False and possible


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    *,
    policy: EvictionPolicy | None = None,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
    eos_token_id: int,
    pad_token_id: int,
    progress: bool = False,
    record_visibility: bool = False,
    measure_dense_kv: bool = True,
    compile: str | bool = "auto",
    sync_every: int | None = None,
    kv_quant: str = "none",
) -> RolloutBatch:
    """Sample responses to `prompts` (the caller repeats each one G times), evicting with `policy`.

    Stops when every row has emitted `eos_token_id` or after `max_new_tokens`. `record_visibility` keeps
    a [N, L, Hkv, T, T] log of what each query saw (debugging and tests). `measure_dense_kv` measures a
    dense DynamicCache over the same tokens for `kv/bytes_peak_dense`. `compile` ('auto', true, false):
    capture the evicting decode step as CUDA graphs on CUDA ('auto': whenever possible; never on the CPU).
    `sync_every`: decode steps between host reads of the device (None: 1 on the CPU, `SYNC_EVERY` elsewhere;
    1 also checks the cache's capacity at every step, for debugging). Neither changes what is returned.
    `kv_quant` ("none", "int8", "fp8_e4m3"): the cache stores 8-bit keys and values (`smd_cli.attention.kv_quant`); the prefill
    attends to the fresh ones, every decode step to the cache's, dequantised (without a policy: `KeepAll`'s cache).
    Sampling reads `noise` [N, >= max_new_tokens] (uniforms, `sampling_noise`), or draws it at once from
    `generator`: a row's tokens depend on its own noise only, so splitting the rows into chunks or ranks,
    each with its rows of one noise tensor, samples exactly what one batch would."""
    _check(temperature, top_p, top_k, max_new_tokens, compile, sync_every)
    started = time.perf_counter()
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id, device)
    groups = prompt_groups(prompt_ids, prompt_mask, prompt_ids.shape[1])  # rows repeating a prompt: prefilled once
    if check_kind(kv_quant) != "none" and policy is None:  # an 8-bit cache is the evicting one, keeping everything
        policy = KeepAll()
    run = _Run.start(model, prompt_ids, prompt_mask, policy, max_new_tokens, pad_token_id, record_visibility, groups, kv_quant)
    if _use_graphs(compile, device, policy, record_visibility):
        run.graphs = DecodeGraphs()
    sync_every = sync_every or (1 if device.type == "cpu" else SYNC_EVERY)
    if temperature > 0 and noise is None:
        noise = sampling_noise(len(prompts), max_new_tokens, generator)
    if noise is not None:
        if noise.shape[0] != len(prompts) or noise.shape[1] < max_new_tokens:
            raise ValueError(f"noise has shape {tuple(noise.shape)}; expected [{len(prompts)}, >= {max_new_tokens}] (rows, new tokens)")
        noise = noise.to(device)
    bar, task = _progress(progress, max_new_tokens)
    use_smd_attention(row_floor.apply(model))
    with bar, fixed_weights(model):
        for step in range(max_new_tokens):
            uniforms = None if noise is None else noise[:, step]
            tokens, token_logp, kept = sample(run.forward(model, step), temperature, top_p, uniforms, top_k)
            run.record(step, tokens, token_logp, kept, eos_token_id, pad_token_id, check_nan=temperature > 0)
            bar.advance(task)
            if (step + 1) % sync_every == 0 or step + 1 == max_new_tokens:
                if run.synchronise():
                    break
    steps = run.kept_steps()
    batch = run.batch(model, measure_dense_kv, steps)
    if batch.stats.get("rollout/support_capped_fraction", 0.0) > 0:
        warnings.warn(f"top_p={top_p}, top_k={top_k}: some tokens' sampling support reached its bound of {MAX_SUPPORT} tokens "
                      "(smd_cli/rollout/sampling.py); the sampler drew from the capped set and the learner scores that same set "
                      "(rollout/support_capped_fraction counts them)", RuntimeWarning, stacklevel=2)
    batch.stats["rollout/seconds"] = time.perf_counter() - started
    return batch
