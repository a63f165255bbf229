"""``selfspec bench``: every decoding method side by side, in one process, interleaved."""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch

from ..card import this_hardware
from ..core.backbone import config_fingerprint
from ..corpus import is_corpus_dir, load_corpus, read_corpus_config
from ..heads import read_heads_config
from ..io import prompt_ids
from ..loading import check_model_name, load_model
from ..settings import CORPUS_HELP, DEFAULT_MAX_NEW_TOKENS, DRAFTER_SETTINGS, SETTING_HELP, SETTING_KEYS, check_settings
from ..shipped import HEADS_DRAFTERS, shipped_corpus, shipped_draft, shipped_heads
from ..training.cli_args import at_least, check_corpus_arg, check_output_dir, check_sampling
from .engines import DEFAULT_VLLM_SPEC_TOKENS, ENGINE_METHODS, check_engines, engines_python, export_eagle3, these
from .harness import ALIASES, ALL_METHODS, AUTO_METHOD, DRAFT_METHODS, ENGINE_METHOD_NAMES, load_prompts, run_bench
from .methods import SELFSPEC_METHODS, build_methods, flag_prefixes, parse_methods, resolve_auto, split_variant
from .report import decoding_mode, markdown, write_report


def add_bench_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", required=True, help="JSONL with \"prompt\" and optional \"category\"")
    p.add_argument("--limit", type=int, default=None, help="first N prompts")
    p.add_argument("--sample", type=int, default=None, help="a seeded random N prompts (with --seed), in file order")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--methods", default="all",
                   help=f"comma list from: {', '.join(ALL_METHODS)} ({', '.join(f'{a} = {m}' for a, m in ALIASES.items())}); "
                        f"{AUTO_METHOD}: the method of the drafter drafter=\"auto\" picks for --model at --temperature; "
                        "all (the default) leaves out those that need --draft-model when none is given; "
                        "a method with heads takes other heads as METHOD@DIR (e.g. selfspec-medusa@out/heads "
                        "beside selfspec-medusa: two trainings in one run), and one whose lookup reads a corpus "
                        "takes another corpus the same way (selfspec-lookup@out/corpus beside selfspec-lookup); "
                        f"the serving engines, after `make engines`: {', '.join(ENGINE_METHOD_NAMES)}")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (identical-output check on); > 0: every method samples at this temperature, hf-generate too")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="every method applies transformers' repetition penalty, hf-generate too (1 = off)")
    p.add_argument("--draft-model", default=None, help="draft for hf-assisted(-bf16) / selfspec-draft-model")
    for prefix, drafter in flag_prefixes().items():   # --medusa-heads, --medusa-tree, --exit-threshold, ...
        if drafter in HEADS_DRAFTERS:
            p.add_argument(f"--{prefix}-heads", default=None,
                           help=f"{drafter} heads directory (default: the shipped checkpoint for the demo model)")
        for key in SETTING_KEYS:
            if getattr(DRAFTER_SETTINGS[drafter], key) is not None:
                p.add_argument(f"--{prefix}-{key}", default="auto", help=f"{drafter}: {SETTING_HELP[key]}")
    p.add_argument("--corpus", default="auto", help=CORPUS_HELP)
    p.add_argument("--batch-size", type=int, default=1,
                   help="prompts per generate call (left-padded batches, file order); methods that refuse batches are reported as refused")
    p.add_argument("--compile", action="store_true",
                   help="selfspec's methods verify through a compiled static-shape step (compiled during the warm-up)")
    p.add_argument("--engines-python", default=None,
                   help="the Python the engine methods run in (default: $SELFSPEC_ENGINES_PYTHON, else "
                        ".venv-engines/bin/python, where `make engines` installs vLLM and llama-cpp-python)")
    p.add_argument("--vllm-spec-tokens", type=int, default=DEFAULT_VLLM_SPEC_TOKENS,
                   help="vllm-eagle3: tokens the EAGLE head drafts a step (a chain)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: $OMP_NUM_THREADS where set, else all cores)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write results.json, results.md and the charts speedup.png, acceptance.png, speed_tau.png here (a new or empty directory)")
    p.add_argument("--force", action="store_true", help="overwrite the results already in --out")
    p.add_argument("--json", action="store_true", help="print the results JSON to stdout")


def check_bench_args(args) -> tuple[list[str], str | None]:
    """Every flag checked before any model loads; returns the methods to run, and the one selfspec-auto
    stands for (None where it was not asked for)."""
    at_least(args.limit, 1, "limit")
    at_least(args.sample, 1, "sample")
    at_least(args.max_new_tokens, 1, "max_new_tokens")
    at_least(args.threads, 1, "threads")
    at_least(args.batch_size, 1, "batch_size")
    check_sampling(temperature=args.temperature, repetition_penalty=args.repetition_penalty)
    if args.out:
        check_output_dir(args.out, force=args.force)
    names, auto = resolve_auto(parse_methods(args.methods), model=args.model, temperature=args.temperature)
    if args.methods == "all" and not args.draft_model and shipped_draft(args.model) is None:
        # "all" means what can run: the methods that need a second model are left out, and said so.
        left_out = [n for n in names if n in DRAFT_METHODS]
        names = [n for n in names if n not in DRAFT_METHODS]
        print(f"selfspec bench: {', '.join(left_out)} left out: they need --draft-model PATH", file=sys.stderr)
    _check_selfspec_flags(args, names)
    check_corpus_arg(args.corpus)
    _check_engine_flags(args, names)
    if auto is not None:
        print(f"selfspec bench: {AUTO_METHOD} runs as {auto}, the drafter \"auto\" picks for {args.model} "
              f"{'when sampling' if args.temperature > 0 else 'greedy'}", file=sys.stderr)
    return names, auto


def _corpus_dir(args):
    """--corpus -> the directory the run's lookups read (auto: the one shipped for the model), or None."""
    if args.corpus == "auto":
        return shipped_corpus(args.model)
    return None if args.corpus == "none" else args.corpus


def _method_settings(args) -> dict[str, dict]:
    """drafter -> {setting: value} from its bench flags (--medusa-tree -> {"medusa": {"tree": ...}})."""
    return {drafter: {key: getattr(args, f"{prefix}_{key}") for key in SETTING_KEYS
                      if getattr(DRAFTER_SETTINGS[drafter], key) is not None}
            for prefix, drafter in flag_prefixes().items()}


def _heads_flags(args) -> dict[str, str | None]:
    """drafter -> the heads directory its --PREFIX-heads flag names (None: not given)."""
    return {drafter: getattr(args, f"{prefix}_heads") for prefix, drafter in flag_prefixes().items()
            if drafter in HEADS_DRAFTERS}


def _check_selfspec_flags(args, names: list[str]) -> None:
    """Trees, thresholds and heads directories of the selfspec methods being run, before anything loads."""
    check_model_name(args.model)
    settings, heads = _method_settings(args), _heads_flags(args)
    runs = [(SELFSPEC_METHODS[base][0], variant) for base, variant in map(split_variant, names)
            if base in SELFSPEC_METHODS]
    for drafter in dict.fromkeys(d for d, _ in runs):
        check_settings(drafter, **settings.get(drafter, {}))
        if heads.get(drafter) is not None:
            read_heads_config(heads[drafter], expect_kind=drafter)
    for drafter, variant in runs:
        if variant is not None:
            if is_corpus_dir(variant):
                read_corpus_config(variant)
            else:
                read_heads_config(variant, expect_kind=drafter)
    if DRAFT_METHODS & set(names):
        path = args.draft_model or shipped_draft(args.model)
        if path is None:
            raise ValueError("hf-assisted, hf-assisted-bf16 and selfspec-draft-model need --draft-model PATH (e.g. from `selfspec export`)")
        check_model_name(str(path))


def _check_engine_flags(args, names: list[str]) -> None:
    """The engine methods: greedy only, a GGUF for llama.cpp, their engine installed."""
    engines = [n for n in names if n in ENGINE_METHODS]
    at_least(args.vllm_spec_tokens, 1, "vllm_spec_tokens")
    if not engines:
        return
    if args.temperature > 0 or args.repetition_penalty != 1.0:
        raise ValueError(f"{these(engines, 'decode')} greedily only: leave out --temperature and --repetition-penalty")
    if any(ENGINE_METHODS[n][0] == "llamacpp" for n in engines):
        _gguf(args.model)
    check_engines(engines, args.engines_python)


def _gguf(model: str) -> str:
    """The GGUF file llama.cpp runs for --model (``loading.gguf_of``), or a one-line refusal."""
    from ..loading import gguf_of

    gguf = gguf_of(model)
    if gguf is None:
        raise ValueError(f"llamacpp and llamacpp-lookup run a GGUF file: give --model a .gguf file or an alias "
                         f"(e.g. smollm2-135m), not {model}")
    return str(gguf)


def _engines(args, names: list[str], prompts, encode, heads: dict, threads: int) -> dict | None:
    """What the engine methods run: the target's directory (the float32 weights selfspec loads), the GGUF,
    the EAGLE head exported for vLLM, the longest sequence the run needs."""
    engines = [n for n in names if n in ENGINE_METHODS]
    if not engines:
        return None
    from ..loading import resolve_source

    target = resolve_source(args.model)[0]
    longest = max(len(encode(p.text)[0]) for p in prompts) + args.max_new_tokens
    eagle = None
    if "vllm-eagle3" in engines:
        if heads.get("eagle") is None:
            raise ValueError("vllm-eagle3 needs EAGLE heads: give --eagle-heads DIR")
        eagle = export_eagle3(heads["eagle"], target)
    return {"python": engines_python(args.engines_python), "target_dir": target,   # checked by check_bench_args
            "gguf": _gguf(args.model) if any(ENGINE_METHODS[n][0] == "llamacpp" for n in engines) else None,
            "eagle_dir": eagle, "eagle_heads": None if eagle is None else str(heads["eagle"]),
            "spec_tokens": args.vllm_spec_tokens, "threads": threads,
            "max_model_len": -(-(longest + 64) // 1024) * 1024}


def default_threads() -> int:
    """--threads' default: ``$OMP_NUM_THREADS`` where it is a positive whole number (the share of the cores a
    scheduler or a parallel test run gives this process: more threads than cores there only spin),
    else every core."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(given) if given.isdigit() and int(given) > 0 else (os.cpu_count() or 1)


def run_bench_cli(args) -> int:
    names, auto = check_bench_args(args)
    prompts = load_prompts(args.prompts, limit=args.limit, sample=args.sample, seed=args.seed)
    threads = args.threads or default_threads()
    torch.set_num_threads(threads)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    draft = None
    if DRAFT_METHODS & set(names):
        path = args.draft_model or shipped_draft(args.model)
        draft = load_model(str(path), dtype=args.dtype, device=args.device).model
    heads = {kind: path or shipped_heads(args.model, kind) for kind, path in _heads_flags(args).items()}
    corpus_dir = _corpus_dir(args)
    corpus = None if corpus_dir is None else load_corpus(corpus_dir, fingerprint=config_fingerprint(loaded.model.config))
    chat = bool(getattr(loaded.tokenizer, "chat_template", None))

    def encode(text: str) -> torch.Tensor:
        return torch.tensor([prompt_ids(loaded.tokenizer, text, chat=chat)])

    engines = _engines(args, names, prompts, encode, heads, threads)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        methods, notes = build_methods(names, model=loaded.model, tokenizer=loaded.tokenizer, model_name=loaded.name,
                                       temperature=args.temperature, repetition_penalty=args.repetition_penalty,
                                       heads=heads, draft_model=draft,
                                       settings=_method_settings(args), corpus=corpus, compile=args.compile,
                                       engines=engines)
    notes["corpus"] = None if corpus_dir is None else str(corpus_dir)
    results = run_bench(methods, prompts, encode,
                        model=loaded.model, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        seed=args.seed, progress=not args.json, batch_size=args.batch_size)
    p = loaded.model.get_output_embeddings().weight
    result = {
        "config": {
            "model": loaded.name, "device": str(p.device), "machine": this_hardware(p.device),
            "dtype": str(p.dtype).replace("torch.", ""),
            "threads": threads, "prompts": str(args.prompts), "n_prompts": len(prompts), "limit": args.limit,
            "sample": args.sample,
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "batch_size": args.batch_size,
            "compile": args.compile, "decoding": decoding_mode(args.temperature, repetition_penalty=args.repetition_penalty),
            "repetition_penalty": args.repetition_penalty, "chat_template": chat,
            "methods": names, "auto": auto, "heads": notes, "seed": args.seed,
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
