"""Context lookup (drafters/lookup.py): the n-gram search and the graft are pure; the output stays exact."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, tiny_model

from selfspec.core.backbone import Backbone
from selfspec.core.decode import decode
from selfspec.core.sampling import SamplingParams
from selfspec.core.tree import build_tree
from selfspec.core.types import DecodeState, Draft
from selfspec.drafters import LookupDrafter, MedusaDrafter
from selfspec.drafters.lookup import (
    MAX_NGRAM,
    chain_nodes,
    context_match,
    copied_chain,
    copy_prior,
    graft,
    grafted_path_p,
    with_lookup,
)
from selfspec.model import SelfSpeculativeModel, untrained_heads


def test_match_follows_the_longest_then_latest_earlier_match():
    assert context_match([1, 2, 3, 9, 8, 1, 2, 3], 2) == ([9, 8], 3)
    # Trigram [9, 5, 6] never occurred before; bigram [5, 6] did, latest at index 3.
    assert context_match([5, 6, 7, 5, 6, 8, 4, 9, 5, 6], 3) == ([8, 4, 9], 2)
    # The longer n-gram wins over a later shorter one: [1, 2, 3] at 0 beats [2, 3] at 5.
    assert context_match([1, 2, 3, 4, 0, 2, 3, 5, 1, 2, 3], 1) == ([4], 3)
    # A match near the end gives fewer than k tokens (here it overlaps the suffix: a loop).
    assert context_match([1, 2, 1, 2], 4) == ([1, 2], 2)
    # The match counts up to max_ngram tokens: a longer one is no stronger, so the latest of those wins.
    long = [7, 1, 2, 3, 4, 5, 8, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5]
    assert context_match(long, 1) == ([9], MAX_NGRAM)
    assert context_match(long, 1, max_ngram=5) == ([8], 5)


def test_match_needs_a_repeated_ngram_of_min_length():
    assert context_match([4, 1, 4], 3) == ([], 0)                  # one repeated token is a weak match
    assert context_match([4, 1, 4], 3, min_ngram=1) == ([1, 4], 1)
    assert context_match([1, 2, 3], 3, min_ngram=1) == ([], 0)
    assert context_match([], 3) == ([], 0)
    with pytest.raises(ValueError, match="k >= 1"):
        context_match([1, 2], 0)
    with pytest.raises(ValueError, match="min_ngram"):
        context_match([1, 2], 2, min_ngram=3, max_ngram=2)


class _Corpus:
    """A corpus that proposes ``chain`` wherever it is asked."""

    def __init__(self, chain):
        self.chain = chain

    def continuation(self, ids, k):
        return self.chain[:k]


def test_copied_chain_takes_a_context_match_then_the_corpus_then_the_last_token_alone():
    greedy, sampled = SamplingParams(), SamplingParams(do_sample=True, temperature=1.0)
    state = lambda ids, params=greedy: DecodeState(ids=ids, cache=None, params=params, generator=None)  # noqa: E731
    # A match of two tokens beats the corpus.
    assert copied_chain(state([5, 6, 7, 5, 6]), 2, _Corpus([9])) == ([7, 5], copy_prior(2, sampled=False))
    # Only the last token repeats: the corpus first, with its own prior ...
    assert copied_chain(state([4, 1, 4]), 3, _Corpus([9, 9])) == ([9, 9], copy_prior(None, sampled=False))
    # ... and where it has nothing (or there is none), the last token's continuation.
    assert copied_chain(state([4, 1, 4]), 3, _Corpus([])) == ([1, 4], copy_prior(1, sampled=False))
    assert copied_chain(state([4, 1, 4], sampled), 3) == ([1, 4], copy_prior(1, sampled=True))
    assert copied_chain(state([1, 2, 3]), 3)[0] == []                  # nothing repeats: nothing copied


def test_copy_priors_grow_with_the_match_and_stay_chances():
    for sampled in (False, True):
        firsts = [copy_prior(n, sampled=sampled)[0] for n in range(1, MAX_NGRAM + 1)]
        assert firsts == sorted(firsts) and firsts[0] < 0.3 < 0.7 < firsts[-1]
        assert copy_prior(MAX_NGRAM + 3, sampled=sampled) == copy_prior(MAX_NGRAM, sampled=sampled)
        assert all(0 < p < 1 for n in range(1, MAX_NGRAM + 1) for p in copy_prior(n, sampled=sampled))
    assert copy_prior(2, sampled=True)[0] < copy_prior(2, sampled=False)[0]


def test_graft_follows_matching_nodes_then_branches_off():
    paths = ((0,), (1,), (0, 0))
    tokens = [100, 10, 11, 12]                  # root, (0,)=10, (1,)=11, (0, 0)=12
    # Agrees with (0,) and (0, 0), then goes on below them.
    assert graft(paths, tokens, [10, 12, 13]) == (paths + ((0, 0, 0),), tokens + [13])
    # Disagrees at depth 2: a new sibling of (0, 0), then a chain under it.
    assert graft(paths, tokens, [10, 20, 21]) == (paths + ((0, 1), (0, 1, 0)), tokens + [20, 21])
    # Disagrees at once: a third child of the root.
    assert graft(paths, tokens, [30, 31]) == (paths + ((2,), (2, 0)), tokens + [30, 31])
    # Nothing new to add.
    assert graft(paths, tokens, [11]) == (paths, tokens)
    # An empty tree becomes the chain itself; the result is a valid tree.
    merged, toks = graft((), [100], [7, 8, 9])
    assert merged == ((0,), (0, 0), (0, 0, 0)) and toks == [100, 7, 8, 9]
    tree = build_tree(graft(paths, tokens, [10, 20, 21])[0])
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 4]
    with pytest.raises(ValueError, match="node tokens"):
        graft(paths, tokens[:-1], [1])


def test_graft_ranks_past_a_pruned_sibling():
    # A cut tree may keep rank 2 without rank 1 under a node: the new branch must not reuse a rank.
    paths = ((0,), (2,))
    merged, _ = graft(paths, [100, 10, 12], [40])
    assert merged == ((0,), (2,), (3,))


def test_a_copied_chain_through_drafted_nodes_keeps_its_own_chance_when_greedy():
    # Drafted: (0,)=10 at 0.2, (1,)=11 at 0.5, (0, 0)=12 at 0.1. A strong match copies 10, 12, 13.
    paths, tokens = ((0,), (1,), (0, 0)), [100, 10, 11, 12]
    draft = Draft(tree=build_tree(paths), tokens=torch.tensor(tokens), path_p=torch.tensor([1.0, 0.2, 0.5, 0.1]))
    merged, toks = graft(paths, tokens, [10, 12, 13])
    tree = build_tree(merged)
    assert chain_nodes(tree.parents.tolist(), toks, [10, 12, 13]) == [1, 3, 4]
    assert chain_nodes(tree.parents.tolist(), toks, [11, 99]) == [2]           # stops where no node holds it
    prior = (0.9, 0.8)
    # Without agreement (sampling) the chain inherits the drafted nodes' chances: 0.2, 0.1, then 0.1 * 0.8.
    old = grafted_path_p(draft, tree, toks, [10, 12, 13], prior)
    assert old == pytest.approx([1.0, 0.2, 0.5, 0.1, 0.08])
    # Greedy: a node both sources propose gets the larger chance, and the copy below builds on it.
    new = grafted_path_p(draft, tree, toks, [10, 12, 13], prior, agree=True)
    assert new == pytest.approx([1.0, 0.9, 0.5, 0.72, 0.576])
    # A drafted node more confident than the copy keeps its own chance.
    sure = Draft(tree=draft.tree, tokens=draft.tokens, path_p=torch.tensor([1.0, 0.95, 0.02, 0.9]))
    both = grafted_path_p(sure, tree, toks, [10, 12, 13], prior, agree=True)
    assert both == pytest.approx([1.0, 0.95, 0.02, 0.9, 0.72])
    # A copy that branches off where the draft proposed another child: the prior from there on.
    merged, toks2 = graft(paths, tokens, [10, 20, 21])
    tree2 = build_tree(merged)
    off = grafted_path_p(draft, tree2, toks2, [10, 20, 21], prior, agree=True)
    assert off == pytest.approx([1.0, 0.9, 0.5, 0.1, 0.72, 0.576])
    for t, p in ((tree, new), (tree, both), (tree2, off)):   # no child outscores its parent
        parents = t.parents.tolist()
        assert all(p[i] <= p[parents[i]] for i in range(1, t.size))


def test_medusa_with_lookup_is_exact_and_uses_the_copied_tokens():
    """A random tiny model's greedy output falls into loops, which lookup predicts: many more tokens
    per step than the (untrained) heads alone, and still token for token plain greedy."""
    model = tiny_model("llama")
    bb = Backbone(model)
    heads = untrained_heads("medusa", model, "t")
    tree = build_tree(((0,), (1,), (0, 0)))
    g = torch.Generator().manual_seed(5)
    taus = {}
    for lookup in (0, 6):
        for seed in range(3):
            ids = torch.randint(3, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(seed))
            ref = hf_greedy(model, ids, 60)[0, ids.shape[1]:].tolist()
            new, stats = decode(bb, MedusaDrafter(bb, heads, tree, lookup=lookup), ids[0], params=SamplingParams(),
                                max_new_tokens=60, eos_token_ids=set(), generator=g)
            assert new == ref
            taus.setdefault(lookup, []).append(stats.tau)
    assert sum(taus[6]) > sum(taus[0]) + 1.0
    assert max(taus[6]) > 2.0


def test_lookup_grafts_when_sampling_and_is_validated():
    model = tiny_model("llama")
    bb = Backbone(model)
    heads = untrained_heads("medusa", model, "t")
    tree = build_tree(((0,),))
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    params = SamplingParams(do_sample=True, temperature=1.0)
    drafter = MedusaDrafter(bb, heads, tree, lookup=4)
    _, stats = decode(bb, drafter, ids[0], params=params, max_new_tokens=20, eos_token_ids=set(),
                      generator=torch.Generator().manual_seed(0))
    assert stats.drafted >= stats.steps
    # A sampled step's graft: copied nodes are point-mass drafts with q rows of their own.
    V = bb.vocab_size
    state = DecodeState(ids=[5, 6, 7, 5, 6], cache=None, params=params, generator=None)
    q = torch.full((1, V), 1.0 / V)
    base = Draft(tree=tree, tokens=torch.tensor([6, 9]), q=q)          # the heads drew 9 under the root
    merged = with_lookup([base], [state], 4, vocab_size=V)[0]                  # context says 7, 5, 6 follow 5, 6
    assert merged.tree.paths == ((0,), (1,), (1, 0), (1, 0, 0))
    assert merged.tokens.tolist() == [6, 9, 7, 5, 6]
    assert merged.q_index.tolist()[1:] == [0, 1, 2, 3]
    assert torch.equal(merged.q[1:].argmax(-1), torch.tensor([7, 5, 6])) and bool((merged.q[1:].sum(-1) == 1).all())
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="lookup must be"):
            MedusaDrafter(bb, heads, tree, lookup=bad)


def test_lookup_drafter_alone_is_exact_and_samples():
    model = tiny_model("qwen2")
    bb = Backbone(model)
    for seed in range(3):
        ids = torch.randint(3, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(seed))
        ref = hf_greedy(model, ids, 60)[0, ids.shape[1]:].tolist()
        new, stats = decode(bb, LookupDrafter(bb.device, lookup=5, vocab_size=bb.vocab_size), ids[0], params=SamplingParams(), max_new_tokens=60,
                            eos_token_ids=set(), generator=None)
        assert new == ref and stats.drafted > 0
    _, stats = decode(bb, LookupDrafter(bb.device, vocab_size=bb.vocab_size), torch.tensor([5, 6, 7, 5, 6, 7, 5, 6]),
                      params=SamplingParams(do_sample=True, temperature=1.0), max_new_tokens=20, eos_token_ids=set(),
                      generator=torch.Generator().manual_seed(0))
    assert stats.new_tokens == 20   # sampling runs (copied tokens are point-mass drafts: test_sampling_lossless)
    sm = SelfSpeculativeModel(model, None, drafter_name="lookup", heads=None, tree="auto", name="tiny", lookup=3)
    assert sm.drafter.lookup == 3
    with pytest.raises(ValueError, match="lookup >= 1"):
        LookupDrafter(bb.device, lookup=0, vocab_size=bb.vocab_size)
    with pytest.raises(ValueError, match="whole number"):
        SelfSpeculativeModel(model, None, drafter_name="lookup", heads=None, tree="auto", name="tiny", lookup="x")
