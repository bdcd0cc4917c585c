"""What a rerun or a report reads back is checked, and a mismatch is named, never used (issue 40): `smd_cli.runtime.records`, the
one reader of smd's records, on hand-made damage, and through its users: the report (a member's summary out of range,
a bad line in its metrics.jsonl) and a sweep (a finished member whose summary was edited is not taken as finished)."""

import csv
import json

import pytest

from smd_cli.report.data import Sweep
from smd_cli.report.write import write_report
from smd_cli.runs import sweep
from smd_cli.runtime import integrity, records
from tests.test_reproduce import fake_sweep


def test_a_summary_out_of_range_is_named_with_its_key_value_and_range(tmp_path):
    path = tmp_path / "summary.json"
    for good in ({"eval/reward_after": 1.0000000000000002, "last/loss": -0.12, "train/seconds": 3.5, "steps": 4, "steps_run": 4,
                  "last/kv/kept_fraction": 0.5, "eval/reward_stderr": 0.1, "status": "completed", "kl": None},):
        path.write_text(json.dumps(good))
        assert records.read_summary(path) == good
    for bad, said in (({"eval/reward_after": 5.0}, "eval/reward_after=5.0 is out of range: a value of eval/reward_after is in [0, 1]"),
                      ({"last/agreement/p5": -0.1}, "last/agreement/p5=-0.1 is out of range"),
                      ({"train/compression_mean": 1.5}, "train/compression_mean=1.5 is out of range"),
                      ({"train/seconds": -1.0}, "train/seconds=-1.0 is out of range: a value of train/seconds is >= 0"),
                      ({"steps": 2.5}, "steps=2.5 is out of range: a value of steps is a whole number >= 0"),
                      ({"steps": 2, "steps_run": 3}, "steps_run=3 is more than steps=2")):
        path.write_text(json.dumps(bad))
        with pytest.raises(records.Damaged, match=f"^{path}: " + said.replace("[", r"\[").replace("]", r"\]")):
            records.read_summary(path)
    path.write_text('{"eval/reward_after": NaN, "x": 1}')  # not JSON; smd writes null for it
    assert records.read_summary(path) == {"eval/reward_after": None, "x": 1}
    for text, said in (("[1, 2]", "holds a JSON list, not an object"), ('{"a": ', "not valid JSON"), ("[" * 100_000, "nested too deeply")):
        path.write_text(text)
        with pytest.raises(records.Damaged, match=said):
            records.read_object(path)


def test_a_metrics_log_is_checked_line_by_line_and_for_the_steps_a_checkpoint_needs(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "reward": 0.5} for s in (1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert records.read_metrics(path, through=3) == rows
    with pytest.raises(records.Damaged, match=r"lacks 2 of the 5 steps before the run's checkpoint \(steps 4-5\)"):
        records.read_metrics(path, through=5)
    path.write_text("".join(json.dumps(r) + "\n" for r in (rows[0], rows[2])))
    with pytest.raises(records.Damaged, match=r"lacks 1 of the 3 steps .* \(steps 2\): its statistics would be computed from 2 of them"):
        records.read_metrics(path, through=3)
    for lines, said in (([rows[0], rows[0]], ":2: step 1 after step 1"), ([rows[0], {"reward": 1}], ":2: not a step's row"),
                        ([rows[0], {"step": 2, "reward": 3.0}], ":2: reward=3.0 is out of range")):
        path.write_text("".join(json.dumps(r) + "\n" for r in lines))
        with pytest.raises(records.Damaged, match=said):
            records.read_metrics(path)
    path.write_text(json.dumps(rows[0]) + "\n" + '{"step": 2, "rew')  # a write a kill cut short
    assert records.read_metrics(path, torn_tail_ok=True) == [rows[0]]
    with pytest.raises(records.Damaged, match=f"{path}:2: not valid JSON"):
        records.read_metrics(path)


def test_a_sealed_record_changed_on_disk_is_named(tmp_path):
    path = tmp_path / "entry.json"
    path.write_text(json.dumps(records.sealed({"key": "k", "summary": {"eval/reward_before": 0.25}})))
    assert records.read_sealed(path) == {"key": "k", "summary": {"eval/reward_before": 0.25}}
    path.write_text(path.read_text().replace("0.25", "0.75"))
    with pytest.raises(records.Damaged, match="does not match its SHA-256"):
        records.read_sealed(path)


def test_the_report_names_a_members_summary_out_of_range_and_never_uses_it(tmp_path):
    """Before: a finished member's summary.json edited to eval/reward_after=5.0 was averaged into the report ("+5.000")."""
    runs = [({"algo": a, "seed": str(s)}, {"eval/evict/reward_after": 0.5, "eval/reward_after": 5.0 if (a, s) == ("smd", 1) else 0.9})
            for a in ("smd", "naive_sparse") for s in range(2)]
    with pytest.raises(records.Damaged, match=r"/runs/run1/summary.json: eval/reward_after=5.0 is out of range: a value of "
                                              r"eval/reward_after is in \[0, 1\]"):
        fake_sweep(tmp_path, "main", ["algo", "seed"], runs)


def test_the_report_names_a_bad_line_of_a_members_metrics_instead_of_a_blank_column(tmp_path):
    """Before: one bad line in a member's metrics.jsonl silently turned its runs.csv column into `-`."""
    runs = [({"algo": a, "seed": str(s)}, {"eval/evict/reward_after": 0.5 + 0.1 * s, "eval/reward_after": 0.9})
            for a in ("smd", "naive_sparse") for s in range(2)]
    main_ = fake_sweep(tmp_path, "main", ["algo", "seed"], runs, steps=[{"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.25}])
    report = write_report(tmp_path / "report", {"main": main_}, {"learner_memory": None, "step_overhead": []}, {"scale": "tiny"})
    table = list(csv.DictReader((tmp_path / "report" / "runs.csv").open()))
    assert [r["steps:reward:last10"] for r in table] == ["0.375"] * 4 and report.is_file()
    damaged = main_.runs[1].dir / "metrics.jsonl"
    damaged.write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "rew\n{"step": 3, "reward": 0.25}\n')
    main_ = Sweep.read("main", tmp_path / "main")  # read again, as a later report would
    with pytest.raises(records.Damaged, match=f"{damaged}:2: not valid JSON"):
        write_report(tmp_path / "report2", {"main": main_}, {"learner_memory": None, "step_overhead": []}, {"scale": "tiny"})


def test_the_reports_csvs_are_written_atomically(tmp_path, monkeypatch):
    written = []
    real = integrity.write_file
    monkeypatch.setattr(integrity, "write_file", lambda path, *a, **k: written.append(path.name) or real(path, *a, **k))
    runs = [({"algo": a, "seed": str(s)}, {"eval/evict/reward_after": 0.5, "eval/reward_after": 0.9}) for a in ("smd", "dense") for s in range(2)]
    write_report(tmp_path / "report", {"main": fake_sweep(tmp_path, "main", ["algo", "seed"], runs)},
                 {"learner_memory": None, "step_overhead": []}, {"scale": "tiny"})
    csvs = sorted(p.name for p in (tmp_path / "report").glob("*.csv"))
    assert len(csvs) >= 3 and set(csvs) <= set(written)  # through integrity.write_file: a temporary, then a rename


def test_a_sweep_does_not_take_a_member_whose_summary_was_edited_out_of_range_as_finished(tmp_path):
    run = tmp_path / "member"
    run.mkdir()
    (run / "member.json").write_text(json.dumps({"identity": "abc", "status": "ok"}))
    (run / "summary.json").write_text(json.dumps({"status": "completed", "eval/reward_after": 0.75}))
    assert sweep._finished(run, "abc") is not None
    (run / "summary.json").write_text(json.dumps({"status": "completed", "eval/reward_after": 5.0}))
    assert sweep._finished(run, "abc") is None  # run again, not reused
    summary, why = sweep.read_json(run / "summary.json", summary=True)
    assert summary == {} and "eval/reward_after=5.0 is out of range" in why
