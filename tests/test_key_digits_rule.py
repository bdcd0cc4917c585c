"""`task.key_digits` (the passkey's length) is an integer in [1, 12], as its rule says: 13 digits stop the stage at its
first line with one `config error:` (exit 2), in `task` and in the warm start's task alike (before, the rule enforced
only >= 1 and said "at most 12")."""

import pytest

from tests.conftest import smd


def said(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("key", ["task.key_digits", "+model.warmstart.task.key_digits"])
def test_thirteen_key_digits_are_a_config_error(key, tmp_path, capsys):
    assert smd("plan", "task=passkey", f"{key}=13", f"hydra.run.dir={tmp_path}") == 2
    assert said(capsys) == f"config error: {key.lstrip('+')}=13 is not allowed: an integer in [1, 12]"


def test_twelve_key_digits_are_allowed(tmp_path, capsys):
    assert smd("plan", "task=passkey", "task.key_digits=12", f"hydra.run.dir={tmp_path}") == 0
