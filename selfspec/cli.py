"""Command line: ``selfspec generate``, ``export``, and the subcommands whose flags other modules define
(``COMMANDS``; a command's module is imported only when that command runs, so ``--help`` and
mistyped flags answer before torch loads).

Human-readable tables by default, machine JSON with ``--json``. Bad input ends with one line on
stderr and exit status 2, never a traceback; flags are checked before any model loads, and a
command that fails on them leaves no output behind.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Callable

from . import __version__
from .io import prompt_ids
from .settings import CORPUS_HELP
from .shipped import DRAFTER_NAMES, HEADS_DRAFTERS, default_drafter, shipped_draft
from .training.cli_args import (
    at_least,
    check_corpus_arg,
    check_output_dir,
    check_prompt_text,
    check_sampling,
    in_unit_interval,
)


def format_stats(stats) -> str:
    acc = " ".join(f"{a:.2f}" for a in stats.acceptance_by_depth) or "-"
    rows = [
        ("new tokens", f"{stats.new_tokens}"),
        ("tokens/s", f"{stats.tokens_per_s:.1f}"),
        ("target forwards", f"{stats.target_forwards}"),
        ("tau (mean accepted length)", f"{stats.tau:.2f}"),
        ("acceptance by depth", acc),
        ("wall s", f"{stats.wall_s:.2f}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def check_generate_args(args) -> None:
    """Everything about ``selfspec generate``'s flags that can be wrong, checked before torch loads."""
    at_least(args.max_new_tokens, 1, "max_new_tokens")
    at_least(args.min_new_tokens, 0, "min_new_tokens")
    if args.min_new_tokens is not None and args.min_new_tokens > args.max_new_tokens:
        raise ValueError(f"--min-new-tokens {args.min_new_tokens} exceeds --max-new-tokens {args.max_new_tokens}: "
                         "a row cannot end before its minimum; lower --min-new-tokens or raise --max-new-tokens")
    check_sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                   repetition_penalty=args.repetition_penalty)
    in_unit_interval(args.min_p, "min_p")
    if args.prompt == "-":   # the prompt from standard input (a file, a here-document, a pipe)
        args.prompt = sys.stdin.read()
    check_prompt_text(args.prompt)
    if args.stop is not None and not all(args.stop):
        raise ValueError("--stop is empty: give the text to stop at, or drop the flag")
    if args.draft_model is not None and args.drafter != "draft-model":
        raise ValueError("--draft-model only applies to --drafter draft-model: drop it or add --drafter draft-model")
    if args.heads is not None and args.drafter not in HEADS_DRAFTERS:
        raise ValueError(f"--drafter {args.drafter} takes no --heads (only {', '.join(HEADS_DRAFTERS)} do): drop --heads")
    check_corpus_arg(args.corpus, args.drafter)



def cmd_generate(args) -> int:
    if args.drafter == "auto":
        args.drafter = default_drafter(args.model)
    check_generate_args(args)
    draft_model = args.draft_model
    if draft_model is None and args.drafter == "draft-model":
        draft_model = shipped_draft(args.model)
        if draft_model is None:
            raise ValueError("--drafter draft-model needs --draft-model PATH (a model directory, .gguf or hub id)")

    import torch
    from transformers import TextStreamer

    from .model import SelfSpeculativeModel

    heads = args.heads
    sm = SelfSpeculativeModel.from_pretrained(args.model, drafter=args.drafter, heads=heads, draft_model=draft_model,
                                              tree=args.tree, dtype=args.dtype, device=args.device,
                                              threshold=args.threshold, gate=args.gate, lookup=args.lookup,
                                              corpus=None if args.corpus == "none" else args.corpus, compile=args.compile)
    ids = torch.tensor([prompt_ids(sm.tokenizer, args.prompt, chat=args.chat)])
    sampling = args.temperature > 0
    gen = torch.Generator(device=sm.backbone.device).manual_seed(args.seed)
    streamer = None if args.json else TextStreamer(sm.tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = sm.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=sampling,
                      temperature=args.temperature if sampling else None, top_p=args.top_p if sampling else None,
                      top_k=args.top_k if sampling else None, min_p=args.min_p if sampling else None,
                      repetition_penalty=args.repetition_penalty, min_new_tokens=args.min_new_tokens,
                      stop_strings=args.stop, streamer=streamer, generator=gen)
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


def add_generate(p: argparse.ArgumentParser) -> None:
    from .settings import DEFAULT_MAX_NEW_TOKENS, DRAFTER_SETTINGS, SETTING_HELP, SETTING_KEYS

    p.add_argument("--model", default="smollm2-135m", help="alias, model directory, .gguf file or hub id")
    p.add_argument("--drafter", default="auto", choices=["auto", *DRAFTER_NAMES],
                   help="auto: the shipped drafter measured fastest for the demo model, greedy or sampling "
                        "(else the context lookup)")
    p.add_argument("--heads", default=None, help="heads directory (default: the shipped checkpoint for the demo model)")
    p.add_argument("--draft-model", default=None, help="draft model for --drafter draft-model")
    for key in SETTING_KEYS:
        takers = [d for d in DRAFTER_NAMES if getattr(DRAFTER_SETTINGS[d], key) is not None]
        p.add_argument(f"--{key}", default="auto", help=f"{' / '.join(takers)}: {SETTING_HELP[key]}")
    p.add_argument("--corpus", default="auto", help=CORPUS_HELP)
    p.add_argument("--prompt", required=True,
                   help="the text to continue (with --chat, the user's message); - reads it from standard input")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--min-new-tokens", type=int, default=None,
                   help="no end of text (EOS) before this many new tokens (default: the model's generation config)")
    p.add_argument("--stop", action="append", default=None, metavar="STRING",
                   help="end the answer at the first token that completes STRING (kept, as transformers' "
                        "stop_strings keep it); repeat for several")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (exact); > 0 samples losslessly")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0,
                   help="when sampling, drop tokens below this share of the top token's probability (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="transformers' repetition penalty (greedy or sampling; 1 = off; default: the model's generation config)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: float32 on CPU)")
    p.add_argument("--compile", action="store_true",
                   help="verify through a compiled static-shape step (for GPUs, over long or many generations: the "
                        "first steps compile)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=cmd_generate)


def cmd_export(args) -> int:
    out = Path(args.out)
    check_output_dir(out, force=args.force)
    at_least(args.layers, 1, "layers")

    from .drafters.draft_model import truncated_copy
    from .loading import check_model_name, load_model, model_config

    check_model_name(args.model)
    n = model_config(args.model).num_hidden_layers
    if args.layers >= n:
        raise ValueError(f"--layers {args.layers}: {args.model} has {n} layers, so a draft takes 1 to {n - 1}")
    loaded = load_model(args.model, device="cpu")
    draft = truncated_copy(loaded.model, args.layers)
    draft.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)
    print(f"wrote a {args.layers}-layer draft of {loaded.name} (untrained: the target's first {args.layers} layers, "
          f"norm and LM head) to {out}; it loads as an ordinary transformers causal LM")
    return 0


def add_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", required=True)
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_export)


def cmd_export_heads(args) -> int:
    check_output_dir(args.out, force=args.force)
    at_least(args.speculative_tokens, 1, "speculative_tokens")

    from .export import check_export, export_heads
    from .heads import read_heads_config
    from .loading import check_model_name, model_config

    model = args.model or read_heads_config(args.heads).base_model
    check_model_name(model)
    check_export(args.heads, args.format, num_layers=model_config(model).num_hidden_layers)
    out = export_heads(args.heads, args.format, args.out, model=model, dtype=args.dtype,
                       speculative_tokens=args.speculative_tokens)
    print(f"wrote {args.heads} as {args.format} to {out}; {out}/README.md says how to serve it")
    return 0


def add_export_heads(p: argparse.ArgumentParser) -> None:
    from .export import DTYPES, FORMATS

    p.add_argument("--heads", required=True, help="a heads directory from `selfspec train-heads` (or a hub id)")
    p.add_argument("--format", required=True, choices=list(FORMATS),
                   help="eagle3-sglang (SGLang; vLLM loads it too), eagle3-speculators (vllm serve DIR), "
                        "medusa-vllm, medusa-tgi")
    p.add_argument("--out", required=True, help="a new directory to write")
    p.add_argument("--model", default=None, help="the target (default: the model the heads were trained for)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="how floating tensors are stored")
    p.add_argument("--speculative-tokens", type=int, default=3,
                   help="eagle3-speculators: the draft length the config proposes to vLLM")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_export_heads)


def cmd_build_corpus(args) -> int:
    check_output_dir(args.out, force=args.force)
    if not args.data:
        raise ValueError("--data needs at least one gen-data directory")

    from .core.backbone import config_fingerprint
    from .corpus import Corpus
    from .loading import check_model_name, model_config
    from .training.data import answers_from_data, read_meta

    check_model_name(args.model)
    meta = read_meta(args.data)       # every directory must be gen-data output, of one model
    if meta.get("model") not in (None, args.model):
        raise ValueError(f"{args.data} holds answers of {meta['model']}, not of {args.model}: pass --model {meta['model']}")
    config = model_config(args.model)
    if meta.get("vocab_size") not in (None, config.vocab_size):
        raise ValueError(f"{args.data} holds token ids of a {meta['vocab_size']}-token vocabulary, but {args.model} "
                         f"has {config.vocab_size}: use data that model generated")
    answers, sources = answers_from_data(args.data)
    corpus = Corpus.from_answers(answers, base_model=args.model, base_fingerprint=config_fingerprint(config),
                                 vocab_size=config.vocab_size, sources=sources)
    corpus.save(args.out)
    print(f"wrote a corpus of {corpus.config.sequences} answers ({corpus.config.tokens} tokens) of {args.model} to "
          f"{args.out}; use it with --corpus {args.out} (corpus= in Python)")
    return 0


def add_build_corpus(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="the target whose answers these are")
    p.add_argument("--data", required=True,
                   help="gen-data directories (comma-separated; DIR@N keeps the first N rows): their response tokens")
    p.add_argument("--out", required=True, help="a new directory to write")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_build_corpus)


def setup_train_heads(p: argparse.ArgumentParser) -> None:
    from .training.train import add_train_heads_args, run_train_heads

    add_train_heads_args(p)
    p.set_defaults(func=lambda a: 130 if run_train_heads(a).interrupted else 0)


def setup_train_draft(p: argparse.ArgumentParser) -> None:
    from .training.draft import add_train_draft_args, run_train_draft

    add_train_draft_args(p)
    p.set_defaults(func=lambda a: 130 if run_train_draft(a).interrupted else 0)


def setup_tune(p: argparse.ArgumentParser) -> None:
    from .training.tune import add_tune_args, run_tune

    add_tune_args(p)
    p.set_defaults(func=run_tune)


def setup_eval(p: argparse.ArgumentParser) -> None:
    from .training.evaluate import add_eval_args, run_eval_heads

    add_eval_args(p)
    p.set_defaults(func=run_eval_heads)


def setup_bench(p: argparse.ArgumentParser) -> None:
    from .bench import add_bench_args, run_bench_cli

    add_bench_args(p)
    p.set_defaults(func=run_bench_cli)


def setup_gen_data(p: argparse.ArgumentParser) -> None:
    from .training import data

    data.add_data_args(p)
    p.set_defaults(func=lambda a: data.run_from_args(a) and 0)


def setup_synth(p: argparse.ArgumentParser) -> None:
    from .training.synth import add_synth_args, run_synth

    add_synth_args(p)
    p.set_defaults(func=run_synth)


# name -> (help, setup). setup adds the flags and the function to run; it is called only for the
# command being run, since most of them import torch: `selfspec --help` and a mistyped flag answer at once.
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "generate": ("generate text with self-speculative decoding, then print the stats", add_generate),
    "export": ("write the target's first L layers + norm + LM head as a standalone draft model", add_export),
    "export-heads": ("write trained heads in the layout SGLang, vLLM or TGI loads", add_export_heads),
    "train-heads": ("fit Medusa heads, the early-exit head or an EAGLE head by self-distillation", setup_train_heads),
    "train-draft": ("distil the target's first L layers into a standalone draft model", setup_train_draft),
    "tune-tree": ("time candidate trees for trained heads (or chains for a draft model) on held-out prompts; keep the fastest", setup_tune),
    "eval-heads": ("per-head top-1/top-5 accuracy of trained heads on prompts they never saw", setup_eval),
    "bench": ("compare decoding methods side by side against transformers' generate", setup_bench),
    "gen-data": ("self-distillation data: the target answers prompts (resumable)", setup_gen_data),
    "build-corpus": ("index the target's own answers (gen-data output) for the lookup to draft from", add_build_corpus),
    "synth-prompts": ("self-instruct: the target writes new prompts in the style of seed prompts", setup_synth),
}


def command_in(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not an option (the top level takes no values)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser, with every subcommand listed; given ``argv``, only the command it names gets its flags."""
    parser = argparse.ArgumentParser(prog="selfspec", description="Exact self-speculative decoding for HF causal LMs.")
    parser.add_argument("--version", action="version", version=f"selfspec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = None if argv is None else command_in(argv)
    for name, (help_, setup) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if argv is None or name == chosen:
            setup(p)
    return parser


def one_line(e: BaseException) -> str:
    """The first non-empty line of an error: a message from a library can run to many."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def main(argv=None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.WARNING, format="selfspec: %(message)s")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.formatwarning = lambda message, *_, **__: f"selfspec: warning: {message}\n"
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
        print(f"selfspec: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("selfspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
