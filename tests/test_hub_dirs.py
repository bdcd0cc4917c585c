"""`model=hub model.name_or_path=DIR` with a directory transformers cannot load as smd loads it: one config error
naming what the directory lacks or holds (before: tracebacks from the tokenizer or the model class). Each runs
`smd eval` in this process, as a user would; nothing is loaded, so each takes about a second."""

import json

from tests.conftest import smd

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 300}


def said(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


def directory(tmp_path, name, config=None, tokenizer=None):
    """A folder holding `config` as config.json (when given) and the tiny tokenizer's files (when given)."""
    path = tmp_path / name
    path.mkdir()
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def refused(tmp_path, capsys, path, *extra) -> str:
    assert smd("eval", "model=hub", f"model.name_or_path={path}", "device=cpu", "eval.limit=1", "progress=false", *extra,
               f"hydra.run.dir={tmp_path / 'run'}") == 2
    err = said(capsys)
    assert "Traceback" not in err
    prefix = f"config error: model.name_or_path='{path}' is not allowed: "
    assert err.startswith(prefix), err
    return err[len(prefix):]


def test_an_empty_directory_is_named_as_empty(tmp_path, capsys):
    assert refused(tmp_path, capsys, directory(tmp_path, "empty")).startswith("the directory is empty: give a save_pretrained directory")


def test_a_directory_with_only_config_json_names_the_tokenizer_and_the_weights_it_lacks(tmp_path, capsys):
    why = refused(tmp_path, capsys, directory(tmp_path, "config_only", LLAMA))
    assert why == ("it has no tokenizer (tokenizer.json or tokenizer_config.json; or set model.tokenizer) and no weights "
                   "(*.safetensors; or set model.random_init=true for random weights) (it holds config.json)")


def test_gemma2_is_refused_for_its_attention_before_anything_is_built(tmp_path, capsys, tiny_tokenizer):
    path = directory(tmp_path, "gemma2", {**LLAMA, "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}, tiny_tokenizer)
    why = refused(tmp_path, capsys, path, "model.random_init=true")
    assert why.startswith("Gemma2ForCausalLM (model_type 'gemma2') has no SDPA attention in transformers ")


def test_an_unknown_model_type_with_auto_map_names_trust_remote_code(tmp_path, capsys, tiny_tokenizer):
    config = {"model_type": "mything", "architectures": ["MyThingForCausalLM"], "vocab_size": 300,
              "auto_map": {"AutoConfig": "configuration_mything.MyThingConfig",
                           "AutoModelForCausalLM": "modeling_mything.MyThingForCausalLM"}}
    why = refused(tmp_path, capsys, directory(tmp_path, "custom", config, tiny_tokenizer))
    assert why.startswith("its model_type 'mything' is not one transformers ")
    assert why.endswith("its config.json's auto_map builds it with Python code of its own (configuration_mything.py, "
                        "modeling_mything.py), which runs only with model.trust_remote_code=true (read that code first)")


def test_an_unknown_model_type_without_auto_map_is_named(tmp_path, capsys, tiny_tokenizer):
    path = directory(tmp_path, "unknown", {**LLAMA, "model_type": "nosuchmodel"}, tiny_tokenizer)
    assert refused(tmp_path, capsys, path).startswith("its model_type 'nosuchmodel' is not one transformers ")
