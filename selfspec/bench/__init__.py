"""``selfspec bench``: every decoding method side by side, in one process, interleaved."""

from __future__ import annotations

import json
import sys
import warnings

from .harness import ALL_METHODS, load_prompts, run_bench
from .methods import build_methods, parse_methods
from .report import markdown, write_report


def add_bench_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", required=True, help="JSONL with \"prompt\" and optional \"category\"")
    p.add_argument("--limit", type=int, default=None, help="first N prompts")
    p.add_argument("--sample", type=int, default=None, help="a seeded random N prompts (with --seed), in file order")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", default="all", help=f"comma list from: {', '.join(ALL_METHODS)}")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (identical-output check on)")
    p.add_argument("--medusa-heads", default=None, help="default: the shipped checkpoint for the demo model")
    p.add_argument("--exit-heads", default=None, help="default: the shipped checkpoint for the demo model")
    p.add_argument("--draft-model", default=None, help="draft for hf-assisted / selfspec-draft-model")
    p.add_argument("--medusa-tree", default="auto")
    p.add_argument("--exit-tree", default="auto")
    p.add_argument("--draft-tree", default="auto")
    p.add_argument("--medusa-threshold", default="auto", help="draft path probability below which nodes are not proposed")
    p.add_argument("--exit-threshold", default="auto", help="likewise for early exit (0 = never prune)")
    p.add_argument("--medusa-gate", default="auto", help="expected accepted tokens below which a Medusa step proposes nothing")
    p.add_argument("--medusa-lookup", default="auto",
                   help="context tokens a greedy Medusa step may also propose (prompt lookup; 0 = off, auto = as tuned)")
    p.add_argument("--eagle-heads", default=None, help="default: the shipped checkpoint for the demo model")
    p.add_argument("--eagle-tree", default="auto", help="dynamic-D-K-M: depth D, K expanded per level, M nodes verified")
    p.add_argument("--eagle-threshold", default="auto", help="draft path probability below which eagle nodes are not proposed")
    p.add_argument("--eagle-lookup", default="auto", help="context tokens an eagle step may also propose (0 = off)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write results.json, results.md, speedup.png here")
    p.add_argument("--json", action="store_true", help="print the results JSON to stdout")


def run_bench_cli(args) -> int:
    import os

    import torch

    from ..cli import encode_prompt
    from ..shipped import shipped_draft, shipped_heads
    from ..loading import load_model

    if args.limit is not None and args.limit < 1:
        raise ValueError("--limit must be >= 1")
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be >= 1")
    names = parse_methods(args.methods)
    if args.sample is not None and args.sample < 1:
        raise ValueError("--sample must be >= 1")
    prompts = load_prompts(args.prompts, limit=args.limit, sample=args.sample, seed=args.seed)
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    draft = None
    if {"hf-assisted", "selfspec-draft-model"} & set(names):
        path = args.draft_model or shipped_draft(args.model)
        if path is None:
            raise ValueError("hf-assisted / selfspec-draft-model need --draft-model PATH (e.g. from `selfspec export`)")
        draft = load_model(str(path), dtype=args.dtype, device=args.device).model
    medusa = args.medusa_heads or shipped_heads(args.model, "medusa")
    exits = args.exit_heads or shipped_heads(args.model, "early-exit")
    eagle = args.eagle_heads or shipped_heads(args.model, "eagle")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        methods, notes = build_methods(names, model=loaded.model, tokenizer=loaded.tokenizer, model_name=loaded.name,
                                       temperature=args.temperature, medusa_heads=medusa, exit_heads=exits,
                                       draft_model=draft, medusa_tree=args.medusa_tree, exit_tree=args.exit_tree,
                                       draft_tree=args.draft_tree, medusa_threshold=args.medusa_threshold,
                                       exit_threshold=args.exit_threshold, medusa_gate=args.medusa_gate,
                                       medusa_lookup=args.medusa_lookup, eagle_heads=eagle, eagle_tree=args.eagle_tree,
                                       eagle_threshold=args.eagle_threshold, eagle_lookup=args.eagle_lookup)
    chat = bool(getattr(loaded.tokenizer, "chat_template", None))
    results = run_bench(methods, prompts, lambda text: encode_prompt(loaded.tokenizer, text, chat=chat),
                        model=loaded.model, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        seed=args.seed, progress=not args.json)
    p = loaded.model.get_output_embeddings().weight
    result = {
        "config": {
            "model": loaded.name, "device": str(p.device), "dtype": str(p.dtype).replace("torch.", ""),
            "threads": threads, "prompts": str(args.prompts), "n_prompts": len(prompts), "limit": args.limit,
            "sample": args.sample,
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "chat_template": chat,
            "methods": names, "heads": notes, "seed": args.seed,
            "torch": torch.__version__, "command": " ".join(["selfspec"] + sys.argv[1:]),
        },
        "methods": results,
    }
    if args.out:
        write_report(result, args.out)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(markdown(result))
        if args.out:
            print(f"wrote {args.out}/results.json, results.md, speedup.png")
    return 0


__all__ = ["add_bench_args", "run_bench_cli", "run_bench", "load_prompts", "build_methods", "write_report"]
