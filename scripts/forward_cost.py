"""What one target forward of k new tokens costs on this machine: the budget every draft tree must fit.

    python scripts/forward_cost.py [--model smollm2-135m] [--threads 2] [--context 256] [--ks 1,2,3,4,5,8,16]

Times (median of warm repeats, interleaved) a cached forward of k new tokens after a
``--context``-token prefix: transformers' own forward (``F.linear`` throughout) and the same
layers as selfspec decodes them (selfspec/projection.py: the LM head and the layers' few-row
products in the layout timed fastest for k rows), and the LM head alone both ways, each relative to transformers' k = 1. On CPUs whose BLAS
runs a 2- or 3-row matrix product no faster per row than a matrix-vector product, k = 2..3 can
cost more than k = 4..8; `selfspec tune-tree` measures speed end to end for this reason.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn import functional as F


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--ks", default="1,2,3,4,5,8,16")
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    if a.repeats < 4:
        ap.error("--repeats must be at least 4: the first 3 of each are warm-up, not timed")
    torch.set_num_threads(a.threads)
    from selfspec import cache as kv
    from selfspec.backbone import Backbone
    from selfspec.loading import load_model
    from selfspec.projection import few_row_linears
    from selfspec.bench.methods import CACHE_KWARG
    from transformers import DynamicCache

    model = load_model(a.model).model
    bb = Backbone(model)
    linears = few_row_linears(model)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, 10_000, (1, a.context), generator=g)
    rows = []
    with torch.no_grad():
        # transformers' forward on its own DynamicCache; selfspec's layers on selfspec's KVCache
        hf_cache = DynamicCache(config=model.config)
        model(prefix, **{CACHE_KWARG: hf_cache}, use_cache=True)   # "cache" from transformers 5.24 on
        cache = kv.new_cache()
        bb.run_layers(bb.embed(prefix[0]), start=0, end=bb.num_layers, position_ids=torch.arange(a.context)[None],
                      attention_mask=None, cache=cache)
        for k in (int(x) for x in a.ks.split(",")):
            x = torch.randint(100, 10_000, (1, k), generator=g)
            h = torch.randn(1, k, model.config.hidden_size, generator=g)
            bb.logits(h)  # the projections time their layouts for k rows once, here
            _ours(bb, linears, x, cache, a.context)
            kv.truncate(cache, a.context)
            t = {"hf": [], "ours": [], "linear": [], "head": []}
            for _ in range(a.repeats):
                for name, fn in (("hf", lambda: model(x, **{CACHE_KWARG: hf_cache}, use_cache=True)),
                                 ("ours", lambda: _ours(bb, linears, x, cache, a.context)),
                                 ("linear", lambda: F.linear(h, bb.lm_head.weight)),
                                 ("head", lambda: bb.logits(h))):
                    t0 = time.perf_counter()
                    fn()
                    t[name].append(time.perf_counter() - t0)
                    kv.truncate(cache, a.context)
                    if hf_cache.get_seq_length() > a.context:   # transformers 5: crop(-n) removes n tokens
                        hf_cache.crop(a.context - hf_cache.get_seq_length())
            rows.append((k, {n: statistics.median(v[3:]) * 1e3 for n, v in t.items()}, bb.head.choices().get(k, "linear")))
    base = rows[0][1]["hf"]
    print(f"{a.model}, {a.threads} threads, {a.context}-token context, torch {torch.__version__}")
    print("| k | transformers forward ms | x k=1 | selfspec forward ms | x k=1 | LM head F.linear ms "
          "| LM head selfspec ms (layout) |\n|---|---|---|---|---|---|---|")
    for k, m, layout in rows:
        print(f"| {k} | {m['hf']:.1f} | {m['hf'] / base:.2f} | {m['ours']:.1f} | {m['ours'] / base:.2f} "
              f"| {m['linear']:.1f} | {m['head']:.1f} ({layout}) |")


def _ours(bb, linears, x, cache, start):
    """k new tokens (1, k) through selfspec's layers (few-row products in their timed layouts) and LM head."""
    k = x.shape[1]
    with linears:
        h = bb.run_layers(bb.embed(x[0]), start=0, end=bb.num_layers, position_ids=torch.arange(start, start + k)[None],
                          attention_mask=None, cache=cache)
        return bb.logits(bb.final_norm(h))


if __name__ == "__main__":
    main()
