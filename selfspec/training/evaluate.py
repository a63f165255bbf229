"""``selfspec eval-heads``: per-head accuracy of trained heads (or a distilled draft) on prompts they never saw.

The target answers the prompts greedily in the dtype it decodes in (batched, resumable, cached
under ``$SELFSPEC_HOME/eval-data``), then each head is scored where decoding uses it: from the
position that produced the pending token onwards, against the target's actual next tokens (a
token outside the heads' draft vocabulary counts as a miss, since it could never be drafted).
Medusa head k (1-based) at position t proposes the token at t + k + 1; the exit head at t
proposes the token at t + 1 (its top-1 is its agreement with the full model), and so does a
distilled draft model (``selfspec train-draft``; scored on its draft vocabulary). The same numbers
are computed on the heads' own held-out training split, so the gap between training-like and
unseen prompts is measured, not guessed. Prompts are picked like ``selfspec bench`` picks them
(``--limit`` / ``--sample`` with ``--seed``), so an evaluation and a bench run can cover the same
prompts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

from ..core.backbone import Backbone, config_fingerprint
from ..heads import ExitLayerHead, load_heads, read_heads_config
from ..io import pyplot, save_figure
from ..loading import DRAFT_META_FILE, check_model_name, load_model, selfspec_home
from .cli_args import at_least
from .data import data_dirs
from .split import Sequence, to_sequences
from .tune import heldout_sequences, medusa_rank_accuracy, rank_of


def eval_data_dir(model, prompts: list[dict], *, max_new_tokens: int) -> Path:
    """Cache directory for the target's answers to these prompts (keyed by model, prompts and length)."""
    h = hashlib.sha1(f"{config_fingerprint(model.config)}:{model.dtype}:{max_new_tokens}".encode())
    for row in prompts:
        h.update(json.dumps([row["id"], row["prompt"]]).encode())
    return selfspec_home() / "eval-data" / h.hexdigest()[:20]


def _next_token_hits(z: torch.Tensor, s: Sequence, ids: torch.Tensor, vocab, max_rank: int) -> tuple[torch.Tensor, int]:
    """Rank hits of (L, V_sub) scores at t against the token at t + 1, from the pending token's position t."""
    t = torch.arange(max(s.response_start - 1, 0), ids.shape[1] - 1, device=z.device)
    rank = rank_of(z[t], ids[0, t + 1], vocab, max_rank)
    return torch.stack([(rank == r).sum() for r in range(max_rank)]).float().cpu(), len(t)


@torch.no_grad()
def exit_rank_accuracy(model, heads, seqs: list[Sequence], *, max_rank: int = 5) -> list[list[float]]:
    """acc[0][r] = P(the target's next token is the exit head's rank-r candidate), on response positions."""
    bb = Backbone(model)
    E = heads.config.exit_layer
    vocab = heads.draft_vocab
    w = bb.lm_head.weight if vocab is None else bb.lm_head.weight.index_select(0, vocab)  # (V_sub, H)
    hits, total = torch.zeros(max_rank), 0
    for s in seqs:
        ids = s.ids.to(bb.device)[None]
        h = bb.model.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states[E]  # (1, L, H)
        if isinstance(heads.module, ExitLayerHead):
            pos = torch.arange(ids.shape[1], device=bb.device)[None]
            h = heads.module(h, position_embeddings=bb.rotary_emb(h, position_ids=pos), position_ids=pos)
        else:
            h = heads.module(h)
        n_hits, n = _next_token_hits(F.linear(bb.final_norm(h), w)[0], s, ids, vocab, max_rank)
        hits, total = hits + n_hits, total + n
    return [(hits / max(total, 1)).tolist()]


@torch.no_grad()
def draft_rank_accuracy(draft, seqs: list[Sequence], *, max_rank: int = 5) -> list[list[float]]:
    """acc[0][r] = P(the target's next token is the draft model's rank-r candidate), scored as the
    draft-model drafter scores: on the draft's own vocabulary subset when it names one."""
    w = draft.get_output_embeddings().weight
    subset = getattr(draft.config, "selfspec_draft_vocab", None)
    vocab = None if subset is None else torch.as_tensor(subset, dtype=torch.long, device=w.device)
    w = w if vocab is None else w.index_select(0, vocab)
    hits, total = torch.zeros(max_rank), 0
    for s in seqs:
        ids = s.ids.to(w.device)[None]
        h = draft.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0]  # (L, H) post-norm
        n_hits, n = _next_token_hits(F.linear(h, w), s, ids, vocab, max_rank)
        hits, total = hits + n_hits, total + n
    return [(hits / max(total, 1)).tolist()]


EAGLE_EVAL_STEPS = 5   # draft depths scored for an eagle head


@torch.no_grad()
def eagle_rank_accuracy(model, heads, seqs: list[Sequence], *, max_rank: int = 5,
                        steps: int = EAGLE_EVAL_STEPS) -> list[list[float]]:
    """acc[j][r]: drafting j + 1 tokens ahead of the committed text (its own states in between, the
    true tokens as their inputs: training-time test), the head's rank-r candidate is the target's token."""
    from .tasks.eagle import pad_batch, target_pass

    bb = Backbone(model)
    head, vocab = heads.module, heads.draft_vocab
    hits, total = torch.zeros(steps, max_rank), torch.zeros(steps)
    for s in seqs:
        ids, am, rows = (t.to(bb.device) for t in pad_batch([s]))
        aux, _ = target_pass(bb, ids, am, aux_layers=heads.config.aux_layers, lm_weight=None)
        L = ids.shape[1]
        emb = bb.embed_tokens(torch.cat([ids[:, 1:], ids[:, -1:]], dim=1))
        pos_emb = bb.rotary_emb(emb, position_ids=torch.arange(L, device=ids.device)[None])
        feature, past = head.fuse(aux.to(emb.dtype)), []
        for j in range(steps):
            states, kv = head.ttt_step(feature, emb, position_embeddings=pos_emb, past=past)
            past.append(kv)
            feature = F.pad(states, (0, 0, 1, 0))[:, :L]
            # Slot i (needs i >= j) proposes token i + 2, on response rows.
            t = torch.arange(max(j, s.response_start - 2, 0), L - 2, device=ids.device)
            if len(t) == 0:
                continue
            rank = rank_of(head.logits(states[0, t]).float(), ids[0, t + 2], vocab, max_rank)
            for r in range(max_rank):
                hits[j, r] += float((rank == r).sum())
            total[j] += len(t)
    return (hits / total.clamp(min=1)[:, None]).tolist()


def rank_accuracy(model, heads, seqs: list[Sequence], *, max_rank: int = 5) -> list[list[float]]:
    """acc[k][r]: head k's rank-r candidate is the target's token (decode-aligned; see the module doc)."""
    if heads.config.kind == "medusa":
        return medusa_rank_accuracy(model, heads, seqs, max_rank=max_rank)
    if heads.config.kind == "eagle":
        return eagle_rank_accuracy(model, heads, seqs, max_rank=max_rank)
    return exit_rank_accuracy(model, heads, seqs, max_rank=max_rank)


def _summary(acc: list[list[float]], n_seqs: int) -> dict:
    return {"prompts": n_seqs, "top1": [a[0] for a in acc], "top5": [sum(a[:5]) for a in acc]}


def _answers(model, tokenizer, prompts: list[dict], *, max_new_tokens: int, batch_size: int, progress: bool):
    """The target's greedy answers to ``prompts`` (generated once, cached): (directory, sequences)."""
    from . import data as gen

    out_dir = eval_data_dir(model, prompts, max_new_tokens=max_new_tokens)
    dataset = gen.generate_distillation_data(model, tokenizer, prompts, out_dir, max_new_tokens=max_new_tokens,
                                             batch_size=batch_size, progress=progress)
    return out_dir, to_sequences(dataset, max_len=1 << 30)


@torch.no_grad()
def eval_heads(model, tokenizer, heads, prompts: list[dict], *, max_new_tokens: int = 128, batch_size: int = 16,
               held_out: list[Sequence] | None = None, progress: bool = True) -> dict:
    """Answer ``prompts`` with the target (cached), then score ``heads`` on every response position
    (and on ``held_out`` training sequences, when given, the same way)."""
    out_dir, seqs = _answers(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                             progress=progress)
    result = {"kind": heads.config.kind, "data": str(out_dir), **_summary(rank_accuracy(model, heads, seqs), len(seqs))}
    if held_out is not None:
        result["held_out_train_split"] = _summary(rank_accuracy(model, heads, held_out), len(held_out))
    return result


@torch.no_grad()
def eval_draft(model, tokenizer, draft, prompts: list[dict], *, max_new_tokens: int = 128, batch_size: int = 16,
               progress: bool = True) -> dict:
    """Answer ``prompts`` with the target (cached), then score the draft model's next-token agreement."""
    out_dir, seqs = _answers(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                             progress=progress)
    return {"kind": "draft-model", "data": str(out_dir), **_summary(draft_rank_accuracy(draft, seqs), len(seqs))}


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--heads", required=True, help="a heads directory (Medusa, early-exit or eagle), or a draft from `selfspec train-draft`")
    p.add_argument("--prompts", required=True, help="JSONL with a prompt per line, e.g. dev.jsonl (never the training prompts)")
    p.add_argument("--limit", type=int, default=None, help="the first N prompts")
    p.add_argument("--sample", type=int, default=None, help="a seeded random N prompts, as `selfspec bench --sample`")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16, help="prompts answered at once")
    p.add_argument("--data", default=None,
                   help="the heads' training data, to score their held-out split the same way (default: the "
                        "directory recorded in the heads' config, when it exists; 'none' to skip)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--plot", default=None, help="also write a chart of per-head top-1 / top-5 accuracy to this .png file")
    p.add_argument("--no-progress", action="store_true")


def run_eval_heads(args: argparse.Namespace) -> int:
    from ..bench.harness import load_prompts

    for flag in ("limit", "sample", "max_new_tokens", "batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    at_least(args.threads, 1, "threads")
    if args.plot is not None and (not args.plot.endswith(".png") or not Path(args.plot).resolve().parent.is_dir()):
        raise ValueError(f"--plot {args.plot}: give a .png file in an existing directory")
    check_model_name(args.model)
    cfg_path = Path(args.heads) / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{args.heads} is not a heads directory (no config.json): pass one from `selfspec train-heads` "
                         "or a draft from `selfspec train-draft`")
    is_draft = (Path(args.heads) / DRAFT_META_FILE).is_file()
    kind = "draft-model" if is_draft else read_heads_config(args.heads).kind
    if args.data and args.data != "none" and not all(d.is_dir() for d in data_dirs(args.data)):
        raise FileNotFoundError(f"--data {args.data}: no such directory: pass the heads' training data, or 'none'")
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = [{"id": p.id, "prompt": p.text}
               for p in load_prompts(args.prompts, limit=args.limit, sample=args.sample, seed=args.seed)]
    if not prompts:
        raise ValueError(f"{args.prompts} holds no prompts")
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    w = loaded.model.get_output_embeddings().weight
    if is_draft:
        draft = load_model(args.heads, dtype=args.dtype, device=args.device).model
        if draft.get_output_embeddings().weight.shape[0] < w.shape[0]:
            raise ValueError(f"{args.heads} has a smaller vocabulary than {args.model}: it is not a draft for it")
        r = eval_draft(loaded.model, loaded.tokenizer, draft, prompts, max_new_tokens=args.max_new_tokens,
                       batch_size=args.batch_size, progress=not args.no_progress)
        return _report(r, args, data=None, name=lambda k: "draft (next token)")
    heads = load_heads(args.heads, expect_kind=kind, fingerprint=config_fingerprint(loaded.model.config),
                       device=w.device, dtype=w.dtype, model=loaded.model)
    data = args.data or heads.config.provenance.get("data")
    held = (heldout_sequences(data, heads) if data and data != "none" and all(d.is_dir() for d in data_dirs(data))
            else None)
    r = eval_heads(loaded.model, loaded.tokenizer, heads, prompts, max_new_tokens=args.max_new_tokens,
                   batch_size=args.batch_size, held_out=held, progress=not args.no_progress)
    exit_name = f"exit (layer {heads.config.exit_layer})"
    names = {"medusa": lambda k: str(k + 1), "eagle": lambda k: f"draft step {k + 1}"}
    return _report(r, args, data=data if held else None, name=names.get(r["kind"], lambda k: exit_name))


def _report(r: dict, args: argparse.Namespace, *, data, name) -> int:
    r.update(heads=str(args.heads), prompts_file=str(args.prompts), limit=args.limit, sample=args.sample,
             seed=args.seed, max_new_tokens=args.max_new_tokens, train_data=data,
             command=" ".join(["selfspec"] + sys.argv[1:]))
    if args.plot:
        plot_accuracy(r, Path(args.plot), name=name)
    if args.json:
        json.dump(r, sys.stdout, indent=1)
        print()
        return 0
    ref = r.get("held_out_train_split")
    what = "draft" if r["kind"] == "draft-model" else f"{r['kind']} heads"
    print(f"{what} {args.heads}: {r['prompts']} prompts from {args.prompts}, {args.max_new_tokens} new tokens"
          + (f"; held-out split of {data}: {ref['prompts']} sequences" if ref else ""))
    print("| head | top-1 | top-5 |" + (" top-1 held-out train | top-5 held-out train |" if ref else "")
          + "\n|---|---|---|" + ("---|---|" if ref else ""))
    for k, (t1, t5) in enumerate(zip(r["top1"], r["top5"])):
        extra = f" {ref['top1'][k]:.3f} | {ref['top5'][k]:.3f} |" if ref else ""
        print(f"| {name(k)} | {t1:.3f} | {t5:.3f} |{extra}")
    return 0


def plot_accuracy(r: dict, path: Path, *, name) -> None:
    """Bars of top-1 and top-5 per head (or draft step) on the unseen prompts, held-out split beside them."""
    plt = pyplot()
    series = [("top-1 unseen prompts", r["top1"]), ("top-5 unseen prompts", r["top5"])]
    ref = r.get("held_out_train_split")
    if ref:
        series += [("top-1 held-out train", ref["top1"]), ("top-5 held-out train", ref["top5"])]
    n, width = len(r["top1"]), 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * n + 2), 4))
    for i, (label, vals) in enumerate(series):
        ax.bar([k + i * width for k in range(n)], vals, width, label=label)
    ax.set_xticks([k + width * (len(series) - 1) / 2 for k in range(n)])
    ax.set_xticklabels([name(k) for k in range(n)])
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy (draft candidate is the target's token)")
    ax.set_title(f"{r['kind']} {Path(str(r['heads'])).name}: {r['prompts']} prompts of {Path(str(r['prompts_file'])).name}",
                 fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path)
