"""Models and tokenizers: a Hub checkpoint, its architecture with random weights, or the tiny CPU model.

The tiny scale uses the very same `transformers.Qwen3ForCausalLM` code path as the paper's
Qwen3-4B-Instruct-2507, built from a small config (GQA on), and a byte-level BPE tokenizer that the
project builds itself: every byte is a token (so any text round-trips, GSM8K included), and the
synthetic tasks' words (` f12`, ` k3`, ` v40`, ...) are single tokens through explicit merge chains.
"""

from __future__ import annotations

import contextlib

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
from transformers.initialization import no_init_weights
from transformers.modeling_layers import GradientCheckpointingLayer

from smd_cli.attention.dispatch import use_smd_attention
from smd_cli.model import row_floor

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = [PAD, BOS, EOS]

# The words of the synthetic tasks (smd_cli/tasks/synthetic.py): filler, keys, values and markers.
N_FILLER, N_KEYS, N_VALUES = 128, 64, 64
MARKERS = ["KEY", "QUERY", "ANSWER", "NEEDLE", "SEP"]


def tiny_words() -> list[str]:
    """The synthetic vocabulary, each word a single token of the tiny tokenizer."""
    return (
        [f"f{i}" for i in range(N_FILLER)]
        + [f"k{i}" for i in range(N_KEYS)]
        + [f"v{i}" for i in range(N_VALUES)]
        + MARKERS
    )


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE: 256 byte tokens plus one merge chain per synthetic word (deterministic, offline)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    merges: list[tuple[str, str]] = []
    for word in tiny_words():
        piece = "\u0120" + word  # the byte-level form of " word"
        for end in range(2, len(piece) + 1):
            left, right, merged = piece[: end - 1], piece[end - 1], piece[:end]
            if merged not in vocab:
                vocab[merged] = len(vocab)
                merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    # Split before each space (the space stays with the word that follows), then map bytes; no GPT-2
    # regex, which would cut " v40" into " v" and "40".
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(" ", behavior="merged_with_next"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, padding_side="left"
    )


def tiny_config(**fields) -> Qwen3Config:
    """A small Qwen3 (2 layers, 64 wide, 4 query heads sharing 2 KV heads, tied embeddings), with `fields`
    overriding any of it: a vocabulary size, other widths, or a whole architecture (Qwen3-4B's)."""
    base = dict(
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    base.update(fields)
    return Qwen3Config(**base)


def build_tiny_model(vocab_size: int, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu", draw_once: bool = False,
                     **overrides) -> Qwen3ForCausalLM:
    """A randomly initialised Qwen3 from `tiny_config(vocab_size=vocab_size, **overrides)`, reproducible from
    `seed`, built on `device` in `dtype` directly (a 4B model never exists in float32), with the smd attention.
    `draw_once`: each weight drawn once, by transformers' init alone (N(0, 0.02), norms 1), not first by torch's
    default init of every layer and a second time by transformers': the same distributions, a third of the draws
    (Qwen3-4B's embedding and one layer: 0.49 instead of 1.76 G numbers), other values for a seed than the tiny
    model's, which keeps the draws its warm starts and recorded runs were made with."""
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        config = tiny_config(vocab_size=vocab_size, **overrides)
        with no_init_weights() if draw_once else contextlib.nullcontext():
            model = Qwen3ForCausalLM(config).float() if dtype == torch.float32 else Qwen3ForCausalLM._from_config(config, dtype=dtype)
        if draw_once:
            model.tie_weights()  # no_init_weights left the head untied
            head = model.get_output_embeddings() if config.tie_word_embeddings else None
            for module in model.modules():  # transformers' init of each; a tied head is the embedding, drawn once
                if module is not head:
                    model._init_weights(module)
    model.generation_config.pad_token_id = 0
    return use_smd_attention(row_floor.apply(model))


def hub_config(name_or_path: str, trust_remote_code: bool, config_overrides: dict | None = None):
    """The checkpoint's config.json with `config_overrides` over it, without its weights."""
    return AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **dict(config_overrides or {}))


def load_hub_model(name_or_path: str, dtype: str, trust_remote_code: bool, random_init: bool, config_overrides: dict | None = None):
    """A Hub (or local) causal LM in `dtype`, with the smd attention; `random_init` builds the architecture
    with random weights (downloading only its config.json)."""
    torch_dtype = getattr(torch, dtype)
    if random_init:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **dict(config_overrides or {}))
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation="sdpa", trust_remote_code=trust_remote_code)
    else:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, use_safetensors=True, dtype=torch_dtype, attn_implementation="sdpa",
                                                     trust_remote_code=trust_remote_code, **dict(config_overrides or {}))
    return use_smd_attention(row_floor.apply(model))


DECODER_LAYOUT = ("embed_tokens", "layers", "norm", "rotary_emb")  # what smd_cli.learner.forward runs layer by layer

# The decoder families (transformers `model_type`) whose layer-by-layer learner is the sampler's policy: each one,
# built from a tiny random config (1 layer, GQA 4/2, its embedding, residual, attention and logit multipliers moved
# off 1), gives the sampler's log-probs within 1e-6 when its evicting rollout is replayed (one learner step at lr 0;
# tests/test_architecture_allowlist.py holds the list to that). Measured on transformers 5.24 over every family it
# ships that has the decoder layout and full causal attention; the others are refused by name (`unreplayable`).
REPLAYED = frozenset({
    "apertus", "apertus1p5_text", "arcee", "aria_text", "bitnet", "cwm", "ernie4_5", "ernie4_5_moe", "exaone", "flex_olmo",
    "gemma", "glm", "glm4", "glm4_moe", "helium", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "internlm3", "iquestcoder",
    "jais2", "llama", "minimax_m2", "ministral3", "mixtral", "olmo", "olmo2", "olmoe", "phi3", "phimoe", "qwen2", "qwen2_moe",
    "qwen3", "qwen3_moe", "sarvam_moe", "smollm3", "solar_open", "starcoder2",
})
# Families with the decoder layout whose learner measurably is not the sampler's policy (the same one-step check):
# what their forward does outside the layers the learner runs one by one.
NOT_REPLAYED = {
    "cohere": "it scales its logits (logit_scale) outside the LM head",
    "granite": "it scales its embeddings and logits (embedding_multiplier, logits_scaling) outside the layers",
    "granitemoe": "it scales its embeddings and logits (embedding_multiplier, logits_scaling) outside the layers",
    "granitemoeshared": "it scales its embeddings and logits (embedding_multiplier, logits_scaling) outside the layers",
    "hyperclovax": "it scales its embeddings and logits (embedding_multiplier, logits_scaling) outside the layers",
    "nanochat": "it soft-caps its logits (final_logit_softcapping) outside the LM head",
    "diffllama": "its differential attention does not go through the attention interface the shadow mask replaces",
}


def unsupported(config) -> str | None:
    """Why the engine cannot serve a model of `config` (a transformers config, read before any weight is loaded or
    warm-started), or None: sliding-window or alternating attention, a family off the allow-list (`REPLAYED`), or
    a config without the head counts."""
    kinds = sorted(set(getattr(config, "layer_types", None) or ()) - {"full_attention"})
    window = getattr(config, "sliding_window", None)
    if kinds or (window and getattr(config, "use_sliding_window", True) and not getattr(config, "layer_types", None)):
        what = f"layer types {kinds}" if kinds else f"sliding_window={window}"
        return (f"it has sliding-window or alternating attention ({what}); the shadow mask encodes evictions of full causal "
                "attention only (Llama, Qwen2 and Qwen3 without a sliding window are supported)")
    kind = getattr(config, "model_type", None)
    if kind not in REPLAYED:
        why = NOT_REPLAYED.get(kind, "it is not among the families whose shadow replay was measured to give the sampler's "
                                     "log-probs")
        return (f"{why}, so the layer-by-layer learner would not be the sampler's policy (SMD's parity broken); "
                f"supported model_type: {', '.join(sorted(REPLAYED))} (smd_cli.model.build.REPLAYED)")
    if not all(hasattr(config, key) for key in ("num_hidden_layers", "num_key_value_heads", "num_attention_heads")):
        return "its config does not name num_hidden_layers, num_attention_heads and num_key_value_heads"
    return None


def unreplayable(model) -> str | None:
    """Why the engine cannot roll out and replay `model`, or None when it can: `unsupported(model.config)`, or a
    backbone without the usual layout (`DECODER_LAYOUT`: the learner runs the layers one by one to share a prompt
    between its samples). A sliding window or alternating local/global layers (Mistral, Gemma 2/3, Qwen2 with
    `use_sliding_window`) would need the window in the shadow mask, which it does not encode."""
    backbone = getattr(model, "base_model", None)
    missing = [name for name in DECODER_LAYOUT if not hasattr(backbone, name)]
    if missing:
        return (f"its backbone ({type(backbone).__name__}) lacks {', '.join(missing)} of the decoder layout the learner "
                f"replays layer by layer ({', '.join(DECODER_LAYOUT)})")
    return unsupported(model.config)


class WideLogits(torch.nn.Linear):
    """An LM head that computes its logits in a wider dtype than the model's (`logits_dtype`, float64 by default):
    input, weight and bias are cast to it, so everything after the head (log-softmax, sampling, the KL) runs in
    it too. The weight stays the model's own parameter (tied, trained, checkpointed as before). Inside
    `fixed_weights` (a rollout, whose weights do not change) the cast weight is made once, not at every decode step;
    elsewhere it is cast at every call (a fused optimizer updates weights without bumping their version, so no
    cache could tell a stale cast).

    Why: the projection onto the vocabulary is the largest float32 reduction the log-probs go through (on
    SmolLM2-135M its rounding moved a token's log-prob by up to 1.7e-5 between float32 and float64). Most of what that
    did to parity was the sampler's few-row matmul running another kernel than the learner's, which `row_floor` now
    removes for every layer (this one included), so SmolLM2's config leaves the head in float32; this remains for a
    model whose logits need the wider sum (README, "Parity on a real model")."""

    logits_dtype = torch.float64
    fixed: torch.Tensor | None = None  # the cast weight while `fixed_weights` holds

    @property
    def wide(self) -> torch.dtype:
        """The dtype it computes in: `logits_dtype`, or the weight's when that is wider (a float64 copy stays float64)."""
        return torch.promote_types(self.logits_dtype, self.weight.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        wide = self.wide
        fixed = self.fixed is not None and not torch.is_grad_enabled()
        weight = self.fixed if fixed else self.weight.to(wide)
        bias = None if self.bias is None else self.bias.to(wide)
        return row_floor.linear(hidden.to(wide), weight, bias)


@contextlib.contextmanager
def fixed_weights(model):
    """While the weights stay as they are (a rollout): a `WideLogits` head casts its weight once for all calls
    without gradient. Nothing for another head, or a sharded one (FSDP gathers it inside the forward)."""
    head = model.get_output_embeddings()
    if not isinstance(head, WideLogits) or type(head.weight.detach()) is not torch.Tensor:
        yield
        return
    head.fixed = head.weight.detach().to(head.wide)
    try:
        yield
    finally:
        head.fixed = None


def set_attention_dtype(model, name: str | None) -> None:
    """Attend in dtype `name` (`kernels.widened`: every SDPA of the smd attention, the rollout's and the learner's, but a
    prompt's own rows, which every forward sums alike; the compiled flex replay gives way to SDPA); None: in the compute dtype. Set on the config, where the attention
    reads it, and set or cleared by every loader, so that a checkpoint's saved value never carries over."""
    if name is None:
        model.config.__dict__.pop("smd_attention_dtype", None)
    else:
        model.config.smd_attention_dtype = name


def set_logits_dtype(model, name: str | None) -> None:
    """Compute `model`'s logits in dtype `name` (`WideLogits`); None leaves its head as it is (the compute dtype)."""
    if name is None:
        return
    head = model.get_output_embeddings()
    if type(head) not in (torch.nn.Linear, row_floor.FlooredLinear, WideLogits):  # a subclass (LoRA, quantised, remote code) has its own forward
        raise TypeError(f"model.logits_dtype={name}: the LM head is a {type(head).__name__}, not a plain Linear layer")
    head.__class__ = WideLogits  # the same module and parameters (state dict, ties, hooks), another forward
    head.logits_dtype = getattr(torch, name)


def enable_checkpointing(model) -> None:
    """Gradient (activation) checkpointing of every decoder layer, non-reentrant: a layer's activations are
    recomputed during backward, with the same keyword arguments, hence the same (shadow) attention."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.?: the new name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def learner_mode(model):
    """The learner's forward computes the function the sampler ran (DESIGN.md contract 1), whatever the model's config.

    The sampler runs the model in eval mode. transformers keys every stochastic training-mode behaviour on a module's
    `training` flag: `nn.Dropout` (Phi3's `resid_pdrop`), attention dropout (`dropout=0.0 if not self.training else
    self.attention_dropout`), MoE router and input jitter (Mixtral's `router_jitter_noise`, PhiMoE's
    `input_jitter_noise`) and PhiMoE's sampled expert routing (its sparsemixer draws experts by Gumbel noise in
    training mode, whatever the jitter). So every module stays in eval mode here, and only the decoder layers that
    gradient checkpointing wraps are flagged `training`, each on itself and none of its children: transformers
    recomputes a layer in backward only then (`GradientCheckpointingLayer`), and no decoder layer of the families
    on the allow-list reads the flag for anything else (tests/test_learner_mode.py reads their source). TRL's GRPO
    zeroes the `p` of every `nn.Dropout` instead (`disable_dropout`), which leaves attention dropout and router
    jitter on. The learner puts the model back in eval mode (`model.eval()`) when its step is done."""
    model.eval()
    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer) and layer.gradient_checkpointing:
            layer.training = True
    return model


def load_hub_tokenizer(name_or_path: str, trust_remote_code: bool):
    tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
