"""Issue 29: the per-token agreement between the sampler's distribution and the dense policy's (`smd_cli.learner.agreement`),
and `compression=adaptive` (`smd_cli.rollout.adaptive`), which holds its 5th percentile at a target."""

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import smd

from smd_cli.learner import agreement
from smd_cli.learner.forward import vocab_terms
from smd_cli.rollout import adaptive
from smd_cli.rollout.sampling import Support


def by_hand(student_logits, teacher_logits, keep=None) -> list[float]:
    """sum_v min(p(v), q(v)) of two softmaxes, written out in float64 (over `keep`'s tokens, renormalised there)."""
    out = []
    for row, (a, b) in enumerate(zip(student_logits.tolist(), teacher_logits.tolist())):
        tokens = range(len(a)) if keep is None else keep[row]
        za, zb = sum(math.exp(a[v]) for v in tokens), sum(math.exp(b[v]) for v in tokens)
        out.append(sum(min(math.exp(a[v]) / za, math.exp(b[v]) / zb) for v in tokens))
    return out


def test_agreement_is_sum_of_min_on_a_small_vocabulary_chunked():
    """Five tokens, an identity head (hidden = logits): `vocab_terms`' agreement, two tokens a chunk, is the sum of the
    smaller probability, 1 - TV, 1 for identical rows; with a recorded support both sides are renormalised on it."""
    head = torch.nn.Linear(5, 5, bias=False)
    head.weight.data = torch.eye(5)
    student = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5], [0.0, 0.0, 0.0, 0.0, 0.0], [3.0, -2.0, 1.0, 0.0, 0.0]])
    teacher = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5], [4.0, 0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 2.0, -3.0]])
    tokens, mask = torch.tensor([[0, 1, 2]]), torch.ones(1, 3, dtype=torch.bool)
    out = vocab_terms(head, student[None], tokens, mask, 1.0, teacher[None], chunk=2)["agreement"][0]
    expected = by_hand(student, teacher)
    assert expected[0] == pytest.approx(1.0) and expected[1] < 0.5  # the same distribution; a far one
    assert out.tolist() == pytest.approx(expected, abs=1e-6)
    p, q = torch.softmax(student.double(), -1), torch.softmax(teacher.double(), -1)
    assert out.double().tolist() == pytest.approx((1 - 0.5 * (p - q).abs().sum(-1)).tolist(), abs=1e-6)  # = 1 - TV
    # the sampler kept {0, 2} for the first token, {0, 1, 4} for the second, {0, 1, 2, 3, 4} for the third (top-k / top-p)
    keep = [[0, 2], [0, 1, 4], [0, 1, 2, 3, 4]]
    support = Support(torch.tensor([v for k in keep for v in k], dtype=torch.int32), torch.tensor([[0, 2, 5]]),
                      torch.tensor([[2, 3, 5]], dtype=torch.int32), 5)
    truncated = vocab_terms(head, student[None], tokens, mask, 1.0, teacher[None], chunk=2, support=support)["agreement"][0]
    assert truncated.tolist() == pytest.approx(by_hand(student, teacher, keep), abs=1e-6)


def test_percentiles_are_numpys():
    values = torch.rand(1001, generator=torch.Generator().manual_seed(0))
    found = agreement.summary(values)
    assert found["agreement/p5"] == pytest.approx(float(np.percentile(values.numpy(), 5)), abs=1e-6)
    assert found["agreement/p50"] == pytest.approx(float(np.percentile(values.numpy(), 50)), abs=1e-6)
    assert found["agreement/mean"] == pytest.approx(float(values.double().mean()))
    assert found["agreement/min"] == pytest.approx(float(values.min()))
    assert agreement.summary(torch.zeros(0)) == {}


def controller(**settings) -> adaptive.Controller:
    return adaptive.Controller(**{"target": 0.86, "min_compression": 0.1, "max_compression": 0.9, "step": 0.05, "gain": 1.0, **settings})


def synthetic_p5(c: float) -> float:
    """A tail that worsens as more KV is evicted: p5 = 1 - 0.3 c, at the target 0.86 when c = 0.4667."""
    return 1.0 - 0.3 * c


def test_controller_moves_toward_the_target_and_stays_within_its_bounds():
    up = controller()  # starts at min_compression 0.1: p5 0.97 > 0.86, so it evicts more, by the step cap of 0.05
    path = [up.compression] + [up.update(synthetic_p5(up.compression)) for _ in range(30)]
    assert path[:3] == pytest.approx([0.1, 0.15, 0.2])
    assert all(b >= a for a, b in zip(path, path[1:]))  # from below, it only rises (it never overshoots: gain 1 < 1 / 0.3)
    assert path[-1] == pytest.approx(0.14 / 0.3, abs=1e-3) and synthetic_p5(path[-1]) == pytest.approx(0.86, abs=1e-3)
    down = controller(compression=0.9)  # p5 0.73 < 0.86: it keeps more KV
    path = [down.compression] + [down.update(synthetic_p5(down.compression)) for _ in range(30)]
    assert path[:3] == pytest.approx([0.9, 0.85, 0.8]) and all(b <= a for a, b in zip(path, path[1:]))
    assert path[-1] == pytest.approx(0.14 / 0.3, abs=1e-3)
    hopeless = controller(compression=0.5)  # the tail never reaches the target: it stops at the most KV it may keep
    assert [hopeless.update(0.5) for _ in range(12)][-1] == 0.1
    easy = controller()
    assert [easy.update(1.0) for _ in range(40)][-1] == 0.9  # always above: it stops at the most it may evict
    assert easy.update(float("nan")) == 0.9 and easy.update(None) == 0.9  # no token: stays


def test_controller_resumes_exactly_from_its_saved_state():
    straight = controller()
    uninterrupted = [straight.update(synthetic_p5(straight.compression) + 0.01 * math.sin(k)) for k in range(12)]
    first = controller()
    head = [first.update(synthetic_p5(first.compression) + 0.01 * math.sin(k)) for k in range(5)]
    saved = json.loads(json.dumps(first.state_dict()))  # through a file, as a checkpoint keeps it
    second = controller()
    second.load_state_dict(saved)
    tail = [second.update(synthetic_p5(second.compression) + 0.01 * math.sin(k)) for k in range(5, 12)]
    assert head + tail == uninterrupted


TINY = ["grpo.prompts_per_step=2", "grpo.num_generations=4", "eval.num_prompts=4", "eval.greedy=false", "task.prompt_tokens=48",
        "model.warmstart.steps=5", "progress=false", "compression=adaptive", "adaptive.start=0.5"]


def rows_of(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_smd_train_compression_adaptive_logs_agreement_and_its_compression_and_resumes_exactly(tmp_path, capsys):
    """`smd train compression=adaptive steps=3`: every step logs its agreement percentiles and the compression its rollout
    ran at, each the last one moved by the controller's rule from the last step's p5; a run stopped at step 2 and
    resumed gives the uninterrupted run's rows, compressions included (the controller's state is in the checkpoint)."""
    cache = f"cache_dir={tmp_path / 'cache'}"
    assert smd("train", *TINY, "steps=3", cache, f"hydra.run.dir={tmp_path / 'whole'}") == 0
    printed = capsys.readouterr().out
    rows = rows_of(tmp_path / "whole")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 0 <= r["agreement/min"] <= r["agreement/p5"] <= r["agreement/p50"] <= 1 and 0 < r["agreement/mean"] <= 1
    assert rows[0]["compression"] == 0.5  # adaptive.start
    for before, after in zip(rows, rows[1:]):  # c' = clamp(c + clamp(p5 - 0.86, -0.05, 0.05), 0.3, 0.9), by hand
        move = max(-0.05, min(0.05, before["agreement/p5"] - 0.86))
        assert after["compression"] == pytest.approx(min(0.9, max(0.3, before["compression"] + move)), abs=1e-9)
    assert "step 3: compression" in printed and "agreement p5" in printed
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["eval/evict/compression_before"] == 0.5 and 0.3 <= summary["eval/evict/compression_after"] <= 0.9

    parts = tmp_path / "parts"
    assert smd("train", *TINY, "steps=2", "checkpoint.every=1", cache, f"hydra.run.dir={parts}") == 0
    assert smd("train", *TINY, "steps=3", "checkpoint.every=1", "resume=true", cache, f"hydra.run.dir={parts}") == 0
    resumed = rows_of(parts)
    timing = ("time/", "step_time", "memory/")
    assert [{k: v for k, v in r.items() if not k.startswith(timing)} for r in resumed] == \
        [{k: v for k, v in r.items() if not k.startswith(timing)} for r in rows]


def test_a_dense_view_algorithm_gets_its_agreement_from_one_extra_pass(tmp_path):
    """naive_sparse's learner has the dense view only: its agreement comes from one no-grad pass of both views, timed."""
    run = tmp_path / "run"
    assert smd("train", *TINY[:-2], "algo=naive_sparse", "steps=1", f"cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run}") == 0
    row = rows_of(run)[0]
    assert 0 <= row["agreement/p5"] <= row["agreement/mean"] <= 1 and row["compression"] == 0.5 and row["time/agreement_s"] > 0


def test_compression_adaptive_is_refused_where_nothing_adapts(tmp_path, capsys):
    assert smd("train", *TINY, "algo=dense", "eviction=none", f"hydra.run.dir={tmp_path / 'a'}") == 2
    assert "compression=adaptive is not allowed with algo=dense" in capsys.readouterr().err
    assert smd("rollout", "compression=adaptive", f"hydra.run.dir={tmp_path / 'b'}") == 2
    assert "compression='adaptive' is not allowed: a fraction in [0, 1)" in capsys.readouterr().err
    assert smd("train", *TINY, "adaptive.min_compression=0.95", f"hydra.run.dir={tmp_path / 'c'}") == 2
    assert "adaptive.min_compression=0.95 is not allowed: at most adaptive.max_compression=0.9" in capsys.readouterr().err


SMALL = ["model.warmstart.steps=0", "task.prompt_tokens=48", "num_prompts=2", "num_generations=2", "sampling.max_new_tokens=6",
         "progress=false", "device=cpu"]


def test_smd_rollout_and_check_parity_report_the_agreement_per_policy(tmp_path, capsys):
    """Without eviction the sampler is the dense policy (agreement 1 at every token); SnapKV at c = 0.9 moves it (an
    untrained model feels the eviction): `smd rollout` and `smd check-parity` print and write p5, p50 and mean."""
    cache = f"cache_dir={tmp_path / 'cache'}"
    for name, eviction in (("none", "eviction=none"), ("snapkv", "eviction=snapkv")):
        assert smd("rollout", *SMALL, eviction, "compression=0.9", cache, f"hydra.run.dir={tmp_path / name}") == 0
    printed = capsys.readouterr().out
    assert "agreement/p5" in printed and "agreement/mean" in printed
    kept = json.loads((tmp_path / "none" / "summary.json").read_text())
    evicted = json.loads((tmp_path / "snapkv" / "summary.json").read_text())
    assert kept["agreement/min"] == pytest.approx(1.0, abs=1e-5)
    assert evicted["agreement/p5"] <= evicted["agreement/p50"] <= 1 and evicted["agreement/mean"] < 1 - 1e-4
    assert smd("check-parity", *SMALL, "policies=[none,snapkv]", "compression=0.9", "parity.physical=false", "parity.float64=false",
               cache, f"hydra.run.dir={tmp_path / 'parity'}") == 0
    assert "the sampler's per-token agreement with the dense policy" in " ".join(capsys.readouterr().out.split())
    report = json.loads((tmp_path / "parity" / "parity.json").read_text())["policies"]
    assert report["none"]["agreement"]["min"] == pytest.approx(1.0, abs=1e-5)
    assert report["snapkv"]["agreement"] == pytest.approx({k: evicted[f"agreement/{k}"] for k in ("p5", "p50", "mean", "min")}, abs=1e-5)


def test_smd_plan_budgets_an_adaptive_run_for_its_most_kv(tmp_path):
    """`smd plan compression=adaptive` plans the KV cache of adaptive.min_compression (the least evicted), not of
    where the controller may go: the same plan as compression=min_compression, a larger cache than max_compression's."""
    plans = {}
    for name, overrides in (("adaptive", ["compression=adaptive", "adaptive.min_compression=0.2"]), ("low", ["compression=0.2"]),
                            ("high", ["compression=0.9"])):
        assert smd("plan", *overrides, f"hydra.run.dir={tmp_path / name}") == 0
        plans[name] = json.loads((tmp_path / name / "plan.json").read_text())
    assert plans["adaptive"]["run"]["kept"] == plans["low"]["run"]["kept"] > plans["high"]["run"]["kept"]
    assert plans["adaptive"]["rollout"]["kv cache"] == plans["low"]["rollout"]["kv cache"] > plans["high"]["rollout"]["kv cache"]


def test_the_reports_training_curves_plot_the_agreements_tail(tmp_path, monkeypatch):
    """The reproduction report's training curves get a fourth panel: per algorithm, the mean over seeds of agreement/p5."""
    from smd_cli.report import figures
    from smd_cli.report.data import Run, Sweep

    def steps(seed):
        return [{"step": k, "reward": 0.5, "mismatch/mean_abs_diff": 1e-6, "mismatch/dense_mean_abs_diff": 0.1,
                 "agreement/p5": 0.9 - 0.01 * k - 0.02 * seed} for k in (1, 2, 3)]

    runs = [Run({"algo": "naive_sparse", "seed": str(s)}, "ok", None, tmp_path, {}, steps(s)) for s in (0, 1)]
    drawn, finish = {}, figures._finish
    monkeypatch.setattr(figures, "_finish", lambda plt, fig, axes, title, path: (drawn.update(
        p5=[list(line.get_ydata()) for line in axes[3].lines], title=axes[3].get_title()), finish(plt, fig, axes, title, path))[1])
    path = figures.training_curves(Sweep("main", tmp_path, ["algo", "seed"], runs), None, tmp_path)
    assert path.is_file() and "agreement" in drawn["title"]
    assert drawn["p5"] == [pytest.approx([0.88, 0.87, 0.86])]  # the mean over the two seeds, step by step


def test_bench_agreement_small_runs_quick_on_the_tiny_model(tmp_path, capsys):
    """bench/agreement_small.py --quick: the dense row agrees at 1, every evicting cell has percentiles in order, and the
    markdown table and JSON are written (the SmolLM2 sweep itself is issue 29 item 2's, run by hand)."""
    spec = importlib.util.spec_from_file_location("agreement_small", Path(__file__).resolve().parents[1] / "bench" / "agreement_small.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--quick", "--json", str(tmp_path / "out.json"), f"cache_dir={tmp_path / 'cache'}"])
    assert [(r["policy"], r["compression"]) for r in rows] == [("none", 0.0), ("snapkv", 0.5), ("snapkv", 0.9), ("random", 0.5),
                                                              ("random", 0.9)]
    assert rows[0]["agreement/p5"] == 1.0 and all(0 <= r["agreement/p5"] <= r["agreement/p50"] <= 1 for r in rows)
    assert rows[2]["kv_kept"] < rows[1]["kv_kept"] < 1.0
    assert "| snapkv | 0.9 |" in capsys.readouterr().out and json.loads((tmp_path / "out.json").read_text())["rows"] == rows


def test_smds_free_agreement_is_the_extra_passes(tiny_model, tiny_tokenizer):
    """SMD's learner step (its shadow view against its dense teacher, at the rollout's weights: lr 0 here) logs the same
    percentiles as the standalone pass the dense-view algorithms take, whole or three rows at a time."""
    from smd_cli.eviction.snapkv import SnapKV
    from smd_cli.learner.step import Algorithm, learner_step
    from smd_cli.rollout.sampler import generate
    from smd_cli.tasks.synthetic import NeedleRetrieval

    task = NeedleRetrieval(prompt_tokens=48)
    prompts = [task.encode_prompt(task.example("test", i), tiny_tokenizer) for i in range(2) for _ in range(4)]
    batch = generate(tiny_model, prompts, policy=SnapKV(compression=0.8), max_new_tokens=6, generator=torch.Generator().manual_seed(0),
                     eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id, measure_dense_kv=False)
    optimizer = torch.optim.SGD(tiny_model.parameters(), lr=0.0)
    free = learner_step(tiny_model, optimizer, batch, torch.zeros(8), Algorithm("smd"))
    for rows in (None, 3):
        values = agreement.measure(tiny_model, batch, 1.0, micro_batch_size=rows)
        assert values.numel() == int(batch.response_mask.sum())
        extra = agreement.summary(values)
        assert {k: free[k] for k in extra} == pytest.approx(extra, abs=1e-5)
    assert free["agreement/mean"] < 1 - 1e-4  # the eviction is felt


def test_bench_adaptive_frontier_reads_a_sweep_and_finds_what_dominates(tmp_path):
    """bench/adaptive_frontier.py on a sweep's runs written by hand: cell means and standard errors over seeds, the
    adaptive cell dominated by a fixed one that keeps less KV and ends higher, the paired difference, the plot."""
    spec = importlib.util.spec_from_file_location("adaptive_frontier", Path(__file__).resolve().parents[1] / "bench" / "adaptive_frontier.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cells = {("adaptive", 0): (0.70, 0.80), ("adaptive", 1): (0.72, 0.60), ("0.3", 0): (0.714, 0.90), ("0.3", 1): (0.714, 0.70),
             ("0.5", 0): (0.525, 0.50), ("0.5", 1): (0.525, 0.40)}
    for (c, seed), (kept, reward) in cells.items():
        run = tmp_path / f"smd_c{c}_seed{seed}"
        run.mkdir()
        (run / "config.json").write_text(json.dumps({"algo": {"name": "smd"}, "compression": c if c == "adaptive" else float(c), "seed": seed}))
        (run / "summary.json").write_text(json.dumps({"status": "completed", "train/kv/kept_fraction_mean": kept, "train/compression_mean": 0.3,
                                                      "train/agreement/p5_mean": 0.5, "train/agreement/mean_mean": 0.9, "eval/evict/reward_after": reward,
                                                      "eval/reward_after": 1.0, "eval/evict/reward_before": 0.5}))
    rows = bench.load(tmp_path)
    table = {c["compression"]: c for c in bench.cells(rows)}
    assert table["adaptive"]["kv kept"] == pytest.approx(0.71) and table["adaptive"]["held-out, own cache"] == pytest.approx(0.70)
    assert table["adaptive"]["held-out, own cache se"] == pytest.approx(0.1)  # sd 0.1414 / sqrt(2)
    assert table["adaptive"]["dominated by"] == "-" and table["0.3"]["dominated by"] == "-"
    assert table["0.5"]["dominated by"] == "-"  # keeps the least KV: nothing fixed keeps less
    assert bench.paired(rows, "smd", "adaptive", "0.3", "held-out, own cache") == pytest.approx((-0.10, 0.0, 2))
    (tmp_path / "smd_c0.3_seed0" / "summary.json").write_text(json.dumps({"status": "completed", "train/kv/kept_fraction_mean": 0.60,
        "train/compression_mean": 0.3, "train/agreement/p5_mean": 0.5, "train/agreement/mean_mean": 0.9, "eval/evict/reward_after": 0.90, "eval/reward_after": 1.0,
        "eval/evict/reward_before": 0.5}))
    table = {c["compression"]: c for c in bench.cells(bench.load(tmp_path))}
    assert table["0.3"]["kv kept"] == pytest.approx(0.657) and table["adaptive"]["dominated by"] == "0.3"
    bench.plot(list(table.values()), tmp_path / "frontier.png")
    assert (tmp_path / "frontier.png").stat().st_size > 10_000
