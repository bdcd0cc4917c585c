"""The paper's claims across tasks (`smd_cli.report.across`): the table read from each task's claims.csv, the claims whose
verdict changes between tasks, and the dense-cache verdicts a ceiling leaves undecided; and `smd reproduce tasks=[...]`
composing each task's runs with its own overrides in its own folder."""

import csv
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from smd_cli.cli import CONF_DIR, main, register_recipes
from smd_cli.report.across import write_across
from smd_cli.report.claims import CEILING
from smd_cli.runs.sweep import distinct, plan
from smd_cli.stages.reproduce import sweep_overrides, task_cost, tasks, validate

FIELDS = ["claim", "paper", "scope", "view", "verdict", "prompts", "seeds", "d", "se", "critical", "pending", "detectable",
          "paper_difference", "seeds_needed", "evidence", "rule"]


def claims_csv(folder: Path, rows: list[tuple]) -> Path:
    """A task's report folder with a claims.csv of (claim, view, verdict, seeds, d, se, prompts) rows."""
    folder.mkdir(parents=True)
    with (folder / "claims.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, FIELDS, restval="")
        w.writeheader()
        for claim, view, verdict, seeds, d, se, prompts in rows:
            w.writerow({"claim": claim, "view": view, "verdict": verdict, "seeds": seeds, "d": d, "se": se, "prompts": prompts})
    return folder


def test_across_tasks_names_the_claims_whose_verdict_changes(tmp_path):
    a = claims_csv(tmp_path / "passkey", [
        ("SMD beats naive", "dense cache", "holds", 3, 0.429, 0.028, "fixed"),
        ("SMD beats naive", "under eviction", "holds", 5, 0.247, 0.0256, "fixed"),
        ("SMD matches dense", "dense cache", CEILING, 3, 0, 0, "fixed"),
        ("Sparse-RL vetoes > 20 %", "", "does not hold", "", "", "", ""),
        ("lambda 0.1 beats 0", "under eviction", "inconclusive", 8, 0.041, 0.017, "fixed")])
    b = claims_csv(tmp_path / "niah", [
        ("SMD beats naive", "dense cache", "holds", 3, 0.2, 0.05, "per seed"),
        ("SMD beats naive", "under eviction", "does not hold", 3, -0.31, 0.02, "per seed"),
        ("SMD matches dense", "dense cache", "holds", 5, 0.01, 0.01, "per seed"),
        ("Sparse-RL vetoes > 20 %", "", "does not hold", "", "", "", "")])
    path = write_across(tmp_path / "out", {"passkey": a, "niah": b}, {"passkey": "make A", "niah": "make B"})
    rows = list(csv.reader((tmp_path / "out" / "across_tasks.csv").open()))
    assert rows[0] == ["claim", "view", "passkey", "niah"]
    assert rows[1:] == [
        ["SMD beats naive", "dense cache", "holds, +0.429 ± 0.028 (3 seeds)", "holds, +0.200 ± 0.050 (3 seeds)"],
        ["SMD beats naive", "under eviction", "holds, +0.247 ± 0.026 (5 seeds)", "does not hold, -0.310 ± 0.020 (3 seeds)"],
        ["SMD matches dense", "dense cache", CEILING, "holds, +0.010 ± 0.010 (5 seeds)"],
        ["Sparse-RL vetoes > 20 %", "-", "does not hold", "does not hold"],
        ["lambda 0.1 beats 0", "under eviction", "inconclusive, +0.041 ± 0.017 (8 seeds)", "not run"]]
    text = " ".join(path.read_text().split())
    assert "- SMD beats naive (under eviction): both ways: holds on passkey; does not hold on niah" in text
    assert f"- SMD matches dense (dense cache): decided on some: passkey: {CEILING}; niah: holds" in text
    assert "SMD beats naive (dense cache):" not in text and "Sparse-RL vetoes > 20 %:" not in text  # the same on both
    assert "- passkey: 1 of 2 dense-cache verdicts informative" in text and "- niah: 2 of 2 dense-cache verdicts informative" in text
    assert "Verdicts of passkey rest (in part) on runs that evaluated the same fixed held-out prompts" in text
    assert "re-run with `make B`" in text


@pytest.mark.parametrize("family, new_tokens", [("niah_multikey", 16), ("niah_multivalue", 64)])
@pytest.mark.parametrize("native_bf16", [True, False])
def test_each_task_runs_its_tables_with_its_overrides_in_its_own_folder(tmp_path, monkeypatch, family, new_tokens, native_bf16):
    """`smd reproduce small=true tasks=[passkey,FAMILY]`: passkey as the scale has it, in ROOT (its finished runs count);
    the family's main table (five algorithms) and compression ablation (0.5, 0.7) on RULER at 1024 tokens in
    ROOT/tasks/FAMILY, composed as `smd ablate` composes them; its cost model the seconds of the dtype it computes in
    on this machine (model.cpu_dtype=auto: bf16 where the CPU has it)."""
    monkeypatch.setattr("smd_cli.model.precision.native_bf16", lambda: native_bf16)
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("reproduce", overrides=["small=true", f"tasks=[passkey,{family}]", f"root={tmp_path}", f"out={tmp_path / 'o'}"])
        scale = validate(cfg)
        passkey, niah = tasks(cfg, scale, tmp_path, tmp_path / "o")
        assert (passkey.root, passkey.out, passkey.own, list(passkey.tables)) == (tmp_path, tmp_path / "o", True,
                                                                                  ["main", "compression", "lambda", "selection"])
        assert (niah.root, niah.out, niah.own) == (tmp_path / "tasks" / family, tmp_path / "o" / "tasks" / family, False)
        assert list(niah.tables) == ["main", "compression"] and niah.cost["benchmarks_s"] == 0
        own = cfg.task_sets[family].cost[("bfloat16" if native_bf16 else "float32")]
        assert niah.cost == {**cfg.cost.small, "run_s": 15, "step_s": own.step_s, "eval_prompt_s": own.eval_prompt_s, "benchmarks_s": 0}
        assert passkey.cost == dict(cfg.cost.small)
        by_dtype = cfg.task_sets[family].cost
        for asked, dtype in (("model.cpu_dtype=bfloat16", "bfloat16"), ("model.cpu_dtype=null", "float32"),
                             ("model.cpu_dtype=float32", "float32")):  # a set dtype is the dtype, whatever the CPU has
            assert task_cost(by_dtype, (*cfg.task_sets[family].overrides, asked))["step_s"] == by_dtype[dtype].step_s
        if not native_bf16:
            return  # the runs' identities are the machine's (test_ablate); composed once
        runs = {}
        for role, recipe in niah.tables.items():
            overrides = sweep_overrides(cfg, scale, recipe, niah)
            ablate = compose("ablate", overrides=overrides)
            assert ablate.ablate.runs_dir == str(tmp_path / "tasks" / family / "members")
            for m in distinct(plan(ablate, [o for o in overrides if not o.startswith("ablate.")])[1]):
                runs[m.identity] = dict(m.combo)
                member = compose("train", overrides=m.overrides)
                assert (member.task.family, member.task.prompt_tokens, member.task.max_new_tokens) == (family, 1024, new_tokens)
                assert member.model.name == "smollm2_135m" and member.steps == 20
    algos = {(v["algo"], v.get("compression", "0.5")) for v in runs.values()}
    assert algos == {(a, "0.5") for a in ("dense", "naive_sparse", "sparse_rl", "tis", "smd")} | {
        (a, "0.7") for a in ("naive_sparse", "sparse_rl", "smd")}
    assert len(runs) == 8 * 3  # three seeds each; the compression table's 0.5 runs are the main table's


def test_a_task_selection_it_cannot_run_is_a_config_error(capsys):
    for overrides, why in ((["tasks=[passkey]"], "tasks=['passkey'] is not allowed: null unless small=true"),
                           (["small=true", "tasks=[passkey,ruler]"], "null or distinct names of task_sets: passkey, niah_multikey, niah_multivalue"),
                           (["small=true", "tasks=[passkey,passkey]"], "null or distinct names of task_sets"),
                           (["small=true", "tasks=[niah_multikey]", "only=[lambda]"], "tables that task niah_multikey runs (main, compression)"),
                           (["small=true", "tasks=[passkey,copy]", "+task_sets.copy={overrides:[],only:null,quick:[],cost:{}}"],
                            "at most one task without overrides (the scale's own; here passkey, copy)")):
        with pytest.raises(SystemExit) as done:
            main(["reproduce", *overrides, "dry_run=true"])
        assert done.value.code == 2 and why in " ".join(capsys.readouterr().err.split()), overrides
