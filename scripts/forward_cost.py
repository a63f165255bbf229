"""What one target forward of k new tokens costs on this machine: the curve every draft tree must fit.

    python scripts/forward_cost.py [--model smollm2-135m] [--threads 2] [--context 256] [--ks 1,2,4,8,16] [--compile]

Times (median of warm repeats, interleaved) a cached forward of k new tokens after a ``--context``-token
prefix, through transformers' own forward and through selfspec's pass (the same layers on selfspec's
KV cache), each relative to transformers' k = 1. ``--compile`` adds ``compile=True``'s verify pass
(``runtime/step.StaticStep``: k padded to its bucket, on CPU with the weights frozen in; every bucket
compiles first, minutes on CPU). Where k = 8 costs little more than k = 1 (a GPU),
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
    ap.add_argument("--compile", action="store_true", help="also time the compiled static verify pass")
    a = ap.parse_args()
    if a.repeats < 4:
        ap.error("--repeats must be at least 4: the first 3 of each are warm-up, not timed")
    torch.set_num_threads(a.threads)
    from transformers import DynamicCache

    from selfspec.bench.methods import CACHE_KWARG
    from selfspec.core import cache as kv
    from selfspec.core.backbone import Backbone
    from selfspec.core.decode import prefill_rows
    from selfspec.core.tree import build_tree, chain
    from selfspec.core.types import Draft
    from selfspec.loading import load_model
    from selfspec.runtime.step import StaticStep

    model = load_model(a.model).model
    bb = Backbone(model)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, 10_000, (1, a.context), generator=g)
    rows = []
    ks = [int(x) for x in a.ks.split(",")]
    methods = ("hf", "ours", "compiled") if a.compile else ("hf", "ours")
    if a.compile:
        step = StaticStep(bb, compile=True)
        step.reserve(a.context + max(ks))
        step.warm_up(max_nodes=max(ks))   # every bucket compiled at the capacity timed below
        static = step.new_cache(1, a.context + max(ks))
        with torch.inference_mode():
            prefill_rows(bb, static, [prefix[0]])
    with torch.no_grad():
        # transformers' forward on its own DynamicCache; selfspec's layers on selfspec's KVCache
        hf_cache = DynamicCache(config=model.config)
        model(prefix, **{CACHE_KWARG: hf_cache}, use_cache=True)
        cache = kv.new_cache()
        bb.run_layers(bb.embed(prefix[0]), start=0, end=bb.num_layers, position_ids=torch.arange(a.context)[None],
                      attention_mask=None, cache=cache)
        for k in ks:
            x = torch.randint(100, 10_000, (1, k), generator=g)
            fns = {"hf": lambda: model(x, **{CACHE_KWARG: hf_cache}, use_cache=True),
                   "ours": lambda: _ours(bb, x, cache, a.context)}
            if a.compile:
                draft = Draft(tree=build_tree(chain(k - 1)), tokens=x[0])   # a root and k - 1 below it
                fns["compiled"] = lambda: _compiled(step, static, draft, a.context)
            t = {name: [] for name in methods}
            for _ in range(a.repeats):
                for name in methods:
                    t0 = time.perf_counter()
                    fns[name]()
                    t[name].append(time.perf_counter() - t0)
                    kv.truncate(cache, a.context)
                    if hf_cache.get_seq_length() > a.context:   # transformers 5: crop(-n) removes n tokens
                        hf_cache.crop(a.context - hf_cache.get_seq_length())
            rows.append((k, {n: statistics.median(v[3:]) * 1e3 for n, v in t.items()}))
    base = rows[0][1]["hf"]
    print(f"{a.model}, {a.threads} threads, {a.context}-token context, torch {torch.__version__}")
    head = ["transformers forward", "selfspec forward", "compiled pass"][: len(methods)]
    print("| k | " + " | ".join(f"{h} ms | x k=1" for h in head) + " |\n|---|" + "---|---|" * len(head))
    for k, m in rows:
        print(f"| {k} | " + " | ".join(f"{m[n]:.1f} | {m[n] / base:.2f}" for n in methods) + " |")


@torch.inference_mode()   # as decoding runs the step (a compiled pass guards on the mode)
def _compiled(step, cache, draft, start):
    """A chain of k new tokens through the static verify pass (LM head included), then the cache cut back."""
    step.verify(step.backbone, cache, [start], [draft], rows=[0])
    cache.truncate(start)


def _ours(bb, x, cache, start):
    """k new tokens (1, k) through selfspec's layers and LM head."""
    k = x.shape[1]
    h = bb.run_layers(bb.embed(x[0]), start=0, end=bb.num_layers, position_ids=torch.arange(start, start + k)[None],
                      attention_mask=None, cache=cache)
    return bb.logits(bb.final_norm(h))


if __name__ == "__main__":
    main()
