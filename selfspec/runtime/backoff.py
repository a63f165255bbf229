"""Back-off: drafting only where it pays on the machine that runs it.

A drafter pays when the tokens a speculative step commits per second beat what plain steps make
there. That depends on the machine (a CPU where a wide pass is dear, a GPU where it is free), the
drafter (a draft model or early exit spends most of a plain step drafting) and the text. So the
loop asks ``Backoff.draft_now`` before each step and reports each step's committed tokens after it
(``observe``); the back-off times the step between the two itself and compares the two rates as it goes:

* it measures plain steps now and then (``PLAIN_PROBE`` of them every ``RECHECK`` steps, and first
  after ``WINDOW`` speculative ones), so that it knows the rate to beat on this machine at this
  context length;
* after each ``WINDOW`` speculative steps it compares their rate (their tokens over their seconds: a
  drafter whose gains come in bursts, as a lookup's do, is judged by what the bursts add up to, not by
  its typical step) with the plain one; where speculation does not beat it by ``MARGIN``, it turns
  drafting off for ``hold`` steps, then probes again; each failed probe doubles ``hold`` (up to
  ``MAX_HOLD``), a probe that pays resets it. A hold carries over to the next ``generate`` call.
* a window that clearly loses ends early (``EARLY``: after 2 steps below 0.75 of the plain rate, or 4
  below 0.9), so a drafter that never pays on this machine (a draft model or early exit where their
  layers are dear) spends a probe's 2 steps, not 8, each time it is tried again.

A plain step is what ``NoDrafter`` does (the pending token alone), and the drafter still commits it
(its state follows every committed token), so the back-off only changes what is drafted: greedy
output stays token-identical, and sampling stays exactly the target's distribution.
"""

from __future__ import annotations

from collections import deque

import torch

from ..core.clock import now


class Backoff:
    WINDOW = 8          # speculative steps judged together (their tokens over their seconds)
    PLAIN_PROBE = 2     # plain steps that measure the rate to beat
    RECHECK = 64        # while speculation pays, the plain rate is measured again this often
    MARGIN = 0.03       # speculation must beat plain steps by this share to stay on
    FIRST_HOLD, MAX_HOLD = 16, 512   # steps drafting stays off after a failed probe (doubling)
    EARLY = {2: 0.75, 4: 0.9}        # a window of n steps below this share of the plain rate fails at once

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.began = 0.0                  # when the step being run began (``draft_now``)
        self.plain: deque = deque(maxlen=2 * self.PLAIN_PROBE)   # (tokens a row, seconds) of recent plain steps
        self.spec: deque = deque(maxlen=self.WINDOW)              # ... of the speculative steps being judged
        self.hold = self.FIRST_HOLD
        self.plan: deque = deque()        # the coming steps' modes (True: draft), when one is set
        self.since_plain = 0              # speculative steps since the plain rate was last measured
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
        self.since_plain += 1
        if self.plan:
            return
        if not self.plain or self.since_plain >= self.RECHECK:   # measure the rate to beat
            self.plan.extend([False] * self.PLAIN_PROBE)
            self.since_plain = 0
            return
        n, share = len(self.spec), _rate(self.spec) / max(_rate(self.plain), 1e-9)
        if n < self.WINDOW and share >= self.EARLY.get(n, 0.0):
            return
        if share < (1 + self.MARGIN):
            self.plan.extend([False] * self.hold)                 # off for a while, then probe again
            self.hold = min(2 * self.hold, self.MAX_HOLD)
        else:
            self.hold = self.FIRST_HOLD
        self.spec.clear()

    def start(self) -> None:
        """A new decode: what was learned stays (the machine and drafter have not changed), and so does a hold
        in progress (short generations would otherwise each pay a probe); its first step is not counted."""
        self.skip_first = True
        self.spec.clear()


def _rate(steps) -> float:
    """Tokens a second a row over ``steps`` ((tokens a row, seconds) each)."""
    return sum(t for t, _ in steps) / max(sum(s for _, s in steps), 1e-9)
