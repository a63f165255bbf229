"""Fit Medusa heads or an exit head to the target's own distributions (self-distillation).

The backbone is frozen and the heads learn on the draft vocabulary from the target's own
distributions; the per-kind losses are in ``tasks/`` (``tasks.heads`` describes the pass), and
every kind runs under the one loop of ``loop.fit``. This module turns a ``TrainConfig`` into such a
run (``train_heads``) and holds the ``train-heads`` CLI.

Output ``out/``: a heads directory (``selfspec.heads.save_heads``: config.json + model.safetensors,
with ``draft_vocab``) refreshed every ``save_every`` steps and at the end, plus ``trainer_state.pt``
(heads weights, optimizer, scheduler, step, RNG, eval history), written to a temporary file and
``os.replace``d, so ``resume=True`` continues from the last one and a Ctrl-C never leaves a torn
checkpoint. Batches are a pure function of (seed, step), so a resumed run sees the batches an
uninterrupted run would have.

CLI: ``selfspec train-heads --model M --kind medusa --data DIR --out DIR`` (or ``--prompts FILE``
to generate the data into ``DIR/data`` first); ``--config recipe.yaml`` supplies defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from ..heads import KINDS
from ..settings import default_exit_layer
from .checkpoint import STATE_FILE, check_resumable, open_run
from .cli_args import GROUP_BY_LENGTH_HELP, at_least, check_generation_flags, check_training_config, flag_type, run_module
from .config import RunConfig, TrainConfig
from .features import extract_features, target_view
from .loop import RunState, TrainResult, fit, make_accelerator, report_run, resolve_mixed_precision, run_hardware
from .split import encode_rows, frequent_vocab, run_split, warm_split
from .tasks import HEAD_TASKS
from .warm_start import check_init_shape, load_grown, load_init

log = logging.getLogger(__name__)


def train_heads(
    model,
    dataset,
    *,
    config: TrainConfig,
    name: str,
    eos_token_ids=(),
    data_dir: str | None = None,
    data_rows: list[int] | None = None,
    resume: bool = False,
    progress: bool = True,
    callback: Callable[[int], None] | None = None,
) -> TrainResult:
    """Train heads for ``model`` on ``dataset`` (rows: input_ids, response_start) into ``config.out``.

    ``name`` is the base model name recorded in the heads' config; ``data_dir`` (one directory or
    several, comma-separated) and ``data_rows`` (rows used from each) are recorded so that tune-tree
    and eval-heads can rebuild the exact held-out split later. ``callback(step)`` runs after
    every optimizer step (tests use it to interrupt). Returns a summary; on KeyboardInterrupt the
    last checkpoint stays intact and ``interrupted`` is True.
    """
    from ..model import untrained_heads

    aux = check_heads_config(config, model.config.num_hidden_layers)
    resolve_mixed_precision(config.mixed_precision, "cpu")   # an unknown mode fails before any loading
    if config.steps < 1 or config.batch_size < 1 or config.grad_accum < 1:
        raise ValueError("steps, batch_size and grad_accum must all be >= 1")
    out = Path(config.out)
    state_path = open_run(out, resume=resume)

    accelerator = make_accelerator(model, grad_accum=config.grad_accum, mixed_precision=config.mixed_precision)
    device = accelerator.device
    model.requires_grad_(False).eval().to(device)
    n_layers = model.config.num_hidden_layers
    exit_layer = (config.exit_layer if config.exit_layer is not None else default_exit_layer(n_layers)) if config.kind == "early-exit" else None
    if exit_layer is not None and not 0 < exit_layer < n_layers:
        raise ValueError(f"exit layer {exit_layer} must be between 1 and {n_layers - 1}")

    seqs, train_idx, eval_idx = run_split(dataset, max_len=config.max_len, fraction=config.eval_fraction, seed=config.seed)
    init = None
    if config.init:
        if config.lora:
            raise ValueError("--init warm-starts heads only: it cannot be combined with --lora")
        init = load_init(config.init, kind=config.kind, model=model)
        train_idx, eval_idx = warm_split(seqs, eval_idx, init)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    vocab = init.draft_vocab if init is not None else frequent_vocab(
        dataset, config.draft_vocab_size, vocab_size=vocab_size, eos_token_ids=eos_token_ids)

    torch.manual_seed(config.seed)   # the heads' random initial weights: a rerun (or a killed run restarted) starts the same
    heads = untrained_heads(config.kind, model, name, num_heads=config.num_heads, exit_layer=exit_layer,
                            token_input=config.token_input, head_mlp=parse_widths(config.head_mlp),
                            adapter=config.exit_adapter, intermediate_size=config.exit_intermediate,
                            aux_layers=aux, draft_vocab=vocab if config.kind == "eagle" else None)
    if init is not None:
        check_init_shape(init, heads, config.init)
    heads.config.draft_vocab_size = 0 if vocab is None else int(vocab.numel())
    heads.config.storage_dtype = config.save_dtype
    heads.draft_vocab = vocab
    # fp32 master weights (autocast on CUDA); trainable even where copied from the frozen backbone (layer adapter).
    module = heads.module.to(device=device, dtype=torch.float32).requires_grad_(True).train()
    if config.kind == "eagle":
        heads.config.shared_lm_head = config.shared_lm_head
        module.lm_head.weight.requires_grad_(not config.shared_lm_head)

    saved = torch.load(state_path, map_location="cpu", weights_only=True) if resume and state_path.is_file() else None
    if saved is not None:
        check_resumable(saved, differing=_changed_settings(saved["config"], config), fingerprint=heads.config.base_fingerprint,
                        vocab=vocab, out=out)
        module.load_state_dict(saved["heads"])
    elif init is not None:
        load_grown(module, init, heads.config.aux_layers if config.kind == "eagle" else None)
        log.info("warm start from %s", config.init)
    elif resume:
        log.warning("--resume: %s has no %s, starting from scratch", out, STATE_FILE)

    lora = _attach_lora(model, config.lora) if config.lora > 0 else None
    if lora is not None:
        heads.config.lora = {"rank": config.lora, "alpha": 2 * config.lora, "target_modules": "all-linear",
                             "note": "the backbone was fine-tuned: output differs from the original model"}
        if saved is not None and "lora" in saved:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(lora, saved["lora"])
    params = list(module.parameters()) + ([p for p in lora.parameters() if p.requires_grad] if lora is not None else [])

    target = target_view(model, vocab=vocab, exit_layer=exit_layer)
    features = None
    if config.cache_features and lora is None and HEAD_TASKS[config.kind].caches_features:
        # Features for the default exit layer too when training Medusa, so both kinds share one pass.
        features = extract_features(model, seqs, exit_layer=exit_layer if exit_layer is not None else default_exit_layer(n_layers),
                                    batch_size=config.batch_size, device=device, dtype=config.feature_dtype,
                                    progress=progress and accelerator.is_main_process)
    task = HEAD_TASKS[config.kind](config, target=target, device=device, lora=lora, heads=heads)

    hardware = run_hardware(accelerator)

    def record(state: RunState, wall: float) -> dict:
        prov = {
            "data": data_dir, "rows": data_rows, "sequences": len(seqs), "steps": state.step, "tokens_seen": state.tokens_seen, "wall_s": round(wall, 1),
            "eval": asdict(state.evals[-1]) if state.evals else None, "train_config": asdict(config), "hardware": hardware,
        }
        if init is not None:  # not the seeded split: record it for tune-tree and eval-heads; and the init's run
            prov["held_out_rows"] = encode_rows(eval_idx)
            prov["init"] = {"path": str(config.init), **{
                k: init.config.provenance.get(k) for k in ("data", "rows", "steps", "tokens_seen", "wall_s", "hardware", "eval", "init")}}
        return prov

    try:
        return fit(task, module, params, accelerator=accelerator, config=config, seqs=seqs, train_idx=train_idx,
                   eval_idx=eval_idx, features=features, saved=saved, record=record,
                   fingerprint=heads.config.base_fingerprint, vocab=vocab, out=out, desc=f"train {config.kind}",
                   progress=progress, callback=callback)
    finally:
        _detach_lora(lora)


def _changed_settings(old: dict, config: TrainConfig) -> list[str]:
    """The heads-shaping settings of a saved run (its ``asdict(TrainConfig)``) that differ from ``config``."""
    keys = ("kind", "num_heads", "token_input", "head_mlp", "exit_layer", "exit_adapter", "exit_intermediate",
            "draft_vocab_size", "lora", "aux_layers", "shared_lm_head")
    defaults = TrainConfig()
    before = {"token_input": False}  # runs saved before a field existed had the old behaviour, not today's default
    value = lambda k, v: parse_widths(v) if k == "head_mlp" else v  # noqa: E731  ("1024,1024" == "1024, 1024")
    return [k for k in keys if value(k, old.get(k, before.get(k, getattr(defaults, k)))) != value(k, getattr(config, k))]


def _attach_lora(model, rank: int):
    """Wrap the frozen backbone's linear layers (not the LM head) with trainable LoRA adapters, in place."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear", bias="none")
    return get_peft_model(model, cfg)


def _detach_lora(lora) -> None:
    """Remove the adapters again (unmerged): the caller's model is left as it was given."""
    if lora is not None:
        lora.unload()


def check_heads_config(config: TrainConfig, num_layers: int) -> list[int] | None:
    """What a run of ``config.kind`` heads takes, checked before anything is read or written; returns the
    aux layers asked for (None: the default)."""
    if config.kind not in KINDS:
        raise ValueError(f"unknown kind {config.kind!r}: expected one of {', '.join(KINDS)}")
    if config.lora < 0:
        raise ValueError("--lora must be >= 0 (0 = heads only, the model's output unchanged)")
    if config.head_mlp and config.kind != "medusa":
        raise ValueError("--head-mlp widens Medusa heads: drop it for --kind early-exit (see --exit-intermediate)")
    if config.exit_adapter not in ("mlp", "layer"):
        raise ValueError(f"--exit-adapter must be 'mlp' or 'layer' (got {config.exit_adapter!r})")
    if config.loss_rows not in ("response", "all") or (config.loss_rows == "all" and config.kind != "eagle"):
        raise ValueError(f"--loss-rows is 'response' (any kind) or 'all' (eagle only), got {config.loss_rows!r}")
    if config.kind == "eagle" and config.ttt_steps < 1:
        raise ValueError(f"--ttt-steps must be >= 1 (got {config.ttt_steps}): the draft steps unrolled in training")
    aux = parse_widths(config.aux_layers, flag="--aux-layers") or None
    if aux is not None and config.kind != "eagle":
        raise ValueError("--aux-layers applies to --kind eagle only")
    if aux is not None and not all(0 < a < num_layers for a in aux):
        raise ValueError(f"--aux-layers {config.aux_layers}: the model has {num_layers} layers, so each is 1 to {num_layers - 1}")
    return aux


def parse_widths(text, *, flag: str = "--head-mlp") -> list[int]:
    """"1024,1024" (or a YAML list) -> [1024, 1024]; "" -> []. Also --aux-layers' "2,15,27"."""
    if isinstance(text, (list, tuple)):
        return [int(w) for w in text]
    try:
        widths = [int(w) for w in str(text).replace(" ", "").split(",") if w]
    except ValueError:
        what = "widths, one per head, e.g. 1024,1024" if flag == "--head-mlp" else "layer numbers, e.g. 2,15,27"
        raise ValueError(f"{flag} takes comma-separated {what} (got {text!r})") from None
    if any(w < 0 for w in widths):
        raise ValueError(f"{flag} values must be >= 0 (got {text!r})")
    return widths


# ---------------------------------------------------------------------------------------------- CLI


def add_train_heads_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags for ``selfspec train-heads``. TrainConfig fields default to None here so that a
    ``--config`` recipe can fill them; :func:`config_from_args` applies the dataclass defaults last."""
    d = TrainConfig()
    parser.add_argument("--model", default=None, help="alias, model directory, .gguf file or hub id (e.g. smollm2-135m)")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--data", default=None, help="self-distillation data directory (from `selfspec gen-data`); several: comma-separated; DIR@N: its first N rows")
    src.add_argument("--prompts", default=None, help="prompt file: generate the data into <out>/data first (resumable)")
    parser.add_argument("--config", default=None, help="YAML recipe whose keys are these flags' names (underscores); flags win")
    helps = {"kind": "medusa | early-exit | eagle", "aux_layers": "eagle: comma-separated target layers whose hidden states feed the head (default: 2, N/2, N-3)",
             "ttt_steps": "eagle: draft steps unrolled per position (training-time test)", "exit_layer": "default: num_layers // 2", "draft_vocab_size": "0 = full vocabulary",
             "lora": "Medusa-2: also fine-tune the backbone with LoRA of this rank, distilled to the original (the model's output CHANGES: speculative output then matches the fine-tuned model, not the original)", "hard_weight": "cross-entropy weight on the target's tokens (medusa, early-exit: the tokens that followed; eagle: the target's top token at each row)",
             "init": "warm start: heads directory (same kind and shape) whose weights and draft vocabulary this run starts from, with a fresh optimizer and schedule",
             "token_input": "medusa: heads also read the root token's embedding (true | false)",
             "head_mlp": "medusa: comma-separated widths of an extra residual MLP per head (e.g. 1024,1024: heads 1 and 2; empty: none)",
             "mixed_precision": "auto (bf16 on CUDA, none on CPU) | no | bf16 (on a CPU, faster only with AVX512-BF16 or AMX)",
             "group_by_length": GROUP_BY_LENGTH_HELP,
             "feature_dtype": "float32 | bfloat16: precision of the one-off backbone feature pass (bfloat16: faster on CPUs with BF16)",
             "num_heads": "medusa: heads, one per draft depth",
             "shared_lm_head": "eagle: true scores with the target's own LM-head rows, frozen and not stored; false trains "
                               "the draft vocabulary's rows too (starting from the target's) and stores them",
             "loss_rows": "eagle: response (answer rows only) | all (the prompt's rows too)",
             "steps": "optimizer steps", "lr": "peak learning rate (AdamW)", "warmup": "linear warm-up steps, then cosine decay to 0",
             "weight_decay": "AdamW weight decay", "batch_size": "sequences per micro-batch (per process)",
             "grad_accum": "micro-batches per optimizer step", "max_len": "longer sequences keep their last max_len tokens",
             "head_weight_base": "loss weight base: medusa head k (eagle: unrolled step k) weighs base**k",
             "eval_fraction": "share of the sequences held out for evaluation", "eval_every": "steps between held-out evaluations",
             "save_every": "steps between checkpoints (atomic; --resume continues from the last)",
             "seed": "seeds the held-out split, the batches and the initial weights",
             "exit_adapter": "early-exit: mlp (residual MLP) | layer (a decoder layer initialised from the exit layer)",
             "exit_intermediate": "early-exit mlp width (0 = the hidden size)",
             "cache_features": "one backbone pass up front, kept on disk (medusa, early-exit; eagle runs the target in each step)",
             "save_dtype": "float32 | float16 | bfloat16: storage dtype of model.safetensors (resume state stays float32)",
             "out": "output heads directory"}
    shared = {f.name for f in dataclasses.fields(RunConfig)}
    fields = dataclasses.fields(TrainConfig)
    for f in [f for f in fields if f.name not in shared] + [f for f in fields if f.name in shared]:   # --kind first
        default = getattr(d, f.name)
        typ = {"int | None": int, "str | None": str}.get(str(f.type), type(default) if default is not None else int)
        help_ = "; ".join(x for x in (helps.get(f.name), None if default is None else f"default {default}") if x)
        parser.add_argument("--" + f.name.replace("_", "-"), type=flag_type(typ), default=None, help=help_)
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its trainer_state.pt")
    parser.add_argument("--max-prompts", type=int, default=None, help="with --prompts: use only the first N")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="with --prompts: response length (default: gen-data's)")
    parser.add_argument("--gen-batch-size", type=int, default=None, help="with --prompts: generation batch size")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: float32 on CPU)")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, dict]:
    """TrainConfig from (flags > recipe > defaults), and the recipe's other keys (model, data, prompts)."""
    recipe = {}
    if args.config:
        import yaml

        try:
            recipe = yaml.safe_load(Path(args.config).read_text()) or {}
        except OSError as e:
            raise ValueError(f"--config {args.config} cannot be read ({e.strerror or e}): give a YAML recipe file") from None
        except (yaml.YAMLError, RecursionError) as e:
            where = getattr(e, "problem_mark", None)
            at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
            raise ValueError(f"--config {args.config} is not valid YAML{at}: fix the recipe, a mapping of flag "
                             "names to values") from None
        if not isinstance(recipe, dict):
            raise ValueError(f"{args.config}: a recipe is a YAML mapping of flag names to values")
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    other = {"model", "data", "prompts", "max_prompts", "max_new_tokens", "gen_batch_size"}
    unknown = set(recipe) - names - other
    if unknown:
        raise ValueError(f"{args.config}: unknown keys {', '.join(sorted(unknown))}")
    recipe = {key: _recipe_value(args.config, key, value) for key, value in recipe.items()}
    values = {k: v for k, v in recipe.items() if k in names}
    values.update({k: getattr(args, k) for k in names if getattr(args, k, None) is not None})
    if "head_mlp" in values:  # fail before loading anything; a YAML list becomes the flag's text
        values["head_mlp"] = ",".join(str(w) for w in parse_widths(values["head_mlp"]))
    extra = {k: recipe.get(k) for k in other}
    extra.update({k: getattr(args, k) for k in other if getattr(args, k, None) is not None})
    return TrainConfig(**values), extra


_RECIPE_TYPES = {**{f.name: str(f.type) for f in dataclasses.fields(TrainConfig)}, "model": "str", "data": "str",
                 "prompts": "str", "max_prompts": "int", "max_new_tokens": "int", "gen_batch_size": "int"}
_TAKES = {"int": (int, "a whole number"), "float": ((int, float), "a number"), "bool": (bool, "true or false"),
          "str": (str, "text")}


def _recipe_value(path, key: str, value):
    """A recipe's value, of its flag's type: one line naming the key where it is not (``steps: lots``). A float
    written ``1e-3`` is taken as the number it is (YAML 1.1 reads it as text)."""
    typ = _RECIPE_TYPES[key]
    if value is None and typ.endswith(" | None"):
        return value
    typ = typ.removesuffix(" | None")
    if typ == "float" and isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value)
    takes, want = _TAKES[typ]
    if key in ("head_mlp", "aux_layers"):   # a YAML list of numbers, or the flag's comma text
        takes = (str, list)
    if isinstance(value, bool) != (typ == "bool") or not isinstance(value, takes):
        raise ValueError(f"--config {path}: {key} must be {want} (got {value!r})")
    return value


def check_train_heads_args(args: argparse.Namespace) -> tuple[TrainConfig, dict]:
    """Every train-heads flag and recipe key checked before the model loads: (config, recipe extras)."""
    from ..loading import check_model_name, model_config
    from .data import check_training_sources

    config, extra = config_from_args(args)
    check_training_config(config, resume=args.resume)
    check_generation_flags(extra)
    at_least(args.threads, 1, "threads")
    if not extra["model"]:
        raise ValueError("--model is required (or `model:` in the --config recipe)")
    check_model_name(extra["model"])
    if not extra["data"] and not extra["prompts"]:
        raise ValueError("give --data DIR (from `selfspec gen-data`) or --prompts FILE")
    check_training_sources(data=extra["data"], prompts=extra["prompts"])
    n = model_config(extra["model"]).num_hidden_layers
    check_heads_config(config, n)
    if config.kind == "early-exit" and config.exit_layer is not None:
        if not config.exit_layer < n:
            raise ValueError(f"--exit-layer {config.exit_layer}: {extra['model']} has {n} layers, so it takes 1 to {n - 1}")
    return config, extra


def run_train_heads(args: argparse.Namespace) -> TrainResult:
    """``selfspec train-heads``: check every flag, optionally generate data, train, print a one-line summary."""
    from ..loading import load_model
    from . import data as gen

    config, extra = check_train_heads_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    loaded = load_model(extra["model"], dtype=args.dtype, device=args.device)
    data = gen.run_data(loaded, data=extra["data"], prompts=extra["prompts"], out=config.out, max_prompts=extra["max_prompts"],
                        max_new_tokens=extra["max_new_tokens"], batch_size=extra["gen_batch_size"], progress=not args.no_progress)
    result = train_heads(loaded.model, data.dataset, config=config, name=loaded.name, eos_token_ids=data.eos_token_ids,
                         data_dir=data.dir, data_rows=data.rows, resume=args.resume, progress=not args.no_progress)
    report_run(result, config.out, f"train-heads {config.kind}")
    return result


def main(argv: list[str] | None = None) -> int:
    return run_module(argv, add_args=add_train_heads_args, run=run_train_heads, prog="python -m selfspec.training.train",
                      description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
