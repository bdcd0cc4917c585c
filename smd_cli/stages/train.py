"""`smd train`: GRPO on a task, with any of the algorithms of DESIGN.md section 4.

Each step samples `grpo.prompts_per_step` prompts x G generations with the rollout's eviction policy
(none for algo=dense), scores them with the task's reward, normalises advantages within each group,
and takes one `learner_step`. Held-out reward is measured before and after training on the task's test split, each seed on
its own prompts (`eval.prompts`, `smd_cli.evaluation.heldout`; sampled at the eval temperature, seeded, and greedy). Sampling at step s
uses a generator seeded from (seed, s), so a resumed run draws exactly what an uninterrupted one would.

Checkpoints (`smd_cli.runtime.checkpoint`) are written every `checkpoint.every` steps and at the end, plus `final/`.
`resume=true` (or `resume=RUN_DIR`) restores weights, optimizer, RNG states and the eviction policy's own
random state from the run's newest intact checkpoint (verified against its manifest, before any model is
built) and continues in that run directory; `metrics.jsonl` is cut back to that step, so the remaining rows
equal an uninterrupted run's. A non-finite loss or gradient, non-finite weights, or `guard.collapse_steps`
steps without any gradient stop the run (summary status "diverged", the last good checkpoint named); a
batch left empty by Sparse-RL's rejection is skipped and counted. The run directory is locked for this process.

Under `torchrun` (`smd_cli.runtime.distributed`) each rank rolls out its share of the step's prompt groups on gathered
weights and the learner is sharded with FSDP2; the update, the logged metrics and the checkpoints are those of
one process with the same config. Rank 0 alone writes the run directory.
"""

from __future__ import annotations

import copy
import time

import torch
from omegaconf import DictConfig, OmegaConf
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from smd_cli.attention.shadow import resolve_backend
from smd_cli.checks.profiler import PhaseMemory
from smd_cli.config.factories import build_correction, build_policy, build_task, optimizer_factory
from smd_cli.config.prompts import check_prompts, encode_prompt, held_out_examples, load_examples
from smd_cli.config.rules import check_config
from smd_cli.config.validation import ConfigError, check, check_offload, unread_keys_note
from smd_cli.evaluation import cache as eval_cache
from smd_cli.evaluation.batch import evaluate, evidence_kept
from smd_cli.eviction.none import KeepAll
from smd_cli.learner import agreement
from smd_cli.learner.losses import group_advantages
from smd_cli.learner.step import Algorithm, learner_step
from smd_cli.model.precision import MasterWeights, build_optimizer
from smd_cli.rollout import adaptive
from smd_cli.rollout.sampler import concat_rollouts, ended_with_eos, generate, response_texts, sampling_noise
from smd_cli.runs.console import console
from smd_cli.runs.guard import ParityBroken, ParityGuard
from smd_cli.runs.memory_fit import check_fits
from smd_cli.runs.model_loading import check_context, compute_dtype, load_model, load_tokenizer, record_weights
from smd_cli.runs.run_dirs import pick_device, start_run
from smd_cli.runs.train_state import (  # Ctrl-C and a failed write: one line, a status
    CollapseGuard,
    PolicyCollapsed,
    Whereabouts,
    collapsed,
    find_resume,
    resume,
    save,
    save_final,
    stop_diverged,
    stopped,
)
from smd_cli.runs.train_summary import print_summary, run_statistics
from smd_cli.runtime import checkpoint as ckpt
from smd_cli.runtime import distributed, integrity, records
from smd_cli.runtime.failures import ParityFailed, TrainingDiverged
from smd_cli.runtime.offload import Offload, offloaded
from smd_cli.runtime.records import MetricsLog, read_jsonl, write_json


def validate(cfg: DictConfig) -> None:
    """Every key's own rule (`smd_cli.config.rules`), then what depends on several keys or on the machine."""
    check_config(cfg, "train")
    check_algorithm(cfg)
    if adaptive.problem(cfg):
        raise ConfigError(adaptive.problem(cfg))
    if unread_keys_note(cfg):
        console.print(f"[yellow]note:[/yellow] {escape(unread_keys_note(cfg))}", highlight=False, soft_wrap=True)
    if cfg.model.replay == "flex" and not (cfg.device != "cpu" and torch.cuda.is_available()):
        raise ConfigError("model.replay='flex' trains only on CUDA (flex_attention has no CPU backward); use model.replay=auto")
    if cfg.eval.evicting and not cfg.algo.evicting and cfg.eval.dense_eviction is not None:
        build_policy(cfg, cfg.eval.dense_eviction)  # a wrong option is named now, not after training
    check_optimizer(cfg)


def check_algorithm(cfg: DictConfig) -> None:
    """An algorithm is a composition (conf/algo/*.yaml): its view, whether it distils, its correction (built now,
    so that a bad value is named before any work). Each key's own rule is in `smd_cli.config.rules`; here, how
    they go together."""
    a = cfg.algo
    check(not a.distill or a.view == "shadow", "algo.distill", a.distill,
          "false with algo.view=dense (SMD's KL from the dense teacher needs the shadow view)")
    check(a.get("correction") is not None and "_target_" in a.correction, "algo.correction", a.get("correction"),
          "a node with a _target_ (smd_cli/corrections/; NoCorrection for none)")
    build_correction(cfg)


def check_optimizer(cfg: DictConfig) -> None:
    """optim=adamw8bit needs a CUDA device: say so before any work is done. (A bitsandbytes that does not import on
    a CUDA machine falls back to AdamW with a warning: `optimizer_factory`.)"""
    target = str(cfg.optim.get("_target_", ""))
    if not target.startswith("bitsandbytes."):
        return
    name = f"optim=adamw8bit (_target_ {target})"
    if cfg.device == "cpu" or not torch.cuda.is_available():
        raise ConfigError(f"{name} keeps 8-bit optimizer states on a CUDA device, but device={cfg.device!r} and "
                          f"CUDA available={torch.cuda.is_available()}; use optim=adamw on CPU")


def kernels_line(cfg: DictConfig, device: torch.device, policy, optimizer, optimizer_name: str, offload) -> str:
    """What `smd train` runs, in one line: the shadow replay's kernel, the decode's CUDA graphs, the optimizer and
    optim.offload. A run-time fallback (flex compile, graph capture, 8-bit AdamW import) warns where it happens."""
    replay = {"flex": "flex_attention (compiled)", "sdpa": "SDPA"}[resolve_backend(cfg.model.replay, device)]
    graphs = device.type == "cuda" and policy is not None and cfg.sampling.get("compile", "auto") is not False  # smd_cli.rollout.sampler's rule
    masters = " over float32 masters" if isinstance(optimizer, MasterWeights) else ""
    moved = "off" if offload is None else f"on ({'pinned ' if offload.pinned else ''}host memory during rollouts)"
    return (f"kernels: attention SDPA (mask-free causal, masked rows with query groups folded), shadow replay {replay}, "
            f"decode {'CUDA graphs' if graphs else 'eager'}; optimizer {optimizer_name}{masters}; optim.offload {moved}")


def optimizer_of(cfg: DictConfig, make, params):
    """`make(params)` (`optimizer_factory`'s); a target that is not an optimizer class is a ConfigError."""
    try:
        return make(params)
    except Exception as err:  # Hydra wraps the import or constructor error
        cause = err.__cause__ or err
        raise ConfigError(f"optim._target_={cfg.optim.get('_target_')!r} is not allowed: an optimizer class taking the parameters "
                          f"({type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''})") from None


def rollout_policy(cfg: DictConfig):
    """The rollout's eviction policy; None (a plain dense rollout) for algo=dense. compression=adaptive: built at
    adaptive.min_compression, and the controller sets its `compression` before every rollout."""
    policy = build_policy(adaptive.fixed(cfg))
    if not cfg.algo.evicting:
        if not isinstance(policy, KeepAll):
            raise ConfigError(f"algo={cfg.algo.name} samples without eviction, but eviction={type(policy).__name__} was set; "
                              "use an evicting algo (naive_sparse, sparse_rl, tis, mis, icepop, trm, smd) to train with an "
                              "evicting rollout")
        return None
    if isinstance(policy, KeepAll):
        console.print(f"[yellow]note:[/yellow] algo={cfg.algo.name} with eviction=none keeps every KV entry")
    return policy


def algorithm(cfg: DictConfig) -> Algorithm:
    g, a = cfg.grpo, cfg.algo
    return Algorithm(
        name=a.name, epsilon=g.epsilon, epsilon_high=g.epsilon_high, beta=g.beta, loss_agg=g.loss_agg,
        num_iterations=g.num_iterations, micro_batch_size=g.micro_batch_size, max_grad_norm=g.max_grad_norm,
        temperature=cfg.sampling.temperature, lam=cfg["lambda"], replay_backend=cfg.model.replay, logits_chunk=g.logits_chunk,
        view=a.view, correction=build_correction(cfg), distill=a.distill,
    )


def prompts_at(task, step: int, per_step: int, seed: int, pool: list | None) -> list[dict]:
    """The prompts of training step `step` (0-based): a pure function of (step, seed) so runs resume exactly.

    Generated tasks are read in order; loaded datasets are walked in a fresh seeded permutation per epoch."""
    if pool is None:
        return [task.example(task.train_split, step * per_step + i) for i in range(per_step)]
    picked = []
    for i in range(step * per_step, (step + 1) * per_step):
        epoch, offset = divmod(i, len(pool))
        order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        picked.append(pool[int(order[offset])])
    return picked


def eval_policy(cfg: DictConfig):
    """A fresh instance of the policy the evicting held-out evaluation runs (`eval/evict/*`): the run's own
    eviction policy, or for a dense run `eval.dense_eviction` at `compression` (what a dense-trained policy
    meets when deployed with eviction); None when `eval.evicting` is off or nothing evicts."""
    if not cfg.eval.evicting:
        return None
    if cfg.algo.evicting:
        policy = build_policy(adaptive.fixed(cfg))
    elif cfg.eval.dense_eviction:
        policy = build_policy(cfg, cfg.eval.dense_eviction)
    else:
        return None
    return None if isinstance(policy, KeepAll) else policy


def held_out(model, tokenizer, task, examples, cfg, when: str) -> dict[str, float]:
    """Reward on held-out prompts at the eval temperature (seeded; the policy's expected reward), and greedy
    when `eval.greedy`, with a dense cache (`eval/reward_{when}`, `eval/greedy_reward_{when}`) and under the
    evicting policy of `eval_policy` (`eval/evict/...`, with how much answer-bearing KV it kept), each with its exact
    match (`eval/exact_{when}`, `eval/greedy_exact_{when}`, ...). A paper task reports each of its metrics instead
    (`eval/rougeL_{when}`, ...); `reward` is its primary one."""
    if not examples:
        return {}
    out = {}
    views = ["eval"] + (["eval/evict"] if eval_policy(cfg) is not None else [])
    for prefix in views:
        for key, temperature in (("reward", cfg.eval.temperature), ("greedy_reward", 0.0 if cfg.eval.greedy else None)):
            if temperature is None:
                continue
            policy = eval_policy(cfg) if prefix == "eval/evict" else None  # fresh: the same random choices every time
            _, summary = evaluate(model, tokenizer, task, examples, max_new_tokens=cfg.sampling.max_new_tokens,
                                  batch_size=cfg.eval.batch_size, temperature=temperature, top_p=cfg.sampling.top_p,
                                  top_k=cfg.sampling.top_k, policy=policy, seed=cfg.seed + 1, progress=cfg.progress,
                                  kv_quant=cfg.kv.quant if prefix == "eval/evict" else "none")  # eval: dense, full precision
            out[f"{prefix}/{key}_{when}"] = summary["reward"]
            if "exact" in summary:  # exact match beside a reward that credits part of an answer (passkey's digits, vote's words)
                out[f"{prefix}/{key.replace('reward', 'exact')}_{when}"] = summary["exact"]
            if key == "reward":
                metrics = getattr(task, "metric_list", ())
                out.update({f"{prefix}/{m.name}_{when}": summary[m.name] for m in metrics})
                out.update({f"{prefix}/{k.removeprefix('evidence/')}_{when}": v for k, v in summary.items() if k.startswith("evidence/")})
    return out


def held_out_before(model, tokenizer, task, examples, cfg) -> tuple[dict[str, float], str | None]:
    """`held_out(..., "before")`, and where it was read from: the evaluation cache's entry (`smd_cli.evaluation.cache`) when
    `eval.reuse_before` and an earlier run stored this very evaluation of these weights (the same bytes, prompts,
    settings, code and machine), else None (computed here, then stored). One process only (under torchrun: computed)."""
    if not (examples and cfg.eval.get("reuse_before") and distributed.size() == 1):
        return held_out(model, tokenizer, task, examples, cfg, "before"), None
    plain = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("task", "eval", "sampling", "eviction", "kv")}
    settings = {**plain, "compression": cfg.compression, "algo.evicting": cfg.algo.evicting,
                "seed": cfg.seed if cfg.eval.temperature > 0 else None,  # greedy: no noise is drawn
                "precision": {k: cfg.model.get(k) for k in ("dtype", "cpu_dtype", "logits_dtype", "attention_dtype")}}
    digest = eval_cache.key(model, examples, [encode_prompt(task, e, tokenizer) for e in examples], settings)
    try:
        found = eval_cache.load(cfg.cache_dir, digest)
    except records.Damaged as err:  # named, never used: evaluated again, and the entry replaced
        console.print(f"[yellow]warning:[/yellow] {escape(str(err))}; evaluating again", highlight=False, soft_wrap=True)
        found = None
    if found is not None:
        return found, str(eval_cache.path(cfg.cache_dir, digest))
    out = held_out(model, tokenizer, task, examples, cfg, "before")
    eval_cache.store(cfg.cache_dir, digest, out)
    return out, None


def run(cfg: DictConfig) -> dict:
    """`smd train`. Ctrl-C, or a write that fails (a full disk, a file-size limit), ends it with one line naming the step,
    the last checkpoint and the command that continues, and that status in summary.json (`train_state.stopped`)."""
    where = Whereabouts()
    try:
        return _run(cfg, where)
    except KeyboardInterrupt as err:
        raise stopped(cfg, where, err) from None
    except (integrity.DiskFull, integrity.FileTooLarge, integrity.WriteFailed, integrity.Unwritable) as err:
        raise stopped(cfg, where, err) from None


def _run(cfg: DictConfig, where: Whereabouts) -> dict:
    validate(cfg)
    distributed.init(pick_device(cfg))  # under torchrun: join the process group first (one process: nothing)
    check_context(cfg, response=False)  # the architecture, and a prompt within the model's positions, before anything is sized
    check_fits(adaptive.fixed(cfg), pick_device(cfg), distributed.size())  # the planner's step (adaptive: its most KV) against this machine's memory
    resume_from = distributed.from_main(find_resume, cfg)  # verified and config-checked before any model is built
    run_ = start_run(cfg)  # prompt and response within the model's positions (`check_context`), then the run directory
    main = distributed.is_main()
    run_dir = resume_from.path.parent.parent if resume_from else run_.dir
    where.run_dir = run_dir
    task = build_task(cfg)
    policy = rollout_policy(cfg)
    pool = None if hasattr(task, "example") else load_examples(task, task.train_split)  # data errors before the model
    eval_examples = held_out_examples(task, cfg.eval.num_prompts, cfg.seed, cfg.eval.prompts)  # the seed's own (eval.prompts)
    check_offload(cfg, distributed.size())
    check_prompts(task, eval_examples, load_tokenizer(cfg))  # training prompts are checked as each step reads them
    check(cfg.grpo.prompts_per_step % distributed.size() == 0, "grpo.prompts_per_step", cfg.grpo.prompts_per_step,
          f"a multiple of the {distributed.size()} processes (each rank takes an equal share of whole prompt groups)")
    model, tokenizer = load_model(cfg, task, run_.device, progress=cfg.progress and main)
    algo = algorithm(cfg)
    # the initial policy, frozen (also on resume); copied before the optimizer hooks the weights
    ref_model = copy.deepcopy(model).requires_grad_(False).eval() if algo.beta > 0 else None
    state = rng = None
    if resume_from is not None:  # the weights before sharding; the optimizer's state once it is built
        state, rng, optimizer_state = resume(cfg, resume_from, run_.dir, model)
    root = distributed.shard(model, run_.device, float32_masters(model) if distributed.size() > 1 else None)
    learner = root or model
    make_optimizer, optimizer_name = optimizer_factory(cfg, run_.device)
    optimizer = build_optimizer(model, lambda params: optimizer_of(cfg, make_optimizer, params))
    offload = Offload(optimizer, run_.device) if cfg.optim.get("offload", False) else None
    if main:
        console.print(kernels_line(cfg, run_.device, policy, optimizer, optimizer_name, offload), soft_wrap=True)
    G = cfg.grpo.num_generations
    controller = adaptive.Controller.of(cfg, (state or {}).get("adaptive"))  # compression=adaptive; restored on resume

    if resume_from is None:
        start = 0
        with distributed.gathered(root):
            before, reused = held_out_before(model, tokenizer, task, eval_examples, adaptive.at(cfg, controller))
            state = {"summary": before, "skipped_steps": 0, "seconds": 0.0}
        if reused:
            console.print(f"held-out evaluations before GRPO: read from {reused} (these weights, prompts and settings, evaluated by an "
                          "earlier run with this code; eval.reuse_before=false evaluates them again)", highlight=False)
        if controller is not None:
            state["adaptive"] = controller.state_dict()
            state["summary"]["eval/evict/compression_before"] = controller.compression
        console.print(f"held-out reward before GRPO: {state['summary'].get('eval/reward_before', float('nan')):.4f} "
                      f"({len(eval_examples)} prompts, temperature {cfg.eval.temperature})")
    else:  # the held-out reward before, the skip count and the seconds so far come back with the checkpoint
        if root is None:
            optimizer.load_state_dict(optimizer_state)
        else:
            distributed.load_full_states(root, optimizer, optimizer_state)
        start = resume_from.step
        if policy is not None:
            policy.load_state_dict(state.pop("policy", {}))
    summary = dict(state["summary"])
    where.summary = summary
    log = MetricsLog(run_dir, truncate_after=start) if main else None
    history = distributed.from_main(lambda: read_jsonl(log.path) if log.path.is_file() else [])  # rank 0 reads, all get it
    last = {k: v for k, v in history[-1].items() if k != "step"} if history else {}
    mem = PhaseMemory(run_.device)
    guard, stopped = CollapseGuard(cfg.guard.collapse_steps, history), None  # a resumed run judges its whole history
    parity = ParityGuard.of(cfg, compute_dtype(cfg, run_.device), distributed.size())
    if resume_from is not None:
        parity.load_state_dict(state.get("parity"), start)
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn()]
    if rng is not None:
        ckpt.set_rng_state(rng)  # last, so that nothing between the restore and the first step draws from it
    with Progress(*columns, console=console, disable=not (cfg.progress and main)) as bar:
        job = bar.add_task(f"{algo.name}: rollout", total=cfg.steps, completed=start)
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            bar.update(job, description=f"{algo.name}: rollout")
            if controller is not None:
                policy.compression = controller.compression
            with mem.phase("rollout"), distributed.gathered(root), offloaded(offload):
                batch, rewards = sample_step(cfg, step, model, tokenizer, task, policy, pool, run_.device)
            with distributed.gathered(root):  # the sampler's agreement with the dense policy, where the learner has not both views
                found, agreement_s = measured_agreement(model, batch, algo)
            t1 = time.perf_counter()
            bar.update(job, description=f"{algo.name}: learn  ")
            advantages = group_advantages(rewards, G, cfg.grpo.scale_rewards).to(run_.device)
            try:
                with mem.phase("learner"):  # a parity miss is judged on this batch before the update (ParityGuard.check)
                    metrics = learner_step(learner, optimizer, batch, advantages, algo, ref_model, parity.check(step + 1, model, batch))
                guard.check_weights(step + 1, model)
            except ParityBroken:  # a mask error: the update was not made; the summary says why
                break
            except TrainingDiverged as err:
                if log is not None:
                    log.close()
                stop_diverged(run_dir, step + 1, err, summary, guard.last_good)
            t2 = time.perf_counter()
            # step_time stays rollout + learner: the diagnostic pass is its own number (time/agreement_s)
            slowest = {"time/rollout_s": t1 - t0 - agreement_s, "time/learner_s": t2 - t1, "step_time": t2 - t0 - agreement_s, **mem.take()}
            if found is not None:
                slowest["time/agreement_s"] = agreement_s
            metrics.update({**(found or {}), **({"compression": policy.compression} if policy is not None else {})})
            if controller is not None:  # the next rollout's compression, from this one's agreement
                controller.update(metrics.get(adaptive.SIGNAL))
                state["adaptive"] = controller.state_dict()
            metrics.update({**rollout_metrics(batch, rewards, G, tokenizer.eos_token_id),
                            **{k: distributed.largest(v) for k, v in slowest.items()}})  # the slowest rank's, the largest peak
            state["skipped_steps"] += int(metrics["learner/skipped_empty_batch"])
            if log is not None:
                log.log(step + 1, metrics)
            last = metrics
            state["seconds"] += distributed.largest(time.perf_counter() - t0)
            bar.update(job, advance=1, description=progress_text(algo.name, metrics))
            parity.observe(step + 1, metrics)  # several processes: no float64 replay judges a miss
            state["parity"] = parity.state_dict()
            if parity.broken:
                break
            stopped = guard.after_step(step + 1, metrics)  # a certain collapse: stop, and evaluate what is left
            if stopped is not None:
                break
            if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0 and step + 1 < cfg.steps:
                save(cfg, run_dir, step + 1, model, tokenizer, optimizer, state, policy, root, protect=guard.protect())
    if log is not None:
        log.close()
    if stopped is None and not parity.broken:  # a collapsed policy's (or a broken learner's) weights are not published
        latest = distributed.from_main(ckpt.latest_checkpoint, run_dir)
        if cfg.checkpoint.get("at_end", True) and (latest is None or latest.step != cfg.steps):
            save(cfg, run_dir, cfg.steps, model, tokenizer, optimizer, state, policy, root, protect=guard.protect())
        if cfg.checkpoint.get("final", True):
            save_final(run_dir, model, tokenizer, root)
    summary.update({"train/seconds": state["seconds"], "train/skipped_steps": state["skipped_steps"], "steps": cfg.steps,
                    "steps_run": guard.rows[-1]["step"] if guard.rows else start, "status": "completed",
                    "status_reason": "; ".join(n for n in (guard.note(), parity.note()) if n)})
    record_weights(run_dir, model, summary)
    with distributed.gathered(root):
        summary.update(held_out(model, tokenizer, task, eval_examples, adaptive.at(cfg, controller), "after"))
    if controller is not None:
        summary["eval/evict/compression_after"] = controller.compression
    summary.update({f"last/{k}": v for k, v in last.items()})
    before, after = summary.get("eval/reward_before"), summary.get("eval/reward_after")
    found = stopped or guard.at_end((before, after) if isinstance(before, float) and isinstance(after, float) else None)
    message = collapsed(run_dir, found, summary) if found is not None and not parity.broken else None
    summary.update(parity.summary())  # a broken learner is the run's status, whatever else happened
    if main:
        summary.update(run_statistics(log.path))
        write_json(run_dir / "summary.json", summary)
        print_summary(summary, run_dir, cfg, eval_policy(adaptive.at(cfg, controller)))
        if controller is not None or "agreement/p5" in last:
            console.print(adaptive.trace(guard.rows), soft_wrap=True, highlight=False)
    distributed.barrier()
    if parity.broken:
        raise ParityFailed(f"{parity.broken}; stopped ({run_dir / 'summary.json'}: status parity_broken)")
    if message is not None:
        raise PolicyCollapsed(message)
    return summary


def float32_masters(model) -> torch.dtype | None:
    """Make a low-precision model float32 before FSDP2 shards it (its float32 shards are then the master weights)
    and return the dtype it computed in, FSDP2's compute dtype; None for a float32 model."""
    dtype = next(model.parameters()).dtype
    if dtype == torch.float32:
        return None
    model.float()
    return dtype


def sample_step(cfg: DictConfig, step: int, model, tokenizer, task, policy, pool, device) -> tuple:
    """Step `step`'s rollout, (batch, rewards [N]): this rank's share of its prompts x G samples (all of them for
    one process), sampled with this step's noise (seeded by (seed, step), one row per sample of the whole
    step), so that a resumed run, and a run over any number of processes, draws exactly what an uninterrupted
    one-process run does."""
    G, s = cfg.grpo.num_generations, cfg.sampling
    everything = prompts_at(task, step, cfg.grpo.prompts_per_step, cfg.seed, pool)
    share = distributed.rank_slice(len(everything))
    examples = [e for e in everything[share] for _ in range(G)]
    prompts = [encode_prompt(task, e, tokenizer) for e in examples]
    noise = sampling_noise(len(everything) * G, s.max_new_tokens, torch.Generator().manual_seed(cfg.seed * 1_000_003 + step))
    noise = noise[share.start * G : share.stop * G]
    chunk = s.batch_size or len(prompts)  # sequences decoded at once: bounds the rollout's KV memory
    batch = concat_rollouts([
        generate(model, prompts[i : i + chunk], policy=policy, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                 top_p=s.top_p, top_k=s.top_k, noise=noise[i : i + chunk], eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id, measure_dense_kv=False, compile=s.get("compile", "auto"), kv_quant=cfg.kv.quant)
        for i in range(0, len(prompts), chunk)
    ], tokenizer.pad_token_id)
    batch.stats.update(evidence_kept(task, batch, examples, prompts))
    return batch, torch.tensor(rollout_rewards(batch, tokenizer, task, examples))


def rollout_metrics(batch, rewards: torch.Tensor, G: int, eos_token_id: int) -> dict[str, float]:
    """Reward and completion statistics of one step's rollout (TRL names), its `kv/*` numbers and how much
    answer-bearing KV its eviction kept (`evidence/*`, synthetic tasks), over every rank's share: rewards and
    lengths gathered, peaks the largest, the rest the mean of the ranks' (equal shares of rows)."""
    lengths = batch.response_mask.sum(1).float()
    clipped = (~ended_with_eos(batch, eos_token_id)).float()
    if distributed.size() > 1:
        rewards, lengths, clipped = (torch.tensor(sum(distributed.gather_objects(t.tolist()), [])) for t in (rewards, lengths, clipped))
    grouped = rewards.view(-1, G)
    stats = {k: v for k, v in batch.stats.items() if k.startswith(("kv/", "evidence/"))}
    stats = {k: distributed.largest(v) if "peak" in k else distributed.total(v) / distributed.size() for k, v in sorted(stats.items())}
    return {
        "reward": float(rewards.mean()), "reward_std": float(rewards.std()),
        "frac_reward_zero_std": float((grouped.std(1) == 0).float().mean()),
        "completions/mean_length": float(lengths.mean()),
        "completions/clipped_ratio": float(clipped.mean()),
        **stats,
    }


def measured_agreement(model, batch, algo: Algorithm) -> tuple[dict | None, float]:
    """(agreement/* of this rollout by one extra no-grad pass of both views, and its seconds) where the learner does
    not compute it for free (SMD with lambda > 0 does: its shadow view and dense teacher); (None, 0) for a dense
    rollout, or when the learner will."""
    if batch.evict_at is None or (algo.distill and algo.lam > 0):
        return None, 0.0
    started = time.perf_counter()
    values = agreement.measure(model, batch, algo.temperature, algo.logits_chunk, algo.micro_batch_size, algo.replay_backend)
    return agreement.summary(values), time.perf_counter() - started


def progress_text(name: str, metrics: dict) -> str:
    text = f"{name}: reward {metrics['reward']:.3f}"
    if "mismatch/max_abs_diff" in metrics:
        text += f" mismatch {metrics['mismatch/max_abs_diff']:.1e}"
    return text + (" (skipped: empty batch)" if metrics.get("learner/skipped_empty_batch") else "")


def rollout_rewards(batch, tokenizer, task, examples) -> list[float]:
    return [float(task.reward(t, e)) for t, e in zip(response_texts(batch, tokenizer), examples)]
