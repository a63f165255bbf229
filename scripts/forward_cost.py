"""What one target forward of k new tokens costs on this machine: the budget every draft tree must fit.

    python scripts/forward_cost.py [--model smollm2-135m] [--threads 2] [--context 256] [--ks 1,2,3,4,5,8,16]

Times (median of warm repeats) a cached forward of k new tokens after a ``--context``-token prefix,
and the LM head alone on k rows, and prints each relative to k = 1. On CPUs whose BLAS runs a
2- or 3-row matrix product no faster per row than a matrix-vector product, k = 2..3 can cost
more than k = 4..8; `selfspec tune-tree` measures speed end to end for this reason.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--ks", default="1,2,3,4,5,8,16")
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from selfspec import cache as kv
    from selfspec.backbone import Backbone
    from selfspec.loading import load_model

    model = load_model(a.model).model
    bb = Backbone(model)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, 10_000, (1, a.context), generator=g)
    rows = []
    with torch.no_grad():
        cache = kv.new_cache()
        model(prefix, past_key_values=cache, use_cache=True)
        for k in (int(x) for x in a.ks.split(",")):
            x = torch.randint(100, 10_000, (1, k), generator=g)
            h = torch.randn(1, k, model.config.hidden_size, generator=g)
            fwd, head = [], []
            for _ in range(a.repeats):
                t = time.perf_counter()
                model(x, past_key_values=cache, use_cache=True)
                fwd.append(time.perf_counter() - t)
                kv.truncate(cache, a.context)
                t = time.perf_counter()
                bb.logits(h)
                head.append(time.perf_counter() - t)
            rows.append((k, statistics.median(fwd[3:]) * 1e3, statistics.median(head[3:]) * 1e3))
    base = rows[0][1]
    print(f"{a.model}, {a.threads} threads, {a.context}-token context, torch {torch.__version__}")
    print("| k | forward ms | x k=1 | LM head ms |\n|---|---|---|---|")
    for k, f, h in rows:
        print(f"| {k} | {f:.1f} | {f / base:.2f} | {h:.1f} |")


if __name__ == "__main__":
    main()
