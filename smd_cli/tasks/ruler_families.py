"""RULER's synthetic families (Hsieh et al. 2024, NVIDIA/RULER `scripts/data/synthetic/`): what each one draws and
the text it is written in. `smd_cli.tasks.ruler` fits a draw to a length in tokens and scores the answer.

| family           | RULER's variants            | haystack (default first)  | needles                             | answer              |
|------------------|-----------------------------|---------------------------|-------------------------------------|---------------------|
| niah_single      | niah_single_1, _2           | essay, noise              | 1 key, 1 value                      | the 7-digit value   |
| niah_multikey    | niah_multikey_1, _2         | essay (4 keys), needle    | 4 keys (1 in a haystack of needles) | the queried value   |
| niah_multivalue  | niah_multivalue             | essay, noise              | 1 key, 4 values                     | all 4 values        |
| niah_multiquery  | niah_multiquery             | essay, noise              | 4 keys, 4 of them queried           | all 4 values        |
| vt               | vt (variable tracking)      | noise                     | a chain `VAR A = 12345`, 4 hops     | the 5 variables     |
| cwe              | cwe (common words)          | a numbered word list      | 10 words x6 (x30 at >= 4k), rest x1 | the 10 common words |
| fwe              | fwe (frequent words)        | coded words, Zipf(2)      | -                                   | the 3 most frequent |

Every random choice comes from the `random.Random` given to `draw`, so an example is a pure function of
(seed, split, index); its text only needs the tokenizer later, to be cut to a length (`ruler.Ruler.fit_prompt`).
The templates and answer prefixes are RULER's (`scripts/data/synthetic/constants.py`), with its singular form
when one value is asked for. Where this differs from RULER, on purpose:

- the essay haystack starts at a random sentence of the 49 essays (RULER starts every prompt at the first word
  of the concatenated essays), so prompts differ in their text and not only in where the needles are;
- needles go in at RULER's 40 evenly spaced depths in every haystack (RULER samples uniform positions in the
  noise and needle haystacks);
- variable tracking's one-shot example has 6 noise sentences (RULER's fills 500 tokens, half a 1k prompt).

A draw is JSON-like data (strings, numbers, lists): the example carries it, so the reward can tell an answer
from a distractor (a value of an unqueried key, a word that is not among the most common) without the prompt.
"""

from __future__ import annotations

import dataclasses
import random
import string
from collections.abc import Callable
from typing import Any

from smd_cli.tasks import ruler_sources

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER's np.round(np.linspace(0, 100, 40))
NIAH_HEAD = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
             "I will quiz you about the {kind} afterwards.\n")
NIAH_TAIL = "\nWhat are all the special magic {kind} for {query} mentioned in the provided text?"
NIAH_PREFIX = " The special magic {kind} for {query} mentioned in the provided text are"
VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_TAIL = "\nQuestion: Find all variables that are assigned the value {value} in the text above."
VT_PREFIX = " Answer: According to the chain(s) of variable assignment in the text above, {n} variables are assigned the value {value}, they are: "
VT_SHOT_SENTENCES = 6
CWE_HEAD = ("Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.\n")
CWE_TAIL = "\nQuestion: What are the 10 most common words in the above list?"
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_HEAD = ("Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words.")
FWE_TAIL = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
            "frequently appeared words in the above coded text?")
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"


@dataclasses.dataclass(frozen=True)
class Needle:
    """Text inserted into a haystack at `depth` (percent), and the substrings of it that bear the answer."""

    depth: int
    text: str
    evidence: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Haystack:
    """A prompt of filler units with needles among them: `unit(i)` is the i-th filler unit (as many as asked)."""

    head: str
    tail: str
    prefix: str
    joiner: str
    unit: Callable[[int], str]
    needles: tuple[Needle, ...]
    shot: str = ""  # a worked example before the head (variable tracking)


@dataclasses.dataclass(frozen=True)
class WordList:
    """A prompt whose context is a list of `items(n)` (n from `smallest` up), each item pieces of (text, answer-bearing)."""

    head: str
    tail: str
    prefix: str
    items: Callable[[int], list[tuple[tuple[str, bool], ...]]]
    smallest: int
    largest: int
    shot: str = ""


@dataclasses.dataclass(frozen=True)
class Family:
    """One row of the table above: `draw(rng, settings, prompt_tokens)` -> (draw, answers, distractors);
    `layout(draw)` -> the prompt's parts."""

    haystacks: tuple[str, ...]
    settings: dict[str, int]  # the family's defaults of num_keys, num_values, num_queries, num_chains, num_hops
    ruler_new_tokens: int  # RULER's tokens_to_generate (the answers fit in far fewer; task.max_new_tokens decides)
    draw: Callable[..., tuple[dict[str, Any], list[str], list[str]]]
    layout: Callable[[dict[str, Any]], Haystack | WordList]


# -- needles in a haystack ---------------------------------------------------------------------------------------
def _number(rng: random.Random) -> str:
    return str(rng.randint(10**6, 10**7 - 1))


def _distinct(rng: random.Random, make: Callable[[random.Random], str], n: int, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        value = make(rng)
        if value not in taken:
            taken.add(value)
            out.append(value)
    return out


def _key(rng: random.Random) -> str:
    return f"{rng.choice(ruler_sources.words('adjective'))}-{rng.choice(ruler_sources.words('noun'))}"


def _draw_niah(rng: random.Random, s: dict[str, int], prompt_tokens: int, haystack: str) -> tuple[dict, list[str], list[str]]:
    num_keys = max(s["num_keys"], s["num_queries"])
    used: set[str] = set()
    keys = _distinct(rng, _key, num_keys, used)
    values = [_distinct(rng, _number, s["num_values"], used) for _ in keys]
    needles = [[k, v] for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    depths = sorted(rng.sample(DEPTHS, len(needles)))
    queried = sorted(rng.sample(range(num_keys), s["num_queries"]))
    answers = [v for i in queried for v in values[i]]
    distractors = [v for i in range(num_keys) if i not in queried for v in values[i]]
    draw: dict[str, Any] = {"keys": keys, "queried": [keys[i] for i in queried], "needles": needles, "depths": depths,
                            "kind": "numbers" if len(answers) > 1 else "number"}
    if haystack == "essay":
        draw["start"] = rng.randrange(len(ruler_sources.essay_sentences()))
    if haystack == "needle":  # distractor needles: more than any budget holds (each is > 8 tokens)
        fake_keys = _distinct(rng, _key, prompt_tokens // 8 + 1, used)
        draw["fillers"] = [[k, v] for k, v in zip(fake_keys, _distinct(rng, _number, len(fake_keys), used))]
        distractors += [v for _, v in draw["fillers"]]
    return draw, answers, distractors


def _query(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def _singular(text: str, one: bool) -> str:
    """RULER's template for one value: 'Some' -> 'A', 'are all' / 'are' -> 'is'."""
    return text.replace("Some", "A").replace("are all", "is").replace("are", "is") if one else text


def _layout_niah(draw: dict[str, Any], haystack: str) -> Haystack:
    one, shown = draw["kind"] == "number", draw["kind"]
    # RULER's needle says "numbers" even when one is asked for; its template is made singular (before the query,
    # whose key words may contain "are", goes in)
    asked = set(draw["queried"])  # only the queried keys' values bear the answer
    needles = tuple(Needle(d, NEEDLE.format(kind="numbers", key=k, value=v), (v,) if k in asked else ())
                    for d, (k, v) in zip(draw["depths"], draw["needles"]))
    query = _query(draw["queried"])
    head = _singular(NIAH_HEAD.format(kind=shown), one)
    tail = _singular(NIAH_TAIL.format(kind=shown, query="{query}"), one).format(query=query)
    prefix = _singular(NIAH_PREFIX.format(kind=shown, query="{query}"), one).format(query=query)
    if haystack == "essay":
        sentences, start = ruler_sources.essay_sentences(), draw["start"]
        return Haystack(head, tail, prefix, " ", lambda i: sentences[(start + i) % len(sentences)], needles)
    if haystack == "noise":
        return Haystack(head.rstrip("\n"), tail, prefix, "\n", lambda i: NOISE, needles)
    fillers = draw["fillers"]
    return Haystack(head.rstrip("\n"), tail, prefix, "\n",
                    lambda i: NEEDLE.format(kind="numbers", key=fillers[i % len(fillers)][0], value=fillers[i % len(fillers)][1]), needles)


def _niah(haystacks: tuple[str, ...], **settings: int) -> Family:
    defaults = {"num_keys": 1, "num_values": 1, "num_queries": 1, **settings}
    return Family(haystacks, defaults, 128, _draw_niah, _layout_niah)


# -- variable tracking -------------------------------------------------------------------------------------------
def _variables(rng: random.Random, n: int, used: set[str]) -> list[str]:
    return _distinct(rng, lambda r: "".join(r.choices(string.ascii_uppercase, k=5)), n, used)


def _chain(variables: list[str], value: int) -> list[str]:
    return [f"VAR {variables[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(variables, variables[1:])]


def _draw_vt(rng: random.Random, s: dict[str, int], prompt_tokens: int, haystack: str) -> tuple[dict, list[str], list[str]]:
    used: set[str] = set()
    hops = s["num_hops"]
    chains = [_variables(rng, hops + 1, used) for _ in range(s["num_chains"])]
    values = rng.sample(range(10000, 100000), s["num_chains"] + 1)
    lines = [line for c, v in zip(chains, values) for line in _chain(c, v)]
    # each chain's lines in order, at increasing depths (RULER: sorted positions per chain)
    depths = [d for _ in chains for d in sorted(rng.sample(DEPTHS, hops + 1))]
    shot_vars = _variables(rng, hops + 1, used)
    shot_depths = sorted(rng.sample(range(VT_SHOT_SENTENCES + 1), hops + 1))
    draw = {"chains": chains, "values": values[:-1], "lines": lines, "depths": depths,
            "shot": {"variables": shot_vars, "value": values[-1], "slots": shot_depths}}
    return draw, chains[0], [v for c in chains[1:] for v in c] + shot_vars


def _layout_vt(draw: dict[str, Any], haystack: str) -> Haystack:
    hops = len(draw["chains"][0]) - 1
    shot = draw["shot"]
    lines = iter(_chain(shot["variables"], shot["value"]))
    body: list[str] = []
    for i in range(VT_SHOT_SENTENCES + 1):  # the worked example: its chain among a few noise sentences, and its answer
        body += [next(lines) for _ in range(shot["slots"].count(i))]
        if i < VT_SHOT_SENTENCES:
            body.append(NOISE)
    example = (VT_HEAD + "\n".join(body) + VT_TAIL.format(value=shot["value"]) +
               VT_PREFIX.format(n=hops + 1, value=shot["value"]) + " ".join(shot["variables"]) + "\n")
    chain_of = [i for i, c in enumerate(draw["chains"]) for _ in range(len(c))]
    needles = tuple(Needle(d, line, tuple(w for w in line.split() if w != "VAR" and w != "="))
                    for d, line, c in zip(draw["depths"], draw["lines"], chain_of) if c == 0)
    others = tuple(Needle(d, line, ()) for d, line, c in zip(draw["depths"], draw["lines"], chain_of) if c != 0)
    value = draw["values"][0]
    return Haystack(VT_HEAD.rstrip("\n"), VT_TAIL.format(value=value), VT_PREFIX.format(n=hops + 1, value=value), "\n",
                    lambda i: NOISE, needles + others, shot=example)


# -- common words ------------------------------------------------------------------------------------------------
def _word_pool() -> list[str]:
    return sorted(set(ruler_sources.words("noun")) | set(ruler_sources.words("adjective")) | set(ruler_sources.words("verb")))


def _draw_cwe(rng: random.Random, s: dict[str, int], prompt_tokens: int, haystack: str) -> tuple[dict, list[str], list[str]]:
    pool = _word_pool()
    words = rng.sample(pool, min(len(pool), prompt_tokens // 2 + 10))  # more distinct words than any budget holds
    shot = rng.sample(pool, 20)
    draw = {"words": words, "shot": shot, "order": rng.getrandbits(32), "shot_order": rng.getrandbits(32),
            "repeats": [30, 3] if prompt_tokens >= 4096 else [6, 1]}
    return draw, words[:10], words[10:]


def _numbered(words: list[str], common: set[str]) -> list[tuple[tuple[str, bool], ...]]:
    return [((f" {i + 1}.", False), (f" {w}", w in common)) for i, w in enumerate(words)]


def _listing(words: list[str], n: int, repeats: list[int], seed: int) -> list[str]:
    """RULER's list: the first 10 of `n` words `repeats[0]` times, the others `repeats[1]` times, shuffled."""
    listing = words[:10] * repeats[0] + words[10:n] * repeats[1]
    random.Random(seed).shuffle(listing)
    return listing


def _layout_cwe(draw: dict[str, Any], haystack: str) -> WordList:
    shot_list = _listing(draw["shot"], 20, [3, 1], draw["shot_order"])  # RULER's few-shot example below 4k tokens
    shot = (CWE_HEAD + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_list)) + CWE_TAIL + CWE_PREFIX + " " +
            " ".join(f"{i + 1}. {w}" for i, w in enumerate(draw["shot"][:10])) + "\n")
    words, repeats, common = draw["words"], draw["repeats"], set(draw["words"][:10])
    return WordList(CWE_HEAD.rstrip("\n") + "\n", CWE_TAIL, CWE_PREFIX,
                    lambda n: _numbered(_listing(words, n, repeats, draw["order"] + n), common), 10, len(words), shot=shot)


# -- frequent words ----------------------------------------------------------------------------------------------
def _zeta(alpha: float, terms: int = 10000) -> float:
    """Riemann zeta(alpha), alpha > 1: the partial sum and the Euler-Maclaurin tail (error < 1e-12 for alpha = 2)."""
    return sum(k**-alpha for k in range(1, terms)) + terms ** (1 - alpha) / (alpha - 1) + 0.5 * terms**-alpha


def _draw_fwe(rng: random.Random, s: dict[str, int], prompt_tokens: int, haystack: str) -> tuple[dict, list[str], list[str]]:
    size = max(prompt_tokens // 50, 8)  # RULER's vocabulary: max_seq_length // 50 coded words
    vocab = _distinct(rng, lambda r: "".join(r.choices(string.ascii_lowercase, k=6)), size, set())
    vocab[0] = "..."  # RULER: the most frequent word is noise, the answer the next three
    return {"vocab": vocab, "order": rng.getrandbits(32)}, vocab[1:4], vocab[4:]


def _layout_fwe(draw: dict[str, Any], haystack: str) -> WordList:
    vocab, answers, zeta = draw["vocab"], set(draw["vocab"][1:4]), _zeta(2.0)

    def items(n: int) -> list[tuple[tuple[str, bool], ...]]:
        counts = [int(n * k**-2.0 / zeta) for k in range(1, len(vocab) + 1)]
        text = [w for w, c in zip(vocab, counts) for _ in range(c)]
        random.Random(draw["order"] + n).shuffle(text)
        return [((f" {w}", w in answers),) for w in text]

    return WordList(FWE_HEAD, FWE_TAIL, FWE_PREFIX, items, 10, 10**7)


FAMILIES: dict[str, Family] = {
    "niah_single": _niah(("essay", "noise")),
    "niah_multikey": _niah(("essay", "needle"), num_keys=4),
    "niah_multivalue": _niah(("essay", "noise"), num_values=4),
    "niah_multiquery": _niah(("essay", "noise"), num_keys=4, num_queries=4),
    "vt": Family(("noise",), {"num_chains": 1, "num_hops": 4}, 30, _draw_vt, _layout_vt),
    "cwe": Family(("list",), {}, 120, _draw_cwe, _layout_cwe),
    "fwe": Family(("coded",), {}, 50, _draw_fwe, _layout_fwe),
}
SETTINGS = ("num_keys", "num_values", "num_queries", "num_chains", "num_hops")


def settings_of(family: str, haystack: str, given: dict[str, int | None]) -> dict[str, int]:
    """The family's settings with the user's (non-null) ones over them; a setting the family has none of is refused.
    RULER's multikey in a haystack of needles (niah_multikey_2) has one real key: the haystack holds the others."""
    table = FAMILIES[family]
    out = dict(table.settings)
    if family == "niah_multikey" and haystack == "needle":
        out["num_keys"] = 1
    for key, value in given.items():
        if value is None:
            continue
        if key not in out:
            raise ValueError(f"task.{key}={value} is not allowed with task.family={family}: it has "
                             f"{', '.join('task.' + k for k in out) or 'no such settings'}")
        out[key] = value
    return out

