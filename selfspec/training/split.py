"""The training data side: sequences, the held-out split, batches and the draft vocabulary.

Batches are a pure function of (seed, step), so a resumed run sees the batches an uninterrupted run
would have; the held-out split of a finished run can be rebuilt from what its heads recorded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..heads import Heads


@dataclass(frozen=True)
class Sequence:
    ids: torch.Tensor        # (L,) int64: prompt then response
    response_start: int


@dataclass
class Batch:
    """One padded micro-batch and the window of rows that carry training signal."""

    input_ids: torch.Tensor       # (B, L) right-padded
    attention_mask: torch.Tensor  # (B, L)
    window: torch.Tensor          # (B, W) positions (into L) the heads read
    mask: torch.Tensor            # (B, W) bool: the target row at that position is a response row
    next_tokens: torch.Tensor     # (B, W) the token that followed each window position


def frequent_vocab(dataset, size: int, *, vocab_size: int, eos_token_ids=()) -> torch.Tensor | None:
    """The ``size`` most frequent response token ids (EOS always included), sorted; None = full vocabulary.

    A draft vocabulary: the heads score only these rows of the LM head, which makes their training
    and drafting much cheaper (the full LM head dominates both), at the cost of never proposing a
    rare token. Ties go to the smaller id, so the result is a pure function of the data.
    """
    if size <= 0 or size >= vocab_size:
        return None
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids, start in zip(dataset["input_ids"], dataset["response_start"]):
        counts += torch.bincount(torch.as_tensor(ids[start:], dtype=torch.int64), minlength=vocab_size)
    forced = sorted({int(e) for e in eos_token_ids if 0 <= int(e) < vocab_size})
    counts[forced] = torch.iinfo(torch.int64).max  # EOS first: a draft must be able to end
    order = torch.sort(-counts, stable=True).indices  # stable: ties keep ascending ids
    return order[:size].sort().values


def to_sequences(dataset, *, max_len: int) -> list[Sequence]:
    """Rows with at least one response token, each cut to its last ``max_len`` tokens."""
    out = []
    for ids, start in zip(dataset["input_ids"], dataset["response_start"]):
        ids = torch.as_tensor(ids, dtype=torch.int64)
        cut = max(0, len(ids) - max_len)
        start = max(int(start) - cut, 1)  # position 0 has no target row before it
        if start < len(ids):
            out.append(Sequence(ids=ids[cut:], response_start=start))
    return out


def split_eval(n: int, *, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) indices: a seeded random ``fraction`` is held out (at least one when n > 1 and fraction > 0)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = 0 if fraction <= 0 or n < 2 else min(n - 1, max(1, round(fraction * n)))
    return sorted(perm[n_eval:]), sorted(perm[:n_eval])


def run_split(dataset, *, max_len: int, fraction: float, seed: int) -> tuple[list[Sequence], list[int], list[int]]:
    """A training run's sequences (``to_sequences``) and its seeded (train, eval) split of them; ValueError
    where no row has a response token."""
    seqs = to_sequences(dataset, max_len=max_len)
    if not seqs:
        raise ValueError("the data has no sequence with a response token: generate some with `selfspec gen-data`")
    return (seqs, *split_eval(len(seqs), fraction=fraction, seed=seed))


def content_key(s: Sequence) -> tuple[bytes, int]:
    """What identifies a sequence across data directories: its tokens and where its response starts."""
    return s.ids.numpy().tobytes(), s.response_start


def recorded_split(data_dir: str, heads: Heads) -> tuple[list[Sequence], list[Sequence]]:
    """(trained on, held out): the split of the run that produced ``heads``, rebuilt from what it recorded.

    Data directories only grow by appended shards, so a run's rows are the first ``rows[i]`` of each
    directory now; the split is recomputed over exactly those, never over rows added later (which
    would move training sequences into the "held-out" set). A warm-started run records its held-out
    rows outright (``held_out_rows``: its split keeps its init's, see :func:`warm_split`). Heads saved
    before per-directory row counts were recorded carry only a sequence count, which pins a single
    directory the same way.
    """
    from .data import load_distillation_data

    prov = heads.config.provenance
    tc = prov.get("train_config") or {}
    rows = prov.get("rows")
    seqs = to_sequences(load_distillation_data(data_dir, rows=rows), max_len=tc.get("max_len", 1024))
    if rows is None:
        n = prov.get("sequences", len(seqs))
        if n > len(seqs):
            raise ValueError(f"the heads were trained on {n} sequences but {data_dir} holds {len(seqs)}: "
                             "pass the data directory they were trained on")
        seqs = seqs[:n]
    held = decode_rows(prov.get("held_out_rows"))
    if held is None:
        _, held = split_eval(len(seqs), fraction=tc.get("eval_fraction", 0.05), seed=tc.get("seed", 0))
    held_set = set(held)
    return [s for i, s in enumerate(seqs) if i not in held_set], [seqs[i] for i in held]


def encode_rows(rows: list[int]) -> str:
    """Row indices as one compact string for a config: runs of consecutive rows as "a-b" ("3,17,22-25")."""
    out, rows = [], sorted(rows)
    i = 0
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and rows[j + 1] == rows[j] + 1:
            j += 1
        out.append(str(rows[i]) if i == j else f"{rows[i]}-{rows[j]}")
        i = j + 1
    return ",".join(out)


def decode_rows(value) -> list[int] | None:
    """:func:`encode_rows`'s string (or the plain list older configs hold) -> sorted row indices."""
    if value is None or isinstance(value, list):
        return value
    rows = []
    for part in filter(None, str(value).split(",")):
        lo, _, hi = part.partition("-")
        rows.extend(range(int(lo), int(hi or lo) + 1))
    return rows


def warm_split(seqs: list[Sequence], eval_idx: list[int], init: Heads) -> tuple[list[int], list[int]]:
    """(train, eval) indices for a run warm-started from ``init``: whatever ``init`` held out stays held
    out, and whatever it trained on is never scored as held-out. Sequences are matched by content,
    so the init's data may sit anywhere in this run's (larger) data."""
    data = init.config.provenance.get("data")
    if not data:
        raise ValueError("the --init heads do not record their training data, so their held-out split cannot be kept: "
                         "train from scratch instead")
    from .data import data_dirs

    missing = [str(d) for d in data_dirs(data) if not (d / "meta.json").is_file()]
    if missing:
        raise ValueError(f"the --init heads were trained on {', '.join(missing)}, which is not here, so their held-out "
                         "split cannot be kept: make that data again (the heads' README says how) or train from scratch")
    init_train, init_held = recorded_split(data, init)
    trained, held = {content_key(s) for s in init_train}, {content_key(s) for s in init_held}
    chosen = set(eval_idx)
    keys = [content_key(s) for s in seqs]
    eval_new = [i for i, k in enumerate(keys) if k in held or (i in chosen and k not in trained)]
    eval_set = set(eval_new)
    return [i for i in range(len(seqs)) if i not in eval_set], eval_new


# With length grouping, each epoch's permutation is cut into runs of this many micro-batches, each
# run is sorted by length and cut into micro-batches, and those are shuffled: a batch pads to its
# longest sequence, and random batches of the broad data were over half padding.
GROUP_BATCHES = 64


@functools.lru_cache(maxsize=4)
def epoch_order(n: int, *, epoch: int, seed: int, batch_size: int, lengths: tuple[int, ...] | None) -> tuple[int, ...]:
    """The order of the n training sequences in ``epoch``: a seeded permutation; with ``lengths``, that
    permutation's runs of ``GROUP_BATCHES`` micro-batches sorted by length and cut into micro-batches,
    which are then shuffled (seeded). The last run's short remainder (n mod batch_size sequences, a
    different random few each epoch) is left out, so every micro-batch is whole and length-grouped."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
    if lengths is None:
        return tuple(perm)
    if len(lengths) != n:
        raise ValueError(f"{len(lengths)} lengths for {n} sequences")
    span = batch_size * GROUP_BATCHES
    batches = []
    for at in range(0, n, span):
        run = sorted(perm[at:at + span], key=lambda i: -lengths[i])   # stable: ties keep the permutation's order
        batches += [run[b:b + batch_size] for b in range(0, len(run) - batch_size + 1, batch_size)]
    shuffle = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seed * 100_003 + epoch + 50_000_017))
    return tuple(i for b in shuffle.tolist() for i in batches[b])


def length_batches(seqs: list[Sequence], batch_size: int) -> list[list[int]]:
    """Indices of ``seqs`` in batches of ``batch_size`` by increasing length, for passes whose results do
    not depend on batching (held-out scores, the feature cache): a batch pads to its longest."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].ids))
    return [order[lo:lo + batch_size] for lo in range(0, len(order), batch_size)]


def batch_indices(n: int, *, micro_step: int, batch_size: int, seed: int,
                  lengths: tuple[int, ...] | None = None) -> list[int]:
    """Indices for global micro-batch ``micro_step``: consecutive slices of per-epoch orders
    (``epoch_order``; micro-batches of similar lengths when ``lengths`` is given and n >= batch_size).

    A pure function of (seed, micro_step), so resuming needs nothing but the step counter.
    """
    if lengths is not None and n >= batch_size:
        epoch, b = divmod(micro_step, n // batch_size)
        order = epoch_order(n, epoch=epoch, seed=seed, batch_size=batch_size, lengths=lengths)
        return list(order[b * batch_size:(b + 1) * batch_size])
    out, offset = [], micro_step * batch_size
    while len(out) < batch_size:
        epoch, pos = divmod(offset, n)
        order = epoch_order(n, epoch=epoch, seed=seed, batch_size=batch_size, lengths=None)
        take = list(order[pos : pos + batch_size - len(out)])
        out += take
        offset += len(take)
    return out


def collate(seqs: list[Sequence], *, lead: int, pad_id: int = 0) -> Batch:
    """Right-pad and pick each sequence's window.

    Target rows with signal are s in [start - 1, L - 2] (they predict the response tokens). The
    heads at position t learn from rows up to t + lead (lead = K for Medusa's last head, 0 for
    exit), so the window runs from max(start - 1 - lead, 0) to L - 2.
    """
    B, L = len(seqs), max(len(s.ids) for s in seqs)
    input_ids = torch.full((B, L), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((B, L), dtype=torch.int64)
    starts, ends = [], []
    for i, s in enumerate(seqs):
        input_ids[i, : len(s.ids)] = s.ids
        attention_mask[i, : len(s.ids)] = 1
        starts.append(max(s.response_start - 1 - lead, 0))
        ends.append(len(s.ids) - 1)  # exclusive: row L - 1 predicts past the end
    W = max(e - b for b, e in zip(starts, ends))
    start_t, end_t = torch.tensor(starts)[:, None], torch.tensor(ends)[:, None]
    pos = start_t + torch.arange(W)[None]  # (B, W)
    rs = torch.tensor([s.response_start for s in seqs])[:, None]
    mask = (pos >= rs - 1) & (pos < end_t)
    window = pos.clamp(max=L - 1)
    next_tokens = input_ids.gather(1, (window + 1).clamp(max=L - 1))
    return Batch(input_ids=input_ids, attention_mask=attention_mask, window=window, mask=mask, next_tokens=next_tokens)
