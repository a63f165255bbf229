"""What one target forward of k new tokens costs on this machine: the curve every draft tree must fit.

    python scripts/forward_cost.py [--model smollm2-135m] [--threads 2] [--context 256] [--ks 1,2,4,8,16]

Times (median of warm repeats, interleaved) a cached forward of k new tokens after a ``--context``-token
prefix, through transformers' own forward and through selfspec's pass (the same layers on selfspec's
KV cache), each relative to transformers' k = 1. Where k = 8 costs little more than k = 1 (a GPU),
wide trees pay; where it costs twice as much (many CPUs), only likely drafts do. Width fitting measures
this curve itself at first use (``selfspec/runtime/width.py``); this script shows it.
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
    ap.add_argument("--ks", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    if a.repeats < 4:
        ap.error("--repeats must be at least 4: the first 3 of each are warm-up, not timed")
    torch.set_num_threads(a.threads)
    from transformers import DynamicCache

    from selfspec.bench.methods import CACHE_KWARG
    from selfspec.core import cache as kv
    from selfspec.core.backbone import Backbone
    from selfspec.loading import load_model

    model = load_model(a.model).model
    bb = Backbone(model)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, 10_000, (1, a.context), generator=g)
    rows = []
    with torch.no_grad():
        # transformers' forward on its own DynamicCache; selfspec's layers on selfspec's KVCache
        hf_cache = DynamicCache(config=model.config)
        model(prefix, **{CACHE_KWARG: hf_cache}, use_cache=True)
        cache = kv.new_cache()
        bb.run_layers(bb.embed(prefix[0]), start=0, end=bb.num_layers, position_ids=torch.arange(a.context)[None],
                      attention_mask=None, cache=cache)
        for k in (int(x) for x in a.ks.split(",")):
            x = torch.randint(100, 10_000, (1, k), generator=g)
            t = {"hf": [], "ours": []}
            for _ in range(a.repeats):
                for name, fn in (("hf", lambda: model(x, **{CACHE_KWARG: hf_cache}, use_cache=True)),
                                 ("ours", lambda: _ours(bb, x, cache, a.context))):
                    t0 = time.perf_counter()
                    fn()
                    t[name].append(time.perf_counter() - t0)
                    kv.truncate(cache, a.context)
                    if hf_cache.get_seq_length() > a.context:   # transformers 5: crop(-n) removes n tokens
                        hf_cache.crop(a.context - hf_cache.get_seq_length())
            rows.append((k, {n: statistics.median(v[3:]) * 1e3 for n, v in t.items()}))
    base = rows[0][1]["hf"]
    print(f"{a.model}, {a.threads} threads, {a.context}-token context, torch {torch.__version__}")
    print("| k | transformers forward ms | x k=1 | selfspec forward ms | x k=1 |\n|---|---|---|---|---|")
    for k, m in rows:
        print(f"| {k} | {m['hf']:.1f} | {m['hf'] / base:.2f} | {m['ours']:.1f} | {m['ours'] / base:.2f} |")


def _ours(bb, x, cache, start):
    """k new tokens (1, k) through selfspec's layers and LM head."""
    k = x.shape[1]
    h = bb.run_layers(bb.embed(x[0]), start=0, end=bb.num_layers, position_ids=torch.arange(start, start + k)[None],
                      attention_mask=None, cache=cache)
    return bb.logits(bb.final_norm(h))


if __name__ == "__main__":
    main()
