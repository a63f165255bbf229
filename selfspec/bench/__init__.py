"""``selfspec bench``: every decoding method side by side, in one process, interleaved."""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch

from ..heads import read_heads_config
from ..io import prompt_ids
from ..loading import check_model_name, load_model
from ..settings import DEFAULT_MAX_NEW_TOKENS, check_settings
from ..shipped import shipped_draft, shipped_heads
from ..training.cli_args import at_least, check_output_dir, check_sampling
from .harness import ALIASES, ALL_METHODS, load_prompts, run_bench
from .methods import build_methods, parse_methods
from .report import decoding_mode, markdown, write_report

# selfspec methods -> (drafter, the flags that set its heads / tree / threshold / gate / lookup)
_SELFSPEC_FLAGS = {
    "selfspec-medusa": ("medusa", "medusa_heads", "medusa_tree", "medusa_threshold", "medusa_gate", "medusa_lookup"),
    "selfspec-early-exit": ("early-exit", "exit_heads", "exit_tree", "exit_threshold", None, None),
    "selfspec-medusa-heads": ("medusa", "medusa_heads", "medusa_tree", "medusa_threshold", "medusa_gate", None),
    "selfspec-eagle": ("eagle", "eagle_heads", "eagle_tree", "eagle_threshold", None, "eagle_lookup"),
    "selfspec-eagle-heads": ("eagle", "eagle_heads", "eagle_tree", "eagle_threshold", None, None),
    "selfspec-draft-model": ("draft-model", None, "draft_tree", None, None, None),
}


def add_bench_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", required=True, help="JSONL with \"prompt\" and optional \"category\"")
    p.add_argument("--limit", type=int, default=None, help="first N prompts")
    p.add_argument("--sample", type=int, default=None, help="a seeded random N prompts (with --seed), in file order")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--methods", default="all",
                   help=f"comma list from: {', '.join(ALL_METHODS)} ({', '.join(f'{a} = {m}' for a, m in ALIASES.items())})")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (identical-output check on); > 0: every method samples at this temperature, hf-generate too")
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
    p.add_argument("--out", default=None, help="write results.json, results.md and the charts speedup.png, acceptance.png, speed_tau.png here (a new or empty directory)")
    p.add_argument("--force", action="store_true", help="overwrite the results already in --out")
    p.add_argument("--json", action="store_true", help="print the results JSON to stdout")


def check_bench_args(args) -> list[str]:
    """Every flag checked before any model loads; returns the methods to run."""
    at_least(args.limit, 1, "limit")
    at_least(args.sample, 1, "sample")
    at_least(args.max_new_tokens, 1, "max_new_tokens")
    at_least(args.threads, 1, "threads")
    check_sampling(temperature=args.temperature)
    if args.out:
        check_output_dir(args.out, force=args.force)
    names = parse_methods(args.methods)
    _check_selfspec_flags(args, names)
    return names


def _check_selfspec_flags(args, names: list[str]) -> None:
    """Trees, thresholds and heads directories of the selfspec methods being run, before anything loads."""
    check_model_name(args.model)
    for name in names:
        if name not in _SELFSPEC_FLAGS:
            continue
        drafter, heads, tree, threshold, gate, lookup = _SELFSPEC_FLAGS[name]
        value = lambda flag: "auto" if flag is None else getattr(args, flag)  # noqa: E731
        check_settings(drafter, tree=value(tree), threshold=value(threshold), gate=value(gate), lookup=value(lookup))
        if heads is not None and getattr(args, heads) is not None:
            read_heads_config(getattr(args, heads), expect_kind=drafter)
    if {"hf-assisted", "selfspec-draft-model"} & set(names):
        path = args.draft_model or shipped_draft(args.model)
        if path is None:
            raise ValueError("hf-assisted / selfspec-draft-model need --draft-model PATH (e.g. from `selfspec export`)")
        check_model_name(str(path))


def run_bench_cli(args) -> int:
    names = check_bench_args(args)
    prompts = load_prompts(args.prompts, limit=args.limit, sample=args.sample, seed=args.seed)
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    draft = None
    if {"hf-assisted", "selfspec-draft-model"} & set(names):
        path = args.draft_model or shipped_draft(args.model)
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
    results = run_bench(methods, prompts, lambda text: torch.tensor([prompt_ids(loaded.tokenizer, text, chat=chat)]),
                        model=loaded.model, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        seed=args.seed, progress=not args.json)
    p = loaded.model.get_output_embeddings().weight
    result = {
        "config": {
            "model": loaded.name, "device": str(p.device), "dtype": str(p.dtype).replace("torch.", ""),
            "threads": threads, "prompts": str(args.prompts), "n_prompts": len(prompts), "limit": args.limit,
            "sample": args.sample,
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "decoding": decoding_mode(args.temperature), "chat_template": chat,
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
            print(f"wrote {args.out}/results.json, results.md, speedup.png, acceptance.png, speed_tau.png")
    return 0


__all__ = ["add_bench_args", "run_bench_cli", "run_bench", "load_prompts", "build_methods", "write_report"]
