"""Distil a two-model baseline's draft from the target: its first L layers, trained to imitate it.

The student, its loss and its checkpoint format are ``tasks.draft``'s; batching, windows, eval
split, schedule, atomic checkpoints and ``--resume`` are the shared loop's (``loop.fit``), as for
train-heads. This module runs it (``train_draft``, the ``train-draft`` CLI) and turns a saved draft
back into a complete model (``materialize_draft``, which lives with the other model loading in
``selfspec.loading`` and is re-exported here).

Output ``out/`` (small: the shared tensors are not copied)::

    config.json, generation_config.json   the draft's HF config (num_hidden_layers = L)
    tokenizer files                       only when a tokenizer is given (the CLI does not: the
                                          base model's is 3.5 MB, and materialize_draft adds it)
    model.safetensors                     ONLY the trained tensors, in ``save_dtype`` (float16 by default)
    selfspec_draft.json                   base model name + fingerprint, names of the shared tensors
    trainer_state.pt                      fp32 trained tensors + optimizer etc. for --resume

``materialize_draft(out)`` rebuilds a complete, ordinary transformers model directory from it
(shared tensors taken from the base model) under ``$SELFSPEC_HOME/drafts``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from ..core.backbone import config_fingerprint
from ..loading import check_model_name, load_model, model_config
from ..settings import default_exit_layer
from .checkpoint import STATE_FILE, check_resumable, open_run
from .cli_args import GROUP_BY_LENGTH_HELP, at_least, check_generation_flags, check_training_config, flag_type, run_module
from .config import DraftConfig
from .features import extract_features, target_view
from .loop import RunState, TrainResult, fit, make_accelerator, report_run, run_hardware
from .split import frequent_vocab, run_split
from .tasks.draft import SAVE_DTYPES, DraftTask, make_student

log = logging.getLogger(__name__)


def train_draft(
    model,
    dataset,
    *,
    layers: int,
    config: DraftConfig,
    name: str,
    tokenizer=None,
    eos_token_ids=(),
    data_dir: str | None = None,
    data_rows: list[int] | None = None,
    resume: bool = False,
    progress: bool = True,
    callback: Callable[[int], None] | None = None,
) -> TrainResult:
    """Distil a ``layers``-deep draft of ``model`` on ``dataset`` (rows: input_ids, response_start) into ``config.out``.

    ``name`` is the base model name recorded in ``selfspec_draft.json`` (what ``materialize_draft``
    loads). ``callback(step)`` runs after every optimizer step. On KeyboardInterrupt the last
    checkpoint stays intact and the result says ``interrupted``.
    """
    if config.steps < 1 or config.batch_size < 1 or config.grad_accum < 1:
        raise ValueError("steps, batch_size and grad_accum must all be >= 1")
    if config.save_dtype not in SAVE_DTYPES:
        raise ValueError(f"unknown save dtype {config.save_dtype!r}: use float16 or bfloat16")
    out = Path(config.out)
    state_path = open_run(out, resume=resume)

    accelerator = make_accelerator(model, grad_accum=config.grad_accum)
    device = accelerator.device
    model.requires_grad_(False).eval().to(device)
    fingerprint = config_fingerprint(model.config)

    seqs, train_idx, eval_idx = run_split(dataset, max_len=config.max_len, fraction=config.eval_fraction, seed=config.seed)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    vocab = frequent_vocab(dataset, config.draft_vocab_size, vocab_size=vocab_size, eos_token_ids=eos_token_ids)

    student = make_student(model, layers=layers).to(device).train()  # fp32 master weights; autocast on CUDA
    saved = torch.load(state_path, map_location="cpu", weights_only=True) if resume and state_path.is_file() else None
    if saved is not None:
        _check_resumable(saved, layers=layers, config=config, vocab=vocab, fingerprint=fingerprint, out=out)
        student.load_state_dict(saved["student"], strict=False)
    elif resume:
        log.warning("--resume: %s has no %s, starting from scratch", out, STATE_FILE)
    params = [p for p in student.parameters() if p.requires_grad]

    target = target_view(model, vocab=vocab, exit_layer=None)
    features = None
    if config.cache_features:  # train-heads' cache (same key: exit layer N // 2), so the two share one pass
        features = extract_features(model, seqs, exit_layer=default_exit_layer(model.config.num_hidden_layers), batch_size=config.batch_size,
                                    device=device, dtype=config.feature_dtype, progress=progress and accelerator.is_main_process)
    task = DraftTask(config, target=target, device=device, layers=layers, base_model=name, base_fingerprint=fingerprint,
                     vocab=vocab, tokenizer=tokenizer)

    hardware = run_hardware(accelerator)

    def record(state: RunState, wall: float) -> dict:
        return {"data": data_dir, "rows": data_rows, "steps": state.step, "tokens_seen": state.tokens_seen, "wall_s": round(wall, 1),
                "eval": asdict(state.evals[-1]) if state.evals else None, "train_config": asdict(config), "hardware": hardware}

    return fit(task, student, params, accelerator=accelerator, config=config, seqs=seqs, train_idx=train_idx,
               eval_idx=eval_idx, features=features, saved=saved, record=record, fingerprint=fingerprint, vocab=vocab,
               out=out, desc=f"train draft L={layers}", progress=progress, callback=callback)


def _check_resumable(saved: dict, *, layers: int, config: DraftConfig, vocab, fingerprint: str, out: Path) -> None:
    """Refuse to resume a run with another depth, base model or draft vocabulary."""
    diffs = ["layers"] if saved["layers"] != layers else []
    if saved["config"].get("draft_vocab_size") != config.draft_vocab_size:
        diffs.append("draft_vocab_size")
    check_resumable(saved, differing=diffs, fingerprint=fingerprint, vocab=vocab, out=out)


# ---------------------------------------------------------------------------------------------- CLI


def add_train_draft_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags for ``selfspec train-draft``: --model, --layers, the data source, then one flag per DraftConfig field."""
    parser.add_argument("--model", required=True, help="alias, model directory, .gguf file or hub id (e.g. smollm2-135m)")
    parser.add_argument("--layers", type=int, required=True, help="draft depth L: the target's first L decoder layers")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", default=None, help="self-distillation data directory (from `selfspec gen-data`); several: comma-separated; DIR@N: its first N rows")
    src.add_argument("--prompts", default=None, help="prompt file: generate the data into <out>/data first (resumable)")
    helps = {"draft_vocab_size": "vocabulary the loss is computed on; 0 = full", "save_dtype": "float16 | bfloat16",
             "group_by_length": GROUP_BY_LENGTH_HELP}
    for f in dataclasses.fields(DraftConfig):
        default = f.default
        parser.add_argument("--" + f.name.replace("_", "-"), type=flag_type(type(default)), default=default,
                            help="; ".join(x for x in (helps.get(f.name), f"default {default}") if x))
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its trainer_state.pt")
    parser.add_argument("--max-prompts", type=int, default=None, help="with --prompts: use only the first N")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="with --prompts: response length (default: gen-data's)")
    parser.add_argument("--gen-batch-size", type=int, default=None, help="with --prompts: generation batch size")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 of the target (default: float32 on CPU)")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def check_draft_args(args: argparse.Namespace, config: DraftConfig) -> None:
    """Flags, inputs and --out checked before the model loads (and before --prompts writes data into --out)."""
    from . import data as gen

    at_least(args.layers, 1, "layers")
    at_least(args.threads, 1, "threads")
    check_training_config(config, resume=args.resume)
    check_generation_flags(vars(args))
    if config.save_dtype not in SAVE_DTYPES:
        raise ValueError(f"--save-dtype {config.save_dtype!r}: use float16 or bfloat16")
    check_model_name(args.model)
    gen.check_training_sources(data=args.data, prompts=args.prompts)
    n = model_config(args.model).num_hidden_layers
    if args.layers >= n:
        raise ValueError(f"--layers {args.layers}: {args.model} has {n} layers, so a draft takes 1 to {n - 1}")


def run_train_draft(args: argparse.Namespace) -> TrainResult:
    """``selfspec train-draft``: optionally generate data, distil, print a one-line summary."""
    from . import data as gen

    config = DraftConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DraftConfig)})
    check_draft_args(args, config)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    data = gen.run_data(loaded, data=args.data, prompts=args.prompts, out=config.out, max_prompts=args.max_prompts,
                        max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch_size, progress=not args.no_progress)
    result = train_draft(loaded.model, data.dataset, layers=args.layers, config=config, name=loaded.name,
                         eos_token_ids=data.eos_token_ids, data_dir=data.dir, data_rows=data.rows, resume=args.resume,
                         progress=not args.no_progress)
    report_run(result, config.out, f"train-draft L={args.layers}")
    return result


def main(argv: list[str] | None = None) -> int:
    return run_module(argv, add_args=add_train_draft_args, run=run_train_draft, prog="python -m selfspec.training.draft",
                      description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
