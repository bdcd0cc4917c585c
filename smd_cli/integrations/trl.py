"""SMD inside TRL: `SMDGRPOTrainer` is TRL's `GRPOTrainer` whose rollouts come from this project's evicting sampler and
whose learner replays each rollout's shadow mask, with SMD's stop-gradient dense teacher KL added to TRL's loss.

    from smd_cli.integrations.trl import SMDConfig, SMDGRPOTrainer
    trainer = SMDGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=data,
                             processing_class=tokenizer, smd=SMDConfig(policy="snapkv", compression=0.5, lam=0.1))

What it changes in TRL, and where (read against trl 1.16's source; `TESTED_TRL` is the range the tests ran on):
- generation: TRL's public `rollout_func` hook. The prompts are tokenized by TRL (`_tokenize_prompts`: its chat template,
  its tokenizer), sampled by `smd_cli.rollout.sampler.generate` under the eviction policy (every policy of
  `smd_cli/eviction/`, KV quantisation, top-k / top-p with the kept token sets recorded), with the noise `smd train` draws at
  the same seed and step. TRL pads the returned ids as the sampler did (prompts left, completions right), so TRL's
  batch is the rollout's, column for column; the rollout itself (shadow masks, sampler log-probs) stays here and each
  of TRL's rows carries its index (`smd_row`) through TRL's shuffle and split.
- pi_old: the sampler's log-probs (`old_per_token_logps`, set in `_generate_and_score_completions`: private; overridden,
  which also tags each row with its index in the rollout), as in `smd train algo=smd`: the learner replays the sampler's
  policy, so TRL's importance ratio at a batch's first step is exp(replayed - sampler), 1 within the parity bound.
- the learner's log-probs: `_get_per_token_logps_and_entropies` (private; overridden) scores the rows with the engine's
  `smd_cli.learner.step.scored`: the shadow replay with gradient and, for the loss, the dense teacher without, in one pass.
  The reference model (`beta > 0`) is scored in the same replayed view, as `smd train` does.
- the loss: `_compute_loss` (private; overridden) adds `lam * KL(sg[dense] || replay)`, aggregated as TRL aggregates the
  policy term of the loss type (`dapo`, `bnpo`: token mean; `grpo`: each sequence's token mean), with
  `smd_cli.learner.losses.aggregate`.
- the learner's module flags: `smd_cli.model.build.learner_mode` (no dropout, no router or input jitter anywhere: the
  sampler's function), the top-level module left `training` for TRL's own bookkeeping.

What it refuses, by name, before anything runs (`refusals`): a model family the replay does not serve (the allow-list of
`smd train`, `smd_cli.model.build.unreplayable`), and the TRL settings it cannot honour (vLLM or transformers' paged
generation, tools and environments, PEFT, mixed-precision autocast, loss types whose aggregation SMD's KL does not
follow, sampling settings the sampler does not implement, padding to a multiple, several processes, MoE aux loss,
an entropy bonus).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

try:
    import trl
    from trl import GRPOConfig, GRPOTrainer
except ImportError as err:  # the optional extra
    raise ImportError('smd_cli.integrations.trl needs TRL: pip install "smd[trl]" (or `make install`)') from err

from smd_cli.attention.kv_quant import check_kind
from smd_cli.attention.policy import EvictionPolicy
from smd_cli.attention.shadow import resolve_backend
from smd_cli.eviction.h2o import H2O
from smd_cli.eviction.knorm import KNorm
from smd_cli.eviction.none import KeepAll
from smd_cli.eviction.random import RandomEviction
from smd_cli.eviction.recent import Recent
from smd_cli.eviction.snapkv import SnapKV
from smd_cli.learner.losses import aggregate, mismatch_stats
from smd_cli.learner.step import Algorithm, scored
from smd_cli.model.build import learner_mode, unreplayable
from smd_cli.rollout.sampler import RolloutBatch, generate, sampling_noise

TESTED_TRL = ">=1.16,<1.17"  # the versions whose private methods above were read and tested; pyproject's [trl] pins them

# conf/eviction/<name>.yaml's classes (tested equal to their `_target_`); their constructors' defaults are the YAML's
POLICIES: dict[str, type[EvictionPolicy]] = {"none": KeepAll, "snapkv": SnapKV, "h2o": H2O, "recent": Recent,
                                              "random": RandomEviction, "knorm": KNorm}
# TRL loss types whose policy-term aggregation is one of the engine's (`losses.aggregate`): SMD's KL is aggregated alike
AGGREGATION = {"dapo": "token_mean", "bnpo": "token_mean", "grpo": "seq_mean_token_mean"}
NOISE_SEED = 1_000_003  # smd train's sampling noise at step s: Generator().manual_seed(seed * NOISE_SEED + s)


@dataclass
class SMDConfig:
    """What SMD adds to a `GRPOConfig`: the rollout's eviction and the distillation weight.

    policy: an eviction policy's name (`POLICIES`: none, snapkv, h2o, recent, random, knorm), built with `compression`
        and `policy_kwargs` (its other fields, e.g. `window`, `sink`, `recompress_every`), or an `EvictionPolicy` instance
        (a policy of your own, README "Adding an eviction policy"; then `compression` and `policy_kwargs` are unused).
    compression: fraction of prompt KV entries evicted at rollout (DESIGN.md section 2).
    lam: lambda, the weight of KL(sg[pi_dense] || pi_replay) added to TRL's loss (0: no teacher pass).
    kv_quant: none | int8 | fp8_e4m3, the rollout's 8-bit KV cache, replayed by the learner (README "kv.quant").
    replay_backend: auto (flex_attention on CUDA, SDPA elsewhere) | sdpa | flex.
    logits_chunk: response tokens per vocabulary chunk in the learner (None: about 2^23 logits)."""

    policy: str | EvictionPolicy = "snapkv"
    compression: float = 0.5
    lam: float = 0.1
    kv_quant: str = "none"
    replay_backend: str = "auto"
    logits_chunk: int | None = None
    policy_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.policy, EvictionPolicy) and self.policy not in POLICIES:
            raise ValueError(f"SMDConfig.policy={self.policy!r}: one of {', '.join(POLICIES)}, or an EvictionPolicy instance")
        if not 0.0 <= float(self.compression) < 1.0:
            raise ValueError(f"SMDConfig.compression={self.compression!r}: the fraction of prompt KV evicted, in [0, 1)")
        if not (math.isfinite(self.lam) and self.lam >= 0):
            raise ValueError(f"SMDConfig.lam={self.lam!r}: the distillation weight, a finite number >= 0")
        check_kind(self.kv_quant)
        resolve_backend(self.replay_backend, torch.device("cpu"))  # the replay's own check of the name
        if self.logits_chunk is not None and (not isinstance(self.logits_chunk, int) or self.logits_chunk < 1):
            raise ValueError(f"SMDConfig.logits_chunk={self.logits_chunk!r}: None or an integer >= 1")

    def build_policy(self) -> EvictionPolicy:
        if isinstance(self.policy, EvictionPolicy):
            return self.policy
        if self.policy == "none":
            return KeepAll(**self.policy_kwargs)  # the evicting machinery keeping everything: a shadow mask all the same
        return POLICIES[self.policy](compression=self.compression, **self.policy_kwargs)


def refusals(args: GRPOConfig, kwargs: dict | None = None) -> list[str]:
    """What in `args` (and the trainer's keyword arguments) SMD cannot honour, each with its reason; [] when nothing."""
    out = []

    def no(setting: str, why: str) -> None:
        out.append(f"{setting}: {why}")

    if args.use_vllm:
        no("use_vllm=True", "the rollout is SMD's evicting sampler, whose shadow mask the learner replays; vLLM records none")
    if getattr(args, "use_transformers_continuous_batching", False) or getattr(args, "use_transformers_paged", False):
        no("use_transformers_continuous_batching / use_transformers_paged", "the rollout is SMD's evicting sampler")
    if args.loss_type not in AGGREGATION:
        no(f"loss_type={args.loss_type!r}", "SMD's KL term is aggregated as the policy term is, for the loss types whose "
           f"aggregation is one of the engine's: {', '.join(f'{k} ({v})' for k, v in AGGREGATION.items())}")
    if args.bf16 or args.fp16:
        no(f"{'bf16' if args.bf16 else 'fp16'}=True", "mixed-precision autocast would run the sampler and the learner's replay "
           "as different functions; load the model in the dtype to train in (bf16=False, fp16=False)")
    if args.min_p is not None or args.repetition_penalty != 1.0 or args.generation_kwargs or args.cache_implementation:
        no("min_p / repetition_penalty / generation_kwargs / cache_implementation", "the sampler draws from temperature, "
           "top_k and top_p only, which the learner replays; other logits processors it does not implement")
    if not args.max_completion_length:
        no(f"max_completion_length={args.max_completion_length!r}", "the sampler's fixed number of decode steps (an integer >= 1)")
    if args.pad_to_multiple_of is not None:
        no(f"pad_to_multiple_of={args.pad_to_multiple_of!r}", "TRL's batch must have the rollout's columns, whose shadow mask it replays")
    if args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        no("entropy_coef / use_adaptive_entropy", "the replay's entropy is a diagnostic without gradient")
    if getattr(args, "use_liger_kernel", False):
        no("use_liger_kernel=True", "Liger's fused loss scores a dense forward, not the replay")
    if args.gradient_checkpointing and (args.gradient_checkpointing_kwargs or {}).get("use_reentrant", False):  # mirrors activation_*
        no("use_reentrant=True (checkpointing kwargs)", "the replay's recompute needs non-reentrant checkpointing")
    for name in ("rollout_func", "peft_config", "tools", "environment_factory"):
        if (kwargs or {}).get(name) is not None:
            no(f"{name}=...", "not with SMD: the rollout is SMD's own" if name == "rollout_func" else
               "not tested with the replay (PEFT wraps the decoder the replay runs layer by layer; tools and environments "
               "append tokens the sampler did not draw)")
    return out


class SMDGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer with SMD: evicting rollouts, shadow-mask replay in the learner, the dense teacher's KL.

    Takes GRPOTrainer's arguments plus `smd` (an `SMDConfig`). Logs `smd/mismatch/*` (the replay's parity with the
    sampler: max, mean |log p - sampler|, k3 KL) and `smd/mismatch/dense_*` (the dense teacher's mismatch: what a plain
    learner would score), `smd/distill` (the KL term) and the rollout's `smd/kv_kept_fraction`."""

    def __init__(self, model, reward_funcs, args: GRPOConfig | None = None, *, smd: SMDConfig | None = None, **kwargs):
        self.smd = smd if smd is not None else SMDConfig()
        if args is not None:
            _refuse(refusals(args, kwargs))
        elif any(kwargs.get(k) is not None for k in ("rollout_func", "peft_config", "tools", "environment_factory")):
            _refuse(refusals(GRPOConfig(bf16=False), kwargs))
        self._policy = self.smd.build_policy()
        self._rollouts: dict[str, RolloutBatch] = {}  # the last rollout of each mode (train / eval)
        self._scope: tuple | None = None  # (mode, rows or None, role) while TRL scores a rollout's rows
        self._terms: dict[str, torch.Tensor] | None = None
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, rollout_func=self._rollout, **kwargs)
        problems = refusals(self.args)  # TRL's default GRPOConfig (args=None) included
        if self.accelerator.num_processes > 1:
            problems.append(f"{self.accelerator.num_processes} processes: tested on one (the replay runs the unwrapped model)")
        if self.aux_loss_enabled:
            problems.append("router_aux_loss_coef != 0: the replay returns no MoE load-balancing loss (set it to 0)")
        reason = unreplayable(self.accelerator.unwrap_model(self.model))
        if reason:
            config = self.accelerator.unwrap_model(self.model).config
            problems.append(f"model_type {getattr(config, 'model_type', None)!r} is not supported: {reason}")
        _refuse(problems)
        self._algo = Algorithm(name="smd", temperature=self.args.temperature, lam=self.smd.lam,
                               replay_backend=self.smd.replay_backend, logits_chunk=self.smd.logits_chunk)

    # --- generation ---------------------------------------------------------------------------------------------
    def _rollout(self, prompts: list, trainer=None) -> dict[str, list]:
        """TRL's `rollout_func`: the evicting sampler on TRL's tokenized prompts; keeps the rollout for the learner."""
        mode = "train" if self.model.training else "eval"
        prompt_ids = [list(map(int, ids)) for ids in self._tokenize_prompts(prompts)[0]]
        model = self.accelerator.unwrap_model(self.model)
        top = model.training
        model.eval()  # the sampler's function: every module in eval mode
        model.training = top  # TRL reads the top-level flag for train / eval bookkeeping
        noise = sampling_noise(len(prompt_ids), self.args.max_completion_length,
                               torch.Generator().manual_seed(self.args.seed * NOISE_SEED + self.state.global_step))
        tok = self._tokenizer
        batch = generate(model, prompt_ids, policy=self._policy, max_new_tokens=self.args.max_completion_length,
                         temperature=self.args.temperature, top_p=self.args.top_p, top_k=self.args.top_k or 0, noise=noise,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, measure_dense_kv=False,
                         kv_quant=self.smd.kv_quant)
        self._rollouts[mode] = batch
        self._metrics[mode]["smd/kv_kept_fraction"].append(batch.stats["kv/kept_fraction"])
        responses, mask = batch.input_ids[:, batch.prompt_length:], batch.response_mask
        return {"prompt_ids": prompt_ids,
                "completion_ids": [r[m].tolist() for r, m in zip(responses, mask)],
                "logprobs": [lp[m].tolist() for lp, m in zip(batch.logprobs, mask)]}

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        self._scope = (mode, None, "generation")
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._scope = None
        batch = self._rollouts[mode]
        output["smd_row"] = torch.arange(batch.input_ids.shape[0])  # each row's index in the rollout, through TRL's shuffle
        output["old_per_token_logps"] = output["sampling_per_token_logps"]  # pi_old = the sampler's (smd train's)
        return output

    # --- the learner ----------------------------------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        self._scope, self._terms = (mode, inputs["smd_row"], "loss"), None
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._scope = None
        terms, self._terms = self._terms, None
        mask = inputs["completion_mask"].to(terms["logp"].dtype)
        sampler = inputs["sampling_per_token_logps"]
        metrics = mismatch_stats("smd/mismatch/", terms["logp"].detach(), sampler, mask)
        if "kl" in terms:
            distill = self._aggregate_like_trl(terms["kl"], mask, inputs, mode)
            loss = loss + self.smd.lam * distill
            metrics["smd/distill"] = float(distill.detach())
            metrics.update(mismatch_stats("smd/mismatch/dense_", terms["teacher_logp"], sampler, mask))
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)
        return loss

    def _aggregate_like_trl(self, per_token: torch.Tensor, mask: torch.Tensor, inputs, mode: str) -> torch.Tensor:
        """`per_token` [B, R] reduced as TRL 1.16's `_compute_loss` reduces the policy term of `loss_type` (its
        normaliser, gradient accumulation included), by the engine's `aggregate`."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if self.loss_type == "grpo":
            return aggregate(per_token, mask, "seq_mean_token_mean", 0.0, mask.shape[0] * accumulation)
        if self.loss_type == "bnpo":
            return aggregate(per_token, mask, "token_mean", float(mask.sum()) * accumulation, 0.0)
        normaliser = float(inputs["num_items_in_batch"].clamp(min=1.0)) / self.accelerator.num_processes  # dapo
        if mode == "train":
            normaliser = normaliser * accumulation / self.args.steps_per_generation
        return aggregate(per_token, mask, "token_mean", normaliser, 0.0)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL's per-token log-probs [B, logits_to_keep] of a rollout's rows, under its shadow mask (the engine's
        `scored`); pi_old's forward during generation is the sampler's own log-probs, not computed again. Outside a
        rollout's rows (TRL called from elsewhere): TRL's own."""
        if self._scope is None:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                                              compute_entropy, compute_aux_loss, **multimodal)
        mode, rows, role = self._scope
        batch = self._rollouts[mode]
        rows = torch.arange(batch.input_ids.shape[0]) if rows is None else rows.cpu()
        scoring = self.accelerator.unwrap_model(model)
        if role == "generation" and scoring is self.accelerator.unwrap_model(self.model):  # pi_old (PEFT refused: not a ref)
            return batch.logprobs[rows], None, None
        _check_rows(batch, rows, input_ids, logits_to_keep)
        top = scoring.training
        learner_mode(scoring)  # no dropout, jitter or sampled routing: the sampler's function, through backward too
        scoring.training = top
        order = rows.argsort()  # rows of one prompt side by side again: the replay computes each prompt once
        teacher = role == "loss" and self.smd.lam > 0
        step = batch_size or len(rows)
        parts = [scored(scoring, batch, rows[order[i:i + step]], self._algo, shadow=True, teacher=teacher)
                 for i in range(0, len(rows), step)]
        inverse = order.argsort()
        terms = {key: torch.cat([p[key] for p in parts])[inverse.to(parts[0][key].device)] for key in parts[0]}
        if role == "loss":
            self._terms = terms
        return terms["logp"], terms["entropy"] if compute_entropy else None, None

    # --- evidence ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def rollout_parity(self, mode: str = "train") -> dict[str, float]:
        """On the last rollout of `mode`, at the current weights (call it before they change, e.g. after a step at
        learning rate 0): max |log p - sampler log p| over real completion tokens of TRL's learner with the replay (this
        trainer's `_get_per_token_logps_and_entropies`) and of TRL's own learner (GRPOTrainer's, dense), on the same rows."""
        batch = self._rollouts[mode]
        ids, mask, width = batch.input_ids, batch.attention_mask, batch.logprobs.shape[1]
        self._scope = (mode, None, "parity")
        try:
            replayed = self._get_per_token_logps_and_entropies(self.model, ids, mask, width)[0]
        finally:
            self._scope = None
        model = self.accelerator.unwrap_model(self.model)
        top = model.training
        learner_mode(model)
        model.training = top
        plain = GRPOTrainer._get_per_token_logps_and_entropies(self, self.model, ids, mask, width)[0]
        real = batch.response_mask
        return {"replay_max_abs_diff": float((replayed.float() - batch.logprobs)[real].abs().max()),
                "trl_max_abs_diff": float((plain.float() - batch.logprobs)[real].abs().max()),
                "tokens": int(real.sum())}


def _check_rows(batch: RolloutBatch, rows: torch.Tensor, input_ids: torch.Tensor, width: int) -> None:
    """TRL's batch holds the rollout's rows, column for column (what the replay's masks index)."""
    mine = batch.input_ids[rows.to(batch.input_ids.device)]
    real = batch.attention_mask[rows.to(batch.input_ids.device)].bool()
    if (tuple(input_ids.shape) != tuple(mine.shape) or width != batch.logprobs.shape[1]
            or not torch.equal(input_ids.to(mine.device)[real], mine[real])):
        raise RuntimeError(f"TRL's batch {tuple(input_ids.shape)} (completion width {width}) is not the rollout's rows "
                           f"{tuple(mine.shape)}: the shadow masks cannot be replayed on it (did a setting re-pad or edit "
                           "the completions?)")


def _refuse(problems: list[str]) -> None:
    if problems:
        raise ValueError("SMDGRPOTrainer cannot honour " + "; ".join(problems) + f" (tested with trl {TESTED_TRL}, this is {trl.__version__})")


__all__ = ["SMDConfig", "SMDGRPOTrainer", "POLICIES", "TESTED_TRL", "refusals"]
