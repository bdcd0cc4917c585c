"""Why a few SMD steps of the small reproduction are not bit for bit: float64 attention rounded back to float32.

Usage: python bench/attention_rounding.py [--trials 200] [--steps 1240 --observed 7] [--inject 200]

The sampler's decode step attends over its compact cache (the kept slots); SMD's learner attends over the whole
sequence under the shadow mask. Both run `kernels.grouped` in float64 (`model.attention_dtype`), but over key axes of
different lengths, so the float64 sums group differently and differ in their last bits. Cast back to float32, the two
outputs differ only where a float32 rounding boundary falls between them: with probability |a64 - b64| / ulp32 per
element. This script measures that rate on SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head dim 64)
with random queries, keys and values, and multiplies it by the attention outputs of the learner's response tokens in
one small-scale step (`--rows` x `--response` tokens x `--layers`) to give the flips a step and a reproduction of
`--steps` SMD steps should see. A flip changes one element by one float32 ulp, which the remaining layers carry to the
log-probs: the small reproduction's few nonzero parity steps (`--observed`, up to 9.5e-6) are such flips if the
expected count is of their order. Prints the measured rate, the expected counts, and the flips actually seen.

`--inject N` then loads SmolLM2-135M as `scale=small` does (offline, from the local cache) and, N times, nudges one
element of one attention output (the input of `o_proj`, a random layer, one of the last `--response` positions of a
held-out passkey prompt) by one float32 ulp, and prints how often the log-probs of those positions change and by how
much: the fraction of flips that reach a log-prob, and their size beside the reproduction's nonzero parity steps.
"""

import argparse
import random

import torch
from hydra import compose, initialize_config_dir

from smd_cli.attention import kernels
from smd_cli.cli import CONF_DIR, register_recipes
from smd_cli.config.factories import build_task
from smd_cli.config.prompts import encode_prompt, load_examples
from smd_cli.runs.model_loading import load_model

HEADS, KV_HEADS, DIM = 9, 3, 64  # SmolLM2-135M (conf/model/smollm2_135m.yaml)


def one_trial(prompt: int, response: int, kept: float, generator: torch.Generator,
              leak: bool = False) -> tuple[float, int, int]:
    """(sum over elements of |a64 - b64| / ulp32, float32 flips, elements) for one sequence's response tokens.
    `leak`: the learner also sees the first prompt key the sampler evicted (a wrong mask, for the tests)."""
    total = prompt + response
    q = torch.randn(1, HEADS, response, DIM, generator=generator)
    k = torch.randn(1, KV_HEADS, total, DIM, generator=generator)
    v = torch.randn(1, KV_HEADS, total, DIM, generator=generator)
    visible = torch.rand(KV_HEADS, total, generator=generator) < kept  # one eviction pattern per KV head
    visible[:, prompt:] = True
    scale = DIM ** -0.5
    expected, flips = 0.0, 0
    seen = visible.clone()
    if leak:
        seen[0, (~visible[0]).nonzero()[0]] = True
    learner = kernels.grouped(  # every response row over the whole sequence, causal within the response
        q.double(), k.double(), v.double(),
        (seen[None, :, None, :] & (torch.arange(total) < prompt + 1 + torch.arange(response)[:, None])), scale)
    for t in range(response):  # the sampler: one decode step over its compact cache, per KV head
        for h in range(KV_HEADS):
            slots = visible[h, : prompt + t + 1].nonzero().squeeze(1)
            heads = slice(h * (HEADS // KV_HEADS), (h + 1) * (HEADS // KV_HEADS))
            sampler = kernels.grouped(q[:, heads, t:t + 1].double(), k[:, h:h + 1, slots].double(),
                                      v[:, h:h + 1, slots].double(), torch.ones(1, 1, 1, len(slots), dtype=torch.bool),
                                      scale)
            mine = learner[:, heads, t:t + 1]
            ulp = (torch.nextafter(mine.float().abs(), torch.tensor(float("inf"))) - mine.float().abs()).double()
            expected += ((mine - sampler).abs() / ulp).sum().item()
            flips += (mine.float() != sampler.float()).sum().item()
    return expected, flips, HEADS * response * DIM


def inject(count: int, response: int, seed: int = 0) -> list[float]:
    """Max |change| of the last `response` positions' log-probs after one attention output element moves one ulp."""
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["scale=small", "progress=false", "device=cpu"])
    task = build_task(cfg)
    model, tokenizer = load_model(cfg, task, torch.device("cpu"), progress=False)
    rows = [encode_prompt(task, e, tokenizer) for e in load_examples(task, task.test_split, 4)]
    layers = model.model.layers
    rng = random.Random(seed)
    nudge = {}

    def pre_hook(module, inputs):
        if nudge.get("layer") is not module:
            return None
        x = inputs[0].clone()
        pos, col = nudge["at"]
        x[0, pos, col] = torch.nextafter(x[0, pos, col], torch.tensor(float("inf")))
        return (x,)

    for layer in layers:
        layer.self_attn.o_proj.register_forward_pre_hook(pre_hook)

    def logprobs(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = model(ids).logits[0, -response - 1:-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[0, -response:, None]).squeeze(-1)

    changes = []
    for i in range(count):
        ids = torch.tensor([rows[i % len(rows)]])
        nudge.clear()
        clean = logprobs(ids)
        layer = rng.randrange(len(layers))
        nudge.update(layer=layers[layer].self_attn.o_proj,
                     at=(ids.shape[1] - response + rng.randrange(response), rng.randrange(model.config.hidden_size)))
        changes.append((logprobs(ids) - clean).abs().max().item())
    return changes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--prompt", type=int, default=160, help="prompt tokens (conf/scale/small.yaml's passkey)")
    parser.add_argument("--response", type=int, default=12, help="response tokens (the reproduction's mean length)")
    parser.add_argument("--kept", type=float, default=0.5, help="fraction of prompt keys the sampler kept")
    parser.add_argument("--rows", type=int, default=8, help="sequences a step (2 prompts x 4 generations)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--steps", type=int, default=1240, help="SMD steps of the small reproduction (62 runs x 20, seeds 0-7)")
    parser.add_argument("--observed", type=int, default=7, help="SMD steps whose parity was not 0")
    parser.add_argument("--inject", type=int, default=0, help="one-ulp nudges into SmolLM2's attention (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    expected = flips = elements = 0
    for _ in range(args.trials):
        e, f, n = one_trial(args.prompt, args.response, args.kept, generator)
        expected, flips, elements = expected + e, flips + f, elements + n
    rate = expected / elements
    per_step = rate * HEADS * DIM * args.response * args.rows * args.layers
    print(f"{elements} float64 attention outputs, sampler's against learner's: float32 flip rate "
          f"{rate:.3g} per element expected (|a64 - b64| / ulp32), {flips} flips seen")
    print(f"one step ({args.rows} rows x {args.response} tokens x {args.layers} layers): {per_step:.3g} flipped "
          f"elements expected; {args.steps} steps: {per_step * args.steps:.3g} (observed: {args.observed} steps "
          f"with a nonzero parity)")
    if args.inject:
        changes = inject(args.inject, args.response)
        moved = sorted(c for c in changes if c > 0)
        print(f"SmolLM2, {args.inject} one-ulp nudges of an attention output: {len(moved)} changed a log-prob "
              f"({len(moved) / args.inject:.3g})" + (f", by {moved[0]:.3g} to {moved[-1]:.3g} (median "
                                                   f"{moved[len(moved) // 2]:.3g})" if moved else ""))


if __name__ == "__main__":
    main()
