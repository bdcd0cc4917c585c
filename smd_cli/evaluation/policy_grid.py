"""One prefill, many evictions: evaluate several eviction policies (and compressions) on the same prompts at the cost
of about one prefill per prompt.

Every policy here evicts after the prefill's attention has run (`smd_cli.attention.evicting._prefill`: the prompt
attends to itself in full, then the policy scores and keeps entries per layer), so a prompt's prefill is the same
for all of them. The sampler already prefills a prompt once when neighbouring rows repeat it (GRPO's samples,
`prompt_groups`) and lets the policy choose per row. `PerRow` is a policy that hands each row to its own policy:
a batch of prompts x policies, each prompt repeated once per policy, prefills each prompt once, and each row keeps
what its own policy would have kept alone (the same scores, budget, sink and window; a decode-time policy such as
H2O evicts on its rows only). On a 1k-token prompt the prefill is nearly all of a greedy evaluation's time on
the CPU, so k policies cost about one evaluation instead of k.

A dense cache runs here as `KeepAll` in the evicting cache (compression 0), not transformers' `DynamicCache`: the
same attention over every entry, through the evicting kernel. `RandomEviction` draws its scores for its own rows
from its own generator, so its choices differ from a run of it alone (the same distribution).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from smd_cli.attention.policy import EvictionPolicy, PrefillView, Selection
from smd_cli.attention.shadow import kept_through
from smd_cli.eviction.context_only import ContextOnly
from smd_cli.eviction.none import KeepAll
from smd_cli.evaluation.batch import evidence_columns
from smd_cli.rollout.sampler import generate, response_texts
from smd_cli.tasks.base import Example, Task


class PerRow(EvictionPolicy):
    """`policies[assignment[r]]` decides for row r: its budget, its prefill selection, its decode-time evictions."""

    def __init__(self, policies: list[EvictionPolicy], assignment: list[int]):
        if not policies or any(isinstance(p, PerRow) for p in policies):
            raise ValueError("PerRow needs a non-empty list of plain policies")
        if not assignment or min(assignment) < 0 or max(assignment) >= len(policies):
            raise ValueError(f"assignment {assignment} names a policy outside 0..{len(policies) - 1}")
        self.policies = list(policies)
        self.assignment = torch.tensor(assignment)
        self.compression, self.sink, self.window = float("nan"), 0, 0
        self.decode_time = any(p.decode_time for p in policies)
        self._evicting = [False] * len(policies)

    def _rows(self, device: torch.device) -> list[tuple[EvictionPolicy, torch.Tensor]]:
        where = self.assignment.to(device)
        return [(p, torch.nonzero(where == i).flatten()) for i, p in enumerate(self.policies) if bool((where == i).any())]

    def budget(self, prompt_lengths: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(prompt_lengths)
        for policy, rows in self._rows(prompt_lengths.device):
            out[rows] = policy.budget(prompt_lengths[rows])
        return out

    def select_prefill(self, view: PrefillView, budget: torch.Tensor) -> Selection:
        return Selection.merge(view.key.shape[0], [(rows, policy.select_prefill(view.subset(rows), budget[rows]))
                                                   for policy, rows in self._rows(view.key.device)])

    def cache_growth(self, decode_steps: int) -> int:
        return max(p.cache_growth(decode_steps) for p in self.policies)

    def decode_scores(self, slot_scores: torch.Tensor, attention: torch.Tensor, step: int) -> torch.Tensor:
        out = slot_scores.clone()
        for policy, rows in self._rows(slot_scores.device):
            if policy.decode_time:
                out[rows] = policy.decode_scores(slot_scores[rows], attention[rows], step)
        return out

    def evicts_after(self, step: int) -> bool:
        self._evicting = [p.evicts_after(step) for p in self.policies]  # read by select_decode, called next
        return any(self._evicting)

    def decode_signature(self, step: int) -> tuple | None:
        return None

    def select_decode(self, slot_scores, slot_columns, budget, column, first_real) -> torch.Tensor:
        out = torch.zeros_like(slot_columns, dtype=torch.bool)
        where = self.assignment.to(slot_columns.device)
        for i, policy in enumerate(self.policies):
            rows = torch.nonzero(where == i).flatten()
            if self._evicting[i] and rows.numel():
                out[rows] = policy.select_decode(slot_scores[rows], slot_columns[rows], budget[rows], column, first_real[rows])
        return out


def evaluate_grid(model, tokenizer, task: Task, examples: list[Example], policies: dict[str, EvictionPolicy | None], *,
                  max_new_tokens: int, prompts_per_batch: int = 4, outside: frozenset[str] = frozenset()) -> dict[str, dict[str, Any]]:
    """Greedy evaluation of every policy (None: the dense cache, as `KeepAll`) on the same `examples`, each prompt
    prefilled once per batch: {name: {"rows": per-example rows, "summary": the task's metrics, evidence/kept}}.
    The policies named in `outside` compress the context alone, the question kept outside the compressed span
    (`ContextOnly`; the task says where its closing starts: `closing_tokens`)."""
    names = list(policies)
    plain = [KeepAll() if policies[n] is None else policies[n] for n in names]
    prompts = [task.encode_prompt(e, tokenizer) for e in examples]
    if outside - set(names) or (outside and not hasattr(task, "closing_tokens")):
        raise ValueError(f"outside={sorted(outside)}: each must name a policy of {names}, on a task that knows where its question "
                         f"starts (task=ruler); got task {type(task).__name__}")
    closing = [task.closing_tokens(e, tokenizer) for e in examples] if outside else []
    out: dict[str, dict[str, Any]] = {n: {"rows": [], "kept": []} for n in names}
    started = time.perf_counter()
    for start in range(0, len(examples), prompts_per_batch):
        chunk = list(range(start, min(start + prompts_per_batch, len(examples))))
        rows = [i for i in chunk for _ in names]
        assignment = [j for _ in chunk for j in range(len(names))]
        batch_policies = [ContextOnly(p, [closing[i] for i in chunk]) if names[j] in outside else p for j, p in enumerate(plain)]
        batch = generate(model, [prompts[i] for i in rows], policy=PerRow(batch_policies, assignment), max_new_tokens=max_new_tokens,
                         temperature=0.0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         measure_dense_kv=False)
        texts = response_texts(batch, tokenizer)
        columns = evidence_columns(task, batch, [examples[i] for i in rows], [prompts[i] for i in rows])
        for j, name in enumerate(names):
            mine = [r for r, a in enumerate(assignment) if a == j]
            for r in mine:
                example = examples[rows[r]]
                scores = task.score(texts[r], example) if hasattr(task, "score") else {"reward": task.reward(texts[r], example)}
                out[name]["rows"].append({"id": example["id"], "completion": texts[r], "reference": example["reference"], **scores})
            if columns is not None and any(columns[r] for r in mine):
                kept = kept_through(batch.evict_at[mine], [columns[r] for r in mine])  # [L] over rows, evidence, heads
                out[name]["kept"].append((float(kept.mean()), sum(len(columns[r]) for r in mine)))
    seconds = time.perf_counter() - started
    for name in names:
        completions = [r["completion"] for r in out[name]["rows"]]
        summary = task.metrics(completions, examples)
        kept = out[name].pop("kept")
        if kept:
            summary["evidence/kept"] = sum(v * n for v, n in kept) / sum(n for _, n in kept)
        summary.update({"n": float(len(examples)), "seconds_all_policies": seconds})
        out[name]["summary"] = summary
    return out
