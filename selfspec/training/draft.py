"""Distil a two-model baseline's draft from the target: its first L layers, trained to imitate it.

The student is ``truncated_copy(target, L)``: the target's embeddings, first L decoder layers,
final norm and LM head. Embeddings and LM head (one tensor when tied) stay frozen and identical
to the target's, so a checkpoint only has to store the decoder layers and the final norm. The
loss is KL(target's final distribution || student's distribution) at every response position
(same position, no shift: both read the same prefix), on the draft vocabulary of
``frequent_vocab`` with the renormalised convention of ``losses.py``: teacher and student logits
are both ``F.linear(h, lm_head.weight[vocab])``, so full-vocabulary logits are never built.

Batching, windows, eval split, schedule, atomic checkpoints and ``--resume`` are train-heads'
(``selfspec.training.train``); only the model side differs.

Output ``out/`` (small: the shared tensors are not copied)::

    config.json, generation_config.json   the draft's HF config (num_hidden_layers = L)
    tokenizer files                       only when a tokenizer is given (the CLI does not: the
                                          base model's is 3.5 MB, and materialize_draft adds it)
    model.safetensors                     ONLY the trained tensors, in ``save_dtype`` (float16 by default)
    selfspec_draft.json                   base model name + fingerprint, names of the shared tensors
    trainer_state.pt                      fp32 trained tensors + optimizer etc. for --resume

``materialize_draft(out)`` rebuilds a complete, ordinary transformers model directory from it
(shared tensors taken from the base model) under ``$SELFSPEC_HOME/drafts``.

Why float16 rather than bfloat16 for storage: decoder weights are small (|w| << 65504), so
float16's range is never in play and its 10-bit mantissa rounds 8x finer than bfloat16's 7 bits.
Saving refuses float16 if a tensor would overflow it instead of silently switching.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.nn import functional as F

from .. import __version__
from ..backbone import config_fingerprint
from ..drafters.draft_model import truncated_copy
from .losses import HeadLoss, exit_loss
from .train import (
    STATE_FILE,
    Batch,
    EvalResult,
    FeatureCache,
    Sequence,
    Target,
    RunState,
    TrainResult,
    _atomic_torch_save,
    _deferred_sigint,
    collate,
    extract_features,
    flag_type,
    frequent_vocab,
    optimizer_loop,
    run_module,
    split_eval,
    target_view,
    to_sequences,
)

log = logging.getLogger(__name__)

META_FILE = "selfspec_draft.json"
WEIGHTS_FILE = "model.safetensors"
SAVE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class DraftConfig:
    """Every train-draft default; the CLI flags are derived from these fields (``--layers`` is separate)."""

    steps: int = 2000                 # optimizer steps
    lr: float = 3e-4                  # whole decoder layers, not fresh heads: gentler than train-heads
    warmup: int = 50                  # linear warm-up steps, then cosine decay to 0
    weight_decay: float = 0.0
    batch_size: int = 8               # sequences per micro-batch (per process)
    grad_accum: int = 1               # micro-batches per optimizer step
    max_len: int = 1024               # longer sequences keep their last max_len tokens
    draft_vocab_size: int = 8192      # 0 = the full vocabulary (loss only; the saved draft keeps the full LM head)
    eval_fraction: float = 0.05       # held-out share of the sequences
    eval_every: int = 200
    save_every: int = 500
    seed: int = 0
    save_dtype: str = "float16"       # float16 | bfloat16: storage of the trained tensors
    cache_features: bool = True       # the teacher's states from train-heads' shared on-disk feature cache
    feature_dtype: str = "float32"    # precision of that one-off pass: float32 | bfloat16
    out: str = "draft-out"


class DraftEval(EvalResult):
    """EvalResult with one 'head' (the student); ``loss`` is the mean KL to the target."""

    def line(self) -> str:
        return (f"eval step {self.step}: KL {self.loss:.4f}, top-1 agreement {self.top1[0]:.1%}, "
                f"top-5 {self.top5[0]:.1%} ({self.tokens} positions)")


# ---------------------------------------------------------------------------------------------- model side


def trained_names(student: torch.nn.Module) -> list[str]:
    """State-dict names the student learns: every parameter but the (frozen, shared) embeddings and LM head."""
    frozen = {id(student.get_input_embeddings().weight), id(student.get_output_embeddings().weight)}
    return [n for n, p in student.named_parameters(remove_duplicate=False) if id(p) not in frozen]


def make_student(model: torch.nn.Module, *, layers: int) -> torch.nn.Module:
    """``truncated_copy`` with embeddings and LM head frozen; layers and final norm trainable, fp32."""
    student = truncated_copy(model, layers).float()
    train = set(trained_names(student))
    for n, p in student.named_parameters(remove_duplicate=False):
        p.requires_grad_(n in train)
    return student


def draft_loss(student: torch.nn.Module, target: Target, batch: Batch, *, device,
               final: torch.Tensor | None = None) -> HeadLoss:
    """Frozen target forward (no grad), student forward, KL at the same positions on the draft vocabulary.

    ``final``: the target's cached post-norm last hidden states for the batch (B, L, H), which
    replace its forward (the expensive half of a step).
    """
    ids, am = batch.input_ids.to(device), batch.attention_mask.to(device)
    window = batch.window.to(device)  # (B, W)
    pick = lambda h: h.gather(1, window[..., None].expand(-1, -1, h.shape[-1]))  # noqa: E731  (B, L, H) -> (B, W, H)
    with torch.no_grad():
        if final is None:
            final = target.backbone.model.model(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state
        teacher = F.linear(pick(final), target.weight)  # (B, W, V_sub)
    h = student.model(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state  # (B, L, H) post-norm
    z = F.linear(pick(h), target.weight.to(h.dtype))  # (B, W, V_sub): the student's LM head is the target's, frozen
    return exit_loss(z, teacher, batch.mask.to(device), vocab=target.vocab)


@torch.no_grad()
def evaluate_draft(student, target: Target, seqs: list[Sequence], *, batch_size: int, device, step: int,
                   autocast=contextlib.nullcontext, features: FeatureCache | None = None,
                   feature_ids: list[int] | None = None) -> DraftEval | None:
    if not seqs:
        return None
    was_training = student.training
    student.eval()
    kl_sum, top1, top5, count = 0.0, 0.0, 0.0, 0.0
    for lo in range(0, len(seqs), batch_size):
        final = None if features is None else features.gather(feature_ids[lo : lo + batch_size], device=device)[0]
        with autocast():
            r = draft_loss(student, target, collate(seqs[lo : lo + batch_size], lead=0), device=device, final=final)
        n = float(r.count[0])
        kl_sum, top1, top5, count = kl_sum + float(r.kl[0]) * n, top1 + float(r.top1[0]) * n, top5 + float(r.top5[0]) * n, count + n
    student.train(was_training)
    d = max(count, 1.0)  # position-weighted means, so the batch size does not change the numbers
    return DraftEval(step=step, loss=kl_sum / d, top1=[top1 / d], top5=[top5 / d], tokens=int(count))


# ---------------------------------------------------------------------------------------------- checkpoint format


def save_draft(student: torch.nn.Module, out, *, base_model: str, base_fingerprint: str, save_dtype: str = "float16",
               tokenizer=None, extra: dict | None = None, draft_vocab: torch.Tensor | None = None) -> None:
    """Write the small draft directory: config, generation config, tokenizer, trained tensors only, meta last.

    ``draft_vocab``: the token ids it was distilled on, recorded as ``config.selfspec_draft_vocab`` so
    that selfspec's draft-model drafter scores only those LM-head rows (transformers ignores it).
    """
    from safetensors.torch import save_file

    if save_dtype not in SAVE_DTYPES:
        raise ValueError(f"unknown save dtype {save_dtype!r}: use float16 or bfloat16")
    dtype = SAVE_DTYPES[save_dtype]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = set(trained_names(student))
    sd = student.state_dict()
    tensors = {n: t.detach().to("cpu", dtype).contiguous() for n, t in sd.items() if n in names}
    big = [n for n, t in sd.items() if n in names and t.abs().max() > torch.finfo(dtype).max]
    if big:
        raise ValueError(f"{big[0]} overflows {save_dtype}: save with save_dtype='bfloat16'")
    config = copy.deepcopy(student.config)
    if draft_vocab is not None:
        config.selfspec_draft_vocab = [int(t) for t in draft_vocab.tolist()]
    config.save_pretrained(out)
    student.generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    fd, tmp = tempfile.mkstemp(dir=out, suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, out / WEIGHTS_FILE)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    meta = {"base_model": base_model, "base_fingerprint": base_fingerprint, "shared": sorted(set(sd) - names),
            "dtype": save_dtype, "num_layers": student.config.num_hidden_layers, "selfspec_version": __version__,
            **({"training": extra} if extra else {})}
    _atomic_write_text(out / META_FILE, json.dumps(meta, indent=2, default=str) + "\n")
    for name in (WEIGHTS_FILE, META_FILE):  # mkstemp makes 0600 files; a draft is meant to be shared
        os.chmod(out / name, 0o644)


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _content_key(path: Path, *salt: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    for s in salt:
        h.update(b"\0" + s.encode())
    return h.hexdigest()[:12]


def materialize_draft(path, *, base_model: str | None = None) -> Path:
    """A complete transformers model directory for the draft in ``path``; ``path`` itself if it is one already.

    When ``path/selfspec_draft.json`` exists: load the base model, refuse a config-fingerprint
    mismatch, fill the shared tensors from it and the trained ones from ``model.safetensors``
    (upcast to the base model's dtype), and save the result under
    ``selfspec_home()/drafts/<dirname>-<hash of model.safetensors + base name>``. Cached: a
    second call only hashes the file. Written to a temporary directory and renamed, so an
    interrupted call never leaves a half-written draft.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from ..loading import load_model, selfspec_home

    path = Path(path)
    if not (path / META_FILE).is_file():
        return path
    meta = json.loads((path / META_FILE).read_text())
    base = base_model or meta["base_model"]
    out = selfspec_home() / "drafts" / f"{path.resolve().name}-{_content_key(path / WEIGHTS_FILE, base)}"
    if (out / "config.json").is_file() and (out / WEIGHTS_FILE).is_file():
        return out

    loaded = load_model(base, dtype=torch.float32, device="cpu")
    fp = config_fingerprint(loaded.model.config)
    if fp != meta["base_fingerprint"]:
        raise ValueError(f"{path} was distilled from a model with config fingerprint {meta['base_fingerprint']}, "
                         f"but {base} has {fp}: pass the base model it was trained from")
    config = AutoConfig.from_pretrained(path)
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    base_sd = loaded.model.state_dict()
    stored = load_file(path / WEIGHTS_FILE)
    missing_base = [n for n in meta["shared"] if n not in base_sd]
    if missing_base:
        raise ValueError(f"{path}: the base model {base} has no tensor {missing_base[0]}")
    full = {n: base_sd[n] for n in meta["shared"]} | {n: t.float() for n, t in stored.items()}
    missing, unexpected = draft.load_state_dict(full, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path} does not fit its config: missing {missing[:1]}, unexpected {unexpected[:1]}")
    if (path / "generation_config.json").is_file():
        draft.generation_config = GenerationConfig.from_pretrained(path)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        draft.save_pretrained(tmp)
        loaded.tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / WEIGHTS_FILE).is_file():  # not a concurrent materialisation of the same draft
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------------------------- the loop


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
    from accelerate import Accelerator
    from transformers import get_cosine_schedule_with_warmup

    if config.steps < 1 or config.batch_size < 1 or config.grad_accum < 1:
        raise ValueError("steps, batch_size and grad_accum must all be >= 1")
    if config.save_dtype not in SAVE_DTYPES:
        raise ValueError(f"unknown save dtype {config.save_dtype!r}: use float16 or bfloat16")
    out = Path(config.out)
    state_path = out / STATE_FILE
    if state_path.is_file() and not resume:
        raise ValueError(f"{out} already holds a training run: pass --resume to continue it, or choose another --out")

    use_cuda = next(model.parameters()).device.type == "cuda"
    accelerator = Accelerator(mixed_precision="bf16" if use_cuda else "no", gradient_accumulation_steps=config.grad_accum,
                              cpu=not use_cuda)
    device = accelerator.device
    model.requires_grad_(False).eval().to(device)
    fingerprint = config_fingerprint(model.config)

    seqs = to_sequences(dataset, max_len=config.max_len)
    if not seqs:
        raise ValueError("the data has no sequence with a response token: generate some with `selfspec gen-data`")
    train_idx, eval_idx = split_eval(len(seqs), fraction=config.eval_fraction, seed=config.seed)
    train_seqs, eval_seqs = [seqs[i] for i in train_idx], [seqs[i] for i in eval_idx]
    vocab_size = model.get_output_embeddings().weight.shape[0]
    vocab = frequent_vocab(dataset, config.draft_vocab_size, vocab_size=vocab_size, eos_token_ids=eos_token_ids)

    student = make_student(model, layers=layers).to(device).train()  # fp32 master weights; autocast on CUDA
    names = trained_names(student)
    saved = torch.load(state_path, map_location="cpu", weights_only=True) if resume and state_path.is_file() else None
    if saved is not None:
        _check_resumable(saved, layers=layers, config=config, vocab=vocab, fingerprint=fingerprint, out=out)
        student.load_state_dict(saved["student"], strict=False)
    elif resume:
        log.warning("--resume: %s has no %s, starting from scratch", out, STATE_FILE)

    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=min(config.warmup, config.steps),
                                                num_training_steps=config.steps)
    # The scheduler is stepped by hand once per optimizer step (accelerate's wrapper would step it per process).
    student, optimizer = accelerator.prepare(student, optimizer)
    state = RunState()
    if saved is not None:
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        state = RunState(step=saved["step"], tokens_seen=saved["tokens_seen"], wall_before=saved["wall_s"],
                         evals=[DraftEval(**e) for e in saved["evals"]])
        torch.set_rng_state(saved["rng"])
        log.info("resumed %s at step %d", out, state.step)

    target = target_view(model, vocab=vocab, exit_layer=None)
    raw = accelerator.unwrap_model(student)
    features = None
    if config.cache_features:  # train-heads' cache (same key: exit layer N // 2), so the two share one pass
        features = extract_features(model, seqs, exit_layer=model.config.num_hidden_layers // 2, batch_size=config.batch_size,
                                    device=device, dtype=config.feature_dtype, progress=progress and accelerator.is_main_process)

    def micro_loss(mine: list[int]) -> tuple[HeadLoss, Batch]:
        batch = collate([train_seqs[i] for i in mine], lead=0)
        final = None if features is None else features.gather([train_idx[i] for i in mine], device=device)[0]
        return draft_loss(student, target, batch, device=device, final=final), batch

    def evaluate_at(step: int) -> DraftEval | None:
        return evaluate_draft(raw, target, eval_seqs, batch_size=config.batch_size, device=device, step=step,
                              autocast=accelerator.autocast, features=features, feature_ids=eval_idx)

    def save(state: RunState, wall: float) -> None:
        extra = {"data": data_dir, "rows": data_rows, "steps": state.step, "tokens_seen": state.tokens_seen, "wall_s": round(wall, 1),
                 "eval": asdict(state.evals[-1]) if state.evals else None, "train_config": asdict(config)}
        sd = raw.state_dict()
        saved_state = {
            "student": {n: sd[n].detach().cpu() for n in names},
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "step": state.step, "tokens_seen": state.tokens_seen, "wall_s": wall, "rng": torch.get_rng_state(),
            "evals": [asdict(e) for e in state.evals], "config": asdict(config), "layers": layers,
            "fingerprint": fingerprint, "vocab": vocab,
        }
        with _deferred_sigint():
            # Draft first, state last: the state names the step both belong to, and resume reads only the state.
            save_draft(raw, out, base_model=name, base_fingerprint=fingerprint, save_dtype=config.save_dtype,
                       tokenizer=tokenizer, extra=extra, draft_vocab=vocab)
            _atomic_torch_save(saved_state, state_path)

    return optimizer_loop(accelerator=accelerator, module=student, optimizer=optimizer, scheduler=scheduler,
                          params=params, config=config, n_train=len(train_seqs), micro_loss=micro_loss,
                          evaluate_at=evaluate_at, save=save, state=state, out=out, desc=f"train draft L={layers}",
                          progress=progress, callback=callback)


def _check_resumable(saved: dict, *, layers: int, config: DraftConfig, vocab, fingerprint: str, out: Path) -> None:
    """Refuse to resume a run with another depth, base model or draft vocabulary."""
    diffs = ["layers"] if saved["layers"] != layers else []
    if saved["config"].get("draft_vocab_size") != config.draft_vocab_size:
        diffs.append("draft_vocab_size")
    if saved["fingerprint"] != fingerprint:
        diffs.append("base model")
    old = saved["vocab"]
    if (old is None) != (vocab is None) or (vocab is not None and not torch.equal(old, vocab.cpu())):
        diffs.append("draft vocabulary (the data changed)")
    if diffs:
        raise ValueError(f"cannot resume {out}: {', '.join(diffs)} differ from the saved run; use another --out")


# ---------------------------------------------------------------------------------------------- CLI


def add_train_draft_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags for ``selfspec train-draft``: --model, --layers, the data source, then one flag per DraftConfig field."""
    parser.add_argument("--model", required=True, help="alias, model directory, .gguf file or hub id (e.g. smollm2-135m)")
    parser.add_argument("--layers", type=int, required=True, help="draft depth L: the target's first L decoder layers")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", default=None, help="self-distillation data directory (from `selfspec gen-data`); several: comma-separated; DIR@N: its first N rows")
    src.add_argument("--prompts", default=None, help="prompt file: generate the data into <out>/data first (resumable)")
    helps = {"draft_vocab_size": "vocabulary the loss is computed on; 0 = full", "save_dtype": "float16 | bfloat16"}
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


def run_train_draft(args: argparse.Namespace) -> TrainResult:
    """``selfspec train-draft``: optionally generate data, distil, print a one-line summary."""
    from ..loading import load_model
    from . import data as gen

    config = DraftConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DraftConfig)})
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    data_dir = args.data
    if not data_dir:
        data_dir = str(Path(config.out) / "data")
        d = gen.DataGenConfig()
        gen.generate_distillation_data(
            loaded.model, loaded.tokenizer, gen.load_prompts(args.prompts, max_prompts=args.max_prompts), data_dir,
            max_new_tokens=args.max_new_tokens or d.max_new_tokens, batch_size=args.gen_batch_size or d.batch_size,
            model_name=loaded.name, progress=not args.no_progress,
        )
    rows = gen.row_counts(data_dir)  # pinned: gen-data may still be appending shards
    dataset = gen.load_distillation_data(data_dir, rows=rows)
    eos = gen.read_meta(data_dir).get("eos_token_ids", [])
    result = train_draft(loaded.model, dataset, layers=args.layers, config=config, name=loaded.name,
                         eos_token_ids=eos, data_dir=str(data_dir), data_rows=rows, resume=args.resume,
                         progress=not args.no_progress)
    print(result.summary(f"train-draft L={args.layers}"), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    return run_module(argv, add_args=add_train_draft_args, run=run_train_draft, prog="python -m selfspec.training.draft",
                      description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
