"""Pick the draft tree for trained heads by measurement, on held-out training prompts.

Medusa: measure each head's rank accuracy (how often the target's token is its rank-r
candidate), grow best-first trees of several sizes from it (``tree.tree_from_rank_accuracy``),
then time real greedy decoding with each, interleaved prompt by prompt with plain decoding, and
keep the cheapest of those that come close to the highest median speedup over it (``pick``).
Early exit: time chain lengths.
Some trees are also timed cut by confidence (``tree.prune``): early exit with a node threshold
(the chain stops where its draft path probability falls below it), Medusa with a gate (a step
whose tree the heads expect fewer than ``gate`` tokens accepted from proposes nothing), and
Medusa trees with context lookup (``lookup``: tokens copied from the context grafted on). The
winner goes into the ``decode`` section of the heads' ``config.json`` (``tree`` / ``threshold`` /
``gate`` / ``lookup``, which the "auto" settings use), and every timed candidate into
``tune-tree.json`` beside it (what ``--recorded`` re-picks from). A user who passes ``lookup=0`` gets
the same pick with the lookup off.
With ``--temperature T`` the candidates and the plain reference decode sampled at T instead, and the
picks go into ``decode.sampled`` (timings: ``tune-tree-sampled.json``), what "auto" gives a sampled
``generate``; the greedy ones stay (for a draft model, likewise in the pair's record).
Settings are measured per kind of device: a run on a GPU records its picks under ``decode.devices``
(timings: ``tune-tree-cuda.json``, ``tune-tree-cuda-sampled.json``), which "auto" reads there, and
leaves the CPU's (the section's top level) as they are; the other way round on a CPU.

A separate draft model (``--draft-model``, no heads): time chain lengths, each also cut by the
draft's own confidence (``DRAFT_GRID``), on ``--prompts``; the winner is recorded for that pair of
models under $SELFSPEC_HOME (``selfspec.tuned_pairs``), where the draft-model drafter's "auto"
settings read it.

Timing prompts are the training run's own eval split (same data directory, seed and fraction as
recorded in the heads), so nothing is tuned on the evaluation prompts; or, with ``--prompts FILE``, a
seeded sample of a prompt file the heads never saw, so that a head trained mostly on one kind of
text is tuned on the traffic it will serve (Medusa still reads its heads' rank accuracy, which
shapes its candidate trees, from the eval split).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn import functional as F
from tqdm.auto import tqdm

from ..bench.harness import load_prompts as load_bench_prompts
from ..card import this_hardware
from ..core.backbone import Backbone, config_fingerprint
from ..core.decode import decode
from ..core.sampling import SamplingParams
from ..core.tree import build_tree, parse_dynamic_tree, parse_tree, tree_from_rank_accuracy
from ..corpus import load_corpus
from ..drafters import DraftModelDrafter, EagleDrafter, EarlyExitDrafter, MedusaDrafter, NoDrafter
from ..heads import (
    Heads,
    heads_in_dtype,
    load_heads,
    read_heads_config,
    recorded_devices,
    recorded_search,
    search_file,
    write_heads_config,
)
from ..io import atomic_write_text, prompt_ids
from ..loading import check_model_name, load_model, resolve_device, resolve_dtype
from ..runtime.static import BUCKETS
from ..runtime.width import verify_cost
from ..settings import DEFAULT_MAX_NEW_TOKENS, HOME_DEVICE, DecodeSettings
from ..shipped import LOOKUP_DRAFTERS, shipped_corpus
from ..tuned_pairs import pair_searches, read_pair_record, write_pair_record
from .cli_args import at_least, check_corpus_arg, in_unit_interval
from .data import read_meta
from .losses import to_subset_ids
from .split import Sequence, recorded_split

# Timing: more prompts rather than repeats of a few (candidates differ from prompt to prompt far more than
# from run to run), at the bench's length (the context lookup pays more the longer the answer gets).
TUNE_PROMPTS, TUNE_REPEATS, TUNE_NEW_TOKENS = 12, 1, DEFAULT_MAX_NEW_TOKENS
# A second round re-times the fastest candidates (at most FINALISTS of them, within twice the tolerance of
# the best) with plain decoding on as many other prompts, and the pick is made among them on both rounds:
# a median over a dozen prompts is coarse.
FINALISTS = 6
# Candidates within this fraction of the best speedup count as tied (``pick``), and of those, the ones
# within TAU_TOLERANCE of the best tau (the mean tokens a step, measured over every step of every run,
# so far less noisy than a median speedup).
TUNE_TOLERANCE = 0.03
TAU_TOLERANCE = 0.02
MEDUSA_SIZES = (3, 4, 6, 8, 12)  # nodes; on a CPU every verified token costs, so small trees often win
EXIT_TREES = ("chain-1", "chain-1-w4", "chain-2", "chain-2-w2", "chain-3", "chain-4")
# Also timed cut by confidence (all of the above are timed uncut). Where verifying draft nodes costs a good
# share of a plain step (many CPUs), a Medusa step pays off only if it expects most of a token accepted (gate),
# and an exit chain node, half a step to draft, only when it is likely.
MEDUSA_GATED = ((4, 0.5), (4, 0.8), (8, 0.5), (8, 0.8))          # (nodes, gate)
# And with context lookup (drafters/lookup.py): (nodes, gate, most tokens copied per step).
MEDUSA_LOOKUP = ((4, 0.0, 4), (4, 0.0, 8), (8, 0.0, 4), (8, 0.0, 8), (4, 0.8, 8), (8, 0.5, 8), (12, 0.0, 8), (8, 0.0, 12))
EXIT_PRUNED_TREES = ("chain-1", "chain-2", "chain-4")
# eagle: (dynamic tree, threshold, lookup); depth / expand / nodes span a cheap chain-like tree to a wide one.
# The last rows cut hard by confidence: where a verified node costs a good share of a plain step, a node
# pays only if its path probability beats about that share of what a step yields, so thresholds of 0.2-0.4 keep the likely nodes of a deep tree and drop the rest.
EAGLE_GRID = (("dynamic-3-2-3", 0.0, 0), ("dynamic-4-2-4", 0.0, 0), ("dynamic-5-3-6", 0.0, 0), ("dynamic-5-4-8", 0.0, 0),
              ("dynamic-6-4-12", 0.0, 0), ("dynamic-5-4-8", 0.05, 0), ("dynamic-6-4-12", 0.05, 0),
              ("dynamic-5-3-6", 0.15, 0), ("dynamic-6-4-8", 0.1, 0),
              ("dynamic-4-2-4", 0.0, 8), ("dynamic-5-3-6", 0.0, 8), ("dynamic-5-4-8", 0.0, 8),
              ("dynamic-4-2-4", 0.2, 8), ("dynamic-5-2-4", 0.3, 8), ("dynamic-5-3-6", 0.25, 8), ("dynamic-6-2-6", 0.4, 8),
              ("dynamic-6-3-8", 0.3, 0), ("dynamic-8-4-16", 0.05, 0),
              # uncut deep trees: with width fitting on, the drafter stops at the level not expected to pay
              # (runtime/width.py, level_pays), so depth costs only the levels a step's confidence carries
              ("dynamic-8-4-16", 0.0, 0), ("dynamic-8-4-16", 0.0, 12),
              # wide trees with the lookup: where verifying more nodes costs little (GPUs)
              ("dynamic-6-4-12", 0.05, 8), ("dynamic-6-4-12", 0.15, 8), ("dynamic-6-3-8", 0.1, 12), ("dynamic-8-4-16", 0.05, 12))
# ... and on devices where verifying a few dozen nodes costs about what one does (GPUs), wide uncut trees
# too: up to the nodes that, with the root and the copied tokens, fill the largest static bucket (static.py).
EAGLE_WIDE = tuple((f"dynamic-{d}-8-{m - k}", 0.0, k) for k in (0, 12) for d, m in ((8, 31), (10, BUCKETS[-1] - 1)))
EXIT_THRESHOLDS = (0.5, 0.7, 0.85)
# A separate draft model: (chain, threshold). Each drafted token costs a draft forward as well as a
# verified row, so long chains pay only cut where the draft's own path probability falls.
DRAFT_GRID = (("chain-2", 0.0), ("chain-3", 0.0), ("chain-4", 0.0), ("chain-6", 0.0),
              ("chain-4", 0.3), ("chain-6", 0.3), ("chain-6", 0.5), ("chain-8", 0.5))


def eagle_grid(device_type: str) -> tuple:
    """The EAGLE candidates tune-tree times on this kind of device: ``EAGLE_GRID``, and on any but a CPU
    the wide trees of ``EAGLE_WIDE`` as well."""
    return EAGLE_GRID if device_type == HOME_DEVICE else EAGLE_GRID + EAGLE_WIDE


@dataclass
class Candidate:
    spec: str | tuple
    size: int
    tokens_per_s: float
    tau: float
    threshold: float = 0.0
    gate: float = 0.0
    lookup: int = 0
    nodes_per_step: float = 0.0   # draft nodes actually verified per step, after pruning
    speedup: float = 0.0          # median per-prompt tokens/s over plain decoding's, same round
    runs: int = 0                 # timed runs behind these numbers (a finalist's count both rounds)


def heldout_sequences(data_dir: str, heads: Heads) -> list[Sequence]:
    """The eval split of the heads' training run (see :func:`recorded_split`)."""
    held = recorded_split(data_dir, heads)[1]
    if not held:
        raise ValueError("the heads' training run held nothing out (eval_fraction 0): cannot tune without leakage")
    return held


def rank_of(scores: torch.Tensor, tokens: torch.Tensor, vocab: torch.Tensor | None, max_rank: int) -> torch.Tensor:
    """Rank of each token among its row's scores (n, V_sub); max_rank when outside the draft vocabulary."""
    rows = tokens if vocab is None else to_subset_ids(tokens, vocab)
    mine = scores.gather(1, rows.clamp(min=0)[:, None])
    rank = (scores > mine).sum(1)
    return torch.where(rows >= 0, rank, torch.full_like(rank, max_rank))


@torch.no_grad()
def medusa_rank_accuracy(model, heads: Heads, seqs: list[Sequence], *, max_rank: int = 5) -> list[list[float]]:
    """acc[d][r] = P(the target's token at depth d + 1 is head d + 1's rank-r candidate), on response positions."""
    bb = Backbone(model)
    vocab = heads.draft_vocab
    w = bb.lm_head.weight if vocab is None else bb.lm_head.weight.index_select(0, vocab)
    K = heads.config.num_heads
    hits = torch.zeros(K, max_rank)
    total = torch.zeros(K)
    for s in seqs:
        ids = s.ids.to(w.device)[None]
        h = bb.model.model(input_ids=ids, use_cache=False).last_hidden_state[0]   # (L, H) post-norm
        roots = bb.embed(torch.cat([ids[0, 1:], ids[0, -1:]]))[0]                  # (L, H): token t + 1 (last: unused)
        z = F.linear(heads.module(h, roots), w)                                   # (L, K, V_sub)
        L = ids.shape[1]
        for k in range(K):
            # Head k (0-based) at position t proposes the token at t + k + 2.
            lo, hi = max(s.response_start - 1, 0), L - k - 2
            if hi <= lo:
                continue  # the response is too short to reach this head's target
            t = torch.arange(lo, hi, device=w.device)
            rank = rank_of(z[t, k], ids[0, t + k + 2], vocab, max_rank)           # scores (n, V_sub)
            for r in range(max_rank):
                hits[k, r] += float((rank == r).sum())
            total[k] += len(t)
    return (hits / total.clamp(min=1)[:, None]).tolist()


def _run(bb: Backbone, drafter, prompt: torch.Tensor, max_new_tokens: int, *,
         temperature: float = 0.0, seed: int = 0) -> tuple[int, float, int, int, int]:
    """Decode one prompt, greedy or (``temperature`` > 0) sampled with a generator seeded ``seed``:
    (tokens, wall seconds, steps, tokens committed, draft nodes verified). As in
    ``SelfSpeculativeModel.generate``, each step's tree is cut to the width the pass is worth (``runtime/width.py``)."""
    params = SamplingParams(do_sample=True, temperature=temperature) if temperature > 0 else SamplingParams()
    generator = torch.Generator(device=bb.device).manual_seed(seed) if temperature > 0 else None
    new, st = decode(bb, drafter, prompt.to(bb.device), params=params, max_new_tokens=max_new_tokens,
                     eos_token_ids=set(), generator=generator, cost=verify_cost(bb) if drafter.max_nodes > 1 else None)
    return len(new), st.wall_s, st.steps, sum((a + 1) * n for a, n in enumerate(st.accepted_hist)), st.drafted


def time_drafters(bb: Backbone, drafters: list, prompts: list[torch.Tensor], *, max_new_tokens: int,
                  repeats: int, progress: bool, temperature: float = 0.0) -> tuple[list[list[tuple]], list[list[float]]]:
    """Decode every prompt with every drafter (index 0: the plain reference), interleaved; greedy, or
    sampled at ``temperature`` (every drafter's run of a prompt seeded alike).

    For each prompt all drafters run back to back, in an order rotated from prompt to prompt, so
    machine drift hits them alike. Returns (runs, ratios): ``runs[i]`` the ``_run`` tuples of drafter
    i, ``ratios[i]`` its tokens/s over plain decoding's on the same prompt in the same round.
    """
    run = lambda d, prompt, n, seed=0: _run(bb, d, prompt, n, temperature=temperature, seed=seed)  # noqa: E731
    for d in drafters:  # warm-up
        run(d, prompts[0], 4)
    runs: list[list[tuple[int, float, int, int, int]]] = [[] for _ in drafters]
    ratios: list[list[float]] = [[] for _ in drafters]
    bar = tqdm(total=repeats * len(prompts) * len(drafters), desc="tune-tree", disable=not progress)
    turn = 0
    for _ in range(repeats):
        for prompt in prompts:
            order = list(range(len(drafters)))
            order = order[turn % len(order):] + order[: turn % len(order)]
            turn += 1
            here = {}
            for i in order:
                here[i] = run(drafters[i], prompt, max_new_tokens, turn)
                runs[i].append(here[i])
                bar.update(1)
            plain = here[0][0] / here[0][1]
            for i, r in here.items():
                ratios[i].append(r[0] / r[1] / plain)
    bar.close()
    return runs, ratios


def tune_tree(model, heads: Heads, seqs: list[Sequence], *, n_prompts: int = TUNE_PROMPTS,
              max_new_tokens: int = TUNE_NEW_TOKENS, repeats: int = TUNE_REPEATS, progress: bool = True,
              prune: bool = True, tolerance: float = TUNE_TOLERANCE, finalists: int = FINALISTS,
              prompts: list[torch.Tensor] | None = None, corpus=None,
              temperature: float = 0.0) -> tuple[Candidate, list[Candidate], list | None]:
    """Time every candidate (tree, threshold, gate) against plain decoding, greedy or (``temperature`` > 0)
    both sampled; return (best, all, acc).

    Timing follows the bench's protocol at a finer grain (``time_drafters``). A candidate's
    ``speedup`` is the median over (prompt, round) of its tokens/s over plain decoding's on the
    same prompt in the same round; ``pick`` chooses among them.

    Timed on ``prompts`` (token ids) when given, else on the prompts of ``seqs`` (held-out sequences;
    Medusa also reads its rank accuracy from them): the first ``n_prompts``, then the next ``n_prompts``
    for the second round of ``finalists`` candidates (``time_candidates``; none when 0 or no prompts are
    left). ``corpus``: what the candidates' lookup reads where the context has no match
    (``corpus.Corpus``; None: the context only).
    """
    bb = Backbone(model)
    prompts = prompts if prompts is not None else [s.ids[: s.response_start] for s in seqs[:2 * n_prompts]]
    if not prompts:
        raise ValueError("no prompts to time on")
    acc = None
    if heads.config.kind == "medusa":
        acc = medusa_rank_accuracy(model, heads, seqs[: max(n_prompts * 4, 32)])
        acc_t = tuple(tuple(a) for a in acc)
        # (tree, threshold, gate, lookup)
        grid = [(tree_from_rank_accuracy(acc_t, n), 0.0, 0.0, 0) for n in MEDUSA_SIZES]
        grid += [(tree_from_rank_accuracy(acc_t, n), 0.0, g, 0) for n, g in MEDUSA_GATED] if prune else []
        grid += [(tree_from_rank_accuracy(acc_t, n), 0.0, g, k) for n, g, k in MEDUSA_LOOKUP if prune or g == 0]
        make = lambda spec, t, g, k: MedusaDrafter(bb, heads, build_tree(spec, str(bb.device)), threshold=t, gate=g,  # noqa: E731
                                                   lookup=k, corpus=corpus)
    elif heads.config.kind == "eagle":
        grid = [(spec, t, 0.0, k) for spec, t, k in eagle_grid(bb.device.type) if prune or t == 0]
        drafting = heads_in_dtype(heads, bb.dtype)   # one copy for every candidate, not one each
        make = lambda spec, t, g, k: EagleDrafter(bb, drafting, **parse_dynamic_tree(spec), threshold=t, lookup=k,  # noqa: E731
                                                  corpus=corpus)
    else:
        grid = [(spec, 0.0, 0.0, 0) for spec in EXIT_TREES]
        grid += [(spec, t, 0.0, 0) for spec in EXIT_PRUNED_TREES for t in EXIT_THRESHOLDS] if prune else []
        make = lambda spec, t, g, k: EarlyExitDrafter(bb, heads, build_tree(parse_tree(spec, default=()), str(bb.device)),  # noqa: E731
                                                      threshold=t)
    drafters = [NoDrafter(bb.device)] + [make(*cand) for cand in grid]   # index 0: the plain reference

    def size(spec) -> int:
        if heads.config.kind == "eagle":
            return parse_dynamic_tree(spec)["nodes"]
        return build_tree(parse_tree(spec, default=())).size - 1

    cands = time_candidates(bb, drafters, grid, size, prompts[:n_prompts], prompts[n_prompts:2 * n_prompts],
                            max_new_tokens=max_new_tokens,
                            repeats=repeats, progress=progress, tolerance=tolerance, finalists=finalists,
                            temperature=temperature)
    return pick(cands, tolerance=tolerance), cands, acc


def tune_draft_model(model, draft, prompts: list[torch.Tensor], *, max_new_tokens: int = TUNE_NEW_TOKENS,
                     repeats: int = TUNE_REPEATS, n_prompts: int | None = None,
                     progress: bool = True, prune: bool = True, tolerance: float = TUNE_TOLERANCE,
                     finalists: int = FINALISTS, temperature: float = 0.0) -> tuple[Candidate, list[Candidate]]:
    """Time the draft model's chains (``DRAFT_GRID``) against plain decoding as ``tune_tree`` times
    trees; return (best, all). The first ``n_prompts`` of ``prompts``
    (default: all) time every chain, the next ``n_prompts`` the finalists (``time_candidates``)."""
    if not prompts:
        raise ValueError("no prompts to time on")
    bb = Backbone(model)
    grid = [(spec, t, 0.0, 0) for spec, t in DRAFT_GRID if prune or t == 0]
    drafters = [NoDrafter(bb.device)] + [
        DraftModelDrafter(draft, build_tree(parse_tree(spec, default=()), str(bb.device)), vocab_size=bb.vocab_size,
                          threshold=t) for spec, t, _, _ in grid]
    n = len(prompts) if n_prompts is None else n_prompts
    cands = time_candidates(bb, drafters, grid, lambda spec: build_tree(parse_tree(spec, default=())).size - 1,
                            prompts[:n], prompts[n:2 * n],
                            max_new_tokens=max_new_tokens, repeats=repeats, progress=progress, tolerance=tolerance,
                            finalists=finalists, temperature=temperature)
    return pick(cands, tolerance=tolerance), cands


def time_candidates(bb: Backbone, drafters: list, grid: list[tuple], size, first: list[torch.Tensor],
                    second: list[torch.Tensor], *, max_new_tokens: int, repeats: int, progress: bool,
                    tolerance: float, finalists: int, temperature: float = 0.0) -> list[Candidate]:
    """Time ``drafters`` (index 0: plain decoding; then one per ``grid`` row) on ``first``, then the
    ``finalists`` fastest of those within twice ``tolerance`` of the best again on ``second`` (with
    plain decoding, interleaved as before); a finalist's numbers pool both rounds. Returns one
    ``Candidate`` per grid row."""
    runs, ratios = time_drafters(bb, drafters, first, max_new_tokens=max_new_tokens,
                                 repeats=repeats, progress=progress, temperature=temperature)
    cands = _candidates(grid, runs, ratios, size)
    if finalists <= 0 or not second:
        return cands
    top = max(c.speedup for c in cands)
    near = sorted((i for i, c in enumerate(cands) if c.speedup >= (1 - 2 * tolerance) * top),
                  key=lambda i: -cands[i].speedup)[:finalists]
    more_runs, more_ratios = time_drafters(bb, [drafters[0]] + [drafters[i + 1] for i in near], second,
                                           max_new_tokens=max_new_tokens, repeats=repeats, progress=progress,
                                           temperature=temperature)
    for j, i in enumerate(near, start=1):
        runs[i + 1] += more_runs[j]
        ratios[i + 1] += more_ratios[j]
    return _candidates(grid, runs, ratios, size)


def _candidates(grid: list[tuple], runs: list[list[tuple]], ratios: list[list[float]], size) -> list[Candidate]:
    """One ``Candidate`` per grid row (tree, threshold, gate, lookup) from ``time_drafters``' results
    (whose index 0 is plain decoding)."""
    def total(i: int, k: int) -> float:
        return sum(r[k] for r in runs[i])

    return [Candidate(spec=spec, size=size(spec), threshold=t, gate=g, lookup=k,
                      tokens_per_s=total(i, 0) / total(i, 1), tau=total(i, 3) / max(total(i, 2), 1),
                      nodes_per_step=total(i, 4) / max(total(i, 2), 1), speedup=statistics.median(ratios[i]),
                      runs=len(ratios[i]))
            for i, (spec, t, g, k) in enumerate(grid, start=1)]


def pick(cands: list[Candidate], *, tolerance: float = TUNE_TOLERANCE) -> Candidate:
    """The candidate to ship: of those timed on the most runs (the finalists, when a second round
    ran), and of them those within ``tolerance`` of the best median speedup (tied: prompts on a shared
    machine time candidates only to within a few percent), the one that drafts best: the highest
    tau, where taus within ``TAU_TOLERANCE`` of the best count as tied and the one verifying the
    fewest rows per step wins (then the fastest). Among candidates of one speed here, tau is what
    carries to other machines: every pass on a GPU costs about the same at batch 1, and where a
    pass over more rows costs more (batches, slower machines) each step's tree is cut to the width
    the pass is worth there (``runtime/width.py``), so a wider pick costs little where it does not pay."""
    if not cands:
        raise ValueError("no candidates to pick from")
    most = max(c.runs for c in cands)
    cands = [c for c in cands if c.runs == most]
    top = max(c.speedup for c in cands)
    close = [c for c in cands if c.speedup >= (1 - tolerance) * top]
    best_tau = max(c.tau for c in close)
    drafts_best = [c for c in close if c.tau >= (1 - TAU_TOLERANCE) * best_tau]
    return min(drafts_best, key=lambda c: (c.nodes_per_step, -c.speedup))


def _rule(tolerance: float) -> dict:
    """What a tune-tree record keeps of the rule its pick followed (``pick``; the model card states it)."""
    return {"tolerance": tolerance, "tau_tolerance": TAU_TOLERANCE}


def add_tune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--heads", default=None, help="heads directory to tune (rewritten in place)")
    p.add_argument("--draft-model", default=None,
                   help="instead of heads: a separate draft model (alias, directory, .gguf or hub id) to tune chains for, "
                        "on --prompts; the pick is recorded for this pair of models under $SELFSPEC_HOME/tuned")
    p.add_argument("--data", default=None,
                   help="the data directory (or comma-separated directories) the heads were trained on: its held-out "
                        "split gives the timing prompts (and Medusa's rank accuracy); needed unless --prompts is given "
                        "for eagle or early-exit heads")
    p.add_argument("--prompts", default=None,
                   help="time on a seeded sample (--prompts-n, --seed) of this JSONL prompt file instead of the held-out "
                        "split: prompts the heads never saw, of the kinds they will serve")
    p.add_argument("--seed", type=int, default=0, help="which --prompts sample (default 0)")
    p.add_argument("--prompts-n", type=int, default=TUNE_PROMPTS, help=f"prompts to time on (default {TUNE_PROMPTS})")
    p.add_argument("--max-new-tokens", type=int, default=TUNE_NEW_TOKENS,
                   help=f"new tokens per timed run (default {TUNE_NEW_TOKENS}, as the bench): copying from the context "
                        "pays more the longer the answer, so short runs undervalue the lookup")
    p.add_argument("--repeats", type=int, default=TUNE_REPEATS, help=f"rounds over the prompts (default {TUNE_REPEATS})")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default=None,
                   help="cpu | cuda (default: cuda when available); heads: the picks are recorded as this kind of "
                        "device's settings, which \"auto\" reads there (another kind of device keeps its own)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: float32 on CPU, the "
                                                  "checkpoint's on a GPU): time in the dtype you will decode in")
    p.add_argument("--no-prune", action="store_true", help="time unpruned trees only (threshold 0)")
    p.add_argument("--tolerance", type=float, default=TUNE_TOLERANCE,
                   help="candidates within this fraction of the best speedup count as tied; of them the one with the "
                        f"highest tau wins (taus within {TAU_TOLERANCE * 100:.0f}%% tied: the one verifying the fewest rows per "
                        f"step) (default {TUNE_TOLERANCE})")
    p.add_argument("--finalists", type=int, default=FINALISTS,
                   help=f"re-time this many of the fastest candidates on --prompts-n other prompts and pick among "
                        f"them on both rounds (default {FINALISTS}; 0 = one round)")
    p.add_argument("--corpus", default="auto", help="medusa / eagle: the corpus the candidates' lookup reads where the "
                   "context has no match (auto = the one shipped for the demo model, none = off)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="time sampled decoding at this temperature (plain decoding sampled alike) and record the pick "
                        "as the sampled settings of the heads (or the pair), what \"auto\" gives a sampled generate (the "
                        "greedy ones stay); 0 = greedy (default)")
    p.add_argument("--recorded", action="store_true",
                   help="time nothing: choose again, with this --tolerance, from the timings recorded by the last runs "
                        "(greedy and sampled)")


def check_tune_args(args) -> None:
    """Flags, heads and data checked before the model loads."""
    in_unit_interval(args.tolerance, "tolerance", open_high=True)
    resolve_dtype(args.dtype)
    if not args.recorded:
        resolve_device(args.device)
    for name in ("prompts_n", "max_new_tokens", "repeats", "threads"):
        at_least(getattr(args, name), 1, name)
    at_least(args.finalists, 0, "finalists")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(f"--temperature must be a finite number >= 0 (got {args.temperature:g}; 0 = greedy)")
    if args.temperature > 0 and args.recorded:
        raise ValueError("--recorded times nothing: it re-picks the greedy and sampled timings already recorded "
                         "(drop --temperature)")
    if (args.heads is None) == (args.draft_model is None):
        raise ValueError("pass --heads DIR (trained heads) or --draft-model NAME (a separate draft model), one of them")
    if args.draft_model is not None:
        if args.data is not None:
            raise ValueError("--data applies to heads: a draft model is timed on --prompts FILE")
        if args.prompts is None and not args.recorded:
            raise ValueError("--draft-model is timed on prompts it will serve: pass --prompts FILE")
        check_model_name(args.model)
        check_model_name(args.draft_model)
    if args.recorded:
        return
    if args.draft_model is not None:
        load_bench_prompts(args.prompts, sample=args.prompts_n, seed=args.seed)
        return
    check_model_name(args.model)
    kind = read_heads_config(args.heads).kind
    check_corpus_arg(args.corpus, kind)
    if args.data is None and (args.prompts is None or kind == "medusa"):
        raise ValueError("pass --data, the data the heads were trained on" +
                         (" (Medusa heads read their rank accuracy from its held-out split)" if args.prompts else
                          "; or --prompts FILE to time on prompts the heads never saw"))
    if args.data is not None:
        read_meta(args.data)
    if args.prompts is not None:
        load_bench_prompts(args.prompts, sample=args.prompts_n, seed=args.seed)


def run_tune(args) -> int:
    check_tune_args(args)
    if args.recorded and args.draft_model is None:
        return _repick(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    if args.draft_model is not None:
        return _run_tune_pair(args, loaded)
    p = loaded.model.get_output_embeddings().weight
    kind = read_heads_config(args.heads).kind
    heads = load_heads(args.heads, expect_kind=kind, fingerprint=config_fingerprint(loaded.model.config),
                       device=p.device, dtype=p.dtype, model=loaded.model)
    seqs = heldout_sequences(args.data, heads) if args.data is not None else []
    prompts = None
    if args.prompts is not None:
        chat = bool(getattr(loaded.tokenizer, "chat_template", None))
        prompts = [torch.tensor(prompt_ids(loaded.tokenizer, pr.text, chat=chat))
                   for pr in load_bench_prompts(args.prompts, sample=_rounds(args) * args.prompts_n, seed=args.seed)]
    corpus_dir = (shipped_corpus(args.model) if args.corpus == "auto" else None if args.corpus == "none"
                  else args.corpus) if kind in LOOKUP_DRAFTERS else None
    corpus = None if corpus_dir is None else load_corpus(corpus_dir, fingerprint=config_fingerprint(loaded.model.config))
    _, cands, acc = tune_tree(loaded.model, heads, seqs, n_prompts=args.prompts_n,
                                 max_new_tokens=args.max_new_tokens, repeats=args.repeats, prune=not args.no_prune,
                                 tolerance=args.tolerance, finalists=args.finalists, prompts=prompts, corpus=corpus,
                                 temperature=args.temperature)
    _print_candidates(cands)
    timed_on = {"prompts": Path(args.prompts).name, "n_prompts": min(args.prompts_n, len(prompts)), "seed": args.seed} \
        if prompts else {"held_out_prompts": min(args.prompts_n, len(seqs))}
    timed_on["finalists"] = args.finalists
    corpus_note = None if corpus_dir is None else "auto (the shipped corpus)" if args.corpus == "auto" else str(corpus_dir)
    search = {**timed_on, "corpus": corpus_note, "max_new_tokens": args.max_new_tokens,
              **({"temperature": args.temperature} if args.temperature > 0 else {}),
              "threads": torch.get_num_threads(), "rank_accuracy": acc,
              "candidates": [{**asdict(c), "spec": c.spec if isinstance(c.spec, str) else [list(p) for p in c.spec]}
                             for c in cands]}
    return _record(args.heads, heads.config, cands, {**search, **_rule(args.tolerance), "hardware": this_hardware(p.device)},
                   sampled=args.temperature > 0, device=p.device.type)


def _rounds(args) -> int:
    """How many sets of --prompts-n prompts a run reads: a second one for the finalists."""
    return 2 if args.finalists > 0 else 1


def _print_candidates(cands: list[Candidate]) -> None:
    for c in cands:
        print(f"{c.size:3d} nodes  threshold {c.threshold:4.2f}  gate {c.gate:3.1f}  lookup {c.lookup}  {c.nodes_per_step:5.2f} verified/step  "
              f"{c.tokens_per_s:6.1f} tok/s  {c.speedup:5.2f}x plain  tau {c.tau:.2f}  {c.runs:3d} runs  "
              f"{c.spec if isinstance(c.spec, str) else ''}")


def _run_tune_pair(args, loaded) -> int:
    """--draft-model: time the pair's chains, greedy or sampled (``--temperature``), or with --recorded choose
    again from the recorded timings; record the picks for this pair and this kind of device (what "auto"
    reads there). The other mode's pick and timings stay, and so do other devices' (``pair_searches``)."""
    device = loaded.model.device.type
    draft = load_model(args.draft_model, device=loaded.model.device).model
    try:
        old = read_pair_record(loaded.model, draft) or {}
    except ValueError:
        if args.recorded:
            raise
        old = {}   # a torn record: this run's timings replace it
    searches = pair_searches(old)
    if args.recorded:
        searches = {key: {**search, **_rule(args.tolerance)} for key, search in searches.items()
                    if search and search.get("candidates")}
        if not searches:
            raise ValueError(f"{args.model} with draft {args.draft_model} records no tune-tree timings: run "
                             "`selfspec tune-tree --draft-model` without --recorded first")
        timed = list(searches)
    else:
        chat = bool(getattr(loaded.tokenizer, "chat_template", None))
        prompts = [torch.tensor(prompt_ids(loaded.tokenizer, pr.text, chat=chat))
                   for pr in load_bench_prompts(args.prompts, sample=_rounds(args) * args.prompts_n, seed=args.seed)]
        _, cands = tune_draft_model(loaded.model, draft, prompts, max_new_tokens=args.max_new_tokens,
                                    repeats=args.repeats, n_prompts=args.prompts_n, prune=not args.no_prune,
                                    tolerance=args.tolerance, finalists=args.finalists, temperature=args.temperature)
        _print_candidates(cands)
        timed = [(device, args.temperature > 0)]
        searches[timed[0]] = {
            "target": args.model, "draft": args.draft_model, "prompts": Path(args.prompts).name,
            "n_prompts": min(args.prompts_n, len(prompts)), "finalists": args.finalists, "seed": args.seed,
            "max_new_tokens": args.max_new_tokens, **({"temperature": args.temperature} if args.temperature > 0 else {}),
            "threads": torch.get_num_threads(), "device": device, "hardware": this_hardware(loaded.model.device),
            "candidates": [asdict(c) for c in cands], **_rule(args.tolerance)}
    decode = DecodeSettings.from_json(old.get("decode"))
    for kind, sampled in timed:   # the modes and devices not timed keep their picks
        best = pick(_from_records(searches[kind, sampled]["candidates"]), tolerance=args.tolerance)
        picked = DecodeSettings(tree=best.spec, threshold=best.threshold)
        # A first run on a kind of device starts from the CPU's settings, as for heads (``_record``).
        decode = decode.with_device(kind, decode.for_device(kind).with_pick(picked, sampled=sampled))
        print(f"tree=auto for {args.model} drafted by {args.draft_model}{'' if kind == HOME_DEVICE else f' on {kind}'}"
              f"{' when sampling' if sampled else ''} is now {best.spec}, threshold=auto {best.threshold}")
    path = write_pair_record(loaded.model, draft, decode, searches)
    print(f"(recorded in {path})")
    return 0


def _settings(c: Candidate) -> DecodeSettings:
    return DecodeSettings(tree=c.spec if isinstance(c.spec, str) else [list(p) for p in c.spec], threshold=c.threshold,
                          gate=c.gate, lookup=c.lookup)


def _record(heads_dir, config, cands: list[Candidate], search: dict, *, sampled: bool = False,
            device: str = HOME_DEVICE) -> int:
    """The pick (``pick``) into the heads' ``decode`` settings for this kind of device (what
    "auto" reads there; ``sampled``: into its ``sampled`` settings, the greedy ones kept, and the other way
    round; other devices' kept) and the timings behind them into ``search_file``; the weights are not
    rewritten."""
    best = pick(cands, tolerance=search["tolerance"])
    picked = _settings(best)
    # A first run on a kind of device starts from the CPU's settings: the mode it did not time reads what it read before.
    mine = config.decode.for_device(device)
    config.decode = config.decode.with_device(device, mine.with_pick(picked, sampled=sampled))
    config.provenance.pop("tree_search", None)   # a legacy config's timings: they move to tune-tree.json
    write_heads_config(heads_dir, asdict(config))
    atomic_write_text(Path(heads_dir) / search_file(sampled=sampled, device=device),
                      json.dumps({**search, "device": device}, indent=1))
    return _report_choice(heads_dir, best, sampled=sampled, device=device)


def _report_choice(path: str, best: Candidate, *, sampled: bool = False,
                   device: str = HOME_DEVICE) -> int:
    shape = lambda c: c.spec if isinstance(c.spec, str) else f"{len(c.spec)}-node tree"  # noqa: E731
    where = "" if device == HOME_DEVICE else f" on {device}"
    print(f"tree=auto for {path}{where}{' when sampling' if sampled else ''} is now the {shape(best)}, threshold=auto "
          f"{best.threshold}, gate=auto {best.gate}, lookup=auto {best.lookup}")
    return 0


def _repick(args) -> int:
    """--recorded: apply ``pick`` again to the candidates the last tune-tree runs timed, greedy and sampled
    (no weights rewritten)."""
    searches = {(device, sampled): recorded_search(args.heads, sampled=sampled, device=device)
                for device in (recorded_devices(args.heads) or (HOME_DEVICE,)) for sampled in (False, True)}
    searches = {key: s for key, s in searches.items() if s and s.get("candidates")}
    if not searches:
        raise ValueError(f"{args.heads} records no tune-tree timings: run `selfspec tune-tree` without --recorded first")
    for (device, sampled), search in searches.items():
        _record(args.heads, read_heads_config(args.heads), _from_records(search["candidates"]),
                {**search, **_rule(args.tolerance)}, sampled=sampled, device=device)
    return 0


def _from_records(rows: list[dict]) -> list[Candidate]:
    """Candidates back from a tune-tree record (a tree given as paths becomes a tuple again)."""
    fields = set(Candidate.__dataclass_fields__)
    return [Candidate(**{**{k: v for k, v in c.items() if k in fields},
                         "spec": c["spec"] if isinstance(c["spec"], str) else tuple(tuple(p) for p in c["spec"])})
            for c in rows]
