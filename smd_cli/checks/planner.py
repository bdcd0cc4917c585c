"""The memory planner: each phase's peak predicted from the shapes of a run, before anything is allocated.

Three phases, each a sum of named terms (bytes), mirroring what the code allocates:

- static, held for the whole run: the weights in the compute dtype, the float32 master weights and
  their gradients (`smd_cli.model.precision`; a float32 model keeps its own gradients instead), the optimizer's
  state, and the frozen reference policy when `beta > 0`. With `optim.offload` the masters, the gradients and
  the optimizer state are on the host while the rollout runs (`smd_cli.runtime.offload`): the rollout's peak leaves
  them out, the learner's counts them.
- rollout, one chunk of `sampling.batch_size` rows at a time: the evicting KV cache (allocated once at its
  final capacity) with its per-slot bookkeeping, the shadow mask `evict_at` being recorded, the
  activations of one layer's prefill (no gradient: the MLP's three [rows, P, I] tensors dominate), the
  policy's scores (SnapKV's observation window) and the sampling logits; plus the shadow masks of the
  chunks already decoded.
- learner, one micro-batch at a time, above what it holds before it starts (static memory and the
  step's rollouts): the checkpointed layer inputs, one layer recomputed with its gradients, the
  attention (flex on CUDA needs no mask; SDPA on the CPU takes the response rows' mask as float), the
  vocabulary chunk (`smd_cli.learner.forward`) and the LM head's weight gradients that autograd sums across chunks
  and with the tied embedding, and SMD's teacher hidden states. Its peak is the largest of these moments:
  the vocabulary's backward, a layer's backward, and where there is one, a whole no-grad forward (the
  reference policy; Sparse-RL's pi_old over several micro-batches), SMD's teacher rows beside the replay, or the
  parity guard's float64 replay of a miss (one layer widened at a time: no float64 copy of the model).

Rows that repeat a prompt (GRPO's G samples) compute it once in the prefill and in the learner
(`smd_cli.learner.forward.shared_prompt_views`); the plan counts every row's prompt, so for such batches it is an
upper bound (measured on distinct prompts, where it is tight).

Over several GPUs (`gpus`, torchrun with FSDP2, `smd_cli.runtime.distributed`) every figure is per GPU: the rows are
the GPU's share of the step, the float32 weights (FSDP2's shards are the masters), their gradients and the
optimizer's state are split over the GPUs, and each phase adds what FSDP2 gathers for it: all the weights in
the compute dtype for the rollout (which decodes on unsharded weights), and for the learner the root's
weights (embeddings, final norm, LM head), held for its whole pass, and two decoder layers at a time (the
one computing and the one prefetched) with one layer's unsharded gradients.

The per-token coefficients of the layer terms count the tensors of transformers' Qwen3 layer that are alive
at once (read off the profiler's live allocations of `bench/plan_check.py`); `tests/test_planner.py` and
`bench/plan_check.py` hold every phase to within 15 % of the measured live tensor bytes at several sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache


def cpu_padded_rows(rows: int, vocab: int, hidden: int, bytes_: float) -> int:
    """The rows a CPU matmul of the LM head runs `rows` rows as (`row_floor.padded`, this machine's rule)."""
    from smd_cli.model import row_floor

    return row_floor.padded(rows, _head_rule(min(vocab, 4096), hidden, int(bytes_)))


@lru_cache(maxsize=None)
def _head_rule(proxy_rows: int, hidden: int, bytes_: int) -> tuple[int, int]:
    """`row_floor.rule_of` for a head of this width and dtype, probed once on a proxy of at most 4096 of its rows (the
    rule follows the BLAS kernel, which the width and dtype choose)."""
    import torch

    from smd_cli.model import row_floor

    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}.get(bytes_, torch.float32)
    return row_floor.rule_of(torch.randn(proxy_rows, hidden, generator=torch.Generator().manual_seed(0)).to(dtype))


@dataclass(frozen=True)
class Arch:
    """The shapes of a decoder-only transformer (Qwen3's layer)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = True

    @property
    def params(self) -> int:
        attention = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2 + 2 * self.head_dim
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * layer + embeddings + self.hidden

    @property
    def largest(self) -> int:
        """Elements of the largest weight (the embedding / LM head)."""
        return self.vocab * self.hidden

    def layer_tokens(self, bytes_: int, hidden: float, intermediate: float, query: float, kv: float) -> float:
        """Bytes per token of a set of [tokens, width] tensors of one layer."""
        return bytes_ * (hidden * self.hidden + intermediate * self.intermediate
                         + query * self.heads * self.head_dim + kv * self.kv_heads * self.head_dim)


@dataclass(frozen=True)
class Run:
    """What a training step does, in the planner's terms (`smd plan` fills it from the config)."""

    arch: Arch
    compute_bytes: int  # 4 (float32) or 2 (bfloat16 / float16)
    device: str  # "cuda" or "cpu": which attention kernels run
    algo: str  # its name (conf/algo/); what the planner reads of it are the three fields below
    rows: int  # N: prompts_per_step x G
    micro_batch: int  # n: rows per learner forward/backward
    rollout_rows: int  # rows decoded at once
    prompt: int  # P: padded prompt width
    response: int  # R: max new tokens
    kept: int  # prompt entries kept per (row, layer, KV head); P without eviction
    cache_growth: int  # slots beyond `kept` (R - 1 for prefill-time policies)
    score_rows: int = 0  # prompt query rows a policy scores at once (SnapKV: its window)
    optimizer: str = "adamw"  # adamw | adamw8bit
    reference: bool = False  # beta > 0: a frozen copy of the policy
    logits_chunk: int | None = None  # tokens per vocabulary chunk (None: 2^23 logits)
    lam: float = 0.1
    gpus: int = 1  # FSDP2 over this many GPUs; rows, micro_batch and rollout_rows are then per GPU
    shadow: bool | None = None  # the learner scores the shadow replay (algo.view); None: algo == "smd"
    distill: bool | None = None  # SMD's no-grad dense teacher beside the replay (algo.distill); None: algo == "smd"
    batch_level: bool | None = None  # the correction scores pi_old up front over micro-batches; None: Sparse-RL, TRM
    offload: bool = False  # optim.offload: masters, their gradients and the optimizer state on the host during the rollout
    kv_quant: str = "none"  # kv.quant: the rollout's cache in 8 bits (a code a byte, a float32 scale per token and KV head)
    parity_replay: bool = False  # the parity guard may replay a miss in float64 inside the step (smd_cli.runs.guard)

    def __post_init__(self):  # frozen: the defaults of a run described by its name alone (benchmarks, tests)
        defaults = {"shadow": self.algo == "smd", "distill": self.algo == "smd", "batch_level": self.algo in ("sparse_rl", "trm")}
        for key, value in defaults.items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)

    @property
    def evicting(self) -> bool:
        return self.algo != "dense"

    @property
    def cached(self) -> bool:
        """The rollout runs the evicting cache (a policy, or an 8-bit cache that keeps everything) and records a shadow mask."""
        return self.evicting or self.kv_quant != "none"

    @property
    def width(self) -> int:
        return self.prompt + self.response

    @property
    def chunk(self) -> int:
        return self.logits_chunk or max(1, (1 << 23) // self.arch.vocab)


@dataclass
class Plan:
    """Predicted bytes: the terms of each phase and each phase's peak (static included)."""

    static: dict[str, float] = field(default_factory=dict)
    rollout: dict[str, float] = field(default_factory=dict)
    learner: dict[str, float] = field(default_factory=dict)
    offloaded: float = 0.0  # static bytes on the host while the rollout runs (optim.offload)

    @property
    def static_bytes(self) -> float:
        return sum(self.static.values())

    @property
    def rollout_bytes(self) -> float:
        return self.static_bytes - self.offloaded + self.rollout["peak"]

    @property
    def learner_bytes(self) -> float:
        return self.static_bytes + self.learner["held"] + self.learner["peak"]

    @property
    def peak_bytes(self) -> float:
        return max(self.rollout_bytes, self.learner_bytes)


def static_terms(run: Run) -> dict[str, float]:
    params, b, g = run.arch.params, run.compute_bytes, run.gpus
    optimizer = 8 * params if run.optimizer == "adamw" else 2 * params + 8 * math.ceil(params / 2048)
    if g > 1:  # FSDP2: float32 shards (the masters), their gradients and optimizer state, split over the GPUs
        return {"weights (float32 shards)": 4 * params / g, "master weights": 0.0, "gradients": 4 * params / g,
                "optimizer state": optimizer / g, "reference policy": b * params if run.reference else 0.0}
    return {
        "weights": b * params,
        "master weights": 4 * params if b < 4 else 0.0,
        "gradients": 4 * params,  # float32: the masters' (or the float32 model's own)
        "optimizer state": float(optimizer),
        "reference policy": b * params if run.reference else 0.0,
    }


def layer_params(arch: Arch) -> int:
    """Parameters of one decoder layer."""
    return (arch.params - arch.hidden - arch.vocab * arch.hidden * (1 if arch.tied else 2)) // arch.layers


def shadow_mask_bytes(run: Run, rows: int) -> float:
    return 4.0 * rows * run.arch.layers * run.arch.kv_heads * (run.width + 1) if run.cached else 0.0


def rounding_record_bytes(run: Run, rows: int) -> float:
    """An 8-bit cache's record of rounding directions: a bit per key and value element of every column (`smd_cli.attention.kv_quant`)."""
    return 2.0 * rows * run.arch.layers * run.arch.kv_heads * run.width * -(-run.arch.head_dim // 8) if run.kv_quant != "none" else 0.0


def rollout_terms(run: Run) -> dict[str, float]:
    a, b, rows, P = run.arch, run.compute_bytes, run.rollout_rows, run.prompt
    slots = (run.kept + run.cache_growth) if run.evicting else run.width
    if run.kv_quant == "none":
        kv, dequantised = 2.0 * b * rows * a.layers * a.kv_heads * slots * a.head_dim, 0.0
    else:  # one byte a code and a float32 scale per (token, KV head), keys and values; one layer read back at a time
        kv = 2.0 * rows * a.layers * a.kv_heads * slots * (a.head_dim + 4)
        dequantised = 2.0 * b * rows * a.kv_heads * slots * a.head_dim
    bookkeeping = 8.0 * rows * a.layers * a.kv_heads * slots if run.cached else 0.0
    record = rounding_record_bytes(run, rows)  # while decoding; each finished chunk's goes to the host (`smd_cli.runs.memory_fit.host_terms`)
    # prefill of one layer, no gradient: the larger of its attention (q, k, v, their rolled copies, the
    # policy's scores) and its MLP (gate, up, act(gate) * up), over the residual stream
    scores = rows * a.heads * run.score_rows * P * (b + 4.0) if run.evicting else 0.0
    prefill = no_grad_layer(run, rows, P, scores)
    # the last position's logits, and sampling's float32 copies (scaled, log_softmax, probabilities) and float64 CDF:
    # 24 bytes per logit measured above float32 logits, 28 above bf16 ones
    logits = rows * a.vocab * (b + 24.0 + (4.0 if b < 4 else 0.0))
    padded = cpu_padded_rows(rows, a.vocab, a.hidden, b) if run.device == "cpu" else rows
    if padded > rows:  # the head's output padded to the machine's rows (`smd_cli.model.row_floor`), then the rows' copy
        logits = max(logits, (padded + rows) * a.vocab * b)
    done = shadow_mask_bytes(run, run.rows - rows)  # chunks decoded before this one wait for the learner
    recording = 2 * shadow_mask_bytes(run, rows)  # evict_at while decoding, and its final copy
    gathered = float(b * a.params) if run.gpus > 1 else 0.0  # FSDP2: every weight unsharded while decoding
    return {"gathered weights": gathered, "kv cache": kv, "cache bookkeeping": bookkeeping, "shadow masks": recording + done,
            "kv rounding record": record, "dequantised layer": dequantised,
            "prefill activations": prefill, "policy scores": scores, "sampling logits": logits,
            "peak": gathered + kv + bookkeeping + recording + done + record + max(prefill, logits, dequantised)}


def no_grad_layer(run: Run, rows: int, width: int, extra: float = 0.0) -> float:
    """Peak of one layer's forward without gradient over [rows, width] tokens: attention or MLP."""
    a, b, tokens = run.arch, run.compute_bytes, rows * width
    attention = tokens * a.layer_tokens(b, hidden=3, intermediate=0, query=3, kv=4) + extra
    mlp = tokens * a.layer_tokens(b, hidden=3, intermediate=3, query=0, kv=0)
    return max(attention, mlp) + 2.0 * tokens * a.head_dim * 4  # + the rotary cos and sin


def learner_terms(run: Run) -> dict[str, float]:
    a, b, n, T, R = run.arch, run.compute_bytes, run.micro_batch, run.width, run.response
    tokens = n * T
    held = shadow_mask_bytes(run, run.rows) + run.rows * T * 8 * 3  # the step's batch: evict_at, ids and masks (the rounding
    # record of an 8-bit cache waits on the host; one layer's slice of a micro-batch comes over at a time)
    checkpoints = a.layers * tokens * a.hidden * b
    final = 3.0 * tokens * a.hidden * b  # the final norm's input and output, the response slice
    grad_layer = tokens * a.layer_tokens(b, hidden=8, intermediate=6, query=5, kv=5)
    if run.shadow and run.kv_quant != "none":  # the replay's quantised keys and values (kept for backward) and their float32 work
        grad_layer += 2.0 * tokens * a.kv_heads * a.head_dim * (b + 8.0)
    attention = 0.0
    if run.shadow and run.device == "cpu":  # the response rows' per-head mask, bool then float inside SDPA
        attention = n * a.heads * R * T * (4.0 + 3.0)
    logits = min(run.chunk, n * R) * a.vocab  # one chunk's logits (elements)
    vocab_chunk = logits * (5 * 4.0 + (b if b < 4 else 0))  # its float32 logits, softmax and gradients
    head_grads = 3.0 * a.largest * b  # the LM head's weight gradients, summed across chunks and with the embedding's
    teacher = n * R * a.hidden * b if run.distill and run.lam > 0 else 0.0
    kept = checkpoints + final + teacher
    moments = {
        "vocabulary chunk backward": kept + vocab_chunk,
        "head gradients": kept + 4.0 * logits + head_grads,
        # the LM head's summed gradient waits in autograd's buffer for the tied embedding's
        "layer backward": kept + grad_layer + attention + (a.largest * b if a.tied else 0.0),
    }
    if run.reference or (run.batch_level and run.rows > n):  # a whole no-grad pass before the step
        moments["no-grad forward"] = final + no_grad_layer(run, n, T) + 3 * 4.0 * logits
    if run.parity_replay:  # a miss judged inside the step, after the first backward: float64, one layer widened at a time
        moments["float64 parity replay"] = parity_replay_bytes(run)
    if teacher:  # the teacher's response rows beside the replay, on one layer's prompt keys and values
        tap = 2.0 * n * a.kv_heads * (T - R) * a.head_dim * b
        moments["replay with the teacher"] = checkpoints + tap + teacher + no_grad_layer(run, n, R, extra=n * a.heads * R * T * 4.0)
    gathered = 0.0
    if run.gpus > 1:  # FSDP2: the root's weights for the whole pass, two layers unsharded, one layer's gradients
        gathered = b * (a.params - a.layers * layer_params(a)) + (2 * b + 4.0) * layer_params(a)
        moments = {k: v + gathered for k, v in moments.items()}
    return {"held": held, "gathered weights": gathered, "checkpointed inputs": checkpoints, "layer recompute": grad_layer, "attention masks": attention,
            "vocabulary chunk": vocab_chunk, "head gradients": head_grads, "teacher states": teacher,
            **{f"moment: {k}": v for k, v in moments.items()}, "peak": max(moments.values())}


def parity_replay_bytes(run: Run) -> float:
    """The parity guard's float64 replay of one micro-batch (`smd_cli.checks.parity.float64_replay`, `smd_cli.model.widening`), above
    what the step holds: the larger of its layer moment (one decoder layer's float64 weights, a no-grad float64 layer over
    [n, T], SDPA's response-row mask, bool then float64) and its vocabulary moment (the final hidden states, HEAD_ROWS rows
    of the LM head widened, and two float64 [chunk, V] tensors). Measured at bench/plan_check.py's four sizes: 0.96 to
    1.05 times the live bytes, 1.23 with a single row (tests/test_parity_guard.py holds two sizes to 15 %)."""
    a, n, T, R = run.arch, run.micro_batch, run.width, run.response
    layer = 8.0 * layer_params(a) + no_grad_layer(replace(run, compute_bytes=8), n, T) + n * a.heads * R * T * (1.0 + 8.0)
    vocabulary = n * R * a.hidden * 8.0 + 8.0 * 4096 * a.hidden + 2 * 8.0 * min(run.chunk, n * R) * a.vocab
    return max(layer, vocabulary)


def offloaded_terms(run: Run, static: dict[str, float]) -> float:
    """Bytes `optim.offload` moves to the host for the rollout: the master weights, the gradients and the optimizer
    state (a float32 model is its own master, which the rollout reads: its gradients and optimizer state only)."""
    if not run.offload:
        return 0.0
    return static["master weights"] + static["gradients"] + static["optimizer state"]


def plan(run: Run) -> Plan:
    static = static_terms(run)
    return Plan(static, rollout_terms(run), learner_terms(run), offloaded_terms(run, static))


def largest_fitting(run: Run, field_name: str, limit: int, capacity: float) -> int | None:
    """The largest `micro_batch` (judged by the learner's peak) or `rollout_rows` (by the rollout's) in
    1..limit that fits `capacity` bytes, or None when not even 1 does."""
    phase = {"micro_batch": "learner_bytes", "rollout_rows": "rollout_bytes"}[field_name]
    best, low, high = None, 1, max(limit, 1)
    while low <= high:
        mid = (low + high) // 2
        if getattr(plan(replace(run, **{field_name: mid})), phase) <= capacity:
            best, low = mid, mid + 1
        else:
            high = mid - 1
    return best
