"""KV-cache quantisation (`kv.quant`, issue 28): 8-bit codes with a float32 scale per (token, KV head), checked against
hand computations; the rollout's cache really holds 8-bit tensors; the learner's shadow replay reads keys and values
as that cache held them, rounding as the sampler did (its record of rounding directions), so SMD's learner is the
sampler's policy again (check-parity and smd train, through the CLI); `kv.quant=none` is the unquantised rollout."""

from __future__ import annotations

import json

import pytest
import torch

from smd_cli.attention import kv_quant
from smd_cli.attention.kv_cache import EvictingLayer, kv_bytes
from smd_cli.eviction.snapkv import SnapKV
from smd_cli.rollout.sampler import generate
from tests.conftest import smd

PARITY = ["model.warmstart.steps=0", "task.prompt_tokens=48", "num_prompts=2", "num_generations=2", "sampling.max_new_tokens=6",
          "progress=false", "device=cpu"]


def test_int8_codes_and_scales_are_the_hand_computed_ones():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.3], [0.0, 0.0, 0.0, 0.0]])
    codes, scales = kv_quant.quantise(x, "int8")
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    # scale = absmax / 127 = 2 / 127; x / scale = 63.5 (ties to even: 64), -127, 31.75 -> 32, 19.05 -> 19; a zero row: 0
    assert scales.tolist() == [pytest.approx(2 / 127, rel=1e-7), 0.0]
    assert codes.tolist() == [[64, -127, 32, 19], [0, 0, 0, 0]]
    back = kv_quant.dequantise(codes, scales, torch.float32)
    assert torch.allclose(back[0], torch.tensor([64, -127, 32, 19]) * (2 / 127), rtol=1e-6) and back[1].eq(0).all()


def test_fp8_codes_and_scales_are_the_hand_computed_ones():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.3]])
    codes, scales = kv_quant.quantise(x, "fp8_e4m3")
    assert codes.dtype == torch.float8_e4m3fn
    # scale = 2 / 448; x / scale = 224, -448, 112 (all representable), 67.2 -> 64 (spacing 8 in [64, 128))
    assert scales.item() == pytest.approx(2 / 448, rel=1e-7)
    assert codes.float().tolist() == [[224.0, -448.0, 112.0, 64.0]]
    back = kv_quant.dequantise(codes, scales, torch.float32)
    assert torch.allclose(back, torch.tensor([[1.0, -2.0, 0.5, 64 * 2 / 448]]), rtol=1e-6)


@pytest.mark.parametrize("kind,tie", [("int8", 0.5), ("fp8_e4m3", 68.0)])  # fp8: 68 halfway between 64 and 72
def test_the_recorded_rounding_direction_wins_over_float_noise_at_a_tie(kind, tie):
    """The sampler saw x / scale a hair below a tie and rounded down; the learner's value is a hair above it: rounding
    its own would flip the code, the record gives the sampler's."""
    top = kv_quant.QMAX[kind]
    sampler = torch.tensor([[top, tie - 1e-5]])  # the first element fixes scale = 1
    learner = torch.tensor([[top, tie + 1e-5]])
    codes, _, up = kv_quant.quantise_recorded(sampler, kind)
    own, _ = kv_quant.quantise(learner, kind)
    replayed, _ = kv_quant.quantise(learner, kind, up)
    assert up.tolist() == [[False, False]]
    assert own.float()[0, 1] > codes.float()[0, 1]  # a flip
    assert replayed.float().tolist() == codes.float().tolist()
    assert kv_quant.unpack(kv_quant.pack(torch.tensor([[True, False, True] * 6])), 18).tolist() == [[True, False, True] * 6]


def test_fake_quant_passes_the_gradient_straight_through():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.3]], requires_grad=True)
    out = kv_quant.fake_quant(x, "int8")
    (out * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
    assert out.detach().tolist() == kv_quant.dequantise(*kv_quant.quantise(x.detach(), "int8"), torch.float32).tolist()
    assert x.grad.tolist() == [[1.0, 2.0, 3.0, 4.0]]


def test_the_cache_holds_8_bit_codes_and_float32_scales_measured_in_bytes():
    keys = torch.randn(2, 3, 10, 16)  # [B, Hkv, P, D]
    index = torch.arange(6).expand(2, 3, 6)  # 6 kept entries per (row, KV head)
    ok = torch.ones(2, 3, 6, dtype=torch.bool)
    sizes = {}
    for kind in ("none", "int8", "fp8_e4m3"):
        layer = EvictingLayer(8, kind)
        layer.fill(keys, keys.clone(), index, ok, torch.zeros(2, 3, 6))
        sizes[kind] = kv_bytes(type("C", (), {"layers": [layer]})())
        if kind != "none":
            assert layer.keys.dtype == kv_quant.DTYPES[kind] and layer.key_scales.dtype == torch.float32
            read, _ = layer.read()
            assert read.dtype == torch.float32
            assert torch.equal(read[:, :, :6], kv_quant.fake_quant(keys[:, :, :6], kind))
    slots = 2 * 3 * 8
    assert sizes == {"none": 2 * slots * 16 * 4, "int8": 2 * slots * (16 + 4), "fp8_e4m3": 2 * slots * (16 + 4)}


def test_kv_quant_none_is_the_unquantised_rollout(tiny_model, tiny_tokenizer):
    """`none` (the default) takes the cache's float path: the same batch as a call that does not name it, nothing
    recorded. (Bit for bit against the code before kv.quant existed: checked when it went in, README.)"""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, [7, 8, 9] * 7]
    runs = [generate(tiny_model, prompts, policy=SnapKV(compression=0.5, sink=1, window=2), max_new_tokens=5,
                     generator=torch.Generator().manual_seed(0), eos_token_id=tiny_tokenizer.eos_token_id,
                     pad_token_id=tiny_tokenizer.pad_token_id, measure_dense_kv=False, **extra) for extra in ({}, {"kv_quant": "none"})]
    assert torch.equal(runs[0].logprobs, runs[1].logprobs) and torch.equal(runs[0].evict_at, runs[1].evict_at)
    assert runs[1].kv_quant == "none" and runs[1].kv_rounding is None and runs[1].cache_reads() is None
    assert runs[0].stats["kv/bytes_peak"] == runs[1].stats["kv/bytes_peak"]


def test_check_parity_with_an_int8_cache_passes_and_reports_the_mismatch_parts(tmp_path, capsys):
    code = smd("check-parity", *PARITY, "kv.quant=int8", "policies=[snapkv,h2o,none]", f"cache_dir={tmp_path / 'cache'}",
               f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 0, capsys.readouterr().out
    report = json.loads((tmp_path / "run" / "parity.json").read_text())
    assert report["passed"] is True and report["kv_quant"] == "int8"
    for name, found in report["policies"].items():
        views = found["views"]
        assert views["shadow"]["max_abs_diff"] <= 1e-5 and views["physical"]["max_abs_diff"] <= 1e-5, name
        assert views["shadow_float64"]["max_abs_diff"] <= 1e-5, name
        assert views["quant_only"]["max_abs_diff"] > 1e-5, name  # a learner on full-precision K/V feels the quantisation
        assert views["own_rounding"]["flips"] >= 0, name
        if name != "none":
            assert views["evict_only"]["max_abs_diff"] > 1e-3, name  # and one that sees every key, the eviction
        else:
            assert views["evict_only"]["max_abs_diff"] <= 1e-5, name  # nothing evicted: the quantised view is the sampler's
    assert "quant_only" in capsys.readouterr().out


TRAIN = ["model.warmstart.steps=0", "task.prompt_tokens=40", "task.max_new_tokens=4", "grpo.prompts_per_step=2", "grpo.num_generations=2",
         "eval.num_prompts=2", "eval.batch_size=2", "eval.greedy=false", "checkpoint.every=0", "progress=false", "device=cpu"]


def test_a_dense_learner_of_an_int8_rollout_is_reported_not_judged(tmp_path, capsys):
    """algo=dense samples through the 8-bit cache (KeepAll's) and learns on full-precision keys: its mismatch is the
    quantisation's, like naive_sparse's is the eviction's (it was judged as a dense learner's, and broke the run)."""
    run = tmp_path / "run"
    code = smd("train", "algo=dense", "eviction=none", "kv.quant=int8", "steps=1", *TRAIN, f"cache_dir={tmp_path / 'cache'}",
               f"hydra.run.dir={run}")
    assert code == 0, capsys.readouterr().out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["parity/judged"] == 0.0
    assert summary["train/mismatch/max_abs_diff_max"] > 1e-5  # the quantisation, felt by a full-precision learner


def test_smd_train_with_an_int8_cache_keeps_parity_within_the_contract(tmp_path, capsys):
    run = tmp_path / "run"
    code = smd("train", "kv.quant=int8", "steps=2", "sampling.batch_size=2", *TRAIN, f"cache_dir={tmp_path / 'cache'}",
               f"hydra.run.dir={run}")  # two rollout chunks a step: their rounding records concatenated with the rows
    out = capsys.readouterr().out
    assert code == 0, out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["parity/judged"] == 1.0
    assert summary["train/mismatch/max_abs_diff_max"] <= 1e-5
    assert "parity: max |log p_learner - log p_sampler|" in out


def test_the_planner_counts_8_bit_codes_their_scales_and_the_rounding_record_by_hand():
    from dataclasses import replace

    from smd_cli.checks.planner import Arch, Run, plan

    qwen3_4b = Arch(layers=36, hidden=2560, intermediate=9728, heads=32, kv_heads=8, head_dim=128, vocab=151936)
    run = Run(arch=qwen3_4b, compute_bytes=2, device="cuda", algo="smd", rows=64, micro_batch=4, rollout_rows=16,
              prompt=1024, response=256, kept=512, cache_growth=255)
    slots = 512 + 255
    assert plan(run).rollout["kv cache"] == 16 * 36 * 8 * 128 * 2 * 2 * slots  # bf16
    for quant in ("int8", "fp8_e4m3"):
        rollout = plan(replace(run, kv_quant=quant)).rollout
        assert rollout["kv cache"] == 16 * 36 * 8 * 2 * slots * (128 + 4)  # a byte a code, a float32 scale per (token, KV head)
        assert rollout["dequantised layer"] == 16 * 8 * 2 * slots * 128 * 2  # one layer read back in bf16 at a time
        assert rollout["kv rounding record"] == 16 * 36 * 2 * 8 * (1024 + 256) * 128 // 8  # a bit an element, every column


def test_smd_plan_prints_the_rows_each_kv_format_fits_with_and_without_eviction(tmp_path, capsys):
    assert smd("plan", "+recipe=govreport", "kv.quant=fp8_e4m3", f"hydra.run.dir={tmp_path}") == 0
    formats = json.loads((tmp_path / "plan.json").read_text())["kv_formats"]
    assert sorted(formats) == sorted(f"{q}, {e}" for q in ("none", "int8", "fp8_e4m3") for e in ("kept 1024", "no eviction"))
    for size in ("80", "141"):
        none, fp8 = formats["none, kept 1024"]["rows"][size], formats["fp8_e4m3, kept 1024"]["rows"][size]
        assert none is not None and fp8 > none  # an 8-bit cache fits more rows
        assert formats["fp8_e4m3, no eviction"]["rows"][size] < fp8  # and eviction more again
    # (128 + 4) / 256 of bf16's bytes, plus the rounding record (a bit an element of all 2560 columns): 0.62 of bf16's
    assert formats["fp8_e4m3, kept 1024"]["kv_bytes_per_row"] / formats["none, kept 1024"]["kv_bytes_per_row"] == pytest.approx(
        (132 * (1024 + 511) + 2560 * 128 / 8) / (256 * (1024 + 511)))
    assert "rows at 141 GiB" in capsys.readouterr().out


def test_smd_rollout_with_an_fp8_cache_reports_parity_and_the_mismatch_parts(tmp_path, capsys):
    code = smd("rollout", "kv.quant=fp8_e4m3", "eviction=h2o", "model.warmstart.steps=0", "task.prompt_tokens=48", "num_prompts=2",
               "num_generations=2", "sampling.max_new_tokens=6", "progress=false", "device=cpu", f"cache_dir={tmp_path / 'cache'}",
               f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 0, capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["parity/max_abs_diff_shadow"] <= 1e-5 and summary["parity/max_abs_diff_physical"] <= 1e-5
    assert summary["mismatch/quant_only_max_abs_diff"] > 1e-5 and summary["mismatch/evict_only_max_abs_diff"] > 1e-3
    # codes and scales: (16 + 4) bytes a (token, KV head) where float32 keys took 64
    assert summary["kv/bytes_peak"] < 0.35 * summary["kv/bytes_peak_dense"]
    assert "mismatch/quant_only_max_abs_diff" in capsys.readouterr().out


def test_smd_eval_with_an_int8_cache_holds_the_codes_bytes(tmp_path):
    """eviction=none with kv.quant=int8: the evicting cache keeps every entry in 8 bits; (16 + 4) / 64 of the float32
    cache's bytes on the tiny model (head dim 16, a float32 scale per (token, KV head)), and no dense-cache figure."""
    summaries = {}
    for quant in ("none", "int8"):
        run = tmp_path / quant
        assert smd("eval", f"kv.quant={quant}", "eval.limit=4", "model.warmstart.steps=0", "progress=false", "device=cpu",
                   f"cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run}") == 0
        summaries[quant] = json.loads((run / "summary.json").read_text())
    assert summaries["int8"]["kv_quant"] == "int8" and "kv/bytes_peak_dense" not in summaries["int8"]
    assert summaries["int8"]["kv/bytes_peak"] == summaries["none"]["kv/bytes_peak"] * (16 + 4) / 64


def test_chunks_concatenated_keep_each_rows_rounding_record_at_its_columns(tiny_model, tiny_tokenizer):
    from smd_cli.rollout.sampler import concat_rollouts

    chunks = [generate(tiny_model, prompts, policy=SnapKV(compression=0.5, sink=1, window=2), max_new_tokens=4,
                       generator=torch.Generator().manual_seed(0), eos_token_id=tiny_tokenizer.eos_token_id,
                       pad_token_id=tiny_tokenizer.pad_token_id, measure_dense_kv=False, kv_quant="int8")
              for prompts in ([[5, 6, 7] * 4, [8, 9] * 5], [[7, 8, 9, 10] * 5])]
    records = [c.kv_rounding.clone() for c in chunks]
    widths = [(c.prompt_length, c.input_ids.shape[1]) for c in chunks]
    assert records[0].device.type == "cpu" and records[0].shape[:5] == (2, 2, 2, 2, widths[0][1]) and records[0].any()
    batch = concat_rollouts(chunks, tiny_tokenizer.pad_token_id)
    P = batch.prompt_length
    for rows, record, (prompt, width) in zip((slice(0, 2), slice(2, 3)), records, widths):
        shift = P - prompt  # the prompt moves right by this many columns
        assert torch.equal(batch.kv_rounding[rows, ..., shift : shift + width, :], record)
        assert not batch.kv_rounding[rows, ..., :shift, :].any()
    assert batch.kv_quant == "int8"


def test_fp8_plus_and_minus_zero_are_the_same_code_not_a_flip():
    """Issue 40: `count_flips` compared fp8 codes byte by byte, so +0 (0x00) against -0 (0x80), both read back as 0,
    counted as a flip. Here the learner's own rounding of -1e-5 (scale 1) is -0, the recorded direction (up) gives +0:
    the same value, so no flip; a real flip (a code of another value) is still counted."""
    x = torch.zeros(1, 1, 1, 8)
    x[..., 0], x[..., 1] = 448.0, -1e-5  # scale = 448 / 448 = 1; x / scale = -1e-5, below half fp8's 2^-9 spacing
    own, _ = kv_quant.quantise(x, "fp8_e4m3")
    recorded, _ = kv_quant.quantise(x, "fp8_e4m3", torch.ones(1, 1, 1, 8, dtype=torch.bool))
    assert own.view(torch.uint8)[..., 1].item() == 0x80 and recorded.view(torch.uint8)[..., 1].item() == 0x00  # -0, +0
    up = torch.zeros(1, 1, 1, 8, dtype=torch.bool)
    up[..., 1] = True
    rounding = kv_quant.pack(torch.stack([up, up]))[None, None]  # [N=1, L=1, 2, Hkv=1, T=1, 1]
    reads = kv_quant.CacheReads("fp8_e4m3", rounding)
    visible = torch.ones(1, 1, 1, dtype=torch.bool)
    assert reads.count_flips(0, x, x, visible) == 0
    x[..., 2] = 1.0625  # halfway between fp8's 1.0 and 1.125: the nudge (up) moves it from 1.0 to 1.125, a real flip
    up[..., 2] = True
    reads = kv_quant.CacheReads("fp8_e4m3", kv_quant.pack(torch.stack([up, up]))[None, None])
    assert reads.count_flips(0, x, x, visible) == 2  # keys and values
