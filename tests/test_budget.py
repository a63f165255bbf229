"""Width fitting (budget.py): each greedy step cuts every row's tree to the width the (batched) pass
is worth. Pure choices on hand-built numbers, the cut trees, the cost table, and the
master property: whatever width is chosen, every row is still exactly its prompt decoded alone."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from test_batch import GREEDY, N_NEW, RowOracle, _alone, _prompts, every_drafter

from selfspec.core.backbone import Backbone
from selfspec.core.decode import decode_rows
from selfspec.core.sampling import SamplingParams
from selfspec.core.tree import build_tree, chain
from selfspec.core.types import DecodeState, Draft, Resume, read_host
from selfspec.drafters import LookupDrafter
from selfspec.drafters.base import layout_path_p, prior_chance
from selfspec.drafters.lookup import with_lookup
from selfspec.model import SelfSpeculativeModel
from selfspec.core.accept import Accepted
from selfspec.runtime.width import (Calibrated, Calibration, VerifyCost, best_width, level_pays, path_p, trim,
                                     verify_cost)
from selfspec.settings import COPY_ACCEPT_BY_MATCH, COPY_ACCEPT_FIRST, COPY_ACCEPT_NEXT


def test_best_width_weighs_expected_tokens_against_cost():
    rows = [torch.tensor([0.9, 0.8, 0.1]), torch.tensor([]), torch.tensor([0.5])]
    # Expected tokens by width: 3, 3 + 0.9 + 0.5 = 4.4, 4.4 + 0.8 = 5.2, 5.3.
    assert best_width(rows, [1.0, 1.1, 1.2, 1.3]) == 3       # 4.4/1.1 = 4.0 < 5.2/1.2 = 4.33 > 5.3/1.3
    assert best_width(rows, [1.0, 1.5, 2.0, 2.5]) == 1       # drafting costs more than it brings
    assert best_width(rows, [1.0, 1.0, 1.0, 1.0]) == 4       # free width: take it all
    assert best_width(rows, [1.0, 1.0]) == 2                 # never wider than the table
    assert best_width([torch.tensor([])] * 2, [1.0, 1.0, 1.0]) == 1   # nothing drafted
    # a tie goes to the narrower width
    assert best_width([torch.tensor([1.0])], [1.0, 2.0]) == 1


def test_a_draft_level_pays_where_its_expected_tokens_outweigh_its_seconds():
    drafted = [torch.tensor([0.8, 0.5])]
    children = [torch.tensor([0.4, 0.1])]
    flat = [1.0] * 8                                   # a GPU: any width up to 8 costs one pass
    steep = [1.0 + 0.5 * (w - 1) for w in range(1, 9)]
    # Flat cost, a cheap level: 2.3 tokens in 1.05 s now (2.19/s); 2.8 in 1.1 s with the level (2.55/s).
    assert level_pays(drafted, children, flat, spent=0.05, level=0.05)
    # The same level costing half a pass: 2.8 / 1.55 = 1.81/s.
    assert not level_pays(drafted, children, flat, spent=0.05, level=0.5)
    # Steep cost: the best width is 2 now (1.8 / 1.55 = 1.16/s); the children would only join at width 4 or
    # more, which costs more than they bring, so even a nearly free level does not pay.
    assert not level_pays(drafted, children, steep, spent=0.05, level=0.01)
    # Nothing expected of the next level: never pays.
    assert not level_pays(drafted, [torch.tensor([])], flat, spent=0.0, level=1e-6)
    # A batch: the rows' expected tokens add up, one level serves them all.
    two = [torch.tensor([0.8, 0.5]), torch.tensor([0.9])]
    assert level_pays(two, [torch.tensor([0.3]), torch.tensor([0.6])], flat, spent=0.0, level=0.2)
    assert not level_pays(two, [torch.tensor([0.03]), torch.tensor([0.06])], flat, spent=0.0, level=0.2)


def test_the_runtime_times_the_draft_levels_between_its_questions(monkeypatch):
    """``VerifyCost.level_pays`` times each level from one question to the next within a step, by the rows
    it ran; a row count not yet timed pays; ``fit`` ends a step, so no level spans a verification."""
    from selfspec.runtime import width

    clock = iter([0.0, 0.0, 0.01, 0.01, 0.61, 5.0, 5.0, 5.0, 9.0, 9.0, 9.0])
    monkeypatch.setattr(width, "now", lambda device: next(clock))
    cost = VerifyCost(Backbone(tiny_model("llama")))
    monkeypatch.setattr(cost, "table", lambda rows, widest: [1.0] * widest)   # a flat pass of 1 s
    drafted, children = [torch.tensor([0.8, 0.5])], [torch.tensor([0.4, 0.1])]
    ask = lambda running: cost.level_pays(drafted, children, rows=1, widest=8, running=running)   # noqa: E731
    assert ask(1)            # t=0, a step's first question: no level of one row timed yet, so it runs
    assert ask(2)            # t=0.01: that level took 0.01 s; none of two rows timed yet
    assert not ask(2)        # t=0.61: a level of two rows takes 0.6 s, dear against a 1 s pass: stop
    cost.fit([], 8)          # t=5: verification
    assert ask(1)            # a new step (t=5): priced by the 0.01 s level, nothing timed across the verification
    cost.fit([], 8)          # t=9: that level ran on to the end of drafting: not timed either
    assert ask(1)
    assert {r: list(s) for r, s in cost._levels.items()} == {1: [0.01], 2: [pytest.approx(0.6)]}


def test_trim_keeps_the_likeliest_nodes_as_a_tree():
    tree = build_tree(((0,), (1,), (0, 0), (1, 0), (0, 0, 0)))
    p = torch.tensor([1.0, 0.5, 0.45, 0.4, 0.44, 0.3])   # node 4 (under 2) outranks node 3 (under 1)
    draft = Draft(tree=tree, tokens=torch.tensor([10, 11, 12, 13, 14, 15]), path_p=p)
    cut = trim(draft, 4)
    assert cut.tokens.tolist() == [10, 11, 12, 14]
    assert cut.tree.paths == ((0,), (1,), (1, 0))
    assert cut.tree.parents.tolist() == [-1, 0, 0, 2]
    assert torch.equal(cut.path_p, p[[0, 1, 2, 4]])
    assert trim(draft, 1).tree.size == 1 and trim(draft, 1).tokens.tolist() == [10]
    assert trim(draft, 6) is draft and trim(draft, 9) is draft
    resumed = Draft(tree=tree, tokens=draft.tokens, resume=Resume(layer=1, hidden=torch.zeros(1, 2, 4)))
    assert trim(resumed, 2) is resumed   # early exit's layers < E already ran on these nodes: never cut


def test_trim_breaks_ties_by_node_order_so_parents_stay():
    tree = build_tree(chain(4))
    draft = Draft(tree=tree, tokens=torch.arange(5), path_p=torch.tensor([1.0, 0.5, 0.5, 0.5, 0.5]))
    assert trim(draft, 3).tokens.tolist() == [0, 1, 2]


def test_nodes_without_probabilities_get_the_copy_prior_and_copies_extend_the_draft_s_own():
    tree = build_tree(((0,), (0, 0), (1,)))
    prior = [prior_chance(d) for d in tree.depths.tolist()]
    assert prior == pytest.approx([1.0, COPY_ACCEPT_FIRST, COPY_ACCEPT_FIRST * COPY_ACCEPT_NEXT, COPY_ACCEPT_FIRST])
    conf = torch.tensor([[0.9, 0.05], [0.5, 0.1]])   # (depth, rank) as a Medusa layout holds them
    assert layout_path_p(tree, conf).tolist() == pytest.approx([1.0, 0.9, 0.45, 0.05])
    # The context ends in "7 8" as it began; what followed then, 9 4, grafts under the rank-0 node (token 9),
    # with the chance of a token copied after a match of two tokens.
    state = DecodeState(ids=[7, 8, 9, 4, 7, 8], cache=None, params=GREEDY, generator=None)
    draft = Draft(tree=tree, tokens=torch.tensor([8, 9, 3, 5]), path_p=layout_path_p(tree, conf))
    grafted = with_lookup([draft], [state], 2, vocab_size=20)[0]
    assert grafted.tokens.tolist() == [8, 9, 3, 5, 4]
    assert grafted.path_p.tolist() == pytest.approx([1.0, 0.9, 0.45, 0.05, 0.9 * COPY_ACCEPT_BY_MATCH[1][1]])
    # A new chain under the root starts at the first chance: here after a match of one token (8 -> 6 1).
    state = DecodeState(ids=[8, 6, 1, 2, 8], cache=None, params=GREEDY, generator=None)
    grafted = with_lookup([Draft(tree=tree, tokens=torch.tensor([8, 9, 3, 5]))], [state], 2, vocab_size=20)[0]
    first, nxt = COPY_ACCEPT_BY_MATCH[0]
    assert grafted.tokens.tolist() == [8, 9, 3, 5, 6, 1]
    assert grafted.path_p.tolist() == pytest.approx(prior + [first, first * nxt])
    assert path_p(Draft(tree=tree, tokens=torch.arange(4))) == pytest.approx(prior)


class _Timed(VerifyCost):
    """A VerifyCost whose prior is a formula instead of a timing (rows r, width w: r + w seconds)."""

    def __init__(self):
        super().__init__(backbone=None)
        self.timings = []

    def _time(self, rows, width):
        self.timings.append((rows, width))
        return {w: float(rows + w) for w in (1, 2, 4, width)}


def _verified(p: list[float], accepted: int) -> tuple[Draft, Accepted]:
    """A chain of len(p) - 1 drafts with chances p (root first), of which the first ``accepted`` were accepted."""
    draft = Draft(tree=build_tree(chain(len(p) - 1)), tokens=torch.arange(len(p)), path_p=torch.tensor(p))
    return draft, Accepted(path=tuple(range(accepted + 1)), bonus=0, tokens=(0,) * (accepted + 1))


def test_calibration_starts_at_face_value_and_learns_what_each_depth_is_accepted_with():
    cal = Calibration()
    assert cal.factors(3) == [1.0, 1.0, 1.0, 1.0]                       # nothing seen: the draft's own chances
    assert cal.scaled([1.0, 0.8, 0.5], [0, 1, 2]) == [1.0, 0.8, 0.5]
    g = torch.Generator().manual_seed(0)
    for _ in range(400):   # claimed 0.8 and 0.6; accepted half the time at depth 1, never at depth 2
        draft, acc = _verified([1.0, 0.8, 0.6], int(torch.rand(1, generator=g) < 0.5))
        read_host([draft])                                            # (as fitting leaves it: its host copy read)
        cal.record([draft], [acc])
    f = cal.factors(3)
    assert 0.5 < f[1] / (0.5 / 0.8) < 1.2 and f[2] < 0.1, f         # the measured ratios, the prior faded out
    assert f[3] == f[2]                                               # a depth never seen: no better than above it
    scaled = cal.scaled([1.0, 0.8, 0.6], [0, 1, 2])
    assert scaled[0] == 1.0 and scaled[1] >= scaled[2]
    under = Calibration()      # a draft accepted more often than it claims: chances rise, never past 1 or a parent
    for _ in range(200):
        draft, acc = _verified([1.0, 0.5, 0.45], 2)
        read_host([draft])
        under.record([draft], [acc])
    assert under.scaled([1.0, 0.5, 0.45], [0, 1, 2]) == pytest.approx([1.0, 1.0, 0.9], abs=0.1)
    f = under.factors(2)
    assert f[1] > 1.0 and all(a >= b for a, b in zip(f[1:], f[2:]))   # (the root stays 1)
    assert under.scaled([1.0, 0.9, 0.9], [0, 1, 2])[2] <= 1.0


def test_a_calibrated_fitting_learns_from_every_step_and_stays_exact(one_thread):
    """Through ``decode_rows``: every step's acceptance teaches the calibration (what the lookup's copies of
    this model's text are accepted with, against the prior they are drafted with), and output stays exact."""
    model = tiny_model("llama")
    bb = Backbone(model)
    prompts = _prompts(model.config.vocab_size)
    ref = _alone(model, prompts[:1])
    fitted = Calibrated(_Cycling(), Calibration())
    new, _ = decode_rows(bb, LookupDrafter(bb.device, 4, vocab_size=bb.vocab_size), prompts[:1], params=GREEDY,
                         max_new_tokens=N_NEW, eos_token_ids=set(), generator=None, cost=fitted)
    assert new == ref
    cal = fitted.calibration
    assert cal.chance and cal.reached[0] > 0 and cal.factors(1)[1] != 1.0, (cal.chance, cal.reached)


def test_cost_table_interpolates_flattens_and_learns_from_real_steps():
    cost = _Timed()
    assert cost.table(4, 5) == pytest.approx([5, 6, 7, 8, 9])          # width 3 interpolated
    assert cost.table(3, 5) == pytest.approx([4, 5, 6, 7, 8])          # rows 3: between 2 and 4
    assert sorted(cost.timings) == [(2, 5), (4, 5)]                     # each row count timed once
    cost._timed[4][4] = 5.5                                            # a dip (width 4 cheaper than 2) is flattened
    assert cost.table(4, 5) == pytest.approx([5, 6, 6, 6, 9])
    cost.record(4, 1, 99.0)                                           # a shape's first step (one-off costs): ignored
    assert cost.table(4, 5) == pytest.approx([5, 6, 6, 6, 9])
    cost.record(4, 1, 10.0)                                           # real steps: twice the prior at width 1
    assert cost.table(4, 5) == pytest.approx([10, 12, 12, 12, 18])
    cost.record(4, 5, 50.0)
    cost.record(4, 5, 12.0)                                           # a seen width replaces the prior, and the
    scale = (2.0 + 12.0 / 9.0) / 2                                     # median ratio seen/prior rescales the rest
    assert cost.table(4, 5) == pytest.approx([10, 6 * scale, 6 * scale, 6 * scale, 12])
    cost.record(4, 5, 90.0)                                           # a load spike: load only adds time, so
    assert cost.table(4, 5)[4] == pytest.approx(12.0)                  # the fastest of the last steps counts
    for s in (20.0, 21.0, 22.0):                                       # only the last RECENT steps count
        cost.record(4, 5, s)
    assert cost.table(4, 5)[4] == pytest.approx(20.0) and VerifyCost.RECENT == 3
    assert cost.table(2, 5)[0] == pytest.approx(3.0)                   # other row counts keep their own prior


def test_a_slow_step_at_a_narrow_width_does_not_price_the_wider_ones_out():
    """Timings err high, so a width is never priced above what a wider one was seen to cost; a spike at
    width 2 must not lift widths 3-4 (whose own steps were faster) through the running maximum."""
    cost = _Timed()                                        # prior at 1 row: width w costs 1 + w
    for w in (1, 2, 4):
        cost.record(1, w, 0.0)                            # (each shape's first step is ignored)
    cost.record(1, 1, 2.0)
    cost.record(1, 2, 9.0)                                # a load spike: width 2's only step
    cost.record(1, 4, 3.0)                                # width 4 measured cheaper than that
    # seen {1: 2, 2: 9, 4: 3} (median ratio to the prior 1): width 2 capped by width 4's 3, and width 3
    # (unseen, its prior 4) too; width 5 keeps its prior. Without the cap: [2, 9, 9, 9, 9].
    assert cost.table(1, 5) == pytest.approx([2.0, 3.0, 3.0, 3.0, 6.0])
    assert cost.width([torch.tensor([0.9, 0.8, 0.7])], 4) == 4   # worth the full tree at those prices


def test_a_width_spoiled_by_a_spike_is_measured_again():
    """Widths are measured only when chosen: a spike at the best width must not park a process at
    plain steps for good. Every EXPLORE_EVERY-th step takes a neighbour of the best width instead."""
    cost = _Timed()                                  # prior at 1 row: width w costs 1 + w (width 2: 3, width 1: 2)
    chances = [torch.tensor([0.9, 0.8, 0.7])]        # worth width 4 at that prior (3.4 tokens / 5 s)
    true = {1: 2.0, 2: 2.2, 3: 2.4, 4: 2.6}          # what steps really cost here
    for w in true:
        cost.record(1, w, 0.0)                      # (each shape's first step is ignored)
    for w in (2, 3, 4):
        cost.record(1, w, 50.0)                     # a load spike at every wider width (their only step)
    cost.record(1, 1, true[1])
    chosen = []
    for _ in range(6 * VerifyCost.EXPLORE_EVERY):
        w = cost.width(chances, 4)
        chosen.append(w)
        cost.record(1, w, true[w])
    assert set(chosen[: VerifyCost.EXPLORE_EVERY - 1]) == {1}, "the spike makes drafting look dear at first"
    last = chosen[-VerifyCost.EXPLORE_EVERY:]
    assert last.count(4) >= len(last) - 1, f"exploration should climb back to the best width (chose {last})"


class _TimedStep(VerifyCost):
    """A static step's VerifyCost whose prior is a formula: bucket b costs b seconds at any row count."""

    def __init__(self):
        super().__init__(backbone=None, step=object())
        self.timings = []

    def _time(self, rows, width):
        self.timings.append((rows, width))
        return {b: float(b) for b in (1, 4, 16) if b <= max(16, width)}


def test_a_static_step_is_priced_by_bucket_and_explored_bucket_by_bucket():
    cost = _TimedStep()
    assert cost.table(3, 13) == [1.0] + [4.0] * 3 + [16.0] * 9        # a width costs its bucket (1, 4, 16)
    assert cost.timings == [(3, 13)]                                   # at exactly the step's rows
    for w, seconds in ((3, 1.5), (1, 1.0)):
        cost.record(3, w, 0.0)                                        # (a shape's first step is ignored)
        cost.record(3, w, seconds)                                    # widths 2-4 run as bucket 4: one estimate
    assert cost.table(3, 13) == [1.0, 1.5, 1.5, 1.5] + [6.0] * 9       # bucket 16 rescaled (median seen/prior)
    # Worth bucket 4: 3 + 2.4 tokens in 1.5 s beats 3 tokens in 1 s and 3 + 6.9 in 6 s.
    chances = [torch.tensor([0.9, 0.8, 0.7] + [0.5] * 9)] + [torch.tensor([])] * 2
    chosen = [cost.width(chances, 13) for _ in range(2 * VerifyCost.EXPLORE_EVERY)]
    assert set(chosen) - {4} == {13, 1}     # exploring: the next bucket up (cut to the widest tree), then down
    assert chosen[VerifyCost.EXPLORE_EVERY - 1] == 13 and chosen[-1] == 1


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_static_step_width_fitting_keeps_every_row_exact(arch, one_thread):
    """``compile=True``'s pass (here uncompiled: the same static shapes) with width fitting: the prior
    times each bucket through the step with the drafter's capture, steps are cut, every row exact."""
    from selfspec.runtime.static import BUCKETS
    from selfspec.runtime.step import StaticStep

    model, bb, prompts, ref, drafters = every_drafter(arch)
    for drafter in drafters:
        if drafter.max_nodes < 2:
            continue
        step = StaticStep(bb, compile=False)
        cost = VerifyCost(bb, step=step, capture=drafter.capture_layers, context=8, sweeps=1)
        new, _ = decode_rows(bb, drafter, prompts, params=GREEDY, max_new_tokens=N_NEW, eos_token_ids=set(),
                             generator=None, step=step, cost=cost)
        assert new == ref, f"{arch} {drafter.name}: a row differs from its prompt decoded alone"
        shapes = {w for _, w in cost.observed} | {w for _, w in cost._met}
        assert shapes <= set(BUCKETS) and {r for r, _ in cost._met} == {len(prompts)}


class _Cycling:
    """A cost table whose steepness cycles, so that steps choose every width from 1 up."""

    def __init__(self):
        self.calls, self.seen = 0, []

    def table(self, rows, width):
        self.calls += 1
        slope = (0.0, 0.3, 1.0, 5.0)[self.calls % 4]
        return [1.0 + slope * (w - 1) for w in range(1, width + 1)]

    def width(self, chances, widest, rows=None):
        return best_width(chances, self.table(len(chances), widest))

    def level_pays(self, chances, children, *, rows, widest, running, depths=None):
        from selfspec.runtime import width

        # A level priced as a tiny head's is, against this table's pass: no clock, the same decisions every run.
        return width.level_pays(chances, children, self.table(rows, widest), spent=2e-4 * running, level=2e-4)

    def fit(self, drafts, widest, rows=None, calibration=None):
        from selfspec.runtime.width import fit_width

        return fit_width(drafts, self, widest, rows, calibration)

    def observe(self, rows, width, accepted=None):
        self.seen.append(width)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_every_row_stays_exact_whatever_width_a_step_is_cut_to(arch, one_thread):
    model, bb, prompts, ref, drafters = every_drafter(arch)
    for drafter in drafters:
        cost = _Cycling()
        new, _ = decode_rows(bb, drafter, prompts, params=GREEDY, max_new_tokens=N_NEW, eos_token_ids=set(),
                             generator=None, cost=cost)
        assert new == ref, f"{arch} {drafter.name}: a row differs from its prompt decoded alone"
        assert cost.calls > 0
        if drafter.name == "early-exit":
            assert len(set(cost.seen)) == 1, "early exit's drafts (layers < E already run) must never be cut"
        else:
            assert 1 in cost.seen, f"{drafter.name}: no step was cut to a plain one"
        if isinstance(drafter, RowOracle) and drafter.tree.size > 5:
            assert len(set(cost.seen)) >= 3, f"the cut widths should vary (saw {sorted(set(cost.seen))})"


def test_a_single_row_is_fitted_too_and_sampling_too(one_thread):
    model = tiny_model("llama")
    bb = Backbone(model)
    prompts = _prompts(model.config.vocab_size)
    ref = _alone(model, prompts[:1])
    cost = _Cycling()
    new, _ = decode_rows(bb, LookupDrafter(bb.device, 4, vocab_size=bb.vocab_size), prompts[:1], params=GREEDY,
                         max_new_tokens=N_NEW, eos_token_ids=set(), generator=None, cost=cost)
    assert new == ref and cost.calls > 0
    cost = _Cycling()
    decode_rows(bb, LookupDrafter(bb.device, 4, vocab_size=bb.vocab_size), prompts,
                params=SamplingParams(do_sample=True, temperature=0.8), max_new_tokens=8, eos_token_ids=set(),
                generator=torch.Generator().manual_seed(0), cost=cost)
    assert cost.calls > 0   # exact: tests/test_batch.py checks the sampled distribution under cuts


def test_sampled_siblings_are_cut_in_rank_order():
    """When sampling, siblings are draws in rank order and may score alike (early exit scores a row by its
    largest probability): a cut keeps the lower ranks, whatever order the tree lists them in."""
    tree = build_tree(((1,), (0,), (2,)))           # listed out of rank order
    p = torch.tensor([1.0, 0.4, 0.4, 0.4])
    draft = Draft(tree=tree, tokens=torch.tensor([9, 21, 20, 22]), path_p=p)
    cut = trim(draft, 3)
    assert sorted(cut.tokens.tolist()[1:]) == [20, 21] and sorted(cut.tree.ranks.tolist()[1:]) == [0, 1]


def test_generate_fits_batches_with_costs_timed_on_this_machine(one_thread):
    """End to end: a batch through ``generate`` times the pass (real VerifyCost), cuts trees, and every
    row matches its prompt alone; ``fit_width=False`` verifies whole trees, with the same output."""
    model = tiny_model("llama")
    prompts = _prompts(model.config.vocab_size)
    ref = _alone(model, prompts)
    for fit in (True, False):
        sm = SelfSpeculativeModel(model, None, drafter_name="lookup", heads=None, name="t", lookup=4, fit_width=fit)
        out = sm.generate(list(prompts), max_new_tokens=N_NEW, pad_token_id=0)
        width = out.shape[1] - N_NEW
        assert [row[width:].tolist() for row in out] == ref
        assert (sm._cost(len(prompts), sm.drafter) is not None) == fit
    observed = verify_cost(sm.backbone).observed
    assert max(rows for rows, _ in observed) == len(prompts)   # the fitted run's steps taught the table


def test_fit_width_must_be_a_bool():
    with pytest.raises(ValueError, match="fit_width must be True or False") as excinfo:
        SelfSpeculativeModel(tiny_model("llama"), None, drafter_name="lookup", heads=None, name="t", fit_width="no")
    assert "\n" not in str(excinfo.value)
