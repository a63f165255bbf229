"""A corpus of the target's own answers, looked up like the context (retrieval drafting, as REST does).

A small model answers in recurring phrases ("Here is a Python function that", "I hope this
helps!"), so the tokens that followed the same few tokens in its *own earlier answers* are a good
guess at what follows now, even in text that never repeats itself. A ``Corpus`` holds such answers
(the response tokens of ``selfspec gen-data`` directories: the target's greedy answers) and an
index from every n-gram (``CORPUS_MIN_NGRAM`` .. ``CORPUS_MAX_NGRAM`` tokens) to where it ended.

``continuation(ids, k)`` takes the longest suffix of ``ids`` that occurs in the corpus and walks
forward through its occurrences by majority vote: the most common next token, then among the
occurrences that agree, the most common one after it, and so on, while the vote is strong enough
(at least ``min_count`` occurrences and ``min_share`` of them agree). The lookup grafts that chain
where the context itself has no match (``drafters/lookup.py``). It is only a proposal: acceptance
is unchanged, so output stays exactly the target's. A proposal costs no model call, and a query
is a dictionary lookup per n-gram length.

On disk (``selfspec build-corpus``): ``config.json`` (kind "corpus", base model name and config
fingerprint, vocabulary size, counts, sources) and ``corpus.npz`` (numpy's compressed archive, read
with pickling off) with one array, ``tokens``: the answers one after another, each followed by a
separator, as uint16 when the vocabulary fits below 65,535 (the separator is 65,535) or else int32
(the separator is -1). Token ids compress well: the demo model's 1.8M tokens take 1.4 MB.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import __version__
from .io import SHARED_FILE_MODE, atomic_dir
from .settings import CORPUS_MAX_NGRAM, CORPUS_MIN_COUNT, CORPUS_MIN_NGRAM, CORPUS_MIN_SHARE

SEPARATOR = -1           # ends each answer: no n-gram or continuation crosses it
_U16_SEPARATOR = 0xFFFF  # the separator in a uint16 file
CORPUS_FILE = "corpus.npz"
MAX_OCCURRENCES = 512    # votes counted per lookup (the first occurrences in corpus order)
_MULT = np.uint64(0x9E3779B97F4A7C15)   # n-gram hash: h = h * _MULT + (token + 2), mod 2^64


@dataclass
class CorpusConfig:
    base_model: str
    base_fingerprint: str
    vocab_size: int
    sequences: int
    tokens: int
    sources: list = field(default_factory=list)   # [{"path", "sequences", "tokens"}]
    kind: str = "corpus"
    selfspec_version: str = __version__


def _hashes(tokens: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Hash of every n-gram of ``tokens`` that holds no separator, and the index just after it."""
    count = len(tokens) - n + 1
    if count <= 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    h = np.zeros(count, np.uint64)
    clean = np.ones(count, bool)
    with np.errstate(over="ignore"):
        for j in range(n):
            part = tokens[j:j + count]
            h = h * _MULT + (part + 2).astype(np.uint64)
            clean &= part != SEPARATOR
    return h[clean], np.nonzero(clean)[0] + n


def _hash(ngram) -> np.uint64:
    return _hashes(np.asarray(ngram, dtype=np.int64), len(ngram))[0][0]


class Corpus:
    """Answers of one model, indexed by n-gram; ``continuation`` proposes what followed."""

    def __init__(self, tokens: np.ndarray, config: CorpusConfig):
        self.tokens = np.asarray(tokens, dtype=np.int64)         # answers, each ended by SEPARATOR
        self.config = config
        # n -> (sorted n-gram hashes, the index after each n-gram in that order)
        self.index: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for n in range(CORPUS_MIN_NGRAM, CORPUS_MAX_NGRAM + 1):
            h, ends = _hashes(self.tokens, n)
            order = np.argsort(h, kind="stable")                 # stable: equal n-grams stay in corpus order
            self.index[n] = (h[order], ends[order])

    @classmethod
    def from_answers(cls, answers: list[list[int]], *, base_model: str, base_fingerprint: str, vocab_size: int,
                     sources: list | None = None) -> "Corpus":
        if not answers or not any(answers):
            raise ValueError("a corpus needs at least one non-empty answer")
        tokens = np.concatenate([np.append(np.asarray(a, dtype=np.int64), SEPARATOR) for a in answers if a])
        if tokens.max() >= vocab_size:
            raise ValueError(f"token id {int(tokens.max())} is outside the model's vocabulary of {vocab_size}")
        config = CorpusConfig(base_model=base_model, base_fingerprint=base_fingerprint, vocab_size=vocab_size,
                              sequences=int((tokens == SEPARATOR).sum()), tokens=int((tokens != SEPARATOR).sum()),
                              sources=list(sources or []))
        return cls(tokens, config)

    # ------------------------------------------------------------------ lookup
    def continuation(self, ids, k: int, *, min_count: int = CORPUS_MIN_COUNT,
                     min_share: float = CORPUS_MIN_SHARE) -> list[int]:
        """Up to k tokens that followed the longest suffix of ``ids`` (``CORPUS_MAX_NGRAM`` tokens, down
        to ``CORPUS_MIN_NGRAM``) in the corpus, by majority vote over its occurrences, stopping where
        fewer than ``min_count`` occurrences, or less than ``min_share`` of them, agree; [] if none."""
        if k <= 0:
            return []
        tail = [int(t) for t in ids[-CORPUS_MAX_NGRAM:]]
        for n in range(min(CORPUS_MAX_NGRAM, len(tail)), CORPUS_MIN_NGRAM - 1, -1):
            suffix = np.asarray(tail[-n:], dtype=np.int64)
            keys, ends = self.index[n]
            key = _hash(suffix)
            lo, hi = np.searchsorted(keys, key, "left"), np.searchsorted(keys, key, "right")
            at = ends[lo:hi]
            # A hash match is checked token by token (vocabularies of any size hash with collisions).
            at = at[(self.tokens[at[:, None] - n + np.arange(n)] == suffix).all(axis=1)] if len(at) else at
            if len(at):
                return self._vote(at[:MAX_OCCURRENCES], k, min_count, min_share)
        return []

    def _vote(self, at: np.ndarray, k: int, min_count: int, min_share: float) -> list[int]:
        """Walk forward from occurrences ``at`` (the index after each match), token by token by majority."""
        chain: list[int] = []
        last = len(self.tokens) - 1
        for _ in range(k):
            nxt = self.tokens[np.minimum(at, last)]               # each answer ends in SEPARATOR, so never past it
            real = nxt[nxt != SEPARATOR]
            if not len(real):
                break
            values, counts = np.unique(real, return_counts=True)
            best = int(counts.argmax())
            if counts[best] < min_count or counts[best] < min_share * len(nxt):
                break
            chain.append(int(values[best]))
            at = at[nxt == values[best]] + 1
        return chain

    # ------------------------------------------------------------------ files
    def save(self, directory: str | os.PathLike) -> None:
        """Write ``directory`` whole (atomically: a failed save leaves what was there)."""
        small = self.config.vocab_size < _U16_SEPARATOR      # then 65,535 marks an answer's end, never a token
        stored = np.where(self.tokens == SEPARATOR, _U16_SEPARATOR, self.tokens).astype(np.uint16) if small \
            else self.tokens.astype(np.int32)
        with atomic_dir(directory) as tmp:
            np.savez_compressed(tmp / CORPUS_FILE, tokens=stored)
            (tmp / "config.json").write_text(json.dumps(asdict(self.config), indent=2) + "\n")
            for f in tmp.iterdir():
                f.chmod(SHARED_FILE_MODE)


def is_corpus_dir(directory: str | os.PathLike) -> bool:
    """Whether ``directory``'s config.json says it is a corpus (whole or not: ``read_corpus_config`` then
    says what is wrong with it)."""
    try:
        return json.loads((Path(directory) / "config.json").read_text()).get("kind") == "corpus"
    except (OSError, ValueError, AttributeError):
        return False


def read_corpus_config(directory: str | os.PathLike) -> CorpusConfig:
    """The config of a corpus directory, or a one-line ValueError saying what is wrong with it."""
    path = Path(directory)
    if not (path / "config.json").is_file() or not (path / CORPUS_FILE).is_file():
        raise ValueError(f"{directory} is not a corpus directory (config.json and {CORPUS_FILE}): "
                         "make one with `selfspec build-corpus`")
    try:
        raw = json.loads((path / "config.json").read_text())
        if raw.get("kind") != "corpus":
            raise ValueError
        return CorpusConfig(**raw)
    except (ValueError, TypeError):
        raise ValueError(f"{path / 'config.json'} is not a corpus config: rebuild it with `selfspec build-corpus`") from None


def load_corpus(directory: str | os.PathLike, *, fingerprint: str) -> Corpus:
    """Load and index a corpus directory; refuse one made for a model of another shape."""
    config = read_corpus_config(directory)
    if config.base_fingerprint != fingerprint:
        raise ValueError(f"{directory} holds answers of {config.base_model!r} (config fingerprint "
                         f"{config.base_fingerprint}), not of this model ({fingerprint}): build one with "
                         "`selfspec build-corpus --model MODEL --data DIR`")
    try:
        with np.load(Path(directory) / CORPUS_FILE, allow_pickle=False) as f:
            stored = f["tokens"]
    except (OSError, ValueError, KeyError, EOFError) as e:
        raise ValueError(f"{Path(directory) / CORPUS_FILE} cannot be read ({type(e).__name__}): rebuild it with "
                         "`selfspec build-corpus`") from None
    tokens = stored.astype(np.int64)
    if stored.dtype == np.uint16:
        tokens[stored == _U16_SEPARATOR] = SEPARATOR
    return Corpus(tokens, config)
