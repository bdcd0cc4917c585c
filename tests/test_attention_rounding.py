"""bench/attention_rounding.py: the learner's masked float64 attention over the whole sequence is the sampler's
compact one up to float64 rounding (its expected float32 flips per element, |a64 - b64| / ulp32, are positive and far
below 1e-6), while a wrong mask (one key too many) moves the output by many float32 ulps."""

import importlib.util
from pathlib import Path

import torch

spec = importlib.util.spec_from_file_location("attention_rounding", Path(__file__).resolve().parents[1] / "bench" / "attention_rounding.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_masked_and_compact_attention_differ_only_in_float64_rounding():
    generator = torch.Generator().manual_seed(0)
    expected, flips, elements = 0.0, 0, 0
    for _ in range(5):
        e, f, n = bench.one_trial(prompt=48, response=6, kept=0.5, generator=generator)
        expected, flips, elements = expected + e, flips + f, elements + n
    assert elements == 5 * 9 * 6 * 64
    assert 0 < expected / elements < 1e-6
    assert flips <= 1


def test_a_wrong_mask_is_not_rounding():
    generator = torch.Generator().manual_seed(0)
    e, _, n = bench.one_trial(prompt=48, response=6, kept=0.5, generator=generator, leak=True)
    assert e / n > 1e3
