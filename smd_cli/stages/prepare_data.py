"""`smd prepare-data`: materialise a task's prompts and references, one jsonl per split.

Each row is what training and evaluation feed the model: the prompt text after fitting it to
`task.max_prompt_tokens` (the document cut, never the question), its token count with the chat template
and special tokens of the configured model's tokenizer, whether it was cut, the reference, and the task's
own fields (`meta`; the document itself is left out, it is inside the prompt). Writes `{split}.jsonl` and
`summary.json` (counts, min / mean / median / p95 / max prompt tokens, number truncated) to `out_dir`
or the run directory. Only the tokenizer is loaded, never the model weights.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from smd_cli.config.factories import build_task
from smd_cli.config.prompts import load_examples
from smd_cli.config.rules import check_config
from smd_cli.config.validation import ConfigError, check
from smd_cli.runs.console import console
from smd_cli.runs.model_loading import load_tokenizer
from smd_cli.runs.run_dirs import start_run
from smd_cli.runtime.records import write_json, write_jsonl
from smd_cli.tasks.loading import PromptTooLong, length_stats, prompt_records

CHUNK = 256  # examples per progress-bar update
NOT_META = ("id", "prompt", "reference", "document")


def validate(cfg: DictConfig) -> None:
    check_config(cfg, "prepare_data")
    check(cfg.out_dir is None or not Path(cfg.out_dir).exists() or Path(cfg.out_dir).is_dir(), "out_dir", cfg.out_dir,
          "a folder (this path is an existing file)")


def check_splits(task, splits: list[str]) -> None:
    """Each split exists for the task, checked before the tokenizer or any data is loaded."""
    known = getattr(task, "splits", None)
    for split in splits:
        if known is not None and split not in known:
            raise ConfigError(f"task={task.name} split {split!r}: {task.name} has splits {list(known)}, not {split!r}")


def records_with_progress(task, examples: list[dict], tokenizer, bar: Progress, job) -> list[dict]:
    rows = []
    for start in range(0, len(examples), CHUNK):
        chunk = examples[start : start + CHUNK]
        try:
            records = prompt_records(task, chunk, tokenizer)
        except PromptTooLong as err:
            raise ConfigError(str(err)) from None
        for example, row in zip(chunk, records):
            meta = {k: v for k, v in example.items() if k not in NOT_META}
            rows.append({**row, **({"meta": meta} if meta else {})})
        bar.advance(job, len(chunk))
    return rows


def split_summary(rows: list[dict], path: Path) -> dict:
    return {"n": len(rows), "truncated": sum(r["truncated"] for r in rows),
            "prompt_tokens": length_stats([r["prompt_tokens"] for r in rows]), "file": str(path)}


def run(cfg: DictConfig) -> dict:
    validate(cfg)
    run_ = start_run(cfg)  # also checks and applies `threads`, `seed`, `device`
    task = build_task(cfg)
    splits = list(cfg.splits) if cfg.splits is not None else list(dict.fromkeys([task.train_split, task.test_split]))
    check_splits(task, splits)  # cheap checks first; then the tokenizer and the data, all before writing
    tokenizer = load_tokenizer(cfg)
    examples = {split: load_examples(task, split, cfg.limit) for split in splits}
    out_dir = Path(cfg.out_dir) if cfg.out_dir is not None else run_.dir
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"task": task.name, "tokenizer": cfg.model.tokenizer or cfg.model.name_or_path or "tiny",
               "chat_template": bool(getattr(tokenizer, "chat_template", None)),
               "max_prompt_tokens": getattr(task, "max_prompt_tokens", None), "splits": {}}
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console, disable=not cfg.progress) as bar:
        for split, split_examples in examples.items():
            job = bar.add_task(f"prepare {split}", total=len(split_examples))
            rows = records_with_progress(task, split_examples, tokenizer, bar, job)
            write_jsonl(out_dir / f"{split}.jsonl", rows)
            summary["splits"][split] = split_summary(rows, out_dir / f"{split}.jsonl")
    write_json(out_dir / "summary.json", summary)
    if out_dir.resolve() != run_.dir.resolve():
        write_json(run_.dir / "summary.json", summary)
    print_summary(summary, out_dir)
    return summary


def print_summary(summary: dict, out_dir: Path) -> None:
    budget = summary["max_prompt_tokens"]
    table = Table(title=f"smd prepare-data: {summary['task']} -> {out_dir}")
    cut = "truncated" + (f" (> {budget})" if budget else "")
    for name in ("split", "examples", "min", "mean", "median", "p95", "max", cut):
        table.add_column(name, justify="left" if name == "split" else "right")
    for split, s in summary["splits"].items():
        t = s["prompt_tokens"]
        table.add_row(split, str(s["n"]), f"{t['min']:.0f}", f"{t['mean']:.1f}", f"{t['p50']:.0f}", f"{t['p95']:.0f}",
                      f"{t['max']:.0f}", str(s["truncated"]))
    console.print(table)
    template = "with its chat template" if summary["chat_template"] else "no chat template"
    console.print(f"prompt tokens: {summary['tokenizer']} tokenizer, {template}, special tokens included")
