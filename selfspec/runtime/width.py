"""Width fitting: how many tree nodes per row one verification pass is worth.

A batched pass verifies every row's tree padded to the largest (``decode.verify_rows``), so one row
with a long lookup chain makes every row pay for that width. On a GPU a pass of a few tokens per
row costs about what one costs; on a CPU the cost climbs with the width, by how much depends on the
CPU (``scripts/forward_cost.py`` shows the curve), and in a batch whole trees can cost more than they
commit. Trees and thresholds are tuned once (``tune-tree``), on one machine; the cost curve is the
machine's own, measured where it runs.

So each greedy step picks the width w that maximises the batch's expected tokens per second
(a batch of one included): sum over rows of (1 + the w - 1 likeliest nodes' chances) / the pass's measured cost at
w, and cuts every row's tree to its w - 1 likeliest nodes (w = 1: a plain step). A node's chance
is its path probability under the draft (``Draft.path_p``), or for copied tokens the measured
prior of ``settings.COPY_ACCEPT_*``. Cutting a draft never changes which tokens greedy acceptance
commits, only how many come per step. Drafts whose drafter already ran part of the target on them
(early exit's ``Resume``) are left whole.

Sampling is cut too, and stays exact. Recursive rejection sampling (``verify.rejection_accept_tree``)
needs each drafted child to be a draw from its q given the siblings tried before it, so a cut may
end a node's list of drafted children early but never skip one and keep a later one, and what it
keeps must not depend on the tokens drawn at that node. Both hold: when sampling, a drafter that draws
scores a drawn node without its own token (early exit by the row's largest probability, the draft
model by depth priors), so siblings score in rank order and ties go to the lower rank (``trim``). A
token proposed without a draw (Medusa's and EAGLE's likeliest, a copied one) is a point mass: any cut
of those is exact, and keeping one after dropping a drawn sibling is too (its "draw" is certain).
Which nodes a cut keeps may depend on tokens drawn elsewhere in the tree (an ancestor's, a sibling's
subtree), which are fixed or independent of the acceptance at that node: the same as deciding how
many children to draw before drawing them. ``tests/test_batch.py`` checks the output distribution with every width cut.

Drafting itself is priced too, where it comes in stages. The EAGLE head drafts its tree level by
level, each level one head call: on a CPU a visible share of a one-token pass, on a GPU a small
share of a step whose pass costs the same for 1 or 64 nodes. So before each level the drafter
asks ``level_pays``: with the nodes drafted so far, the step's best rate is its best width's expected
tokens over (the pass's cost + the seconds drafted so far); the next level is expected to add the
current level's best nodes' chances times what a child kept of its parent's chance at the last
level, and costs what the last levels at this row count measured (the fastest of the last three, each
timed from one question to the next; the seconds drafted are counted from the step's first question). If
the rate with those nodes, after paying for the level, is not higher, drafting stops. Where a wide
pass is dear this stops most trees after a level or two; where verifying is flat and levels are cheap it lets a
confident tree grow to its depth. Like the cut, it never changes what acceptance commits, and when
sampling it reads only the scores a node has before its token is drawn (rank scores, below).

A drafter's chances are its head's confidence on the text it was trained on, and on other text it is
accepted less, the deeper the less; a copied token's prior is an average over text of every kind. So
the chances fitting weighs are scaled, per drafter and decoding mode, to what that drafter's verified
nodes were accepted with at each depth (``Calibration``, taught by every step's acceptance through
``Calibrated.observe``): verified nodes that are seldom accepted stop being paid for.

The costs come from timing the pass itself on this machine (``VerifyCost``): a prior at widths 1, 2
and the widest, once per process and model at the batch sizes met (under a second for the demo
model; the bench does it before timing anything), then what decoding's own steps measure. A width is measured only when chosen, so every ``EXPLORE_EVERY``-th
step at a row count verifies one width wider or narrower than the best (alternately): an estimate
spoiled by a load spike is measured again, and the choice can climb to a wider optimum that the prior
hid.
"""

from __future__ import annotations

import math
import statistics
import weakref
from collections import deque
from typing import TYPE_CHECKING

import torch

from ..core.backbone import Backbone
from ..core.cache import KVCache
from ..core.decode import prefill_rows, verify_rows
from ..core.tree import tree_from_parents
from ..core.types import Draft, HostDraft, read_host
from ..drafters.base import prior_chance
from ..core.clock import now
from .static import BUCKETS, bucket

if TYPE_CHECKING:
    from ..core.accept import Accepted
    from .step import StaticStep


def path_p(draft: Draft) -> list[float]:
    """(n,) the draft's estimate of each node's chance of being accepted (root 1), on the host
    (``Draft.host``; without the draft's own, the copied-token prior by depth)."""
    h = draft.host
    if h.path_p is not None:
        return h.path_p
    return [prior_chance(d) for d in h.depths]


def _floats(c) -> list[float]:
    return c.tolist() if isinstance(c, torch.Tensor) else list(c)


def _rates(chances: list, cost: list[float], extra: float = 0.0) -> list[float]:
    """rate[w - 1] = sum_b (1 + the w - 1 largest of chances[b]) / (cost[w - 1] + extra), for w = 1 .. the
    widest the chances fill (at most len(cost)). Host arithmetic on a few dozen numbers."""
    chances = [sorted(_floats(c), reverse=True) for c in chances]
    widest = min(max((len(c) for c in chances), default=0) + 1, len(cost))
    gain = [float(len(chances))] * widest   # gain[w - 1]: expected tokens of the batch at width w
    for c in chances:
        total = 0.0
        for w in range(1, widest):
            total += c[w - 1] if w - 1 < len(c) else 0.0
            gain[w] += total
    return [g / (x + extra) for g, x in zip(gain, cost[:widest])]


def best_width(chances: list, cost: list[float]) -> int:
    """The width w (1 .. len(cost)) maximising sum_b (1 + the w - 1 largest of chances[b]) / cost[w - 1].

    chances[b]: row b's node chances, root excluded; cost[w - 1]: seconds of a pass at width w.
    A pure function; ties go to the narrower width."""
    rates = _rates(chances, cost)
    return rates.index(max(rates)) + 1   # the first maximum: the narrowest


def level_pays(chances: list, children: list, cost: list[float], *, spent: float, level: float) -> bool:
    """Whether drafting one more tree level is expected to raise the step's tokens per second.

    chances[b]: row b's drafted nodes' chances so far (root excluded); children[b]: the chances expected
    of the nodes the next level would add; cost[w - 1]: seconds of the step's pass at width w; spent:
    seconds drafted so far this step; level: seconds one more level costs. The step's rate is its
    best width's expected tokens over (pass + drafting); the level pays where that rate with the
    children, after paying for the level, beats the rate without them. A pure function."""
    now = max(_rates(chances, cost, spent))
    after = max(_rates([_floats(c) + _floats(n) for c, n in zip(chances, children)], cost, spent + level))
    return after > now


def trim(draft: Draft, width: int, p: list[float] | None = None) -> Draft:
    """``draft`` cut to the root and its ``width - 1`` likeliest nodes (ties: shallower, then lower rank,
    then earlier node first), decided on the host from ``Draft.host`` (nothing more is read).

    A node's chance never exceeds its parent's, and ties go to the shallower, so the kept set is a
    tree; among siblings of equal chance the lower rank (drawn first, when sampling) stays.
    p: ``path_p(draft)`` when the caller has it already."""
    n = draft.tree.size
    if n <= width or draft.resume is not None:
        return draft
    h = draft.host
    p = path_p(draft) if p is None else p
    order = sorted(range(1, n), key=lambda i: (-p[i], h.depths[i], h.ranks[i], i))[: width - 1]
    keep = [0] + sorted(order)
    new_id = {old: new for new, old in enumerate(keep)}
    if any(h.parents[i] not in new_id for i in keep[1:]):
        raise AssertionError("a kept node's parent was cut: a subtree must be closed under parents")
    parents, ranks = [-1] + [new_id[h.parents[i]] for i in keep[1:]], [h.ranks[i] for i in keep]
    dev = draft.tree.parents.device
    tree = tree_from_parents(torch.tensor(parents, device=dev), torch.tensor(ranks, device=dev),
                             max_depth=max(h.depths[i] for i in keep))
    at = torch.tensor(keep, dtype=torch.long, device=draft.tokens.device)
    cut = Draft(tree=tree, tokens=draft.tokens[at], q=draft.q,
                q_index=None if draft.q is None else draft.q_rows()[at.to(draft.q.device)],
                path_p=None if draft.path_p is None else draft.path_p[at.to(draft.path_p.device)])
    cut.__dict__["host"] = HostDraft(tokens=[h.tokens[i] for i in keep], parents=parents,
                                     depths=[h.depths[i] for i in keep], ranks=ranks,
                                     path_p=None if h.path_p is None else [h.path_p[i] for i in keep])
    return cut


def fit_width(drafts: list[Draft], cost: "VerifyCost", widest: int, rows: int | None = None,
              calibration: "Calibration | None" = None) -> list[Draft]:
    """Every row's draft cut to the width ``cost`` picks for the batch (``VerifyCost.width``); ``rows``:
    how many rows the pass runs (default: one per draft; a static step also runs its idle rows). Every
    row's draft is read from the device in one transfer (``read_host``). With ``calibration``, the
    chances are the drafter's own scaled to what its verified nodes were accepted with (``Calibration``)."""
    read_host(drafts)
    chances = [path_p(d) for d in drafts]
    if calibration is not None:
        chances = [calibration.scaled(c, d.host.depths) for c, d in zip(chances, drafts)]
    w = cost.width([c[1:] for c in chances], widest, rows)
    return [trim(d, w, c) for d, c in zip(drafts, chances)]


class VerifyCost:
    """Seconds of one batched step (verify, accept, commit) on this machine, by rows and width (nodes per row).

    A prior, timed on first need at power-of-two row counts (interpolated between them) and at
    widths 1, 2 and the drafter's widest tree (interpolated between: most steps choose among the
    narrow widths, and a real step's cost replaces a guess), on a scratch cache of ``context``
    positions per row (the median of ``sweeps`` interleaved sweeps); then what
    decoding's own steps measure (``observe``; the fastest of a shape's last few steps) replaces it
    where seen, and rescales it where not (a
    real context is longer than the scratch one, and a step does more than its pass). No width is
    priced above what a wider one was seen to cost (a load spike at one width must not price every
    width above it out), and a curve that dips (a CPU BLAS can run 6 rows faster than 3) is flattened:
    a wider pass is never assumed cheaper.

    With ``step`` (a ``StaticStep``, ``compile=True``) a pass costs what its bucket costs (``step.bucket``:
    a tree of 2 nodes runs padded to 4), so the prior times each bucket once through the step itself
    (its compiled graphs: the rows, capacity and ``capture`` decoding uses), never at other row counts,
    and widths are explored bucket by bucket."""

    RECENT = 3          # a (rows, width)'s estimate: the fastest of its last RECENT steps (load only adds time)
    EXPLORE_EVERY = 16  # every so many steps at a row count, a neighbour of the best width is verified

    def __init__(self, backbone: Backbone, *, context: int = 32, sweeps: int = 3, widths: tuple[int, ...] = (1, 2),
                 step: "StaticStep | None" = None, capture: tuple[int, ...] = ()):
        self.backbone = backbone
        self.step = step                                     # a static step: costs by bucket, timed through it
        self.capture = tuple(capture)                        # what the step's passes capture (part of its graph)
        self.context = context
        self.sweeps = sweeps
        self.widths = widths                                 # timed for the prior, with the widest
        self._timed: dict[int, dict[int, float]] = {}       # rows -> {width: seconds}, the prior
        self._seen: dict[tuple[int, int], deque] = {}        # (rows, width) -> seconds of its last steps
        self._met: set[tuple[int, int]] = set()              # (rows, width) pairs whose first step was seen
        self._steps: dict[int, int] = {}                     # rows -> widths chosen so far
        self.began = 0.0                                     # when the step being verified began (``fit``)
        self._levels: dict[int, deque] = {}                  # rows a draft level ran -> seconds of its last ones
        self._level: tuple[float, int] | None = None         # the level running: since when, at how many rows
        self._drafting = 0.0                                 # when this step's first level decision came

    def level_pays(self, chances: list, children: list, *, rows: int, widest: int,
                   running: int, depths: list[int] | None = None) -> bool:
        """``level_pays`` priced by this machine's pass at ``rows`` rows (widths up to ``widest``), for a level
        that would run ``running`` rows of the drafter's. The levels are timed here: from one call to the
        next within a step (the first call of a step, after the last ``fit``, starts the step's clock), the
        fastest of the last RECENT at that many rows; a level count not yet timed pays, and is timed. (The
        chances' ``depths`` are a ``Calibrated`` fitting's concern; the prices take the chances as given.)"""
        t = now(self.backbone.device)
        if self._level is None:
            self._drafting = t
        else:
            self._levels.setdefault(self._level[1], deque(maxlen=self.RECENT)).append(t - self._level[0])
        seen = self._levels.get(running)
        pays = not seen or level_pays(chances, children, self.table(rows, widest), spent=t - self._drafting,
                                      level=min(seen))
        self._level = (now(self.backbone.device), running) if pays else None
        return pays

    def fit(self, drafts: list[Draft], widest: int, rows: int | None = None,
            calibration: "Calibration | None" = None) -> list[Draft]:
        """Every row's draft cut to the width this step's pass is worth (``fit_width``); the clock of the
        step's verification (read at ``observe``) starts here."""
        if any(d.tree.size > 1 for d in drafts):   # (a plain step has nothing to cut)
            drafts = fit_width(drafts, self, widest, rows, calibration)
        self.began, self._level = now(self.backbone.device), None   # (drafting is over: no level runs on)
        return drafts

    @property
    def observed(self) -> dict[tuple[int, int], float]:
        """(rows, width) -> the estimate of a real step's seconds, for every pair seen."""
        return {k: min(v) for k, v in self._seen.items()}

    def width(self, chances: list[list[float]], widest: int, rows: int | None = None) -> int:
        """The width to verify this step for rows with these node ``chances`` (root excluded), in a pass
        of ``rows`` rows (default: one per row of chances): ``best_width`` on this table, except every
        ``EXPLORE_EVERY``-th step at a row count, which takes a neighbour of it (wider, then narrower
        next time; a neighbouring bucket with a static step) so that it is measured again."""
        rows = len(chances) if rows is None else rows
        w = best_width(chances, self.table(rows, widest))
        n = self._steps[rows] = self._steps.get(rows, 0) + 1
        if n % self.EXPLORE_EVERY == 0:
            top = min(widest, 1 + max((len(c) for c in chances), default=0))
            choices = sorted({min(self._shape(x), top) for x in range(1, top + 1)})   # widths of distinct cost
            i = next((j for j, c in enumerate(choices) if c >= w), len(choices) - 1)
            w = choices[min(max(i + (1 if (n // self.EXPLORE_EVERY) % 2 else -1), 0), len(choices) - 1)]
        return w

    def _shape(self, width: int) -> int:
        """The width a pass of ``width`` nodes per row actually runs at (its bucket with a static step)."""
        if self.step is None:
            return width
        return bucket(width)

    def observe(self, rows: int, width: int, accepted: "list[Accepted] | None" = None) -> None:
        """The step fitted last (``fit``) verified ``rows`` rows at ``width`` and is done: ``record`` its time
        (what it accepted is a ``Calibrated`` fitting's concern, not the prices')."""
        self.record(rows, width, now(self.backbone.device) - self.began)

    def record(self, rows: int, width: int, seconds: float) -> None:
        """A decoding step of ``rows`` rows at ``width`` took ``seconds``. The first step at a shape is
        not counted: it pays one-off costs (product layouts timed for a new row count, allocations,
        a compilation), and a width that looked that slow would never be chosen, so never measured again."""
        width = self._shape(width)
        if (rows, width) not in self._met:
            self._met.add((rows, width))
            return
        self._seen.setdefault((rows, width), deque(maxlen=self.RECENT)).append(seconds)

    def table(self, rows: int, width: int) -> list[float]:
        """cost[w - 1] for w = 1 .. width at ``rows`` rows."""
        if self.step is not None:    # the static step's rows are fixed: timed at exactly these
            prior = self._curve(rows, width)
        else:
            lo = 1 << (rows.bit_length() - 1)
            hi = lo if lo == rows else lo * 2
            a, b = self._curve(lo, width), self._curve(hi, width)
            f = 0.0 if hi == lo else (rows - lo) / (hi - lo)
            prior = [x + f * (y - x) for x, y in zip(a, b)]
        seen = {w: min(self._seen[rows, self._shape(w)]) for w in range(1, width + 1)
                if (rows, self._shape(w)) in self._seen}
        scale = statistics.median(seen[w] / prior[w - 1] for w in seen) if seen else 1.0
        return _flattened(_capped([seen.get(w, scale * prior[w - 1]) for w in range(1, width + 1)], seen))

    def _curve(self, rows: int, width: int) -> list[float]:
        timed = self._timed.get(rows, {})
        if max(timed, default=0) < self._shape(width):
            timed = self._timed[rows] = self._time(rows, width)
        if self.step is not None:
            return _flattened([timed[self._shape(w)] for w in range(1, width + 1)])
        ws = sorted(timed)
        out = []
        for w in range(1, width + 1):
            j = next(i for i, x in enumerate(ws) if x >= w)
            if ws[j] == w:
                out.append(timed[w])
            else:
                w0, w1 = ws[j - 1], ws[j]
                out.append(timed[w0] + (w - w0) / (w1 - w0) * (timed[w1] - timed[w0]))
        return _flattened(out)

    @torch.inference_mode()   # timed as decode_rows runs its passes
    def _time(self, rows: int, width: int) -> dict[int, float]:
        bb, dev = self.backbone, self.backbone.device
        if self.step is not None:
            return self._time_step(rows, width)
        widths = sorted({w for w in self.widths if w < width} | {width})
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, bb.vocab_size, (self.context,), generator=gen).to(dev) for _ in range(rows)]
        cache = KVCache(rows)
        prefill_rows(bb, cache, prompts)
        pasts = [self.context] * rows
        empty = [torch.zeros(0, dtype=torch.long)] * rows
        drafts = {}
        for w in widths:
            parents = torch.arange(-1, w - 1, device=dev)   # a chain: the mask's shape is what matters
            tree = tree_from_parents(parents, torch.zeros(w, dtype=torch.long, device=dev), max_depth=w - 1)
            drafts[w] = [Draft(tree=tree, tokens=torch.randint(1, bb.vocab_size, (w,), generator=gen).to(dev))] * rows
        seconds: dict[int, list[float]] = {w: [] for w in widths}
        for _ in range(self.sweeps):
            for w in widths:
                t = now(dev)
                verify_rows(bb, cache, pasts, drafts[w])
                seconds[w].append(now(dev) - t)
                cache.keep(pasts, empty)
        return {w: statistics.median(s) for w, s in seconds.items()}


    def _time_step(self, rows: int, width: int) -> dict[int, float]:
        """Each bucket up to ``width``'s, through the static step (run once untimed first: a bucket not yet
        compiled compiles then). Not kept between processes: a compiled pass's speed is the compiler's."""
        bb, dev, step = self.backbone, self.backbone.device, self.step
        shapes = [b for b in BUCKETS if b < self._shape(width)] + [self._shape(width)]
        gen = torch.Generator().manual_seed(0)
        cache = step.new_cache(rows, self.context + 1)
        prefill_rows(bb, cache, [torch.randint(1, bb.vocab_size, (self.context,), generator=gen).to(dev)
                                 for _ in range(rows)])
        pasts, every = [self.context] * rows, list(range(rows))
        empty = [torch.zeros(0, dtype=torch.long)] * rows
        drafts = {}
        for w in shapes:
            parents = torch.arange(-1, w - 1, device=dev)
            tree = tree_from_parents(parents, torch.zeros(w, dtype=torch.long, device=dev), max_depth=w - 1)
            drafts[w] = [Draft(tree=tree, tokens=torch.randint(1, bb.vocab_size, (w,), generator=gen).to(dev))] * rows
        seconds: dict[int, list[float]] = {w: [] for w in shapes}
        for sweep in range(self.sweeps + 1):
            for w in shapes:
                t = now(dev)
                step.verify(bb, cache, pasts, drafts[w], rows=every, capture=self.capture)
                if sweep:
                    seconds[w].append(now(dev) - t)
                cache.keep(pasts, empty)
        step.storage.release(cache)
        return {w: statistics.median(s) for w, s in seconds.items()}


class Calibration:
    """How a drafter's own chances (``path_p``) compare with what its verified nodes were accepted with,
    by depth, learned from the steps where it runs; ``scaled`` turns its chances into the accepted ones.

    A draft's path probabilities are its head's confidence on the prompts it was trained on; on other
    prompts it is accepted less, the deeper the less (and a copied token's prior is an average over
    text of every kind), so fitting on the raw chances verifies nodes that do not pay for their share of
    the pass. Per depth d, the chances of every verified node at d are summed against how many of those
    steps accepted a path reaching d (at most one node per depth is accepted, so the two sums estimate
    the same thing), both decayed by ``DECAY`` a step so that a new kind of prompt is learnt within a few
    hundred steps, and ``PRIOR`` nodes' worth of chance accepted at face value start them: the factor is
    1 until steps say otherwise. Factors never grow with depth and scaled chances stay at most 1, so a
    node never outscores its parent and a cut stays a tree. Scaling changes which nodes are verified,
    from what earlier steps accepted, never what a step accepts: greedy output is unchanged and sampling
    exact (a tree decided before its tokens are drawn). Kept per drafter and decoding mode (``Calibrated``)."""

    PRIOR = 4.0      # nodes' worth of chance, accepted at face value, that every depth's estimate starts from
    DECAY = 0.995    # what a recorded step keeps of the weight of the steps before it

    def __init__(self) -> None:
        self.chance: list[float] = []     # [d - 1]: decayed sum of the chances of verified nodes at depth d
        self.reached: list[float] = []    # [d - 1]: decayed count of rows whose accepted path reached depth d

    def factors(self, depth: int) -> list[float]:
        """f[d] for d = 0 .. depth: what a chance at depth d is worth (f[0] = 1, the root; non-increasing from d = 1,
        above 1 where a drafter is accepted more often than it claims)."""
        out, f = [1.0], math.inf
        for d in range(1, depth + 1):
            c, r = (self.chance[d - 1], self.reached[d - 1]) if d <= len(self.chance) else (0.0, 0.0)
            f = min(f, (r + self.PRIOR) / (c + self.PRIOR))
            out.append(f)
        return out

    def scaled(self, chances: list[float], depths: list[int]) -> list[float]:
        """A draft's node chances (root first) at their ``depths``, as accepted: chance x f[depth], at most 1."""
        f = self.factors(max(depths, default=0))
        return [min(1.0, p * f[d]) for p, d in zip(chances, depths)]

    def record(self, drafts: list[Draft], accepted: list) -> None:
        """A step verified ``drafts`` (as fitted: their host copies read) and accepted ``accepted``."""
        drafted = [(d, a) for d, a in zip(drafts, accepted) if d.tree.size > 1]
        if not drafted:
            return
        self.chance = [x * self.DECAY for x in self.chance]
        self.reached = [x * self.DECAY for x in self.reached]
        for d, a in drafted:
            depths = d.host.depths
            deepest = max(depths)
            while len(self.chance) < deepest:
                self.chance.append(0.0)
                self.reached.append(0.0)
            for p, depth in zip(path_p(d)[1:], depths[1:]):
                self.chance[depth - 1] += p
            for depth in range(1, min(a.num_accepted, deepest) + 1):
                self.reached[depth - 1] += 1.0


class Calibrated:
    """Width fitting for one drafter and decoding mode: the shared prices (``VerifyCost``) with that
    drafter's ``Calibration``, which each step's acceptance teaches (the seam ``decode_rows`` is given)."""

    def __init__(self, cost: VerifyCost, calibration: Calibration):
        self.cost, self.calibration = cost, calibration
        self._fitted: list[Draft] = []

    def fit(self, drafts: list[Draft], widest: int, rows: int | None = None) -> list[Draft]:
        self._fitted = self.cost.fit(drafts, widest, rows, calibration=self.calibration)
        return self._fitted

    def observe(self, rows: int, width: int, accepted: list) -> None:
        self.cost.observe(rows, width)
        self.calibration.record(self._fitted, accepted)

    def level_pays(self, chances: list, children: list, *, rows: int, widest: int, running: int,
                   depths: list[int] | None = None) -> bool:
        """``VerifyCost.level_pays`` on calibrated chances, where the drafter gives their ``depths``."""
        if depths is not None:
            below = max(depths, default=0) + 1
            chances = [self.calibration.scaled(c, depths) for c in chances]
            children = [self.calibration.scaled(c, [below] * len(c)) for c in children]
        return self.cost.level_pays(chances, children, rows=rows, widest=widest, running=running)


def _capped(costs: list[float], seen: dict[int, float]) -> list[float]:
    """costs[w - 1] capped by what any wider width was seen to cost: timings err high (load only adds
    time), so where a wider pass measured cheaper, the narrower width's estimate is the spoiled one.
    Without it, the running maximum (``_flattened``) would carry one slow step at a narrow width to
    every wider width, which then looks too dear to be chosen and measured again."""
    out, low = [], math.inf
    for w in range(len(costs), 0, -1):
        out.append(min(costs[w - 1], low))
        if w in seen:
            low = min(low, seen[w])
    return out[::-1]


def _flattened(costs: list[float]) -> list[float]:
    """Running maximum: a wider pass is never assumed cheaper than a narrower one."""
    out, high = [], 0.0
    for c in costs:
        high = max(high, c)
        out.append(high)
    return out


_COSTS: "weakref.WeakKeyDictionary[torch.nn.Module, VerifyCost]" = weakref.WeakKeyDictionary()


def verify_cost(backbone: Backbone) -> VerifyCost:
    """The process's ``VerifyCost`` for this target (shared by every model object built on it)."""
    cost = _COSTS.get(backbone.model)
    if cost is None:
        cost = _COSTS[backbone.model] = VerifyCost(backbone)
    return cost
