"""A short supervised warm start for the tiny scale: teacher-forced cross-entropy on the answers.

GRPO needs a policy that already succeeds sometimes (a group whose rewards are all equal carries no
advantage), so the tiny model is first trained on (prompt, reference) pairs of the task's train split.
It is kept short on purpose, leaving GRPO room to improve; the stages cache its result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from rich.progress import Progress

from smd_cli.tasks.base import Task


def supervised_batch(task: Task, tokenizer, examples: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompt+answer ids [B, T], attention mask [B, T], and labels [B, T] (-100 off the answer)."""
    rows, label_rows = [], []
    for ex in examples:
        prompt = task.encode_prompt(ex, tokenizer)
        answer = tokenizer(ex["reference"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        label_rows.append([-100] * len(prompt) + answer)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])  # [B, T]
    labels = torch.tensor([[-100] * (width - len(r)) + r for r in label_rows])  # [B, T]
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
    return ids, mask, labels


def answer_loss(model, ids, mask, labels, label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy over answer tokens (optionally label-smoothed), and teacher-forced token accuracy."""
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    # Left padding puts every answer at the end: only the last `keep` positions need logits.
    keep = labels.size(1) - int((labels != -100).any(0).nonzero()[0]) + 1
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, logits_to_keep=keep).logits
    logits, target = logits[:, :-1], labels[:, -keep + 1 :]  # [B, keep-1, V], [B, keep-1]
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=-100, label_smoothing=label_smoothing)
    valid = target != -100
    acc = ((logits.argmax(-1) == target) & valid).sum() / valid.sum()
    return loss, acc


def warm_start(
    model, tokenizer, task: Task, *, steps: int, batch_size: int, lr: float, label_smoothing: float = 0.0, progress: bool = True
) -> dict:
    """Train `model` in place on `steps` batches of the task's train split; returns the last loss/accuracy.

    `label_smoothing` > 0 stops the supervised policy short of certainty (its optimum puts 1 - eps on the
    reference token), so sampling at temperature 1 still errs and GRPO has reward left to gain."""
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, steps // 10)))
    model.train()
    stats = {}
    pool = None if hasattr(task, "example") else task.examples(task.train_split)  # generated tasks: on demand
    with Progress(disable=not progress, transient=True) as bar:
        job = bar.add_task("warm start", total=steps)
        for step in range(steps):
            indices = range(step * batch_size, (step + 1) * batch_size)
            examples = [task.example(task.train_split, i) if pool is None else pool[i % len(pool)] for i in indices]
            ids, mask, labels = (t.to(device) for t in supervised_batch(task, tokenizer, examples))
            loss, acc = answer_loss(model, ids, mask, labels, label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            stats = {"warmstart/loss": loss.item(), "warmstart/token_accuracy": acc.item()}
            bar.update(job, advance=1, description=f"warm start loss {stats['warmstart/loss']:.3f}")
    opt.zero_grad(set_to_none=True)  # no stale gradients reach the first GRPO step
    model.eval()
    return stats
