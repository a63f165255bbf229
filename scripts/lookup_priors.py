"""How often a chain copied from the context is accepted, by the length of the match that found it.

    python scripts/lookup_priors.py training/data/smollm2-135m-broad-cpu [more data dirs] [--last 300]

Reads the target's own answers (``selfspec gen-data`` output: prompt + answer token ids) and replays
the lookup over each answer step by step, as the lookup drafter decodes it: at each step the
context's best match (``selfspec.drafters.lookup.context_match``, down to a single token) proposes
a chain, the answer says how much of it the target would accept, and decoding moves on by that
many tokens plus one. Greedy answers give greedy acceptance exactly; answers sampled at a
temperature give the sampled chance (a copied token is accepted with the target's probability of
it, which is how often a sampled answer continues as the copy does). Prints, per match length
(1, 2, 3, and 4 or more tokens), the share of first copied tokens accepted and of next ones given
the one before: the values of ``settings.COPY_ACCEPT_BY_MATCH`` (pool greedy data dirs) and
``COPY_ACCEPT_SAMPLED_BY_MATCH`` (sampled ones).
"""

from __future__ import annotations

import argparse
import sys

from selfspec.drafters.lookup import MAX_NGRAM, context_match
from selfspec.training.data import load_distillation_data

CHAIN = 12   # tokens copied per step (the longest lookup a shipped setting uses)


def replay(prompt: list[int], answer: list[int], counts: dict[int, list[int]]) -> None:
    """Decode ``answer`` after ``prompt`` with the lookup alone, adding to counts[n] = [first tried,
    first accepted, next tried, next accepted] for each chain's match length n."""
    ids, j = prompt + answer[:1], 1
    while j < len(answer):
        chain, n = context_match(ids, CHAIN, min_ngram=1)
        a = 0
        while j + a < len(answer) and a < len(chain) and answer[j + a] == chain[a]:
            a += 1
        if chain:
            c = counts.setdefault(n, [0, 0, 0, 0])
            c[0] += 1
            c[1] += a > 0
            c[2] += max(0, min(a, len(chain) - 1, len(answer) - j - 1))   # next tokens tried after an accepted one
            c[3] += max(0, a - 1)
        step = min(a + 1, len(answer) - j)
        ids, j = ids + answer[j: j + step], j + step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", nargs="+", help="gen-data output directories")
    ap.add_argument("--last", type=int, default=300, help="answers read from the end of each directory (default 300)")
    a = ap.parse_args()
    if a.last < 1:
        ap.error(f"--last must be >= 1 (got {a.last})")
    counts: dict[int, list[int]] = {}
    for d in a.data:
        try:
            ds = load_distillation_data(d)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        for r in ds.select(range(max(0, len(ds) - a.last), len(ds))):
            start = r["response_start"]
            replay(list(r["input_ids"][:start]), list(r["input_ids"][start: start + r["n_response"]]), counts)
    print("| match (tokens) | chains | first accepted | next accepted, given the one before |\n|---|---|---|---|")
    for n in sorted(counts):
        tried, first, nxt_tried, nxt = counts[n]
        label = f"{n} or more" if n == MAX_NGRAM else str(n)
        print(f"| {label} | {tried} | {first / tried:.2f} | {nxt / max(nxt_tried, 1):.2f} |")


if __name__ == "__main__":
    main()
