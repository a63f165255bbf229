"""Back-off: drafting only where it pays on the machine that runs it.

A drafter pays when the tokens a speculative step commits per second beat what plain steps make
there. That depends on the machine (a CPU where a wide pass is dear, a GPU where it is free), the
drafter (a draft model or early exit spends most of a plain step drafting) and the text. So the
loop asks ``Backoff.draft_now`` before each step and reports each step's committed tokens after it
(``observe``); the back-off times the step between the two itself and compares the two rates as it goes:

* it measures plain steps now and then (``PLAIN_PROBE`` of them after the first speculative step it
  counts, then every ``RECHECK``), so that it knows the rate to beat on this machine at this context
  length;
* after 2 and 4 speculative steps, then every ``WINDOW``, it compares their rate (tokens over seconds, over
  up to the last ``MEMORY`` of them: a drafter whose gains come in bursts, as a lookup's do, is judged by
  what the bursts add up to, not by its typical step) with the plain one. The tokens a step commits vary
  (sampling most of all: two steps in a row that accept nothing are common even where drafting pays), so
  it judges the rate the steps would have made with ``Z`` standard errors more tokens (their spread
  pooled over every speculative step it has seen, from a prior of ``SPREAD`` tokens): where even that
  does not beat plain steps by ``MARGIN`` (after 2 or 4 steps: reach ``EARLY`` of them, a clear loss),
  it turns drafting off for ``hold`` steps, then probes again; each failed probe doubles ``hold`` (up
  to ``MAX_HOLD``), each window that pays (by ``MARGIN``, without the benefit of the doubt) halves it
  back. A hold carries over to the next ``generate`` call.
  So a drafter that never pays on this machine (a draft model or early exit where their layers are
  dear) spends a short probe each time it is tried again, and one that pays on average keeps drafting
  through its unlucky steps.

A plain step is what ``NoDrafter`` does (the pending token alone), and the drafter still commits it
(its state follows every committed token), so the back-off only changes what is drafted: greedy
output stays token-identical, and sampling stays exactly the target's distribution.
"""

from __future__ import annotations

from collections import deque

import torch

from ..core.clock import now


class Backoff:
    WINDOW = 8          # speculative steps between judgements (after the first 2 and 4) ...
    MEMORY = 32         # ... of up to this many of the latest (their tokens over their seconds)
    PLAIN_PROBE = 2     # plain steps that measure the rate to beat
    RECHECK = 64        # while speculation pays, the plain rate is measured again this often
    MARGIN = 0.03       # speculation must beat plain steps by this share to stay on
    FIRST_HOLD, MAX_HOLD = 16, 512   # steps drafting stays off after a failed probe (doubling)
    EARLY = {2: 0.75, 4: 0.9}        # after this many steps, a probe below this share of the plain rate fails
    Z = 1.0             # the benefit of the doubt: standard errors of the steps' tokens added before judging
    SPREAD = 1.0        # the spread (standard deviation) of a step's tokens assumed before any is seen

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.began = 0.0                  # when the step being run began (``draft_now``)
        self.plain: deque = deque(maxlen=2 * self.PLAIN_PROBE)   # (tokens a row, seconds) of recent plain steps
        self.spec: deque = deque(maxlen=self.MEMORY)              # ... of the speculative steps being judged
        self.seen = (0, 0.0, 0.0)         # every speculative step's tokens: count, mean, sum of squared deviations
        self.hold = self.FIRST_HOLD
        self.plan: deque = deque()        # the coming steps' modes (True: draft), when one is set
        self.since_plain = 0              # speculative steps since the plain rate was last measured
        self.since_judged = 0             # speculative steps since the last judgement
        self.skip_first = True            # a decode's first step pays one-off costs: not counted

    def draft_now(self) -> bool:
        """Whether the coming step drafts; the step's clock starts here."""
        self.began = now(self.device)
        return self.plan[0] if self.plan else True

    def observe(self, rows: int, tokens: int, drafted: bool) -> None:
        """The step begun at ``draft_now`` committed ``tokens`` tokens over ``rows`` rows (drafted or plain)."""
        self.record(rows, tokens, now(self.device) - self.began, drafted)

    def record(self, rows: int, tokens: int, seconds: float, drafted: bool) -> None:
        """A step of ``rows`` rows committed ``tokens`` tokens in ``seconds``."""
        if self.plan:
            self.plan.popleft()
        if self.skip_first:
            self.skip_first = False
            return
        if not drafted:
            self.plain.append((1.0, seconds))
            return
        self.spec.append((tokens / rows, seconds))
        self._count(tokens / rows)
        self.since_plain += 1
        self.since_judged += 1
        if self.plan:
            return
        if not self.plain or self.since_plain >= self.RECHECK:   # measure the rate to beat
            self.plan.extend([False] * self.PLAIN_PROBE)
            self.since_plain = 0
            return
        n = len(self.spec)
        early = self.EARLY.get(n)   # (only a probe's, or a decode's, first steps: ``spec`` is cleared then)
        if early is None and self.since_judged < self.WINDOW:
            return
        if early is None:
            self.since_judged = 0
        tokens = sum(t for t, _ in self.spec)
        per_plain = max(sum(s for _, s in self.spec), 1e-9) * max(_rate(self.plain), 1e-9)   # tokens plain steps make
        share = (tokens + self.Z * self.spread() * n ** 0.5) / per_plain   # with the benefit of the doubt
        if share < (early if early is not None else 1 + self.MARGIN):
            self.plan.extend([False] * self.hold)                 # off for a while, then probe again
            self.hold = min(2 * self.hold, self.MAX_HOLD)
            self.spec.clear()
            self.since_judged = 0
        elif early is None and tokens / per_plain >= 1 + self.MARGIN:
            # Paid without the benefit of the doubt: the next failed probe's hold is halved back. A window kept
            # on by the doubt alone leaves the hold as it is, so a drafter that only ever passes that way (it
            # loses, but its steps vary) is probed ever more rarely.
            self.hold = max(self.FIRST_HOLD, self.hold // 2)

    def _count(self, tokens: float) -> None:
        """Pool one speculative step's tokens into ``seen`` (Welford's running mean and squared deviations)."""
        n, mean, m2 = self.seen
        n += 1
        delta = tokens - mean
        mean += delta / n
        self.seen = (n, mean, m2 + delta * (tokens - mean))

    def spread(self) -> float:
        """The standard deviation of a speculative step's tokens: every step seen, with one step's worth of
        the prior ``SPREAD`` (so a handful of equal steps does not read as certainty)."""
        n, _, m2 = self.seen
        return ((m2 + self.SPREAD ** 2) / max(n, 1)) ** 0.5

    def start(self) -> None:
        """A new decode: what was learned stays (the machine and drafter have not changed), and so does a hold
        in progress (short generations would otherwise each pay a probe); its first step is not counted."""
        self.skip_first = True
        self.spec.clear()
        self.since_judged = 0


def _rate(steps) -> float:
    """Tokens a second a row over ``steps`` ((tokens a row, seconds) each)."""
    return sum(t for t, _ in steps) / max(sum(s for _, s in steps), 1e-9)
