"""The decode loop: prefill, then draft -> verify -> accept -> commit until done.

One target forward per step verifies the whole candidate tree (tree attention through the
layers' public forward arguments). Greedy acceptance makes the output token-identical to plain
greedy decoding; rejection sampling makes sampled output follow the target's distribution.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from . import cache as kv
from .accept import Accepted, greedy_accept_rows, point_accept_tree, rejection_accept_tree
from .backbone import Backbone
from .cache import KVCache
from .clock import now
from .sampling import SamplingParams, probs_from_logits, sample, target_logits
from .tree import tree_mask
from .types import DecodeState, Draft, Drafter, Drafts, Pace, TargetOut, Verified, VerifyStep, WidthFit, plain_draft

if TYPE_CHECKING:
    from .stopping import StopStrings  # a rule over token ids; the loop never sees the tokenizer


@dataclass
class DecodeStats:
    new_tokens: int = 0
    target_forwards: int = 0     # prefill + one per verification step (one pass serves every row)
    steps: int = 0               # verification steps, summed over rows
    plain_steps: int = 0         # of those, steps the runtime did not draft (back-off: drafting did not pay)
    drafted: int = 0             # draft nodes verified (tree nodes bar the root), summed over steps
    accepted_hist: list[int] = field(default_factory=list)   # [a] = steps that accepted a drafts
    drafted_by_depth: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)
    wall_s: float = 0.0          # the whole decode, prefill included

    @property
    def tau(self) -> float:
        """Mean tokens a row commits per verification step, bonus included (plain decoding: 1.0)."""
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


def _layers(backbone: Backbone, h, *, start: int, position_ids, mask, cache, capture: tuple[int, ...],
            top: int | None = None):
    """layers[start:N], split at the ``capture`` points a drafter wants hidden states after (same cost).

    Capture c is the hidden state after layer c, as transformers' ``output_hidden_states[c]``
    reports it: so c = N is the final state *after* the final norm. top: a bound the host knows on the
    positions (``Backbone.rope``). Returns (last hidden, pre-norm; captured states in ``capture`` order, each
    (B, n, H))."""
    N = backbone.num_layers
    got: dict[int, torch.Tensor] = {start: h}   # capturing ``start`` itself: the input
    at = start
    rope = backbone.rope(h, position_ids, top=top)   # once for every layer run
    for stop in sorted({c for c in capture if start < c < N}) + [N]:
        h = backbone.run_layers(h, start=at, end=stop, position_ids=position_ids, attention_mask=mask, cache=cache,
                                rope=rope)
        got[stop], at = h, stop
    if N in capture:
        got[N] = backbone.final_norm(h)
    return h, tuple(got[c] for c in capture)


def prefill_rows(backbone: Backbone, cache: KVCache, prompts: list[torch.Tensor], *,
                 capture: tuple[int, ...] = ()) -> list[TargetOut]:
    """Run prompts (n_b,) through the full target in one batched pass (right-padded to the longest;
    each row ends at its own length in the cache). Per row: logits for its last position only."""
    lens = [int(p.shape[0]) for p in prompts]
    L, dev = max(lens), backbone.device
    ids = torch.stack([torch.cat([p, p.new_zeros(L - p.shape[0])]) for p in prompts]).to(dev)
    if len(prompts) == 1:
        mask = None   # one row, empty cache: sdpa's own causal attention
    else:
        causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril().expand(len(lens), L, L)   # (padding: discarded)
        mask = tree_mask(causal, torch.zeros(len(lens), dtype=torch.long, device=dev), L, backbone.dtype)
    h, mid = _layers(backbone, backbone.embed_tokens(ids), start=0, mask=mask, cache=cache, capture=capture,
                     position_ids=torch.arange(L, device=dev)[None].expand(len(lens), -1), top=L)
    cache.set_lengths(lens)
    last = torch.tensor(lens, device=dev) - 1
    normed = backbone.final_norm(h[torch.arange(len(lens), device=dev), last])      # (B, H)
    logits = backbone.logits(normed)
    return [TargetOut(logits=logits[b:b + 1], hidden=normed[b:b + 1], captured=tuple(c[b:b + 1, :n] for c in mid))
            for b, n in enumerate(lens)]


def prefill(backbone: Backbone, cache: KVCache, prompt: torch.Tensor, *, capture: tuple[int, ...] = ()) -> TargetOut:
    """One prompt (n,) through the full target; logits only for the last position."""
    return prefill_rows(backbone, cache, [prompt], capture=capture)[0]


def verify_rows(backbone: Backbone, cache: KVCache, pasts: list[int], drafts: Sequence[Draft], *,
                capture: tuple[int, ...] = ()) -> Verified:
    """ONE full-depth target pass over every tree node of every row (trees padded to the largest).

    Per row: logits/hidden (n_b, V)/(n_b, H), captured (1, n_b, H)."""
    if len(drafts) == 1:
        out = _verify_one(backbone, cache, pasts[0], drafts[0], capture=capture)
        return Verified([out], out.logits, out.captured, [0])
    drafts = Drafts.of(drafts)
    if any(d.resume is not None for d in drafts):
        return _verify_resumed_rows(backbone, cache, pasts, drafts, capture=capture)
    dev = backbone.device
    n = max(drafts.sizes)
    batch = drafts.padded(n, dev)
    lengths = torch.tensor(pasts, device=dev)
    mask = tree_mask(batch.ancestors, lengths, max(pasts) + n, backbone.dtype)
    h, mid = _layers(backbone, backbone.embed_tokens(batch.tokens), start=0, position_ids=batch.depths + lengths[:, None],
                     mask=mask, cache=cache, capture=capture, top=max(pasts) + n)
    return row_outputs(backbone, backbone.final_norm(h), mid, list(range(len(drafts))), batch.sizes)


def _verify_resumed_rows(backbone: Backbone, cache: KVCache, pasts: list[int], drafts: Drafts, *,
                         capture: tuple[int, ...]) -> Verified:
    """``verify_rows`` where drafters already ran layers[0:E] for each row's first m_b nodes (early exit).

    Their KV for layers < E sits in the cache at slots past_b .. past_b + m_b - 1, so layers < E run
    only for each row's other nodes (written right after them: node j at slot past_b + j, as in a
    fresh pass), then layers[E:] for every node, from the saved states and the new ones. Every row at
    once: the rows' nodes laid out as one padded batch, row b's queries of the first pass its nodes
    m_b, m_b + 1, .. (a node past its tree a padding node, which sees itself only)."""
    dev = backbone.device
    E = next(d.resume.layer for d in drafts if d.resume is not None)
    if any(d.resume is not None and d.resume.layer != E for d in drafts):
        raise ValueError("rows of one batch must resume at the same layer")
    if any(c < E for c in capture):
        raise ValueError(f"a drafter that resumes at layer {E} cannot capture earlier layers {capture}")
    sizes = drafts.sizes
    ran = [0 if d.resume is None else d.resume.hidden.shape[1] for d in drafts]      # m_b
    n, R = max(sizes), max(s - m for s, m in zip(sizes, ran))
    width = max(n, max(ran) + R)                  # every query of the first pass is a node of the layout
    batch, lengths = drafts.padded(width, dev), torch.tensor(pasts, device=dev)
    h = torch.zeros(len(drafts), width, backbone.hidden_size, dtype=backbone.dtype, device=dev)
    if R > 0:   # layers[0:E] for the nodes no drafter ran: row b's nodes m_b .. m_b + R - 1
        nodes = torch.tensor(ran, device=dev)[:, None] + torch.arange(R, device=dev)                    # (B, R)
        mask = tree_mask(batch.ancestors.gather(1, nodes[..., None].expand(-1, -1, width)), lengths,
                         max(p + m for p, m in zip(pasts, ran)) + R, backbone.dtype)
        rest = backbone.run_layers(backbone.embed_tokens(batch.tokens.gather(1, nodes)), start=0, end=E,
                                   position_ids=batch.depths.gather(1, nodes) + lengths[:, None],
                                   attention_mask=mask, cache=cache)                                  # (B, R, H)
        h.scatter_(1, nodes[..., None].expand(-1, -1, h.shape[-1]), rest)
    saved = [(b, d.resume.hidden[0]) for b, d in enumerate(drafts) if d.resume is not None]          # (m_b, H)
    place = torch.tensor([b * width + j for b, x in saved for j in range(x.shape[0])], device=dev)
    h.view(-1, h.shape[-1]).index_copy_(0, place, torch.cat([x for _, x in saved]).to(h.dtype))
    ancestors = batch.ancestors[:, :n, :n]      # (a node's ancestors come before it: the first n close)
    h, mid = _layers(backbone, h[:, :n], start=E, position_ids=batch.depths[:, :n] + lengths[:, None],
                     mask=tree_mask(ancestors, lengths, max(pasts) + n, backbone.dtype), cache=cache,
                     capture=capture, top=max(pasts) + n)
    return row_outputs(backbone, backbone.final_norm(h), mid, list(range(len(drafts))), sizes)


def row_outputs(backbone: Backbone, normed: torch.Tensor, mid: tuple[torch.Tensor, ...], rows: list[int],
                sizes: list[int], logits: torch.Tensor | None = None) -> Verified:
    """Per row: its first sizes[i] nodes of a padded pass (normed (B, n, H), row rows[i]). The LM head
    (the widest product) runs on real nodes only, the rows' nodes packed and padding left out, unless the
    pass gave every node's ``logits`` (B, n, V) already."""
    n = normed.shape[1]

    def real(x: torch.Tensor) -> torch.Tensor:   # (B, n, D) -> the rows' real nodes (sum(sizes), D)
        if len(rows) == 1:   # one row: its real nodes are a slice
            return x[rows[0], : sizes[0]]
        index = torch.tensor([b * n + j for b, m in zip(rows, sizes) for j in range(m)], device=x.device)
        return x.reshape(-1, x.shape[-1]).index_select(0, index)

    flat = backbone.logits(real(normed)) if logits is None else real(logits)
    return Verified([TargetOut(logits=lg, hidden=normed[b, :m], captured=tuple(c[b:b + 1, :m] for c in mid))
                     for b, m, lg in zip(rows, sizes, flat.split(sizes))], flat, mid, rows)


def _verify_one(backbone: Backbone, cache, past_len: int, draft: Draft, *, capture: tuple[int, ...] = ()) -> TargetOut:
    tree, tokens = draft.tree, draft.tokens.to(backbone.device)
    positions = tree.position_ids(past_len)
    # A lone root sees the whole cache: no mask needed (and sdpa takes its fast path).
    mask = tree.attention_mask(past_len, dtype=backbone.dtype) if tree.size > 1 else None
    if draft.resume is None:
        h, mid = _layers(backbone, backbone.embed(tokens), start=0, position_ids=positions, mask=mask, cache=cache,
                         capture=capture, top=past_len + tree.size)
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
        h, mid = _layers(backbone, h, start=E, position_ids=positions, mask=mask, cache=cache, capture=capture,
                         top=past_len + tree.size)
    normed = backbone.final_norm(h)
    return TargetOut(logits=backbone.logits(normed)[0], hidden=normed[0], captured=mid)


def verify_forward(backbone: Backbone, cache, past_len: int, draft: Draft, *, capture: tuple[int, ...] = ()) -> TargetOut:
    """ONE full-depth target pass over every node of one tree. Returns logits/hidden (n, V)/(n, H)."""
    return verify_rows(backbone, cache, [past_len], [draft], capture=capture)[0]


def accept_rows(drafts: Sequence[Draft], outs: Sequence[TargetOut], params: SamplingParams,
                generator: torch.Generator | None, rows: Sequence[DecodeState] = (), eos: Collection[int] = ()
                ) -> list[Accepted]:
    """Each row's accepted path and bonus token: greedy as one batched tensor rule over the step's flat batch
    (``Drafts``; with a ``Verified``, its flat logits), sampling row by row. ``rows``: each row's state, whose
    text a repetition penalty reads and whose ``min_length`` bans ``eos``."""
    drafts = Drafts.of(drafts)
    logits = [o.logits for o in outs]
    processed = params.repetition_penalty != 1.0 or any(s.min_length > len(s.ids) for s in rows)
    if processed:   # (transformers' processors)
        logits = [target_logits(z, params, s.ids, tokens=d.tokens, tree=d.tree, eos=eos,
                                eos_until=s.min_length - len(s.ids)) for z, s, d in zip(logits, rows, drafts, strict=True)]
    if not params.do_sample:
        top = outs.logits.argmax(-1) if isinstance(outs, Verified) and not processed else \
            torch.cat([z.argmax(-1) for z in logits])
        return greedy_accept_rows(drafts.tokens, drafts.parents, top, drafts.offsets)
    return [_sample_accept(d, z, params, generator) for d, z in zip(drafts, logits)]


def accept(draft: Draft, out: TargetOut, params: SamplingParams, generator: torch.Generator | None) -> Accepted:
    return accept_rows([draft], [out], params, generator)[0]


def _sample_accept(draft: Draft, logits: torch.Tensor, params: SamplingParams, generator) -> Accepted:
    tokens = draft.tokens.to(logits.device)
    p = probs_from_logits(logits, params)
    if draft.q is None:  # every token chosen without a draw (or nothing drafted: a plain sampling step)
        return point_accept_tree(draft.tree, tokens, p, generator=generator)
    return rejection_accept_tree(draft.tree, tokens, p, draft.q.to(p.device), draft.q_rows().to(p.device),
                                 generator=generator)


def commit_rows(cache: KVCache, states: list[DecodeState], accepted: list[Accepted]) -> list[list[int]]:
    """Keep each row's accepted path in the cache (every layer), append its tokens and the bonus."""
    pasts = [s.past_len for s in states]
    cache.keep(pasts, [a.path for a in accepted], rows=[s.cache.index for s in states])
    for s, a in zip(states, accepted):
        s.ids.extend(a.tokens)
    return [list(a.tokens) for a in accepted]


@torch.inference_mode()   # no autograd (a recorded graph would chain every step's activations via the cache),
# and no version counting on a step's many small ops
def decode_rows(
    backbone: Backbone,
    drafter: Drafter,
    prompts: list[torch.Tensor],
    *,
    params: SamplingParams,
    max_new_tokens: int,
    eos_token_ids: set[int],
    generator: torch.Generator | None,
    on_tokens: Callable[[int, list[int]], None] | None = None,
    step: VerifyStep | None = None,
    cost: WidthFit | None = None,
    pace: Pace | None = None,
    stop: StopStrings | None = None,
    min_new_tokens: int = 0,
    min_length: int = 0,
) -> tuple[list[list[int]], DecodeStats]:
    """Generate up to ``max_new_tokens`` after each prompt (n_b,), all rows in one batch.

    ``drafter`` drafts for every live row in one call (``Drafter.draft``), holding each row's state
    itself; one target pass per step verifies every row's tree; each row accepts, commits and stops
    on its own, and a finished row leaves the batch. With ``step`` (a ``StaticStep``; ``compile=True``) every
    verification runs at static shapes on a static cache, and a finished row stays in it idle, so
    that the shapes (and the compiled graphs) never change. With ``cost``, each step's trees
    are cut to the width the step's pass is worth (``cost.fit``; with ``step``, a ``VerifyCost``
    built on that step, which prices its buckets). With ``pace``, a step it says not to draft is a plain
    step (``plain_draft``), which every drafter still commits. The loop reads no clock: ``cost`` and
    ``pace`` time the steps they see themselves (from ``fit``, and from ``draft_now``, to their
    ``observe``). A row ends at ``max_new_tokens``, at its first EOS or,
    with ``stop``, at the first token that completes a stop string (both kept); not with EOS before
    ``min_new_tokens`` new tokens, nor before the row's text (prompt included) is ``min_length`` long, as
    transformers' processors of those names rule. Returns (new tokens per row, stats summed over rows)."""
    B, dev, stats = len(prompts), backbone.device, DecodeStats()
    t0 = now(dev)
    if step is None:
        cache = kv.new_cache(B)
        verify = lambda live, pasts, drafts: verify_rows(backbone, cache, pasts, drafts,  # noqa: E731
                                                         capture=drafter.capture_layers)
    else:
        cache = step.new_cache(B, max(int(p.shape[0]) for p in prompts) + max_new_tokens)
        verify = lambda live, pasts, drafts: step.verify(backbone, cache, pasts, drafts, rows=live,  # noqa: E731
                                                         capture=drafter.capture_layers)
    drafter.use_step(step)
    drafter.use_cost(cost, None if step is None else B)
    states = [DecodeState(ids=p.tolist(), cache=cache.row(b), params=params, generator=generator,
                          min_length=max(min_length, len(p) + min_new_tokens), row=b) for b, p in enumerate(prompts)]
    outs = prefill_rows(backbone, cache, [p.to(dev) for p in prompts], capture=drafter.capture_layers)
    new: list[list[int]] = [[] for _ in range(B)]
    ended = [False] * B
    tails = [] if stop is None else [p[-stop.window:].tolist() for p in prompts]   # read once, not every step

    def emit(b: int, tokens: list[int]) -> None:
        """Row b's tokens out of a step: as many as it may still take (``_take``), to the caller."""
        # What a stop string's match may span: the row's last tokens, the prompt's included.
        before = () if stop is None else [*tails[b], *new[b][-stop.window:]]
        kept, ended[b] = _take(tokens, max_new_tokens - len(new[b]), eos_token_ids, stop, before=before)
        new[b].extend(kept)
        if on_tokens:
            on_tokens(b, kept)

    for b, (s, out) in enumerate(zip(states, outs)):
        last = target_logits(out.logits[-1:], params, s.ids, eos=eos_token_ids, eos_until=s.min_length - len(s.ids))[0]
        first = int(last.argmax()) if not params.do_sample else int(sample(probs_from_logits(last, params), generator))
        s.ids.append(first)
        emit(b, [first])
    drafter.begin(states, outs)
    if pace is not None:
        pace.start()
    stats.target_forwards = 1
    live = [b for b in range(B) if not ended[b]]

    while live:
        live = _shrink(cache, states, live) if step is None else live
        rows = [states[b] for b in live]
        drafting = pace is None or pace.draft_now()                                  # (or a plain step: no pay)
        drafts = Drafts.of(drafter.draft(rows) if drafting else [plain_draft(s, dev) for s in rows])   # DRAFT
        if cost is not None:                                                        # (the width worth verifying)
            drafts = Drafts.of(cost.fit(drafts, drafter.max_nodes, rows=None if step is None else B))
        outs = verify(live, [s.past_len for s in rows], drafts)                      # VERIFY
        accepted = accept_rows(drafts, outs, params, generator, rows, eos_token_ids)  # ACCEPT
        committed = commit_rows(cache, rows, accepted)                               # COMMIT
        drafter.commit(rows, accepted, outs)                                         # (the drafter's row state)
        if cost is not None:
            cost.observe(len(live) if step is None else B, max(drafts.sizes), accepted)
        if pace is not None:
            pace.observe(len(live), sum(map(len, committed)), drafting)
        stats.plain_steps += 0 if drafting else len(live)
        stats.target_forwards += 1
        for b, d, a, toks in zip(live, drafts, accepted, committed):
            stats.record(d.tree.depth if a.depth is None else a.depth, a.num_accepted, d.tree.size - 1)
            emit(b, toks)
        live = [b for b in live if not ended[b]]

    stats.wall_s = now(dev) - t0
    stats.new_tokens = sum(len(x) for x in new)
    if step is not None:
        step.storage.release(cache)   # its kept buffers are free for the next decode (``cache.StaticStorage``)
    return new, stats


def decode(backbone: Backbone, drafter: Drafter, prompt: torch.Tensor, *, params: SamplingParams, max_new_tokens: int,
           eos_token_ids: set[int], generator: torch.Generator | None,
           on_tokens: Callable[[list[int]], None] | None = None, cost: WidthFit | None = None,
           stop: StopStrings | None = None) -> tuple[list[int], DecodeStats]:
    """One prompt (n,): ``decode_rows`` with a batch of one. Returns (new tokens, stats)."""
    rows, stats = decode_rows(backbone, drafter, [prompt], params=params, max_new_tokens=max_new_tokens,
                              eos_token_ids=eos_token_ids, generator=generator, cost=cost, stop=stop,
                              on_tokens=None if on_tokens is None else (lambda _b, toks: on_tokens(toks)))
    return rows[0], stats


def _shrink(cache: KVCache, states: list[DecodeState], live: list[int]) -> list[int]:
    """Drop finished rows from the cache; each live row's state reads its (possibly new) cache row."""
    if cache.batch != len(live):
        cache.select([s.cache.index for s in (states[b] for b in live)])
        for i, b in enumerate(live):
            states[b].cache = cache.row(i)
    return live


def _take(tokens: list[int], room: int, eos: set[int], stop: StopStrings | None = None, *,
          before: Sequence[int] = ()) -> tuple[list[int], bool]:
    """At most ``room`` tokens, ending at the first EOS or the first that completes a stop string, read
    after ``before`` (the row's tokens so far, prompt included); either is kept, as transformers keeps it.
    Returns (those tokens, whether the row ends with them)."""
    tokens = tokens[:room]
    cut = next((i for i, t in enumerate(tokens) if t in eos), None)
    if stop is not None:
        at = stop.first(before, tokens if cut is None else tokens[: cut + 1])
        cut = at if at is not None else cut
    if cut is not None:
        return tokens[: cut + 1], True
    return tokens, len(tokens) == room
