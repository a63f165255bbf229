"""Every training default, in one place: ``selfspec train-heads``' and ``selfspec train-draft``' flags are derived
from these fields (``train.add_train_heads_args``, ``draft.add_train_draft_args``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import DEFAULT_NUM_HEADS, DEFAULT_TOKEN_INPUT


@dataclass
class RunConfig:
    """What every training run shares: the optimizer's schedule, batches, held-out split, checkpoints and
    the feature cache. ``TrainConfig`` and ``DraftConfig`` add their own fields and defaults."""

    steps: int = 2000                 # optimizer steps
    lr: float = 1e-3
    warmup: int = 50                  # linear warm-up steps, then cosine decay to 0
    weight_decay: float = 0.0
    batch_size: int = 8               # sequences per micro-batch (per process)
    grad_accum: int = 1               # micro-batches per optimizer step
    max_len: int = 1024               # longer sequences keep their last max_len tokens
    group_by_length: bool = False     # micro-batches of similar lengths (split.GROUP_BATCHES): far less padding, more peak memory
    draft_vocab_size: int = 8192      # 0 = the full vocabulary
    eval_fraction: float = 0.05       # held-out share of the sequences
    eval_every: int = 200
    save_every: int = 500
    seed: int = 0
    cache_features: bool = True       # one backbone pass up front, kept on disk; epochs then cost only what trains
    feature_dtype: str = "float32"    # that pass's precision (eagle: its in-step target pass): float32 | bfloat16 (autocast)
    save_dtype: str = "float32"       # storage dtype of the trained tensors
    out: str = "heads-out"


@dataclass
class TrainConfig(RunConfig):
    """Every train-heads default; the CLI flags are derived from these fields."""

    kind: str = "medusa"              # medusa | early-exit | eagle
    num_heads: int = DEFAULT_NUM_HEADS  # medusa
    token_input: bool = DEFAULT_TOKEN_INPUT   # medusa: heads also read the root token's embedding (known when drafting)
    head_mlp: str = ""                # medusa: widths of an extra residual MLP per head, e.g. "1024,1024" (heads 1-2)
    exit_layer: int | None = None     # early-exit; None = num_layers // 2
    aux_layers: str = ""              # eagle: target layers whose hidden states feed the head, e.g. "2,15,27"; "" = low/mid/high
    ttt_steps: int = 4                # eagle: draft steps unrolled per position in training (training-time test)
    shared_lm_head: bool = True       # eagle: score with the target's own LM-head rows, frozen (a smaller, cheaper head)
    loss_rows: str = "response"       # eagle: "response" rows only, or "all" (the prompt's too: the target's forward covers them anyway)
    head_weight_base: float = 0.8     # medusa: head k's loss is scaled by base**k; eagle: unrolled step k's
    hard_weight: float = 0.0          # extra cross-entropy on the target's tokens (eagle: its top token)
    exit_adapter: str = "mlp"         # early-exit: "mlp" (residual MLP) or "layer" (decoder layer initialised from layer E)
    exit_intermediate: int = 0        # early-exit "mlp" width; 0 = the hidden size
    mixed_precision: str = "auto"     # autocast of the training step: auto (bf16 on CUDA, none on CPU) | no | bf16
    lora: int = 0                     # Medusa-2: LoRA rank on the backbone, trained jointly (CHANGES the model's output)
    init: str | None = None           # warm start: a heads directory whose weights and draft vocabulary this run starts from


@dataclass
class DraftConfig(RunConfig):
    """Every train-draft default (``--layers`` is separate): ``RunConfig``'s, with these differing."""

    lr: float = 3e-4                  # whole decoder layers, not fresh heads: gentler than train-heads
    save_dtype: str = "float16"       # float16 | bfloat16 (the saved draft keeps the full LM head; the vocabulary is the loss's)
    out: str = "draft-out"
