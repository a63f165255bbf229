"""The back-off (``selfspec/runtime/backoff.py``): drafting turned off where it does not pay, never a change
of output. Plain steps between drafted ones keep every drafter exact (greedy) and lossless (sampling);
the back-off's own decisions follow the rates it is shown."""

from __future__ import annotations

import pytest
from conftest import chi2_check
from test_batch import ROWS, N, _batched_counts, _exact, _sampling_setup, every_drafter

from selfspec.core import decode as decode_mod
from selfspec.core.decode import decode_rows
from selfspec.core.sampling import SamplingParams
from selfspec.runtime.backoff import Backoff


class _Scripted:
    """A pace that drafts on a fixed, irregular pattern of steps (runs of plain steps of every length)."""

    PATTERN = (True, False, True, True, False, False, True, False, False, False, True, True, True)

    def __init__(self):
        self.step, self.plain = 0, 0

    def start(self):
        pass

    def draft_now(self):
        return self.PATTERN[self.step % len(self.PATTERN)]

    def observe(self, rows, tokens, drafted):
        self.step += 1
        self.plain += not drafted


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_plain_steps_between_drafted_ones_keep_every_drafter_exact(arch, one_thread):
    """Every drafter, in a batch of ragged prompts, with drafting turned off on an irregular pattern of steps:
    every row equals that prompt's greedy continuation alone (each drafter's state follows the plain steps)."""
    model, bb, prompts, ref, drafters = every_drafter(arch)
    for drafter in drafters:
        pace = _Scripted()
        new, stats = decode_rows(bb, drafter, prompts, params=SamplingParams(), max_new_tokens=len(ref[0]),
                                 eos_token_ids=set(), generator=None, pace=pace)
        assert new == ref, f"{arch} {drafter.name}: a plain step changed the output"
        assert pace.plain > 3 and stats.plain_steps > 3, "not vacuous: several steps were plain"
        if drafter.name != "none" and not getattr(drafter, "threshold", 0):   # (a thresholded tiny draft drafts nothing)
            assert stats.drafted > 0, f"{drafter.name}: not vacuous: the drafted steps drafted"


def test_sampling_with_plain_steps_between_drafted_ones_is_lossless(one_thread):
    """Sampled rows (EAGLE's beams plus copied chains) with drafting off on an irregular pattern of steps keep
    the target's distribution (chi-square over whole continuations)."""
    model, bb, params, prompts, drafter = _sampling_setup()
    counts = _counts_with(bb, drafter, prompts, params)
    for prompt, c in zip(prompts, counts):
        stat, threshold = chi2_check(c, _exact(model, prompt, params), N)
        assert stat < threshold, f"chi2={stat:.1f} >= {threshold:.1f}: prompt {prompt} lost the target distribution"


def test_sampling_check_catches_a_plain_step_that_does_not_sample(one_thread, monkeypatch):
    """Planted bug: the back-off's plain steps commit the target's most likely token instead of a draw from
    it (a plain step taken for a greedy one). The same check must fail."""
    from selfspec.core.accept import Accepted

    model, bb, params, prompts, drafter = _sampling_setup()
    real = decode_mod._sample_accept

    def greedy_when_plain(draft, logits, params, generator):
        if draft.tree.size > 1:
            return real(draft, logits, params, generator)
        top = int(logits[0].argmax())
        return Accepted(path=(0,), bonus=top, tokens=(top,))

    monkeypatch.setattr(decode_mod, "_sample_accept", greedy_when_plain)
    counts = _counts_with(bb, drafter, prompts, params)
    stats = [chi2_check(c, _exact(model, p, params), N) for p, c in zip(prompts, counts)]
    assert any(stat > threshold for stat, threshold in stats)


def _counts_with(bb, drafter, prompts, params):
    pace = _Scripted()
    counts = _batched_counts(bb, drafter, prompts, params, batches=2 * N // ROWS, pace=pace)
    assert pace.plain > 10, "not vacuous: plain steps came between drafted ones"
    return counts


def _feed(backoff: Backoff, steps: int, *, spec_rate: float, plain_rate: float) -> list[bool]:
    """Run ``steps`` steps of one row through ``backoff``: a drafted step commits ``spec_rate`` tokens a second,
    a plain one ``plain_rate``. Returns what each step did (True: drafted)."""
    done = []
    for _ in range(steps):
        drafted = backoff.draft_now()
        backoff.record(1, 1, 1.0 / (spec_rate if drafted else plain_rate), drafted)
        done.append(drafted)
    return done


def test_backoff_keeps_drafting_where_it_pays_and_turns_it_off_where_it_does_not():
    pays = _feed(Backoff(), 400, spec_rate=1.5, plain_rate=1.0)
    assert sum(pays) > 0.95 * len(pays), "speculation that pays stays on (plain steps only to re-measure)"
    assert not all(pays), "the rate to beat is measured now and then"
    loses = _feed(Backoff(), 400, spec_rate=0.8, plain_rate=1.0)
    assert sum(loses[200:]) < 0.1 * 200, "speculation that loses is mostly off once measured"
    assert any(loses[200:]), "... and probed again now and then"
    # Within a few percent of the plain rate either way: the loss a user sees is small.
    spent = sum(1 / 0.8 if d else 1.0 for d in loses)
    assert spent < 1.05 * len(loses)


def test_backoff_comes_back_when_drafting_starts_to_pay():
    b = Backoff()
    _feed(b, 300, spec_rate=0.7, plain_rate=1.0)
    later = _feed(b, 3 * Backoff.MAX_HOLD, spec_rate=2.0, plain_rate=1.0)
    assert sum(later[-Backoff.MAX_HOLD:]) > 0.9 * Backoff.MAX_HOLD


def test_a_hold_carries_over_to_the_next_generate_call():
    """Short generations must not each pay a probe: once drafting was found not to pay, the next decode
    (``start``) begins where the hold left off."""
    b = Backoff()
    first = _feed(b, 40, spec_rate=0.5, plain_rate=1.0)
    assert not first[-1], "drafting is off at the end of the first decode"
    b.start()
    assert _feed(b, 5, spec_rate=0.5, plain_rate=1.0) == [False] * 5


@pytest.mark.parametrize("spec_rate, longest", [(0.5, 2), (0.85, Backoff.WINDOW), (0.97, Backoff.WINDOW)])
def test_a_probe_that_loses_ends_within_a_window(spec_rate, longest):
    """Once drafting is off, each probe drafts 2 steps where it clearly loses (half the plain rate) and at most a
    window where it is close: what a drafter that never pays costs, a few percent at most."""
    done = _feed(Backoff(), 2000, spec_rate=spec_rate, plain_rate=1.0)
    runs, n = [], 0
    for drafted in done[200:]:
        if drafted:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    assert runs and max(runs) <= longest, runs
    assert sum(1 / spec_rate if d else 1.0 for d in done) < 1.05 * len(done)


def _feed_noisy(backoff: Backoff, steps: int, tokens: dict[int, float], cost: float, seed: int = 0) -> list[bool]:
    """As ``_feed``, but a drafted step commits a random number of tokens (``tokens``: count -> chance, as a
    sampled step's acceptance varies) and takes ``cost`` plain steps' time; a plain step takes 1 second."""
    import random

    rng, counts = random.Random(seed), list(tokens)
    done = []
    for _ in range(steps):
        drafted = backoff.draft_now()
        made = rng.choices(counts, weights=[tokens[c] for c in counts])[0] if drafted else 1
        backoff.record(1, made, cost if drafted else 1.0, drafted)
        done.append(drafted)
    return done


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_drafting_that_pays_on_average_survives_its_unlucky_steps(seed):
    """Sampled acceptance varies step to step: here a drafted step commits 1 to 4 tokens (2.05 on average, 1 in
    45% of steps) for 1.6 plain steps' time, 1.28x the plain rate. Runs of steps that accept nothing are
    common; judged on them alone, drafting would be off most of the time. It stays on."""
    done = _feed_noisy(Backoff(), 2000, {1: 0.45, 2: 0.2, 3: 0.2, 4: 0.15}, cost=1.6, seed=seed)
    assert sum(done[50:]) > 0.9 * len(done[50:])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisy_drafting_that_loses_is_turned_off(seed):
    """A drafted step commits 1 to 3 tokens (1.5 on average) for 1.8 plain steps' time: 0.83x the plain rate,
    whatever its lucky runs. Drafting ends up mostly off, and costs a few percent at most."""
    done = _feed_noisy(Backoff(), 2000, {1: 0.6, 2: 0.3, 3: 0.1}, cost=1.8, seed=seed)
    assert sum(done[300:]) < 0.1 * len(done[300:])
    made = 1.5 * sum(done) + (len(done) - sum(done))
    spent = 1.8 * sum(done) + (len(done) - sum(done))
    assert made / spent > 0.97


@pytest.mark.parametrize("seconds, halved", [(2.0, False), (1.5, True)])
def test_only_a_window_that_pays_outright_shortens_the_hold(seconds, halved):
    """A window of drafted steps committing 1 and 3 tokens in turn: at 2 s a step they make plain steps' rate
    (1 token a second), kept on only by the benefit of the doubt, so the hold after a later failed probe stays
    as long as it was; at 1.5 s they pay outright (1.33x), and the hold is halved."""
    b = Backoff()
    b.hold = 64
    tokens = iter([1, 3] * 20)
    while len(b.spec) < Backoff.WINDOW or b.since_judged:
        drafted = b.draft_now()
        b.record(1, next(tokens) if drafted else 1, seconds if drafted else 1.0, drafted)
        assert len(b.plan) <= Backoff.PLAIN_PROBE, "no window fails (drafting is never held off)"
    assert b.hold == (32 if halved else 64)


def test_the_simulation_script_reports_what_the_back_off_keeps():
    """scripts/backoff_sim.py (the table the back-off's rules were chosen by) runs and reports, per kind of step
    and noise, a share of the best rate for every drafter share: never above what always drafting or always
    plain steps would make, by more than the noise of a few seeds."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "backoff_sim.py"
    out = subprocess.run([sys.executable, str(script), "--seeds", "2", "--decodes", "3"], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    rows = [line.strip("|").split("|") for line in out[2:]]
    assert len(rows) == 4 and all(len(r) == 10 for r in rows), out
    cells = [float(c) for r in rows for c in r[2:]]
    assert all(0.8 < c < 1.03 for c in cells), out
