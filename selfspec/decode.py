"""The decode loop: prefill, then draft -> verify -> accept -> commit until done.

One target forward per step verifies the whole candidate tree (tree attention through the
layers' public forward arguments). Greedy acceptance makes the output token-identical to plain
greedy decoding; rejection sampling makes sampled output follow the target's distribution.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from . import cache as kv
from .backbone import Backbone
from .drafters.base import DecodeState, Draft, Drafter, TargetOut
from .sampling import SamplingParams, probs_from_logits, sample
from .verify import Accepted, greedy_accept, rejection_accept_tree


@dataclass
class DecodeStats:
    new_tokens: int = 0
    target_forwards: int = 0     # prefill + one per verification step
    steps: int = 0               # verification steps
    drafted: int = 0             # draft nodes verified (tree nodes bar the root), summed over steps
    accepted_hist: list[int] = field(default_factory=list)   # [a] = steps that accepted a drafts
    drafted_by_depth: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0        # target forward + acceptance + cache compaction
    prefill_s: float = 0.0
    wall_s: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens committed per verification step, bonus included (plain decoding: 1.0)."""
        return sum((a + 1) * n for a, n in enumerate(self.accepted_hist)) / max(self.steps, 1)

    @property
    def acceptance_by_depth(self) -> list[float]:
        """P(draft at depth d accepted | depth d drafted), d = 1..D."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_depth, self.drafted_by_depth)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def record(self, depth: int, num_accepted: int, nodes: int = 0) -> None:
        self.steps += 1
        self.drafted += nodes
        self.target_forwards += 1
        for lst, n in ((self.accepted_hist, num_accepted + 1), (self.drafted_by_depth, depth),
                       (self.accepted_by_depth, depth)):
            lst.extend([0] * (n - len(lst)))
        self.accepted_hist[num_accepted] += 1
        for d in range(depth):
            self.drafted_by_depth[d] += 1
        for d in range(num_accepted):
            self.accepted_by_depth[d] += 1

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(tau=self.tau, acceptance_by_depth=self.acceptance_by_depth, tokens_per_s=self.tokens_per_s)
        return d


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _layers(backbone: Backbone, h, *, start: int, position_ids, mask, cache, capture: tuple[int, ...]):
    """layers[start:N], split at the ``capture`` points a drafter wants hidden states after (same cost).

    Capture c is the hidden state after layer c, as transformers' ``output_hidden_states[c]``
    reports it: so c = N is the final state *after* the final norm. Returns (last hidden, pre-norm;
    captured states in ``capture`` order, each (1, n, H))."""
    N = backbone.num_layers
    got: dict[int, torch.Tensor] = {start: h}   # capturing ``start`` itself: the input
    at = start
    for stop in sorted({c for c in capture if start < c < N}) + [N]:
        h = backbone.run_layers(h, start=at, end=stop, position_ids=position_ids, attention_mask=mask, cache=cache)
        got[stop], at = h, stop
    if N in capture:
        got[N] = backbone.final_norm(h)
    return h, tuple(got[c] for c in capture)


def prefill(backbone: Backbone, cache, prompt: torch.Tensor, *, capture: tuple[int, ...] = ()) -> TargetOut:
    """Run the prompt (n,) through the full target; logits only for the last position."""
    # No mask: with an empty cache sdpa applies plain causal attention.
    h, mid = _layers(backbone, backbone.embed(prompt), start=0, mask=None, cache=cache, capture=capture,
                     position_ids=torch.arange(prompt.shape[0], device=prompt.device)[None])
    normed = backbone.final_norm(h[:, -1:])
    return TargetOut(logits=backbone.logits(normed)[0], hidden=normed[0], captured=mid)


def verify_forward(backbone: Backbone, cache, past_len: int, draft: Draft, *, capture: tuple[int, ...] = ()) -> TargetOut:
    """ONE full-depth target pass over every tree node. Returns logits/hidden (n, V)/(n, H)."""
    tree, tokens = draft.tree, draft.tokens.to(backbone.device)
    positions = tree.position_ids(past_len)
    # A lone root sees the whole cache: no mask needed (and sdpa takes its fast path).
    mask = tree.attention_mask(past_len, dtype=backbone.dtype) if tree.size > 1 else None
    if draft.resume is None:
        h, mid = _layers(backbone, backbone.embed(tokens), start=0, position_ids=positions, mask=mask, cache=cache,
                         capture=capture)
    else:
        # The drafter already ran layers[0:E] for the first m nodes (their KV is cached):
        # run those layers for the rest only, then layers[E:] for all nodes.
        E, m = draft.resume.layer, draft.resume.hidden.shape[1]
        h = draft.resume.hidden
        if m < tree.size:
            rest = backbone.run_layers(backbone.embed(tokens[m:]), start=0, end=E, position_ids=positions[:, m:],
                                       attention_mask=None if mask is None else mask[:, :, m:], cache=cache)
            h = torch.cat([h, rest], dim=1)
        if any(c < E for c in capture):
            raise ValueError(f"a drafter that resumes at layer {E} cannot capture earlier layers {capture}")
        h, mid = _layers(backbone, h, start=E, position_ids=positions, mask=mask, cache=cache, capture=capture)
    normed = backbone.final_norm(h)
    return TargetOut(logits=backbone.logits(normed)[0], hidden=normed[0], captured=mid)


def accept(draft: Draft, out: TargetOut, params: SamplingParams, generator: torch.Generator | None) -> Accepted:
    tokens = draft.tokens.to(out.logits.device)
    if not params.do_sample:
        return greedy_accept(draft.tree, tokens, out.logits.argmax(-1))
    p = probs_from_logits(out.logits, params)
    if draft.q is None:  # nothing drafted: a plain sampling step
        return Accepted(path=(0,), bonus=int(sample(p[0], generator)))
    return rejection_accept_tree(draft.tree, tokens, p, draft.q.to(p.device), draft.q_rows().to(p.device),
                                 generator=generator)


def commit(state: DecodeState, draft: Draft, accepted: Accepted) -> list[int]:
    """Keep the accepted path's KV (every layer), append its tokens and the bonus. Returns new tokens."""
    past = state.past_len
    path = torch.tensor(accepted.path, device=draft.tree.parents.device)
    kv.keep(state.cache, past, path)
    new = [int(t) for t in draft.tokens[list(accepted.path[1:])].tolist()] + [accepted.bonus]
    state.ids.extend(new)
    return new


@torch.no_grad()   # never records autograd: a recorded graph would chain every step's activations via the cache
def decode(
    backbone: Backbone,
    drafter: Drafter,
    prompt: torch.Tensor,
    *,
    params: SamplingParams,
    max_new_tokens: int,
    eos_token_ids: set[int],
    generator: torch.Generator | None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> tuple[list[int], DecodeStats]:
    """Generate up to ``max_new_tokens`` after ``prompt`` (n,). Returns (new tokens, stats)."""
    stats = DecodeStats()
    dev = backbone.device
    _sync(dev)
    t0 = time.perf_counter()
    state = DecodeState(ids=prompt.tolist(), cache=kv.new_cache(), params=params, generator=generator)
    out = prefill(backbone, state.cache, prompt.to(dev), capture=drafter.capture_layers)
    first = int(out.logits[-1].argmax()) if not params.do_sample else int(
        sample(probs_from_logits(out.logits[-1], params), generator))
    state.ids.append(first)
    drafter.begin(state, out)
    stats.target_forwards = 1
    new = _take([first], max_new_tokens, eos_token_ids)
    if on_tokens:
        on_tokens(new)
    _sync(dev)
    stats.prefill_s = time.perf_counter() - t0

    while len(new) < max_new_tokens and new[-1] not in eos_token_ids:
        t1 = time.perf_counter()
        draft = drafter.draft(state)                                              # DRAFT
        _sync(dev)
        t2 = time.perf_counter()
        out = verify_forward(backbone, state.cache, state.past_len, draft,
                             capture=drafter.capture_layers)                       # VERIFY
        accepted = accept(draft, out, params, generator)                          # ACCEPT
        committed = commit(state, draft, accepted)                                # COMMIT
        drafter.commit(state, accepted, out)
        _sync(dev)
        stats.draft_s += t2 - t1
        stats.verify_s += time.perf_counter() - t2
        stats.record(draft.tree.depth, accepted.num_accepted, draft.tree.size - 1)
        emitted = _take(committed, max_new_tokens - len(new), eos_token_ids)
        new.extend(emitted)
        if on_tokens:
            on_tokens(emitted)

    _sync(dev)
    stats.wall_s = time.perf_counter() - t0
    stats.new_tokens = len(new)
    return new, stats


def _take(tokens: list[int], room: int, eos: set[int]) -> list[int]:
    """At most ``room`` tokens, ending at the first EOS (kept, as transformers does)."""
    tokens = tokens[:room]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens
