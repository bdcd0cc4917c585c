"""What a local model directory (`model=hub model.name_or_path=DIR`) must hold, said before transformers reads it.

`problem(dir, ...)` names the first thing that stops transformers from loading the directory as smd loads it
(`models.load_hub_model`: safetensors weights, SDPA attention, the tokenizer beside them): an empty directory, no
or a broken `config.json`, a `model_type` transformers does not know (with an `auto_map`: code of the directory's
own, run only with `model.trust_remote_code=true`), an architecture without SDPA attention (Gemma 2), no tokenizer,
no safetensors weights. (A Hub id is judged from its config once transformers has it: `stages.model_loading`.)
"""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
CONFIG_BYTES = 16 << 20  # a config.json is a few KB; a larger one is not read


def problem(path: Path, tokenizer_given: bool, random_init: bool, trust_remote_code: bool) -> str | None:
    """Why transformers cannot load the local directory `path` as smd does, or None when nothing is seen wrong."""
    files = sorted(p.name for p in path.iterdir())
    if not files:
        return ("the directory is empty: give a save_pretrained directory (config.json, *.safetensors weights and the "
                "tokenizer's files) or a Hub id")
    held = ", ".join(files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
    config_path = path / "config.json"
    if not config_path.is_file():
        return f"it has no config.json (it holds {held}): give a save_pretrained directory"
    try:
        if config_path.stat().st_size > CONFIG_BYTES:
            return f"its config.json is {config_path.stat().st_size} bytes, not a model's config"
        config = json.loads(config_path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"its config.json cannot be read as JSON ({err})"
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str) or not config["model_type"]:
        return "its config.json names no model_type (the architecture transformers builds)"
    found = architecture_problem(config, trust_remote_code)
    if found:
        return found
    missing = []
    if not tokenizer_given and not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"no tokenizer ({' or '.join(TOKENIZER_FILES[:2])}; or set model.tokenizer)")
    if not random_init and not any(path.glob("*.safetensors")):
        unread = ", which smd reads: its pytorch_model*.bin is not" if any(path.glob("pytorch_model*.bin")) else ""
        missing.append(f"no weights (*.safetensors{unread}; or set model.random_init=true for random weights)")
    return f"it has {' and '.join(missing)} (it holds {held})" if missing else None


def architecture_problem(config: dict, trust_remote_code: bool) -> str | None:
    """Why transformers cannot build `config` (a config.json) as a causal LM with SDPA attention, or None."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type, auto_map = config["model_type"], config.get("auto_map")
    version = f"transformers {transformers.__version__}"
    if model_type not in transformers.CONFIG_MAPPING:
        if auto_map and not trust_remote_code:
            code = ", ".join(sorted({str(v).split(".")[0] + ".py" for v in (auto_map.values() if isinstance(auto_map, dict) else [])}))
            return (f"its model_type {model_type!r} is not one {version} knows, and its config.json's auto_map builds it with "
                    f"Python code of its own ({code or 'auto_map'}), which runs only with model.trust_remote_code=true "
                    "(read that code first)")
        return None if auto_map else f"its model_type {model_type!r} is not one {version} knows"
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if name is None and not auto_map:
        return f"its model_type {model_type!r} is not a causal language model in {version} (AutoModelForCausalLM has none)"
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is not None and not getattr(cls, "_supports_sdpa", True):
        return (f"{name} (model_type {model_type!r}) has no SDPA attention in {version}, and smd's attention (shadow masks, "
                "evicting caches) runs through transformers' SDPA interface")
    return None

