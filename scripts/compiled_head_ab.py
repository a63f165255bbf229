"""A/B of the EAGLE head's compiled draft step: with the verify step compiled either way, decode the
same prompts with the head compiled (``static_head=True``, the default on CUDA) and eager (the default
on CPU), interleaved per prompt in one process, after both were compiled and warmed up; checks that
the outputs agree and prints tokens/s and the share of time spent drafting.

    python scripts/compiled_head_ab.py --prompts .cache/prompts/heldout24.jsonl --n 10

This compares two builds of selfspec's own loop; speed claims against transformers come from
``selfspec bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from selfspec.drafters.eagle import EagleDrafter, parse_dynamic_tree
from selfspec.model import SelfSpeculativeModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", required=True, help="JSONL with a 'prompt' field per line")
    ap.add_argument("--n", type=int, default=10, help="how many prompts (from the top)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not os.path.isfile(args.prompts):
        ap.exit(2, f"compiled_head_ab: no prompts file {args.prompts!r}: pass a JSONL file with a 'prompt' field\n")
    if args.n < 1 or args.max_new_tokens < 1:
        ap.exit(2, "compiled_head_ab: --n and --max-new-tokens must be at least 1\n")
    torch.set_num_threads(args.threads)
    sm = SelfSpeculativeModel.from_pretrained("smollm2-135m", drafter="eagle", compile=True, dtype=torch.float32)
    st = sm.settings
    compiled, eager = (EagleDrafter(sm.backbone, sm.heads, **parse_dynamic_tree(st.tree), threshold=st.threshold,
                                    lookup=st.lookup, corpus=sm.corpus, static_head=static) for static in (True, False))
    rows = [json.loads(line)["prompt"] for line in open(args.prompts)][: args.n]
    encoded = [sm.tokenizer.apply_chat_template([{"role": "user", "content": r}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)["input_ids"] for r in rows]
    sm.step.reserve(max(x.shape[1] for x in encoded) + args.max_new_tokens)
    sm.step.warm_up(batch=1, max_nodes=compiled.max_nodes, capture=compiled.capture_layers)
    compiled.warm_up(sm.step, batch=1)
    sm.tune_layouts(1)
    sm.drafter = eager
    sm.generate(encoded[0], max_new_tokens=16)
    totals = {"compiled": [0.0, 0.0, 0], "eager": [0.0, 0.0, 0]}   # wall s, draft s, tokens
    for i, ids in enumerate(encoded):
        outs = {}
        for name in (("compiled", "eager") if i % 2 == 0 else ("eager", "compiled")):
            sm.drafter = compiled if name == "compiled" else eager
            t = time.perf_counter()
            outs[name] = sm.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)[0].tolist()
            wall = time.perf_counter() - t
            s = sm.last_stats
            for j, v in enumerate((wall, s.draft_s, s.new_tokens)):
                totals[name][j] += v
        if outs["compiled"] != outs["eager"]:
            raise SystemExit(f"prompt {i}: the two heads' outputs differ")
        print(f"prompt {i + 1}/{len(encoded)} done", flush=True)
    for name, (wall, draft, toks) in totals.items():
        print(f"{name}: {toks / wall:.2f} tokens/s, drafting {100 * draft / wall:.1f}% of the time")


if __name__ == "__main__":
    main()
