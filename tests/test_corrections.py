"""The rollout corrections beside TIS and Sparse-RL (MIS, IcePop, Trust Region Masking) against hand computations:
the pure functions of `smd_cli.learner.losses`, then through `learner_step` (the loss it minimises and what it reports as
masked), and the registry: every `conf/algo/*.yaml` composes to the algorithm its name stands for."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from smd_cli.corrections.icepop import icepop_weights
from smd_cli.corrections.mis import mis_weights
from smd_cli.corrections.none import NoCorrection
from smd_cli.corrections.trm import trm_keep
from smd_cli.learner.forward import response_logits
from smd_cli.learner.step import ALGORITHMS, Algorithm, learner_step
from smd_cli.rollout.sampler import generate
from smd_cli.rollout.sampling import token_logprobs
from smd_cli.tasks.synthetic import NeedleRetrieval

CONF = Path(__file__).resolve().parents[1] / "conf"
ADVANTAGES = torch.tensor([1.0, -0.5, 0.25, 2.0, -1.0, 0.0, 0.5, -2.0])  # [N]: 2 prompts x 4 generations


def ratios(rho: torch.Tensor, mask: torch.Tensor | None = None):
    """(logp_old, logp_rollout, mask) with pi_old / pi_rollout = rho exactly (rollout log-probs -1)."""
    rollout = torch.full_like(rho, -1.0)
    return rollout + rho.log(), rollout, torch.ones_like(rho) if mask is None else mask


def test_mis_weighs_each_sequence_by_its_ratio_inside_the_band():
    rho = torch.tensor([[1.5, 1.2, 1.0], [2.0, 2.0, 1.0], [0.1, 0.5, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # padding is not part of a sequence's ratio
    weights, keep, stats = mis_weights(*ratios(rho, mask))
    # sequence ratios: 1.5 * 1.2 * 1.0 = 1.8 (kept), 2 * 2 = 4 > 3 (masked), 0.1 >= 0 (kept)
    want = torch.tensor([[1.8] * 3, [0.0] * 3, [0.1] * 3])
    assert weights.flatten().tolist() == pytest.approx(want.flatten().tolist(), rel=1e-5)
    assert torch.equal(keep, mask)  # masked sequences stay in the normaliser (TRL)
    assert stats["rollout_corr/masked_token_frac"] == pytest.approx(2 / 6)
    assert stats["rollout_corr/masked_seq_frac"] == pytest.approx(1 / 3)
    assert stats["rollout_corr/weight_mean"] == pytest.approx((3 * 1.8 + 0.1) / 6, rel=1e-5)
    assert stats["rollout_corr/weight_max"] == pytest.approx(1.8, rel=1e-5)
    weights, _, stats = mis_weights(*ratios(rho, mask), low=0.2)  # a lower bound masks the third one too
    assert weights[2].tolist() == [0.0] * 3 and stats["rollout_corr/masked_seq_frac"] == pytest.approx(2 / 3)


def test_mis_survives_a_sequence_ratio_beyond_float32():
    log_rho = torch.tensor([[60.0, 60.0], [-60.0, -60.0]])  # exp(120) overflows float32
    weights, _, stats = mis_weights(log_rho, torch.zeros_like(log_rho), torch.ones_like(log_rho))
    # the first is masked (its ratio exp(120) > 3), the second kept with its ratio, exp(-120), 0 in float32
    assert weights.tolist() == [[0.0, 0.0], [0.0, 0.0]] and stats["rollout_corr/masked_seq_frac"] == 0.5


def test_icepop_keeps_token_ratios_inside_the_band_as_weights():
    rho = torch.tensor([[0.4, 0.5, 1.0], [5.0, 5.1, 2.0]])
    weights, keep, stats = icepop_weights(*ratios(rho))
    assert weights.flatten().tolist() == pytest.approx([0.0, 0.5, 1.0, 5.0, 0.0, 2.0], rel=1e-5)
    assert keep.tolist() == [[1.0] * 3] * 2  # the paper's 1/|y|: masked tokens stay in the normaliser
    assert stats["rollout_corr/masked_token_frac"] == pytest.approx(2 / 6)
    assert stats["rollout_corr/masked_seq_frac"] == 1.0  # both sequences lost a token
    assert stats["rollout_corr/weight_mean"] == pytest.approx(8.5 / 6, rel=1e-5)


def test_trm_drops_a_sequence_whose_largest_token_divergence_leaves_the_region():
    log_rho = torch.tensor([[0.1, -2.3, 0.0], [2.2, 0.0, 0.0], [0.5, 10.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # row 2's 10.0 is padding
    weights, keep, stats = trm_keep(log_rho, torch.zeros_like(log_rho), mask)
    # k2 = (log rho)^2 / 2: row 0 max 2.645 > 2.5 (out), row 1 max 2.42 (in), row 2 max 0.125 (in)
    assert keep.tolist() == [[0.0] * 3, [1.0] * 3, [1.0, 0.0, 0.0]]
    assert torch.equal(weights, torch.ones_like(mask))
    assert stats["rollout_corr/masked_token_frac"] == pytest.approx(3 / 7)
    assert stats["rollout_corr/masked_seq_frac"] == pytest.approx(1 / 3)
    assert stats["rollout_corr/k2_max"] == pytest.approx(0.5 * 2.3**2, rel=1e-6)
    _, keep, _ = trm_keep(log_rho, torch.zeros_like(log_rho), mask, threshold=3.0)
    assert keep[0].tolist() == [1.0] * 3


def dense_rollout(model, tokenizer):
    task = NeedleRetrieval(prompt_tokens=32)
    prompts = [task.encode_prompt(task.example("train", i), tokenizer) for i in range(2) for _ in range(4)]
    return generate(model, prompts, max_new_tokens=5, generator=torch.Generator().manual_seed(0),
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def with_ratios(model, batch, rho):
    """Sampler log-probs set so that pi_dense_old / pi_rollout = rho on every token."""
    with torch.no_grad():
        dense = token_logprobs(response_logits(model, batch.input_ids, batch.attention_mask, batch.prompt_length),
                               batch.input_ids[:, batch.prompt_length:])
    batch.logprobs = dense - rho.log()
    return batch


@pytest.mark.parametrize("micro_batch_size", [None, 3])
def test_each_correction_through_learner_step(tiny_model, tiny_tokenizer, micro_batch_size):
    """At the first update the PPO ratio is 1, so each token's loss is -A * weight; token_mean over the kept tokens."""
    batch = dense_rollout(tiny_model, tiny_tokenizer)
    assert bool(batch.response_mask.all()) and batch.response_mask.shape == (8, 5)
    rho = torch.ones(8, 5)
    rho[0, 1] = 3.5   # MIS: sequence 0's ratio 3.5 > 3 (masked); IcePop: inside; TRM: k2 0.78 (in)
    rho[1, 2] = 0.2   # IcePop: below 0.5 (masked); MIS: 0.2 (kept); TRM: k2 1.30 (in)
    rho[3, 0] = 12.0  # TRM: k2 = (log 12)^2 / 2 = 3.09 > 2.5 (sequence 3 out); IcePop: above 5 (masked); MIS: 12 (masked)
    adv = ADVANTAGES[:, None]
    seq_rho = rho.prod(dim=1, keepdim=True)
    cases = {
        "mis": (torch.where((seq_rho <= 3.0), seq_rho, 0.0).expand(8, 5), torch.ones(8, 5), (10 / 40, 2 / 8)),
        "icepop": (torch.where((rho >= 0.5) & (rho <= 5.0), rho, 0.0), torch.ones(8, 5), (2 / 40, 2 / 8)),
        "trm": (torch.ones(8, 5), torch.ones(8, 5).index_fill(0, torch.tensor([3]), 0.0), (5 / 40, 1 / 8)),
    }
    for name, (weights, keep, (token_frac, seq_frac)) in cases.items():
        with_ratios(tiny_model, batch, rho)
        want = float((-adv * weights * keep).sum() / keep.sum())
        metrics = learner_step(tiny_model, torch.optim.SGD(tiny_model.parameters(), lr=0.0), batch, ADVANTAGES,
                               Algorithm(name, micro_batch_size=micro_batch_size))
        assert metrics["loss"] == pytest.approx(want, abs=1e-5), name
        assert abs(want) > 1e-2
        assert metrics["rollout_corr/masked_token_frac"] == pytest.approx(token_frac), name
        assert metrics["rollout_corr/masked_seq_frac"] == pytest.approx(seq_frac), name


@pytest.mark.parametrize("micro_batch_size", [None, 3])
def test_sparse_rl_counts_dropped_sequences_in_the_sequence_mean(tiny_model, tiny_tokenizer, micro_batch_size):
    """`loss_agg=seq_mean_token_mean`: the official code (slime's `sum_of_sample_mean`, then `/ global_batch_size`)
    divides the sum of the sequences' kept-token means by all N sequences; a vetoed sequence, or one whose every
    token was rejected, adds 0 and still counts. TRM (verl's default) leaves its dropped sequences out."""
    batch = dense_rollout(tiny_model, tiny_tokenizer)
    rho = torch.ones(8, 5)
    rho[0, 1] = 2.0            # one token rejected (above 1.5): sequence 0's mean is over its 4 others
    rho[2, 0] = rho[5, 3] = 5e-5  # below the veto 1e-4: sequences 2 and 5 dropped whole (25 % of the batch)
    rho[6] = 1.6               # every token of sequence 6 rejected
    rho[4, 2] = 1.3            # inside [0.5, 1.5]: kept, weighted
    capped = rho.clamp(max=1.5)
    weights = capped / capped.mean()  # normalised to mean 1 over every real token of the batch
    keep = ((rho >= 0.5) & (rho <= 1.5)).float()
    keep[2] = keep[5] = 0.0
    per_seq = (-ADVANTAGES[:, None] * weights * keep).sum(1) / keep.sum(1).clamp(min=1)  # ratio 1 at the first update
    want = float(per_seq.sum() / 8)
    with_ratios(tiny_model, batch, rho)
    metrics = learner_step(tiny_model, torch.optim.SGD(tiny_model.parameters(), lr=0.0), batch, ADVANTAGES,
                           Algorithm("sparse_rl", loss_agg="seq_mean_token_mean", micro_batch_size=micro_batch_size))
    assert metrics["loss"] == pytest.approx(want, abs=1e-6) and abs(want) > 1e-2
    assert float(per_seq.sum() / 5) / want == pytest.approx(1.6)  # what dividing by the 5 kept sequences gave
    assert metrics["is/rejected_seq_frac"] == pytest.approx(2 / 8)
    rho = torch.ones(8, 5)
    rho[3, 0] = 12.0  # TRM: k2 = (log 12)^2 / 2 = 3.09 > 2.5, sequence 3 out, and out of the count
    with_ratios(tiny_model, batch, rho)
    keep = torch.ones(8, 5).index_fill(0, torch.tensor([3]), 0.0)
    want = float((-ADVANTAGES[:, None] * keep).sum(1).div(5).sum() / 7)
    metrics = learner_step(tiny_model, torch.optim.SGD(tiny_model.parameters(), lr=0.0), batch, ADVANTAGES,
                           Algorithm("trm", loss_agg="seq_mean_token_mean", micro_batch_size=micro_batch_size))
    assert metrics["loss"] == pytest.approx(want, abs=1e-6)


def test_trm_rejecting_everything_skips_the_step(tiny_model, tiny_tokenizer):
    batch = with_ratios(tiny_model, dense_rollout(tiny_model, tiny_tokenizer), torch.full((8, 5), 20.0))
    before = [p.detach().clone() for p in tiny_model.parameters()]
    optimizer = torch.optim.AdamW(tiny_model.parameters(), lr=1e-2)
    for micro_batch_size in (None, 3):
        metrics = learner_step(tiny_model, optimizer, batch, ADVANTAGES, Algorithm("trm", micro_batch_size=micro_batch_size))
        assert metrics["learner/skipped_empty_batch"] == 1.0 and metrics["rollout_corr/masked_seq_frac"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_model.parameters())) and not optimizer.state


def test_every_algo_yaml_composes_to_its_built_in_algorithm():
    """The folder listing is the registry: each conf/algo/NAME.yaml, instantiated by the stage, is the composition
    that `Algorithm(NAME)` stands for (view, correction with its defaults, distill)."""
    from smd_cli.stages.train import algorithm

    names = sorted(p.stem for p in (CONF / "algo").glob("*.yaml"))
    assert names == sorted(ALGORITHMS) and len(names) == 8
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for name in names:
            built = algorithm(compose("train", overrides=[f"algo={name}"]))
            named = Algorithm(name)
            assert (built.view, built.correction, built.distill) == (named.view, named.correction, named.distill), name


def test_a_composition_needs_a_known_view_and_distils_only_the_shadow_view():
    with pytest.raises(ValueError, match="algo.view='physical'"):
        Algorithm("mine", view="physical", correction=NoCorrection(), distill=False)
    with pytest.raises(ValueError, match="needs algo.view=shadow"):
        Algorithm("smd", view="dense")
    with pytest.raises(ValueError, match="choose one of dense, naive_sparse"):
        Algorithm("mine")


@pytest.mark.parametrize("overrides, message", [
    (["algo=icepop", "algo.correction.high=0.4"],
     "algo.correction: icepop's token-ratio band needs 0 <= low < high, got low=0.5, high=0.4"),
    (["algo=trm", "algo.correction.threshold=0"], "algo.correction: trm needs threshold > 0, got threshold=0"),
    (["algo=dense", "algo.correction._target_=smd_cli.eviction.snapkv.SnapKV"],
     "algo.correction._target_='smd_cli.eviction.snapkv.SnapKV' is not allowed: a subclass of smd_cli.corrections.base.Correction"),
    (["algo=tis", "algo.view=physical"], "algo.view='physical' is not allowed: one of dense, shadow"),
    (["algo=naive_sparse", "algo.distill=true"], "algo.distill=True is not allowed: false with algo.view=dense"),
    (["algo=smd", "sampling.top_k=2.5"], "sampling.top_k=2.5 is not allowed: an integer >= 0"),
])
def test_a_bad_composition_is_a_config_error(tmp_path, overrides, message):
    from smd_cli.config.validation import ConfigError
    from smd_cli.stages import train

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"+run_dir={tmp_path}", f"cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(ConfigError) as err:
        train.run(cfg)
    assert message in str(err.value)
    assert not (tmp_path / "config.json").exists()  # named before anything was written


def test_a_correction_trains_through_the_stage_and_reports_what_it_masked(tmp_path):
    """`smd train algo=icepop`: each step's metrics say what it masked; the summary holds their means."""
    import json

    from smd_cli.stages import train

    overrides = ["algo=icepop", "steps=2", "grpo.prompts_per_step=2", "grpo.num_generations=4", "eval.num_prompts=4",
                 "task.prompt_tokens=48", "model.warmstart.steps=5", "progress=false", "device=cpu",
                 f"+run_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        summary = train.run(compose("train", overrides=overrides))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    fractions = [r["rollout_corr/masked_token_frac"] for r in rows]
    assert len(rows) == 2 and all(0 <= f <= 1 for f in fractions) and all("rollout_corr/masked_seq_frac" in r for r in rows)
    assert summary["train/rollout_corr/masked_token_frac_mean"] == pytest.approx(sum(fractions) / 2)
    assert summary["status"] == "completed"
