"""The one trainer loop every kind of trained module runs under (train-heads' heads, train-draft's draft).

:func:`fit` sets up AdamW with a linear warm-up then cosine decay, restores a resumed run, and
drives :func:`optimizer_loop` with a :class:`~selfspec.training.tasks.base.Task`'s loss,
evaluation and checkpoint. Batches are a pure function of (seed, step), so a resumed run sees the
batches an uninterrupted run would have.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from .checkpoint import STATE_FILE, atomic_torch_save, deferred_sigint
from .features import FeatureCache
from .losses import HeadLoss
from .split import Batch, Sequence, batch_indices, collate
from .tasks.base import EvalResult, Task

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    out: str
    step: int
    tokens_seen: int
    wall_s: float
    evals: list[EvalResult] = field(default_factory=list)
    interrupted: bool = False

    def summary(self, what: str) -> str:
        """One line for the end of a run: what, step, throughput, output, last eval."""
        last = self.evals[-1].line() if self.evals else "no eval split"
        rate = self.tokens_seen / self.wall_s if self.wall_s > 0 else 0.0
        status = "interrupted" if self.interrupted else "done"
        return (f"{what} {status}: step {self.step}, {self.tokens_seen} tokens in {self.wall_s:.0f} s ({rate:.0f} tok/s) "
                f"-> {self.out}; {last}")


@dataclass
class RunState:
    """Where a run stands: what a checkpoint records and ``--resume`` restores."""

    step: int = 0
    tokens_seen: int = 0
    wall_before: float = 0.0          # seconds spent in earlier (resumed) sessions
    evals: list = field(default_factory=list)


def optimizer_loop(
    *,
    accelerator,
    module,
    optimizer,
    scheduler,
    params,
    config,
    n_train: int,
    lengths: tuple[int, ...] | None = None,
    micro_loss: Callable[[list[int]], tuple[HeadLoss, Batch]],
    evaluate_at: Callable[[int], EvalResult | None],
    save: Callable[[RunState, float], None],
    state: RunState,
    out: Path,
    desc: str,
    progress: bool = True,
    callback: Callable[[int], None] | None = None,
) -> TrainResult:
    """Optimizer steps from ``state.step`` to ``config.steps``, shared by train-heads and train-draft.

    Each step takes ``config.grad_accum`` micro-batches; micro-batch i of step s is
    ``batch_indices(n_train, micro_step=s * grad_accum + i)`` (of similar ``lengths`` when given) split
    across processes, and
    ``micro_loss(indices)`` returns its loss and batch. With several processes each one's loss is
    divided by the whole micro-batch's counts (all-reduced), so that the averaged gradients are those
    of one process running the whole batch. Gradients are clipped to norm 1, the
    scheduler moves once per step, ``evaluate_at(step)`` runs at step 0 and every ``eval_every``,
    ``save(state, wall_s)`` (main process only) every ``save_every`` and at the end. Ctrl-C stops
    at once; the last saved checkpoint stays as it was and the result is marked interrupted.
    """
    world, rank = accelerator.num_processes, accelerator.process_index
    started = time.perf_counter()
    wall = lambda: state.wall_before + time.perf_counter() - started  # noqa: E731

    def run_eval() -> None:
        r = evaluate_at(state.step)
        if r is not None:
            state.evals.append(r)
            if accelerator.is_main_process:
                tqdm.write(r.line(), file=sys.stderr)

    def checkpoint() -> None:
        if accelerator.is_main_process:
            save(state, wall())

    last_saved = state.step
    bar = tqdm(total=config.steps, initial=state.step, desc=desc, unit="step", file=sys.stderr,
               disable=not progress or not accelerator.is_main_process, dynamic_ncols=True)
    try:
        if state.step == 0 and not state.evals:
            run_eval()
        while state.step < config.steps:
            for micro in range(config.grad_accum):
                idx = batch_indices(n_train, micro_step=state.step * config.grad_accum + micro,
                                    batch_size=config.batch_size * world, seed=config.seed, lengths=lengths)
                with accelerator.accumulate(module), accelerator.autocast():
                    r, batch = micro_loss(idx[rank::world])
                    loss = r.loss
                    if world > 1:   # normalise by the global batch's counts: the same gradient as one process
                        counts = accelerator.reduce(r.count.to(accelerator.device), "sum")
                        loss = r.normalised(counts) * world
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(params, 1.0)
                    optimizer.step()      # a no-op until the last micro-batch of the step (accelerate)
                    optimizer.zero_grad()
                state.tokens_seen += int(accelerator.reduce(torch.tensor(int(batch.mask.sum()), device=accelerator.device), "sum"))
            scheduler.step()
            state.step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{r.loss.detach().item():.3f}", acc1=f"{float(r.top1[0]):.2f}", lr=f"{scheduler.get_last_lr()[0]:.1e}")
            if callback is not None:
                callback(state.step)
            if state.step % config.eval_every == 0 and state.step < config.steps:
                run_eval()
            if state.step % config.save_every == 0 and state.step < config.steps:
                checkpoint()
                last_saved = state.step
        if not state.evals or state.evals[-1].step != state.step:
            run_eval()
        checkpoint()
    except KeyboardInterrupt:
        bar.close()
        print(f"interrupted at step {state.step}: the checkpoint of step {last_saved} in {out} is intact "
              f"(rerun with --resume to continue)", file=sys.stderr)
        return TrainResult(out=str(out), step=last_saved, tokens_seen=state.tokens_seen, wall_s=wall(),
                           evals=state.evals, interrupted=True)
    bar.close()
    accelerator.wait_for_everyone()
    return TrainResult(out=str(out), step=state.step, tokens_seen=state.tokens_seen, wall_s=wall(), evals=state.evals)


def run_hardware(accelerator) -> str:
    """What a run trains on, as its provenance records it (model cards print it): the device's name,
    with the process count when several train together."""
    from ..card import this_hardware

    name = this_hardware(accelerator.device)
    return name if accelerator.num_processes == 1 else f"{accelerator.num_processes} x {name}"


MIXED_PRECISION = ("auto", "no", "bf16")


def resolve_mixed_precision(mode: str, device_type: str) -> str:
    """``auto``: bf16 autocast on CUDA, none on CPU (where bf16 pays only with AVX512-BF16 or AMX)."""
    if mode not in MIXED_PRECISION:
        raise ValueError(f"unknown mixed precision {mode!r}: use {', '.join(MIXED_PRECISION)}")
    return ("bf16" if device_type == "cuda" else "no") if mode == "auto" else mode


def make_accelerator(model, *, grad_accum: int, mixed_precision: str = "auto"):
    """Autocast per ``mixed_precision`` (float32 master weights either way); gradient accumulation
    over ``grad_accum`` micro-batches."""
    from accelerate import Accelerator

    use_cuda = next(model.parameters()).device.type == "cuda"
    mode = resolve_mixed_precision(mixed_precision, "cuda" if use_cuda else "cpu")
    # accelerate turns an FSDP or DeepSpeed launch on CPU into plain data parallelism without a word,
    # so the launcher's own flags are read as well as the distributed type it settles on.
    asked = [k for k, var in (("FSDP", "ACCELERATE_USE_FSDP"), ("DEEPSPEED", "ACCELERATE_USE_DEEPSPEED"))
             if os.environ.get(var, "false").lower() in ("true", "1")]
    accelerator = None if asked else Accelerator(mixed_precision=mode, gradient_accumulation_steps=grad_accum,
                                                 cpu=not use_cuda)
    kind = asked[0] if asked else str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    if kind in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
        # Checkpoints are written from the unwrapped module, which a sharded run holds only in pieces.
        raise ValueError(f"{kind} launches are not supported: heads and drafts are small enough for data "
                         "parallelism; use training/accelerate/multi_gpu.yaml (DDP)")
    return accelerator


class Objective(torch.nn.Module):
    """A task's loss as a module's ``forward``, wrapping the module it trains: data-parallel wrappers
    (DDP, FSDP) synchronise gradients only for work done inside ``forward``, and a task may use its
    module through other methods (the eagle head's ``fuse`` and ``ttt_step``)."""

    def __init__(self, task, module: torch.nn.Module):
        super().__init__()
        self.task = task
        self.module = module

    def forward(self, batch, features=None) -> HeadLoss:
        return self.task.loss(self.module, batch, features=features)


def fit(
    task: Task,
    module: torch.nn.Module,
    params: list,
    *,
    accelerator,
    config,
    seqs: list[Sequence],
    train_idx: list[int],
    eval_idx: list[int],
    features: FeatureCache | None,
    saved: dict | None,
    record: Callable[[RunState, float], dict],
    fingerprint: str,
    vocab: torch.Tensor | None,
    out: Path,
    desc: str,
    progress: bool = True,
    callback: Callable[[int], None] | None = None,
) -> TrainResult:
    """Train ``module`` (its trainable ``params``) as ``task`` says, from ``saved`` when resuming.

    ``seqs[train_idx]`` are trained on and ``seqs[eval_idx]`` held out (indices into ``features``
    too). ``record(state, wall_s)`` is what the task's saved artefact records about the run. Every
    checkpoint writes the task's artefact first and ``out/trainer_state.pt`` last: the state names
    the step both belong to, and resume reads only the state.
    """
    from transformers import get_cosine_schedule_with_warmup

    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=min(config.warmup, config.steps),
                                                num_training_steps=config.steps)
    # The scheduler is stepped by hand once per optimizer step (accelerate's wrapper would step it per process).
    objective, optimizer = accelerator.prepare(Objective(task, module), optimizer)
    state = RunState()
    if saved is not None:
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        state = RunState(step=saved["step"], tokens_seen=saved["tokens_seen"], wall_before=saved["wall_s"],
                         evals=[task.eval_class(**e) for e in saved["evals"]])
        torch.set_rng_state(saved["rng"])
        log.info("resumed %s at step %d", out, state.step)

    device = accelerator.device
    raw = accelerator.unwrap_model(objective).module
    train_seqs, eval_seqs = [seqs[i] for i in train_idx], [seqs[i] for i in eval_idx]
    # A resumed run keeps its own batching (runs saved before the setting existed did not group).
    grouped = config.group_by_length if saved is None else saved["config"].get("group_by_length", False)
    lengths = tuple(len(s.ids) for s in train_seqs) if grouped else None

    def micro_loss(mine: list[int]) -> tuple[HeadLoss, Batch]:
        batch = collate([train_seqs[i] for i in mine], lead=task.lead)
        feats = None if features is None else features.gather([train_idx[i] for i in mine], device=device)
        return objective(batch, feats), batch

    def evaluate_at(step: int) -> EvalResult | None:
        return task.evaluate(raw, eval_seqs, step=step, autocast=accelerator.autocast, features=features,
                             feature_ids=eval_idx)

    def save(state: RunState, wall: float) -> None:
        trainer_state = {
            **task.state_entries(raw),
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "step": state.step, "tokens_seen": state.tokens_seen, "wall_s": wall, "rng": torch.get_rng_state(),
            "evals": [asdict(e) for e in state.evals], "config": asdict(config),
            "fingerprint": fingerprint, "vocab": vocab,
        }
        with deferred_sigint():
            task.save(raw, out, record=record(state, wall))
            atomic_torch_save(trainer_state, out / STATE_FILE)

    return optimizer_loop(accelerator=accelerator, module=objective, optimizer=optimizer, scheduler=scheduler,
                          params=params, config=config, n_train=len(train_seqs), lengths=lengths, micro_loss=micro_loss,
                          evaluate_at=evaluate_at, save=save, state=state, out=out, desc=desc,
                          progress=progress, callback=callback)


def report_run(result: TrainResult, out, label: str) -> None:
    """The end of a training command, from the main process only: the model card a hub upload needs
    (a run whose card cannot be written has still trained: a warning says why) unless the run was
    interrupted, then one summary line."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    if not result.interrupted:
        from ..card import write_card

        try:
            write_card(Path(out))
        except Exception as e:   # e.g. a data directory moved since: say so, keep the heads
            log.warning("heads saved, but their model card (README.md) was not written: %s", e)
    print(result.summary(label), flush=True)
