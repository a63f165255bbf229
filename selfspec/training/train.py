"""Fit Medusa heads or an exit head to the target's own distributions (self-distillation).

The backbone is frozen. Per micro-batch: one no-grad forward of the target over the padded
sequences gives the final post-norm hidden states (Medusa input, and the teacher) and, for early
exit, the hidden states after layer E. Only a window around each response is kept (the rows that
carry signal), the teacher logits are computed on the draft vocabulary alone
(``F.linear(h, lm_head.weight[vocab])``: full-vocabulary logits are never built), and the heads
run forward + backward on that window. Exit-head output goes through the frozen final norm and
the same restricted LM head, exactly as the drafter uses it.

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
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch.nn import functional as F
from tqdm.auto import tqdm

from ..backbone import Backbone
from ..heads import KINDS, Heads, head_widths, save_heads
from .losses import HeadLoss, exit_loss, medusa_loss

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"


@dataclass
class TrainConfig:
    """Every training default; the CLI flags are derived from these fields."""

    kind: str = "medusa"              # medusa | early-exit
    num_heads: int = 4                # medusa
    token_input: bool = True          # medusa: heads also read the root token's embedding (known when drafting)
    head_mlp: str = ""                # medusa: widths of an extra residual MLP per head, e.g. "1024,1024" (heads 1-2)
    exit_layer: int | None = None     # early-exit; None = num_layers // 2
    steps: int = 2000                 # optimizer steps
    lr: float = 1e-3
    warmup: int = 50                  # linear warm-up steps, then cosine decay to 0
    weight_decay: float = 0.0
    batch_size: int = 8               # sequences per micro-batch (per process)
    grad_accum: int = 1               # micro-batches per optimizer step
    max_len: int = 1024               # longer sequences keep their last max_len tokens
    draft_vocab_size: int = 8192      # 0 = the full vocabulary
    head_weight_base: float = 0.8     # medusa: head k's loss is scaled by base**k
    hard_weight: float = 0.0          # extra cross-entropy on the tokens the target actually produced
    eval_fraction: float = 0.05       # held-out share of the sequences
    eval_every: int = 200
    save_every: int = 500
    seed: int = 0
    exit_adapter: str = "mlp"         # early-exit: "mlp" (residual MLP) or "layer" (decoder layer initialised from layer E)
    exit_intermediate: int = 0        # early-exit "mlp" width; 0 = the hidden size
    cache_features: bool = True       # one backbone pass up front, kept on disk; epochs then cost only the heads
    feature_dtype: str = "float32"    # that pass's precision: float32 | bfloat16 (autocast, faster on CPUs with BF16)
    save_dtype: str = "float32"       # storage dtype of the heads' model.safetensors (float16 halves it; resume keeps float32)
    lora: int = 0                     # Medusa-2: LoRA rank on the backbone, trained jointly (CHANGES the model's output)
    init: str | None = None           # warm start: a heads directory whose weights and draft vocabulary this run starts from
    out: str = "heads-out"


@dataclass(frozen=True)
class Sequence:
    ids: torch.Tensor        # (L,) int64: prompt then response
    response_start: int


@dataclass
class Batch:
    """One padded micro-batch and the window of rows that carry training signal."""

    input_ids: torch.Tensor       # (B, L) right-padded
    attention_mask: torch.Tensor  # (B, L)
    window: torch.Tensor          # (B, W) positions (into L) the heads read
    mask: torch.Tensor            # (B, W) bool: the target row at that position is a response row
    next_tokens: torch.Tensor     # (B, W) the token that followed each window position


@dataclass
class EvalResult:
    step: int
    loss: float
    top1: list[float]  # per head
    top5: list[float]
    tokens: int

    def line(self) -> str:
        acc = " ".join(f"{a:.1%}/{b:.1%}" for a, b in zip(self.top1, self.top5))
        return f"eval step {self.step}: loss {self.loss:.4f}, top-1/top-5 by head: {acc} ({self.tokens} positions)"


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


# ---------------------------------------------------------------------------------------------- data


def frequent_vocab(dataset, size: int, *, vocab_size: int, eos_token_ids=()) -> torch.Tensor | None:
    """The ``size`` most frequent response token ids (EOS always included), sorted; None = full vocabulary.

    A draft vocabulary: the heads score only these rows of the LM head, which makes their training
    and drafting much cheaper (the full LM head dominates both), at the cost of never proposing a
    rare token. Ties go to the smaller id, so the result is a pure function of the data.
    """
    if size <= 0 or size >= vocab_size:
        return None
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids, start in zip(dataset["input_ids"], dataset["response_start"]):
        counts += torch.bincount(torch.as_tensor(ids[start:], dtype=torch.int64), minlength=vocab_size)
    forced = sorted({int(e) for e in eos_token_ids if 0 <= int(e) < vocab_size})
    counts[forced] = torch.iinfo(torch.int64).max  # EOS first: a draft must be able to end
    order = torch.sort(-counts, stable=True).indices  # stable: ties keep ascending ids
    return order[:size].sort().values


def to_sequences(dataset, *, max_len: int) -> list[Sequence]:
    """Rows with at least one response token, each cut to its last ``max_len`` tokens."""
    out = []
    for ids, start in zip(dataset["input_ids"], dataset["response_start"]):
        ids = torch.as_tensor(ids, dtype=torch.int64)
        cut = max(0, len(ids) - max_len)
        start = max(int(start) - cut, 1)  # position 0 has no target row before it
        if start < len(ids):
            out.append(Sequence(ids=ids[cut:], response_start=start))
    return out


def split_eval(n: int, *, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) indices: a seeded random ``fraction`` is held out (at least one when n > 1 and fraction > 0)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = 0 if fraction <= 0 or n < 2 else min(n - 1, max(1, round(fraction * n)))
    return sorted(perm[n_eval:]), sorted(perm[:n_eval])


def _content_key(s: Sequence) -> tuple[bytes, int]:
    return s.ids.numpy().tobytes(), s.response_start


def recorded_split(data_dir: str, heads: Heads) -> tuple[list[Sequence], list[Sequence]]:
    """(trained on, held out): the split of the run that produced ``heads``, rebuilt from what it recorded.

    Data directories only grow by appended shards, so a run's rows are the first ``rows[i]`` of each
    directory now; the split is recomputed over exactly those, never over rows added later (which
    would move training sequences into the "held-out" set). A warm-started run records its held-out
    rows outright (``held_out_rows``: its split keeps its init's, see :func:`warm_split`). Heads saved
    before per-directory row counts were recorded carry only a sequence count, which pins a single
    directory the same way.
    """
    from .data import load_distillation_data

    extra = heads.config.extra or {}
    tc = extra.get("train_config") or {}
    rows = extra.get("rows")
    seqs = to_sequences(load_distillation_data(data_dir, rows=rows), max_len=tc.get("max_len", 1024))
    if rows is None:
        n = extra.get("sequences", len(seqs))
        if n > len(seqs):
            raise ValueError(f"the heads were trained on {n} sequences but {data_dir} holds {len(seqs)}: "
                             "pass the data directory they were trained on")
        seqs = seqs[:n]
    held = extra.get("held_out_rows")
    if held is None:
        _, held = split_eval(len(seqs), fraction=tc.get("eval_fraction", 0.05), seed=tc.get("seed", 0))
    held_set = set(held)
    return [s for i, s in enumerate(seqs) if i not in held_set], [seqs[i] for i in held]


def warm_split(seqs: list[Sequence], eval_idx: list[int], init: Heads) -> tuple[list[int], list[int]]:
    """(train, eval) indices for a run warm-started from ``init``: whatever ``init`` held out stays held
    out, and whatever it trained on is never scored as held-out. Sequences are matched by content,
    so the init's data may sit anywhere in this run's (larger) data."""
    data = (init.config.extra or {}).get("data")
    if not data:
        raise ValueError("the --init heads do not record their training data, so their held-out split cannot be kept: "
                         "train from scratch instead")
    init_train, init_held = recorded_split(data, init)
    trained, held = {_content_key(s) for s in init_train}, {_content_key(s) for s in init_held}
    chosen = set(eval_idx)
    keys = [_content_key(s) for s in seqs]
    eval_new = [i for i, k in enumerate(keys) if k in held or (i in chosen and k not in trained)]
    eval_set = set(eval_new)
    return [i for i in range(len(seqs)) if i not in eval_set], eval_new


def batch_indices(n: int, *, micro_step: int, batch_size: int, seed: int) -> list[int]:
    """Indices for global micro-batch ``micro_step``: consecutive slices of per-epoch permutations.

    A pure function of (seed, micro_step), so resuming needs nothing but the step counter.
    """
    out, offset = [], micro_step * batch_size
    while len(out) < batch_size:
        epoch, pos = divmod(offset, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        take = perm[pos : pos + batch_size - len(out)].tolist()
        out += take
        offset += len(take)
    return out


def collate(seqs: list[Sequence], *, lead: int, pad_id: int = 0) -> Batch:
    """Right-pad and pick each sequence's window.

    Target rows with signal are s in [start - 1, L - 2] (they predict the response tokens). The
    heads at position t learn from rows up to t + lead (lead = K for Medusa's last head, 0 for
    exit), so the window runs from max(start - 1 - lead, 0) to L - 2.
    """
    B, L = len(seqs), max(len(s.ids) for s in seqs)
    input_ids = torch.full((B, L), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((B, L), dtype=torch.int64)
    starts, ends = [], []
    for i, s in enumerate(seqs):
        input_ids[i, : len(s.ids)] = s.ids
        attention_mask[i, : len(s.ids)] = 1
        starts.append(max(s.response_start - 1 - lead, 0))
        ends.append(len(s.ids) - 1)  # exclusive: row L - 1 predicts past the end
    W = max(e - b for b, e in zip(starts, ends))
    start_t, end_t = torch.tensor(starts)[:, None], torch.tensor(ends)[:, None]
    pos = start_t + torch.arange(W)[None]  # (B, W)
    rs = torch.tensor([s.response_start for s in seqs])[:, None]
    mask = (pos >= rs - 1) & (pos < end_t)
    window = pos.clamp(max=L - 1)
    next_tokens = input_ids.gather(1, (window + 1).clamp(max=L - 1))
    return Batch(input_ids=input_ids, attention_mask=attention_mask, window=window, mask=mask, next_tokens=next_tokens)


# ---------------------------------------------------------------------------------------------- model side


@dataclass
class Target:
    """The frozen backbone pieces training needs; built once per run."""

    backbone: Backbone
    vocab: torch.Tensor | None   # (V_sub,) or None
    weight: torch.Tensor         # (V_sub, H) LM-head rows, detached
    exit_layer: int | None


def target_view(model, *, vocab: torch.Tensor | None, exit_layer: int | None) -> Target:
    bb = Backbone(model)
    w = bb.lm_head.weight.detach()
    if vocab is not None:
        vocab = vocab.to(w.device)
        w = w.index_select(0, vocab)
    return Target(backbone=bb, vocab=vocab, weight=w, exit_layer=exit_layer)


@dataclass
class FeatureCache:
    """The frozen backbone's hidden states for every sequence, computed once (float16, CPU).

    With the backbone frozen, its forward is the same in every epoch and dominates the cost of a
    step on CPU (the heads are small), so it is done once and reused by every epoch and by both
    head kinds (the cache holds the final post-norm states and the states after layer E).
    """

    final: list[torch.Tensor]   # per sequence (L_i, H) post-norm last hidden state
    exit: list[torch.Tensor]    # per sequence (L_i, H) after layer E

    def gather(self, ids: list[int], *, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded (B, L, H) float32 tensors for sequences ``ids`` (padding rows are zeros)."""
        def pad(rows):
            L = max(r.shape[0] for r in rows)
            out = torch.zeros(len(rows), L, rows[0].shape[1])
            for i, r in enumerate(rows):
                out[i, : r.shape[0]] = r.float()
            return out.to(device)
        return pad([self.final[i] for i in ids]), pad([self.exit[i] for i in ids])


FEATURE_CHUNK = 256  # sequences per cache file: appending data to a dataset costs only the new chunks


def feature_cache_path(model, seqs: list[Sequence], *, exit_layer: int, dtype: str = "float32") -> Path:
    """Where the features of these sequences live under $SELFSPEC_HOME (keyed by model, data, E and dtype)."""
    import hashlib

    from ..backbone import config_fingerprint
    from ..loading import selfspec_home

    h = hashlib.sha1(f"{config_fingerprint(model.config)}:{exit_layer}:{dtype}".encode())
    for s in seqs:
        h.update(s.ids.numpy().tobytes())
        h.update(str(s.response_start).encode())
    return selfspec_home() / "features" / f"{h.hexdigest()[:20]}.pt"


FEATURE_DTYPES = ("float32", "bfloat16")


@torch.no_grad()
def extract_features(model, seqs: list[Sequence], *, exit_layer: int, batch_size: int, device,
                     dtype: str = "float32", progress: bool = True) -> FeatureCache:
    """One no-grad backbone pass over ``seqs``, cached on disk in chunks of FEATURE_CHUNK sequences.

    Each chunk is keyed by its own content, so a dataset that grew by new shards re-uses every
    earlier chunk and computes only the new ones. ``dtype="bfloat16"`` runs the pass under bfloat16
    autocast (about 1.4x faster on a CPU with AVX512-BF16; the features are stored as float16 either
    way). Batches are length-sorted within a chunk, so there is little padding.
    """
    if dtype not in FEATURE_DTYPES:
        raise ValueError(f"feature dtype must be one of {', '.join(FEATURE_DTYPES)} (got {dtype!r})")
    chunks = [seqs[lo : lo + FEATURE_CHUNK] for lo in range(0, len(seqs), FEATURE_CHUNK)]
    paths = [feature_cache_path(model, c, exit_layer=exit_layer, dtype=dtype) for c in chunks]
    todo = sum(len(c) for c, p in zip(chunks, paths) if not p.is_file())
    if todo:
        log.info("backbone features: %d of %d sequences to compute (%s)", todo, len(seqs), dtype)
    inner = Backbone(model).model.model
    device = torch.device(device)
    final: list = []
    exit_: list = []
    with tqdm(total=todo, desc="backbone features", unit="seq", disable=not progress or not todo, file=sys.stderr) as bar:
        for chunk, path in zip(chunks, paths):
            if path.is_file():
                saved = torch.load(path, map_location="cpu", weights_only=True)
                final += saved["final"]
                exit_ += saved["exit"]
                continue
            f_chunk: list = [None] * len(chunk)
            e_chunk: list = [None] * len(chunk)
            order = sorted(range(len(chunk)), key=lambda i: len(chunk[i].ids))
            for lo in range(0, len(order), batch_size):
                idx = order[lo : lo + batch_size]
                b = collate([chunk[i] for i in idx], lead=0)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                    out = inner(input_ids=b.input_ids.to(device), attention_mask=b.attention_mask.to(device),
                                output_hidden_states=True, use_cache=False)
                for j, i in enumerate(idx):
                    n = len(chunk[i].ids)
                    f_chunk[i] = out.last_hidden_state[j, :n].to("cpu", torch.float16)
                    e_chunk[i] = out.hidden_states[exit_layer][j, :n].to("cpu", torch.float16)
                bar.update(len(idx))
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_torch_save({"final": f_chunk, "exit": e_chunk}, path)
            final += f_chunk
            exit_ += e_chunk
    return FeatureCache(final=final, exit=exit_)


def head_loss(module, target: Target, batch: Batch, *, config: TrainConfig, device, lora=None,
              features: tuple[torch.Tensor, torch.Tensor] | None = None) -> HeadLoss:
    """Frozen target forward (no grad) on the batch, then heads forward + loss on the window.

    With ``lora`` (a peft model wrapping the backbone, Medusa-2): the teacher is the ORIGINAL model
    (adapters disabled, no grad); the heads read the fine-tuned backbone's hidden states, and the
    backbone adds its own self-distillation loss, KL(original || fine-tuned) over the full vocabulary.
    """
    bb = target.backbone
    ids, am = batch.input_ids.to(device), batch.attention_mask.to(device)
    window = batch.window.to(device)  # (B, W)
    early = config.kind == "early-exit"
    pick = lambda h: h.gather(1, window[..., None].expand(-1, -1, h.shape[-1]))  # noqa: E731  (B, L, H) -> (B, W, H)
    with torch.no_grad(), (lora.disable_adapter() if lora is not None else contextlib.nullcontext()):
        if features is not None:  # cached backbone states (B, L, H): (final post-norm, after layer E)
            final_full, full_e = features
        else:
            out = bb.model.model(input_ids=ids, attention_mask=am, output_hidden_states=early, use_cache=False)
            final_full = out.last_hidden_state
            full_e = out.hidden_states[target.exit_layer] if early else None  # (B, L, H)
        final = pick(final_full)                                # (B, W, H) post-norm
        teacher = F.linear(final, target.weight)                # (B, W, V_sub)
    mask, next_tokens = batch.mask.to(device), batch.next_tokens.to(device)
    backbone_kl = None
    if lora is not None:
        student = bb.model.model(input_ids=ids, attention_mask=am, output_hidden_states=early, use_cache=False)
        s_final = pick(student.last_hidden_state)
        full_e = student.hidden_states[target.exit_layer] if early else None
        w_full = bb.lm_head.weight
        t_logp = F.log_softmax(F.linear(final, w_full).float(), -1)      # (B, W, V)
        s_logp = F.log_softmax(F.linear(s_final, w_full).float(), -1)
        kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)                  # (B, W)
        backbone_kl = (kl * mask).sum() / mask.sum().clamp(min=1)
    if early and config.exit_adapter == "layer":
        # The layer adapter attends over earlier positions: run it causally on the whole sequence
        # (right padding only follows the real tokens), then read the window.
        pos = torch.arange(full_e.shape[1], device=device)[None].expand(full_e.shape[0], -1)
        adapted = module(full_e, position_embeddings=bb.rotary_emb(full_e, position_ids=pos), position_ids=pos)
        z = F.linear(bb.final_norm(pick(adapted)), target.weight)  # (B, W, V_sub)
        r = exit_loss(z, teacher, mask, hard_tokens=next_tokens, hard_weight=config.hard_weight, vocab=target.vocab)
    elif early:
        z = F.linear(bb.final_norm(module(pick(full_e))), target.weight)  # (B, W, V_sub)
        r = exit_loss(z, teacher, mask, hard_tokens=next_tokens, hard_weight=config.hard_weight, vocab=target.vocab)
    else:
        source = s_final if lora is not None else final
        with torch.no_grad():  # the root each head row hangs under: the token that followed the position
            roots = bb.embed_tokens(next_tokens)  # (B, W, H)
        z = F.linear(module(source, roots), target.weight)  # (B, W, K, V_sub)
        r = medusa_loss(z, teacher, mask, weight_decay_base=config.head_weight_base, hard_tokens=next_tokens,
                        hard_weight=config.hard_weight, vocab=target.vocab)
    return r if backbone_kl is None else dataclasses.replace(r, loss=r.loss + backbone_kl)


@torch.no_grad()
def evaluate(module, target: Target, seqs: list[Sequence], *, config: TrainConfig, device, step: int,
             autocast=contextlib.nullcontext, lora=None, features: FeatureCache | None = None,
             feature_ids: list[int] | None = None) -> EvalResult | None:
    if not seqs:
        return None
    was_training = module.training
    module.eval()
    lead = config.num_heads if config.kind == "medusa" else 0
    loss_sum, n_batches, correct1, correct5, count = 0.0, 0, 0.0, 0.0, 0.0
    for lo in range(0, len(seqs), config.batch_size):
        with autocast():
            feats = None if features is None else features.gather(feature_ids[lo : lo + config.batch_size], device=device)
            r = head_loss(module, target, collate(seqs[lo : lo + config.batch_size], lead=lead), config=config,
                          device=device, lora=lora, features=feats)
        loss_sum += float(r.loss)
        n_batches += 1
        correct1, correct5, count = correct1 + r.top1 * r.count, correct5 + r.top5 * r.count, count + r.count
    module.train(was_training)
    denom = count.clamp(min=1)
    return EvalResult(step=step, loss=loss_sum / n_batches, top1=(correct1 / denom).tolist(),
                      top5=(correct5 / denom).tolist(), tokens=int(count[0]))


# ---------------------------------------------------------------------------------------------- checkpoints


@contextlib.contextmanager
def _deferred_sigint():
    """Hold Ctrl-C while a checkpoint is written, then raise it: a checkpoint is written whole or not at all."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def _atomic_torch_save(obj, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# ---------------------------------------------------------------------------------------------- the loop


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
    ``batch_indices(n_train, micro_step=s * grad_accum + i)`` split across processes, and
    ``micro_loss(indices)`` returns its loss and batch. Gradients are clipped to norm 1, the
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
                                    batch_size=config.batch_size * world, seed=config.seed)
                with accelerator.accumulate(module), accelerator.autocast():
                    r, batch = micro_loss(idx[rank::world])
                    accelerator.backward(r.loss)
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
    from accelerate import Accelerator
    from transformers import get_cosine_schedule_with_warmup

    from ..model import untrained_heads

    if config.kind not in KINDS:
        raise ValueError(f"unknown kind {config.kind!r}: expected one of {', '.join(KINDS)}")
    if config.lora < 0:
        raise ValueError("--lora must be >= 0 (0 = heads only, the model's output unchanged)")
    if config.steps < 1 or config.batch_size < 1 or config.grad_accum < 1:
        raise ValueError("steps, batch_size and grad_accum must all be >= 1")
    out = Path(config.out)
    state_path = out / STATE_FILE
    if state_path.is_file() and not resume:
        raise ValueError(f"{out} already holds a training run: pass --resume to continue it, or choose another --out")

    use_cuda = next(model.parameters()).device.type == "cuda"
    accelerator = Accelerator(mixed_precision="bf16" if use_cuda else "no", gradient_accumulation_steps=config.grad_accum,
                              cpu=not use_cuda)
    device = accelerator.device
    model.requires_grad_(False).eval().to(device)
    n_layers = model.config.num_hidden_layers
    exit_layer = (config.exit_layer if config.exit_layer is not None else n_layers // 2) if config.kind == "early-exit" else None
    if exit_layer is not None and not 0 < exit_layer < n_layers:
        raise ValueError(f"exit layer {exit_layer} must be between 1 and {n_layers - 1}")

    seqs = to_sequences(dataset, max_len=config.max_len)
    if not seqs:
        raise ValueError("the data has no sequence with a response token: generate some with `selfspec gen-data`")
    train_idx, eval_idx = split_eval(len(seqs), fraction=config.eval_fraction, seed=config.seed)
    init = _warm_start(config, model) if config.init else None
    if init is not None:
        train_idx, eval_idx = warm_split(seqs, eval_idx, init)
    train_seqs, eval_seqs = [seqs[i] for i in train_idx], [seqs[i] for i in eval_idx]
    vocab_size = model.get_output_embeddings().weight.shape[0]
    vocab = init.draft_vocab if init is not None else frequent_vocab(
        dataset, config.draft_vocab_size, vocab_size=vocab_size, eos_token_ids=eos_token_ids)

    if config.head_mlp and config.kind != "medusa":
        raise ValueError("--head-mlp widens Medusa heads: drop it for --kind early-exit (see --exit-intermediate)")
    if config.exit_adapter not in ("mlp", "layer"):
        raise ValueError(f"--exit-adapter must be 'mlp' or 'layer' (got {config.exit_adapter!r})")
    heads = untrained_heads(config.kind, model, name, num_heads=config.num_heads, exit_layer=exit_layer,
                            token_input=config.token_input, head_mlp=parse_widths(config.head_mlp),
                            adapter=config.exit_adapter, intermediate_size=config.exit_intermediate)
    if init is not None:
        _check_init_shape(init, heads, config.init)
    heads.config.draft_vocab_size = 0 if vocab is None else int(vocab.numel())
    heads.config.storage_dtype = config.save_dtype
    heads.draft_vocab = vocab
    # fp32 master weights (autocast on CUDA); trainable even where copied from the frozen backbone (layer adapter).
    module = heads.module.to(device=device, dtype=torch.float32).requires_grad_(True).train()

    saved = torch.load(state_path, map_location="cpu", weights_only=True) if resume and state_path.is_file() else None
    if saved is not None:
        _check_compatible(saved, config=config, vocab=vocab, fingerprint=heads.config.base_fingerprint, out=out)
        module.load_state_dict(saved["heads"])
    elif init is not None:
        load_grown(module, init)
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
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=min(config.warmup, config.steps),
                                                num_training_steps=config.steps)
    # The scheduler is stepped by hand once per optimizer step (accelerate's wrapper would step it per process).
    module, optimizer = accelerator.prepare(module, optimizer)
    state = RunState()
    if saved is not None:
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        state = RunState(step=saved["step"], tokens_seen=saved["tokens_seen"], wall_before=saved["wall_s"],
                         evals=[EvalResult(**e) for e in saved["evals"]])
        torch.set_rng_state(saved["rng"])
        log.info("resumed %s at step %d", out, state.step)

    target = target_view(model, vocab=vocab, exit_layer=exit_layer)
    features = None
    if config.cache_features and lora is None:
        # Features for the default exit layer too when training Medusa, so both kinds share one pass.
        features = extract_features(model, seqs, exit_layer=exit_layer if exit_layer is not None else n_layers // 2,
                                    batch_size=config.batch_size, device=device, dtype=config.feature_dtype,
                                    progress=progress and accelerator.is_main_process)
    lead = config.num_heads if config.kind == "medusa" else 0
    raw = accelerator.unwrap_model(module)

    def micro_loss(mine: list[int]) -> tuple[HeadLoss, Batch]:
        batch = collate([train_seqs[i] for i in mine], lead=lead)
        feats = None if features is None else features.gather([train_idx[i] for i in mine], device=device)
        return head_loss(module, target, batch, config=config, device=device, lora=lora, features=feats), batch

    def evaluate_at(step: int) -> EvalResult | None:
        return evaluate(raw, target, eval_seqs, config=config, device=device, step=step, autocast=accelerator.autocast,
                        lora=lora, features=features, feature_ids=eval_idx)

    def save(state: RunState, wall: float) -> None:
        heads.config.extra = {
            "data": data_dir, "rows": data_rows, "sequences": len(seqs), "steps": state.step, "tokens_seen": state.tokens_seen, "wall_s": round(wall, 1),
            "eval": asdict(state.evals[-1]) if state.evals else None, "train_config": asdict(config),
        }
        if init is not None:  # not the seeded split: record it for tune-tree and eval-heads; and the init's run
            heads.config.extra["held_out_rows"] = eval_idx
            heads.config.extra["init"] = {"path": str(config.init), **{
                k: (init.config.extra or {}).get(k) for k in ("data", "rows", "steps", "tokens_seen", "wall_s", "eval", "init")}}
        saved_state = {
            "heads": {k: v.detach().cpu() for k, v in raw.state_dict().items()},
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "step": state.step, "tokens_seen": state.tokens_seen, "wall_s": wall, "rng": torch.get_rng_state(),
            "evals": [asdict(e) for e in state.evals], "config": asdict(config),
            "fingerprint": heads.config.base_fingerprint, "vocab": vocab,
        }
        if lora is not None:
            from peft import get_peft_model_state_dict

            saved_state["lora"] = {k: v.detach().cpu() for k, v in get_peft_model_state_dict(lora).items()}
        with _deferred_sigint():
            # Heads first, state last: the state names the step both belong to, and resume reads only the state.
            save_heads(Heads(config=heads.config, module=raw, draft_vocab=vocab), out)
            if lora is not None:
                _atomic_save_adapter(lora, out / "lora")
            _atomic_torch_save(saved_state, state_path)

    try:
        return optimizer_loop(accelerator=accelerator, module=module, optimizer=optimizer, scheduler=scheduler,
                              params=params, config=config, n_train=len(train_seqs), micro_loss=micro_loss,
                              evaluate_at=evaluate_at, save=save, state=state, out=out, desc=f"train {config.kind}",
                              progress=progress, callback=callback)
    finally:
        _detach_lora(lora)


def _warm_start(config: TrainConfig, model) -> Heads:
    """The heads in ``config.init``, with the fp32 weights of its trainer state when it has one
    (model.safetensors may be stored in float16). Their shape is checked once this run's heads exist."""
    from ..backbone import config_fingerprint
    from ..heads import load_heads

    if config.lora:
        raise ValueError("--init warm-starts heads only: it cannot be combined with --lora")
    heads = load_heads(config.init, expect_kind=config.kind, fingerprint=config_fingerprint(model.config), model=model)
    state = Path(config.init) / STATE_FILE
    if state.is_file():
        heads.module.load_state_dict(torch.load(state, map_location="cpu", weights_only=True)["heads"])
    heads.module.float()
    return heads


def parse_widths(text) -> list[int]:
    """"1024,1024" (or a YAML list) -> [1024, 1024]; "" -> []."""
    if isinstance(text, (list, tuple)):
        return [int(w) for w in text]
    try:
        widths = [int(w) for w in str(text).replace(" ", "").split(",") if w]
    except ValueError:
        raise ValueError(f"--head-mlp takes comma-separated widths, one per head, e.g. 1024,1024 (got {text!r})") from None
    if any(w < 0 for w in widths):
        raise ValueError(f"--head-mlp widths must be >= 0 (got {text!r})")
    return widths


def load_grown(module: torch.nn.Module, init: Heads) -> None:
    """Copy ``init``'s weights into ``module``, which may give heads an extra MLP that ``init`` lacks
    (left zero-initialised, so the warm start begins with exactly what ``init`` predicts)."""
    missing, unexpected = module.load_state_dict(init.module.state_dict(), strict=False)
    if unexpected or any(".mlp." not in k for k in missing):
        raise ValueError(f"cannot warm-start from heads of another shape (missing {missing[:2]}, unexpected {unexpected[:2]})")


def _check_init_shape(init: Heads, mine: Heads, path: str) -> None:
    keys = ("num_heads", "token_input", "exit_layer", "adapter", "intermediate_size")
    diffs = [f"{k} {getattr(init.config, k)} (this run: {getattr(mine.config, k)})" for k in keys
             if getattr(init.config, k) != getattr(mine.config, k)]
    n = mine.config.num_heads
    old, new = head_widths(init.config.head_mlp, n), head_widths(mine.config.head_mlp, n)
    if any(o and o != w for o, w in zip(old, new)):  # growing a head (0 -> w) is fine; changing a trained MLP is not
        diffs.append(f"head_mlp {init.config.head_mlp} (this run: {mine.config.head_mlp})")
    if diffs:
        raise ValueError(f"--init {path} has {', '.join(diffs)}: pass matching flags, or drop --init")


def _attach_lora(model, rank: int):
    """Wrap the frozen backbone's linear layers (not the LM head) with trainable LoRA adapters, in place."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear", bias="none")
    return get_peft_model(model, cfg)


def _detach_lora(lora) -> None:
    """Remove the adapters again (unmerged): the caller's model is left as it was given."""
    if lora is not None:
        lora.unload()


def _atomic_save_adapter(lora, path: Path) -> None:
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-lora-"))
    lora.save_pretrained(tmp)
    old = path.with_name(path.name + ".old")
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    if old.exists():
        import shutil

        shutil.rmtree(old)


def _check_compatible(saved: dict, *, config: TrainConfig, vocab, fingerprint: str, out: Path) -> None:
    """Refuse to resume a run whose heads have another shape, base model or draft vocabulary."""
    old = saved["config"]
    keys = ("kind", "num_heads", "token_input", "head_mlp", "exit_layer", "exit_adapter", "exit_intermediate",
            "draft_vocab_size", "lora")
    defaults = TrainConfig()
    before = {"token_input": False}  # runs saved before a field existed had the old behaviour, not today's default
    value = lambda k, v: parse_widths(v) if k == "head_mlp" else v  # noqa: E731  ("1024,1024" == "1024, 1024")
    diffs = [k for k in keys if value(k, old.get(k, before.get(k, getattr(defaults, k)))) != value(k, getattr(config, k))]
    if saved["fingerprint"] != fingerprint:
        diffs.append("base model")
    old_vocab = saved["vocab"]
    if (old_vocab is None) != (vocab is None) or (vocab is not None and not torch.equal(old_vocab, vocab.cpu())):
        diffs.append("draft vocabulary (the data changed)")
    if diffs:
        raise ValueError(f"cannot resume {out}: {', '.join(diffs)} differ from the saved run; use another --out")


# ---------------------------------------------------------------------------------------------- CLI


def flag_type(typ: type) -> Callable[[str], object]:
    """argparse ``type`` for a config field: bools take true/false/1/0/yes/no (``bool("false")`` is True)."""
    if typ is not bool:
        return typ

    def parse(text: str) -> bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")

    parse.__name__ = "bool"
    return parse


def add_train_heads_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags for ``selfspec train-heads``. TrainConfig fields default to None here so that a
    ``--config`` recipe can fill them; :func:`config_from_args` applies the dataclass defaults last."""
    d = TrainConfig()
    parser.add_argument("--model", default=None, help="alias, model directory, .gguf file or hub id (e.g. smollm2-135m)")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--data", default=None, help="self-distillation data directory (from `selfspec gen-data`); several: comma-separated; DIR@N: its first N rows")
    src.add_argument("--prompts", default=None, help="prompt file: generate the data into <out>/data first (resumable)")
    parser.add_argument("--config", default=None, help="YAML recipe whose keys are these flags' names (underscores); flags win")
    helps = {"kind": "medusa | early-exit", "exit_layer": "default: num_layers // 2", "draft_vocab_size": "0 = full vocabulary",
             "lora": "Medusa-2: also fine-tune the backbone with LoRA of this rank, distilled to the original (the model's output CHANGES: speculative output then matches the fine-tuned model, not the original)", "hard_weight": "cross-entropy weight on the target's tokens",
             "init": "warm start: heads directory (same kind and shape) whose weights and draft vocabulary this run starts from, with a fresh optimizer and schedule",
             "token_input": "medusa: heads also read the root token's embedding (true | false)",
             "head_mlp": "medusa: comma-separated widths of an extra residual MLP per head (e.g. 1024,1024: heads 1 and 2; empty: none)",
             "feature_dtype": "float32 | bfloat16: precision of the one-off backbone feature pass (bfloat16: faster on CPUs with BF16)"}
    for f in dataclasses.fields(TrainConfig):
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

        recipe = yaml.safe_load(Path(args.config).read_text()) or {}
        if not isinstance(recipe, dict):
            raise ValueError(f"{args.config}: a recipe is a YAML mapping of flag names to values")
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    other = {"model", "data", "prompts", "max_prompts", "max_new_tokens", "gen_batch_size"}
    unknown = set(recipe) - names - other
    if unknown:
        raise ValueError(f"{args.config}: unknown keys {', '.join(sorted(unknown))}")
    values = {k: v for k, v in recipe.items() if k in names}
    values.update({k: getattr(args, k) for k in names if getattr(args, k, None) is not None})
    if "head_mlp" in values:  # fail before loading anything; a YAML list becomes the flag's text
        values["head_mlp"] = ",".join(str(w) for w in parse_widths(values["head_mlp"]))
    extra = {k: recipe.get(k) for k in other}
    extra.update({k: getattr(args, k) for k in other if getattr(args, k, None) is not None})
    return TrainConfig(**values), extra


def run_train_heads(args: argparse.Namespace) -> TrainResult:
    """``selfspec train-heads``: optionally generate data, train, print a one-line summary."""
    from ..loading import load_model
    from . import data as gen

    config, extra = config_from_args(args)
    if not extra["model"]:
        raise ValueError("--model is required (or `model:` in the --config recipe)")
    if not extra["data"] and not extra["prompts"]:
        raise ValueError("give --data DIR (from `selfspec gen-data`) or --prompts FILE")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    loaded = load_model(extra["model"], dtype=args.dtype, device=args.device)
    data_dir = extra["data"]
    if not data_dir:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError("with several processes, generate the data first (`selfspec gen-data`) and pass --data")
        data_dir = str(Path(config.out) / "data")
        d = gen.DataGenConfig()
        gen.generate_distillation_data(
            loaded.model, loaded.tokenizer, gen.load_prompts(extra["prompts"], max_prompts=extra["max_prompts"]), data_dir,
            max_new_tokens=extra["max_new_tokens"] or d.max_new_tokens, batch_size=extra["gen_batch_size"] or d.batch_size,
            model_name=loaded.name, progress=not args.no_progress,
        )
    rows = gen.row_counts(data_dir)  # pinned: gen-data may still be appending shards
    dataset = gen.load_distillation_data(data_dir, rows=rows)
    eos = gen.read_meta(data_dir).get("eos_token_ids", [])
    result = train_heads(loaded.model, dataset, config=config, name=loaded.name, eos_token_ids=eos, data_dir=str(data_dir),
                         data_rows=rows, resume=args.resume, progress=not args.no_progress)
    print(result.summary(f"train-heads {config.kind}"), flush=True)
    return result


def run_module(argv: list[str] | None, *, add_args, run, prog: str, description: str) -> int:
    """``python -m`` entry shared by the training commands: one-line errors, 130 when interrupted."""
    args = add_args(argparse.ArgumentParser(prog=prog, description=description)).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        result = run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 130 if result.interrupted else 0


def main(argv: list[str] | None = None) -> int:
    return run_module(argv, add_args=add_train_heads_args, run=run_train_heads, prog="python -m selfspec.training.train",
                      description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
