"""What the back-off (``selfspec/runtime/backoff.py``) makes of drafters that pay or lose, on synthetic steps.

    python scripts/backoff_sim.py [--seeds 30] [--decodes 10] [--new 128]

No model runs: each simulated decode makes ``--new`` tokens, a plain step commits 1 token in 1 s, a drafted
step commits a random number of tokens (greedy-like: 1-4, mean 1.73; sampled-like: 1-4, mean 2.05) in the
time that gives the drafter the share of the plain rate in the column heading, and every step's time is
scaled by timing noise (log-normal, sigma as in the row). The back-off decides each step, as in decoding,
over ``--decodes`` decodes in a row (its hold carries over). Each cell is the rate it reached over the
best of always plain and always drafting (1.000: it lost nothing to probing or to doubt), the mean over
``--seeds`` seeds.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics

from selfspec.runtime.backoff import Backoff

TOKENS = {"greedy": {1: 0.55, 2: 0.25, 3: 0.12, 4: 0.08}, "sampled": {1: 0.45, 2: 0.2, 3: 0.2, 4: 0.15}}
SHARES = (0.85, 0.93, 0.97, 1.0, 1.05, 1.1, 1.2, 1.4)


def realized(share: float, tokens: dict[int, float], noise: float, seed: int, decodes: int, new: int) -> float:
    """Tokens a second the back-off reached, over the better of the plain rate and ``share`` of it."""
    rng = random.Random(seed)
    counts, weights = zip(*tokens.items())
    cost = sum(c * w for c, w in tokens.items()) / share   # seconds a drafted step takes
    backoff, made, spent = Backoff(), 0, 0.0
    for _ in range(decodes):
        backoff.start()
        done = 0
        while done < new:
            drafted = backoff.draft_now()
            n = rng.choices(counts, weights=weights)[0] if drafted else 1
            seconds = (cost if drafted else 1.0) * rng.lognormvariate(0.0, noise)
            backoff.record(1, n, seconds, drafted)
            done, made, spent = done + n, made + n, spent + seconds
    return made / spent * math.exp(noise ** 2 / 2) / max(1.0, share)   # (the noise's mean factor taken out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--decodes", type=int, default=10)
    ap.add_argument("--new", type=int, default=128, help="tokens per decode")
    a = ap.parse_args()
    if min(a.seeds, a.decodes, a.new) < 1:
        ap.error("--seeds, --decodes and --new must be at least 1")
    print("| steps | noise | " + " | ".join(f"{s:.2f}x" for s in SHARES) + " |")
    print("|---|---|" + "---|" * len(SHARES))
    for name, tokens in TOKENS.items():
        for noise in (0.05, 0.15):
            cells = [statistics.mean(realized(s, tokens, noise, seed, a.decodes, a.new) for seed in range(a.seeds))
                     for s in SHARES]
            print(f"| {name} | {noise} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
