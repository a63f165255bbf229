"""Command line: ``selfspec generate`` (and the subcommands other modules register).

Human-readable tables by default, machine JSON with ``--json``. Bad input ends with one line on
stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from pathlib import Path

from . import __version__
from .drafters import DRAFTERS
from .shipped import default_drafter, shipped_draft



def encode_prompt(tokenizer, prompt: str, *, chat: bool):
    import torch

    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--chat given but the tokenizer has no chat template: drop --chat")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt")
        if not torch.is_tensor(ids):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return ids
    return tokenizer(prompt, return_tensors="pt").input_ids


def format_stats(stats) -> str:
    acc = " ".join(f"{a:.2f}" for a in stats.acceptance_by_depth) or "-"
    rows = [
        ("new tokens", f"{stats.new_tokens}"),
        ("tokens/s", f"{stats.tokens_per_s:.1f}"),
        ("target forwards", f"{stats.target_forwards}"),
        ("tau (mean accepted length)", f"{stats.tau:.2f}"),
        ("acceptance by depth", acc),
        ("draft / verify / wall s", f"{stats.draft_s:.2f} / {stats.verify_s:.2f} / {stats.wall_s:.2f}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def cmd_generate(args) -> int:
    import torch
    from transformers import TextStreamer

    from .model import SelfSpeculativeModel

    drafter = default_drafter(args.model) if args.drafter == "auto" else args.drafter
    args.drafter = drafter
    heads = args.heads
    if args.draft_model is not None and args.drafter != "draft-model":
        raise ValueError("--draft-model only applies to --drafter draft-model")
    if args.heads is not None and args.drafter not in ("medusa", "early-exit", "eagle"):
        raise ValueError("--heads only applies to --drafter medusa, early-exit or eagle")
    draft_model = args.draft_model
    if draft_model is None and args.drafter == "draft-model":
        draft_model = shipped_draft(args.model)
        if draft_model is None:
            raise ValueError("--drafter draft-model needs --draft-model PATH (a model directory, .gguf or hub id)")
    sm = SelfSpeculativeModel.from_pretrained(args.model, drafter=args.drafter, heads=heads, draft_model=draft_model,
                                              tree=args.tree, dtype=args.dtype, device=args.device,
                                              threshold=args.threshold, gate=args.gate, lookup=args.lookup)
    ids = encode_prompt(sm.tokenizer, args.prompt, chat=args.chat)
    sampling = args.temperature > 0
    gen = torch.Generator(device=sm.backbone.device).manual_seed(args.seed)
    streamer = None if args.json else TextStreamer(sm.tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = sm.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=sampling,
                      temperature=args.temperature if sampling else None, top_p=args.top_p if sampling else None,
                      top_k=args.top_k if sampling else None, streamer=streamer, generator=gen)
    new = out[0, ids.shape[1]:]
    stats = sm.last_stats
    if args.json:
        print(json.dumps({"model": sm.name, "drafter": args.drafter, "heads": str(heads) if heads else None,
                          "text": sm.tokenizer.decode(new, skip_special_tokens=True), "token_ids": new.tolist(),
                          "stats": stats.as_dict()}, indent=2))
    else:
        print()
        print(format_stats(stats))
    return 0


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with self-speculative decoding, then print the stats")
    p.add_argument("--model", default="smollm2-135m", help="alias, model directory, .gguf file or hub id")
    p.add_argument("--drafter", default="auto", choices=["auto", *DRAFTERS],
                   help="auto: the shipped drafter measured fastest for the demo model (else the context lookup)")
    p.add_argument("--heads", default=None, help="heads directory (default: the shipped checkpoint for the demo model)")
    p.add_argument("--draft-model", default=None, help="draft model for --drafter draft-model")
    p.add_argument("--tree", default="auto", help="auto | chain-K | chain-K-wW | eagle: dynamic-D-K-M")
    p.add_argument("--threshold", default="auto",
                   help="medusa / early-exit / eagle: propose only tree nodes whose draft path probability is >= this "
                        "(0 = the whole tree; auto = the value tune-tree measured fastest). Output is unchanged")
    p.add_argument("--gate", default="auto",
                   help="medusa: propose nothing in a step whose tree the heads expect fewer than this many tokens "
                        "accepted from (0 = always propose; auto = as tuned). Output is unchanged")
    p.add_argument("--lookup", default="auto",
                   help="medusa / eagle: also propose up to this many tokens copied from where the context's last "
                        "tokens occurred before (0 = off; auto = as tuned). Output is unchanged")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (exact); > 0 samples losslessly")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: float32 on CPU)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=cmd_generate)


def cmd_export(args) -> int:
    from .drafters.draft_model import truncated_copy
    from .loading import load_model

    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.force:
        raise ValueError(f"{out} exists and is not empty: pass --force to overwrite")
    loaded = load_model(args.model, device="cpu")
    draft = truncated_copy(loaded.model, args.layers)
    draft.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)
    print(f"wrote a {args.layers}-layer draft of {loaded.name} (untrained: the target's first {args.layers} layers, "
          f"norm and LM head) to {out}; it loads as an ordinary transformers causal LM")
    return 0


def add_export(sub) -> None:
    p = sub.add_parser("export", help="write the target's first L layers + norm + LM head as a standalone draft model")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", required=True)
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_export)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="selfspec", description="Exact self-speculative decoding for HF causal LMs.")
    parser.add_argument("--version", action="version", version=f"selfspec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate(sub)
    add_export(sub)
    from .bench import add_bench_args, run_bench_cli
    from .training.train import add_train_heads_args, run_train_heads

    p = sub.add_parser("train-heads", help="fit Medusa heads or the early-exit head by self-distillation")
    add_train_heads_args(p)
    p.set_defaults(func=lambda a: 130 if run_train_heads(a).interrupted else 0)
    from .training.draft import add_train_draft_args, run_train_draft

    p = sub.add_parser("train-draft", help="distil the target's first L layers into a standalone draft model")
    add_train_draft_args(p)
    p.set_defaults(func=lambda a: 130 if run_train_draft(a).interrupted else 0)
    from .training.tune import add_tune_args, run_tune

    p = sub.add_parser("tune-tree", help="time candidate trees for trained heads on held-out prompts; keep the fastest")
    add_tune_args(p)
    p.set_defaults(func=run_tune)

    from .training.evaluate import add_eval_args, run_eval_heads

    p = sub.add_parser("eval-heads", help="per-head top-1/top-5 accuracy of trained heads on prompts they never saw")
    add_eval_args(p)
    p.set_defaults(func=run_eval_heads)

    p = sub.add_parser("bench", help="compare decoding methods side by side against transformers' greedy generate")
    add_bench_args(p)
    p.set_defaults(func=run_bench_cli)
    try:
        from .training import data as training_data
    except ImportError:  # the training extras are part of the package; this only guards partial installs
        training_data = None
    if training_data is not None and hasattr(training_data, "add_data_args"):
        p = sub.add_parser("gen-data", help="self-distillation data: the target answers prompts (resumable)")
        training_data.add_data_args(p)
        p.set_defaults(func=lambda a: training_data.run_from_args(a) or 0)
        from .training.synth import add_synth_args, run_synth

        p = sub.add_parser("synth-prompts", help="self-instruct: the target writes new prompts in the style of seed prompts")
        add_synth_args(p)
        p.set_defaults(func=run_synth)
    return parser


def main(argv=None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.WARNING, format="selfspec: %(message)s")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.formatwarning = lambda message, *_, **__: f"selfspec: warning: {message}\n"
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"selfspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("selfspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
