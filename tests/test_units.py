"""Unit tests on hand-built inputs: tree builder, cache compaction, greedy acceptance, sampling helpers."""

from __future__ import annotations

import pytest
import torch

from selfspec.core import cache as kv
from selfspec.core.accept import greedy_accept, rejection_accept_chain
from selfspec.core.sampling import SamplingParams, pick_candidates, probs_from_logits
from selfspec.core.tree import build_tree, chain, chain_with_siblings, parse_tree, subtree, tree_tensors


def test_tree_builder_shapes_mask_positions():
    t = build_tree(((0,), (1,), (0, 0), (1, 0)))
    assert t.size == 5 and t.depth == 2
    assert t.parents.tolist() == [-1, 0, 0, 1, 2]
    assert t.depths.tolist() == [0, 1, 1, 2, 2]
    assert t.ranks.tolist() == [0, 0, 1, 0, 0]
    assert t.children == ((1, 2), (3,), (4,), (), ())
    assert t.node_paths[4] == (0, 2, 4)
    expect = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]).bool()
    assert torch.equal(t.ancestors, expect)
    mask = t.attention_mask(3, dtype=torch.float32)
    assert mask.shape == (1, 1, 5, 8)
    assert (mask[0, 0, :, :3] == 0).all()                       # everyone sees the past
    assert torch.equal(mask[0, 0, :, 3:] == 0, expect)           # and its ancestors only
    assert t.position_ids(3).tolist() == [[3, 4, 4, 5, 5]]
    assert t.width_at(1) == 2 and t.width_at(2) == 1
    assert build_tree(((0,), (1,), (0, 0), (1, 0))) is t          # cached on its shape


@pytest.mark.parametrize("depth", [1, 2, 3, 5, 8, 9, 130])   # (130: past float32's range for the counts)
def test_tree_tensors_give_every_node_its_depth_and_ancestors(depth):
    """Batches of random trees no deeper than ``depth`` (chains of exactly that depth among them): depths and
    ancestor sets as a walk up the parents gives them."""
    g = torch.Generator().manual_seed(depth)
    for _ in range(20):
        n = int(torch.randint(depth + 1, 3 * depth + 4, (1,), generator=g))
        batch = []
        for b in range(3):
            parents, depths = [-1], [0]
            for i in range(1, n):
                p = i - 1 if b == 0 and i <= depth else int(torch.randint(0, i, (1,), generator=g))
                while depths[p] >= depth:   # no deeper than ``depth``
                    p = parents[p]
                parents.append(p)
                depths.append(depths[p] + 1)
            batch.append(parents)
        got_depths, got_anc = tree_tensors(torch.tensor(batch), max_depth=depth)
        for b, parents in enumerate(batch):
            for i in range(n):
                walk, j = set(), i
                while j >= 0:
                    walk.add(j)
                    j = parents[j]
                assert got_anc[b, i].nonzero().flatten().tolist() == sorted(walk)
                assert int(got_depths[b, i]) == len(walk) - 1
        assert int(got_depths[0].max()) == depth   # the chain reaches the deepest level allowed


def test_subtree_renumbers_kept_nodes_and_refuses_orphans():
    t = build_tree(((0,), (1,), (0, 0), (1, 0), (1, 0, 0)))     # nodes 1..5; 5 under 4 under 2
    sub = subtree(t.parents, t.ranks, torch.tensor([0, 2, 4, 5]), max_depth=3)
    assert sub.parents.tolist() == [-1, 0, 1, 2]
    assert sub.paths == ((1,), (1, 0), (1, 0, 0))                # ranks carried over: node 2 is rank 1
    assert sub.depths.tolist() == [0, 1, 2, 3]
    with pytest.raises(AssertionError, match="closed under parents"):
        subtree(t.parents, t.ranks, torch.tensor([0, 1, 4]), max_depth=3)   # 4's parent 2 was cut


def test_tree_builder_rejects_bad_paths():
    with pytest.raises(ValueError, match="before its parent"):
        build_tree(((0, 0), (0,)))
    with pytest.raises(ValueError, match="twice"):
        build_tree(((0,), (0,)))
    with pytest.raises(ValueError, match="unknown tree"):
        parse_tree("zigzag", default=chain(2))


def test_named_trees():
    assert parse_tree("chain-3", default=()) == ((0,), (0, 0), (0, 0, 0))
    t = parse_tree("chain-2-w3", default=())
    assert t == ((0,), (0, 0), (1,), (2,), (0, 1), (0, 2))
    assert chain_with_siblings(2, 3) == t
    assert build_tree(chain(3)).is_chain and not build_tree(t).is_chain


def _cache(n_layers=2, length=6, batch=1, capacity=None):
    """Slot p of layer l holds p + 100 l (keys) and its negative (values); row r adds 1000 r."""
    c = kv.KVCache(batch, capacity=capacity)
    for layer in range(n_layers):
        k = torch.arange(length, dtype=torch.float32).view(1, 1, length, 1).expand(batch, 2, length, 3) + 100 * layer
        k = k + 1000 * torch.arange(batch, dtype=torch.float32).view(batch, 1, 1, 1)
        c.update(k.clone(), (-k).clone(), layer)
    return c


def _slots(c, layer, row=0):
    return [int(x) for x in c.layer(layer, row)[0][0, 0, :, 0].tolist()]


def test_cache_truncate_and_keep():
    c = _cache()
    kv.truncate(c, 4)
    assert kv.seq_len(c, 0) == kv.seq_len(c, 1) == 4
    c = _cache()
    kv.keep(c, 2, torch.tensor([0, 2, 3]))   # keep positions 0, 1 | 2, 4, 5
    for layer in range(2):
        assert _slots(c, layer) == [p + 100 * layer for p in (0, 1, 2, 4, 5)]
        assert c.layer(layer)[1][0, 1, :, 2].tolist() == [-(p + 100 * layer) for p in (0, 1, 2, 4, 5)]
    c = _cache()
    kv.keep(c, 2, torch.tensor([0, 1]))      # a chain prefix is a plain truncation
    assert _slots(c, 0) == [0, 1, 2, 3]


def test_cache_keep_with_layers_at_different_lengths():
    """Early exit leaves layers < E longer than the rest mid-step; compaction must handle both."""
    c = _cache(length=4)
    k = torch.tensor([4.0, 5.0]).view(1, 1, 2, 1).expand(1, 2, 2, 3)
    c.update(k.clone(), (-k).clone(), 0)         # layer 0 runs ahead, as an early-exit draft leaves it
    kv.keep(c, 1, torch.tensor([0, 2]))
    assert _slots(c, 0) == [0, 1, 3]
    assert _slots(c, 1) == [100, 101, 103]


def test_static_storage_hands_its_buffers_to_one_cache_at_a_time():
    """Static caches of one shape reuse the kept buffers (a compiled pass meets the same addresses), each
    starting empty; a request while the last cache is in use gets buffers of its own; a cache handed back
    (``release``) frees its buffers even while something still holds it, and handing back a cache with
    buffers of its own changes nothing; a larger capacity replaces a smaller one; compiled decoding marks
    the buffers static addresses."""
    storage = kv.StaticStorage(static_address=True)
    k = torch.ones(2, 2, 3, 4)
    first = storage.cache(2, 16)
    first.update(k, -k, 0)
    ptr = first.keys[0].data_ptr()
    assert getattr(first.keys[0], "_dynamo_static_input_type", None) == "unguarded"
    busy = storage.cache(2, 16)                     # the first is still in use
    busy.update(k, -k, 0)
    assert busy.keys[0].data_ptr() != ptr
    storage.release(busy)                           # not the kept buffers' user: the first stays in use
    assert storage.cache(2, 16).keys is not first.keys
    del busy
    storage.release(first)                          # handed back while still referenced (held here)
    again = storage.cache(2, 16)
    assert again.keys is first.keys and again.keys[0].data_ptr() == ptr and again.lengths == [] \
        and again.get_seq_length() == 0
    keys, _ = again.update(2 * k, -k, 0)            # its own lengths: writes from slot 0, reads only its slots
    assert keys.shape[2] == 3 and bool((keys == 2).all()) and again.keys[0].data_ptr() == ptr
    assert storage.cache(2, 16).keys is not again.keys   # in use until handed back ...
    del again, first
    assert storage.cache(2, 16).keys[0].data_ptr() == ptr   # ... or gone
    bigger = storage.cache(2, 32)
    bigger.allocate(2, 2, 4, dtype=torch.float32, device="cpu")
    assert [tuple(x.shape) for x in bigger.keys] == [(2, 2, 32, 4)] * 2 and list(storage._buffers) == [(2, 32)]
    plain = kv.StaticStorage(static_address=False).cache(1, 8)
    plain.update(k[:1], -k[:1], 0)
    assert not hasattr(plain.keys[0], "_dynamo_static_input_type")
    with pytest.raises(ValueError, match="capacity"):
        kv.KVCache(1, storage=([], []))


def test_cache_rows_keep_their_own_lengths_and_paths():
    """Rows of one batch: ragged writes after each row's own tokens, per-row paths, rows leaving."""
    c = _cache(batch=3, length=6)
    c.set_lengths([6, 3, 5])                     # ragged prompts: rows end at their own lengths
    k = torch.full((3, 2, 2, 3), 7.0) + torch.tensor([0.0, 10, 20]).view(3, 1, 1, 1)
    keys, _ = c.update(k, -k, 0)
    assert keys.shape[2] == 8                    # the longest row (6) + 2 new slots
    assert _slots(c, 0, 1) == [1000, 1001, 1002, 17, 17]      # written right after row 1's own 3 slots
    c.update(k, -k, 1)
    c.keep([6, 3, 5], [torch.tensor([0]), torch.tensor([1]), torch.tensor([0, 1])])
    assert [c.lengths[0][b] for b in range(3)] == [7, 4, 7]
    assert _slots(c, 0, 0) == [0, 1, 2, 3, 4, 5, 7]
    assert _slots(c, 0, 1) == [1000, 1001, 1002, 17]          # slot 1 of the new block moved into place
    assert _slots(c, 1, 2) == [2100, 2101, 2102, 2103, 2104, 27, 27]
    c.select([2, 0])                             # row 1 finished
    assert c.batch == 2 and _slots(c, 0, 0)[:5] == [2000, 2001, 2002, 2003, 2004] and _slots(c, 0, 1)[-1] == 7
    view = c.row(1)
    one = torch.full((1, 2, 1, 3), 9.0)
    keys, _ = view.update(one, -one, 0)          # a one-row forward sees that row's slots only
    assert keys.shape == (1, 2, 8, 3) and view.get_seq_length(0) == 8 and c.lengths[0] == [7, 8]


def test_cache_rows_view_writes_some_rows_and_leaves_the_others():
    """``rows``: a batched forward of some rows (drafting rows while the others sit idle) writes each
    after its own slots and reads every listed row up to the longest of them; all rows is the cache itself."""
    c = _cache(batch=4, length=6)
    c.set_lengths([6, 3, 5, 2])
    assert c.rows([0, 1, 2, 3]) is c and isinstance(c.rows([2]), kv.RowView)
    view = c.rows([3, 1])
    k = torch.full((2, 2, 2, 3), 7.0) + torch.tensor([0.0, 10]).view(2, 1, 1, 1)
    keys, values = view.update(k, -k, 0)
    assert keys.shape == (2, 2, 5, 3) and view.get_seq_length(0) == 5     # rows 3 and 1, up to the longer (3 + 2)
    assert _slots(c, 0, 3) == [3000, 3001, 7, 7] and _slots(c, 0, 1) == [1000, 1001, 1002, 17, 17]
    assert keys[0, 0, :4, 0].tolist() == [3000, 3001, 7, 7] and values[1, 0, :5, 0].tolist() == [-1000, -1001, -1002, -17, -17]
    assert c.lengths[0] == [6, 5, 5, 4] and c.lengths[1] == [6, 3, 5, 2]    # rows 0, 2 and layer 1 untouched
    c.row(1).truncate(3)
    assert c.lengths[0] == [6, 3, 5, 4] and c.lengths[1] == [6, 3, 5, 2]


def test_static_cache_refuses_to_grow_and_dynamic_grows():
    c = _cache(length=6, capacity=8)
    with pytest.raises(ValueError, match="holds 8 positions"):
        c.update(torch.zeros(1, 2, 3, 3), torch.zeros(1, 2, 3, 3), 0)
    d = _cache(length=6)
    d.update(torch.ones(1, 2, 100, 3), torch.ones(1, 2, 100, 3), 0)
    assert d.get_seq_length(0) == 106 and _slots(d, 0)[:7] == [0, 1, 2, 3, 4, 5, 1]


def test_greedy_accept_hand_built():
    t = build_tree(((0,), (1,), (0, 0), (1, 0), (1, 0, 0)))
    #             node:  0   1   2   3   4   5
    tokens = torch.tensor([9, 5, 6, 7, 8, 4])
    # Target after root says 6 (node 2 ok, node 1 wrong); after node 2 says 8 (node 4 ok);
    # after node 4 says 4 (node 5 ok); after node 5 says 3 -> bonus.
    argmax = torch.tensor([6, 7, 8, 0, 4, 3])
    acc = greedy_accept(t, tokens, argmax)
    assert acc.path == (0, 2, 4, 5) and acc.bonus == 3 and acc.num_accepted == 3
    # Nothing matches: root only, bonus = target after the root.
    acc = greedy_accept(t, tokens, torch.tensor([1, 1, 1, 1, 1, 1]))
    assert acc.path == (0,) and acc.bonus == 1


def test_rejection_chain_hand_built():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    # Draft 1 (token 1) has p = q = 1: always accepted. Draft 2 (token 1) has p = 0: always rejected,
    # and the residual max(0, p - q) puts all mass on token 2.
    n, nxt = rejection_accept_chain(p, q, torch.tensor([1, 1]), generator=g)
    assert (n, nxt) == (1, 2)
    n, nxt = rejection_accept_chain(p, q[:1], torch.tensor([1]), generator=g)
    assert (n, nxt) == (1, 2)  # all accepted: bonus from p after the last draft


def test_probs_from_logits_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    p = probs_from_logits(logits, SamplingParams(do_sample=True, top_k=2))
    assert (p[0, 2:] == 0).all() and torch.allclose(p.sum(), torch.tensor(1.0))
    p = probs_from_logits(logits, SamplingParams(do_sample=True, top_p=0.5))
    assert p[0, 0] == 1.0  # the top token alone holds > 0.5 of the mass
    p = probs_from_logits(logits, SamplingParams(do_sample=True, temperature=0.5))
    assert torch.allclose(p, (logits / 0.5).softmax(-1))
    with pytest.raises(ValueError):
        SamplingParams(do_sample=True, temperature=0.0)


def test_pick_candidates_without_replacement_and_padding():
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    g = torch.Generator().manual_seed(0)
    cand = pick_candidates(probs, 3, params=SamplingParams(do_sample=True), generator=g)
    assert cand.shape == (2, 3)
    assert set(cand[0, :2].tolist()) == {0, 1} and cand[0, 2] == cand[0, 1]   # padded by repetition
    assert len(set(cand[1].tolist())) == 3                                     # no repeats
    greedy = pick_candidates(torch.tensor([[1.0, 3.0, 2.0]]), 2, params=SamplingParams(), generator=None)
    assert greedy.tolist() == [[1, 2]]


def test_row_candidates_when_sampling_draw_or_take_the_likeliest():
    """Sampling: with ``draw`` the candidates are draws from q and carry it (conf: the row's largest
    probability, whatever was drawn); without, they are q's likeliest tokens after the processors, as
    point masses (q None), each scored by its own probability."""
    from types import SimpleNamespace

    from selfspec.drafters.base import row_candidates

    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 3.0, 0.5, 0.0]])
    vocab = torch.tensor([3, 5, 7, 9])   # a draft vocabulary: columns -> token ids
    params = SamplingParams(do_sample=True, temperature=0.5)
    state = SimpleNamespace(params=params, generator=torch.Generator().manual_seed(0))
    q = probs_from_logits(logits, params)
    top = row_candidates(logits, 2, vocab=vocab, vocab_size=10, state=state, draw=False)
    assert top.q is None and top.tokens.tolist() == [[3, 7], [5, 7]]
    assert torch.allclose(top.conf, torch.stack([q[0, [0, 2]], q[1, [1, 2]]]))
    drawn = row_candidates(logits, 2, vocab=vocab, vocab_size=10, state=state, draw=True)
    assert drawn.q.shape == (2, 10) and torch.allclose(drawn.q[:, vocab], q) and drawn.q[:, 0].sum() == 0
    assert torch.allclose(drawn.conf, q.max(-1, keepdim=True).values.expand(-1, 2))
    greedy = row_candidates(logits, 2, vocab=vocab, vocab_size=10, state=SimpleNamespace(params=SamplingParams()),
                            draw=True)
    assert greedy.q is None and greedy.tokens.tolist() == top.tokens.tolist()   # drawing is for sampling only


def test_tree_from_rank_accuracy_is_best_first_and_prefix_closed():
    from selfspec.core.tree import tree_from_rank_accuracy

    acc = ((0.6, 0.2, 0.1), (0.5, 0.2), (0.4,))
    paths = tree_from_rank_accuracy(acc, 5)
    # Path probabilities: (0,) .6, (0,0) .3, (1,) .2, (0,0,0) .12, (0,1) .12, (2,) .1, (1,0) .1 ...
    assert set(paths[:3]) == {(0,), (1,), (0, 0)}
    assert len(paths) == 5 and {(0, 0, 0), (0, 1)} <= set(paths)
    build_tree(paths)  # parents come first
    big = tree_from_rank_accuracy(acc, 100)
    assert len(big) == 3 + 3 * 2 + 3 * 2 * 1   # every path the accuracies allow


def test_prune_keeps_confident_prefix_closed_paths():
    from selfspec.core.tree import prune

    tree = build_tree(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
    # node:            root (0,)  (1,)  (0,0) (0,1) (1,0) (0,0,0)
    conf = torch.tensor([0.0, 0.8, 0.15, 0.5, 0.3, 0.9, 0.9])
    # Path probabilities: (0,) .8, (1,) .15, (0,0) .4, (0,1) .24, (1,0) .135, (0,0,0) .36.
    assert prune(tree, conf, 0.0) == tree.paths
    assert prune(tree, conf, 0.2) == ((0,), (0, 0), (0, 1), (0, 0, 0))
    assert prune(tree, conf, 0.38) == ((0,), (0, 0))
    assert prune(tree, conf, 0.9) == ()
    # A confident child of a pruned parent goes with it (prefix-closed).
    conf2 = torch.tensor([0.0, 0.1, 0.1, 1.0, 1.0, 1.0, 1.0])
    assert prune(tree, conf2, 0.2) == ()
    sub = build_tree(prune(tree, conf, 0.2))   # a valid tree in the original node order
    assert sub.size == 5 and sub.depth == 3
    # Gate: all or nothing on the expected accepted tokens (summed path probabilities) of what is kept.
    assert prune(tree, conf, 0.0, gate=2.0) == tree.paths          # .8+.15+.4+.24+.135+.36 = 2.085
    assert prune(tree, conf, 0.0, gate=2.1) == ()
    assert prune(tree, conf, 0.2, gate=1.79) == ((0,), (0, 0), (0, 1), (0, 0, 0))   # kept: 1.8
    assert prune(tree, conf, 0.2, gate=1.81) == ()


def test_pruned_draft_confidences_follow_the_tree_layout():
    from selfspec.core.tree import prune
    from selfspec.drafters.base import pruned

    tree = build_tree(((0,), (1,), (0, 0)))
    conf = torch.tensor([[0.7, 0.2], [0.5, 0.1]])   # row d: candidates at depth d + 1, rank order
    assert pruned(tree, conf, 0.0) is tree
    assert pruned(tree, conf, 0.3).paths == ((0,), (0, 0))   # (1,) .2 < .3; (0,0) .35
    assert pruned(tree, conf, 0.4).paths == ((0,),)
    # The same confidences as the host's lists (a chain drafter read them already): the same cuts.
    for threshold in (0.0, 0.3, 0.4, 0.8):
        assert pruned(tree, conf.tolist(), threshold).paths == pruned(tree, conf, threshold).paths
    assert prune(tree, [1.0, 0.7, 0.2, 0.5], 0.3) == ((0,), (0, 0))   # node order: root, (0,), (1,), (0, 0)


def test_shipped_checkpoints_stay_under_30_mb():
    """Everything committed under checkpoints/ stays under 30 MB (trainer states are git-ignored)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "checkpoints"
    files = [p for p in root.rglob("*") if p.is_file() and p.name != "trainer_state.pt" and ".tmp-" not in p.name]
    assert files, "no shipped checkpoints"
    assert sum(p.stat().st_size for p in files) < 30e6


def test_model_card_shows_the_settings_of_the_method_it_was_measured_as():
    # A bench of the shipped heads beside other heads (METHOD@DIR) records both; the card of the other
    # heads must show their own settings, not the shipped ones.
    from selfspec.card import _bench_section

    method = {"tau": 2.1, "acceptance_by_depth": [0.7], "speedup": 2.0, "speedup_median": 2.0, "identical": True}
    bench = {"methods": {"selfspec-eagle": method, "selfspec-eagle@h/new": method},
             "config": {"command": "selfspec bench ...", "n_prompts": 2, "prompts": "p.jsonl", "max_new_tokens": 8,
                        "device": "cpu", "threads": 2, "dtype": "float32",
                        "heads": {"eagle_tree": "dynamic-6-2-6", "eagle_threshold": 0.4, "eagle_heads_tree": "dynamic-3-2-3",
                                  "eagle@h/new_tree": "dynamic-5-2-4", "eagle@h/new_threshold": 0.3}}}
    [used] = [line for line in _bench_section(bench, "selfspec-eagle@h/new") if "settings used" in line]
    assert used == "- settings used: tree dynamic-5-2-4, threshold 0.3"
    [used] = [line for line in _bench_section(bench, "selfspec-eagle") if "settings used" in line]
    assert used == "- settings used: tree dynamic-6-2-6, threshold 0.4"


@pytest.mark.parametrize("penalty", [1.7, 0.6])
def test_repetition_penalty_at_each_tree_node_is_transformers_on_that_nodes_text(penalty):
    """penalize_repeats on a hand-built tree: row i equals transformers' RepetitionPenaltyLogitsProcessor on
    the context plus the path root..i (the root's token is the context's last)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from selfspec.core.sampling import penalize_repeats

    tree = build_tree(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
    context = [3, 7, 7, 1]
    tokens = torch.tensor([1, 5, 3, 5, 9, 2, 4])           # node 0 is the root: the context's last token
    logits = (torch.randn(12, generator=torch.Generator().manual_seed(0)) * 3).expand(tree.size, -1)   # one row
    got = penalize_repeats(logits, context, penalty, tokens, tree.ancestors)
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    for i in range(tree.size):
        text = context + tokens[list(tree.node_paths[i][1:])].tolist()
        torch.testing.assert_close(got[i], processor(torch.tensor([text]), logits[i:i + 1].clone())[0])
    assert not torch.equal(got[1], got[2]), "not vacuous: siblings with the same logits differ by their paths"
    # Without a tree every row reads the context alone; ids past the LM head's rows are passed over.
    torch.testing.assert_close(penalize_repeats(logits[:2], context + [40], penalty),
                               processor(torch.tensor([context] * 2), logits[:2].clone()))


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(0.7, 0, 1.0, 0.0), (1.3, 5, 1.0, 0.0), (0.8, 0, 0.8, 0.0),
                                                           (1.0, 0, 1.0, 0.2), (0.6, 20, 0.9, 0.05)])
def test_sampling_distribution_is_transformers_warpers_in_their_order(temperature, top_k, top_p, min_p):
    """probs_from_logits is what transformers' generate samples from: its temperature, top-k, top-p and
    min-p warpers, in the order it applies them, then a softmax (the lossless tests take it as the target's
    distribution, so it must be transformers' own)."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1)) * 4
    warpers = [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else []) + \
        ([TopPLogitsWarper(top_p)] if top_p < 1 else []) + ([MinPLogitsWarper(min_p)] if min_p else [])
    expected = logits.clone()
    for w in warpers:
        expected = w(None, expected)
    params = SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    got = probs_from_logits(logits, params)
    torch.testing.assert_close(got, expected.softmax(-1))
    assert ((got > 0).sum(-1) < 300).all() or (top_k == 0 and top_p == 1 and min_p == 0)   # the cuts cut


@pytest.mark.parametrize("arch", ["llama", "gemma", "phi3"])
def test_rope_table_is_the_rotary_module_bit_for_bit(arch):
    """``Backbone.rope`` reads (cos, sin) from a table the model's own rotary module filled: the very values
    the module gives for those positions, across the table's growth; a rope that depends on more than the
    position (dynamic NTK) is never tabled."""
    from selfspec.core.backbone import Backbone
    from tests.conftest import tiny_model

    bb = Backbone(tiny_model(arch))
    like = torch.zeros(1, 1, bb.hidden_size)
    for top in (5, 300, 700):   # 300 and 700 grow the table (it starts at 256 positions)
        pos = torch.tensor([[top - 1, 0, top // 2], [3, top - 2, 1]])
        for got, want in zip(bb.rope(like, pos, top=top), bb.rotary_emb(like, position_ids=pos)):
            assert torch.equal(got, want)
    dynamic = Backbone(tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}))
    assert dynamic._rope_tables is None
    pos = torch.tensor([[0, 1, 2]])
    assert all(torch.equal(a, b) for a, b in zip(dynamic.rope(like, pos, top=3), dynamic.rotary_emb(like, position_ids=pos)))


def test_eagle_head_stacked_projections_follow_their_weights():
    """Decoding, the EAGLE head runs q, k, v (and gate, up) as one product of stacked weights (models/stacked.py): the same
    outputs as the projections one by one (as training runs them), made again when a weight changes in place."""
    from selfspec.core.backbone import Backbone
    from selfspec.model import untrained_heads
    from tests.conftest import jitter, tiny_model

    model = tiny_model("llama")
    head = untrained_heads("eagle", model, "t").module
    jitter(head, 0.3, seed=1)
    bb = Backbone(model)
    feature, emb = torch.randn(2, 3, bb.hidden_size), torch.randn(2, 3, bb.hidden_size)
    rope = bb.rotary_emb(feature, position_ids=torch.arange(3)[None].expand(2, -1))

    def run():
        return head(feature, emb, position_embeddings=rope, cache=kv.new_cache(2))

    for _ in range(2):
        with torch.no_grad():
            fast = run()
        slow = run()   # autograd on: the projections one by one
        assert torch.allclose(fast, slow, atol=1e-5)
        with torch.no_grad():   # trained in place: the stacked copy must follow
            head.midlayer.self_attn.k_proj.weight.mul_(1.5)
            head.midlayer.mlp.up_proj.weight.add_(0.1)


@pytest.mark.parametrize("token_input", [False, True])
def test_medusa_heads_in_one_product_are_the_heads_one_by_one(token_input):
    """Decoding, every Medusa head runs in one product of stacked weights: the heads' outputs one by one
    (as training runs them), made again when a head's weights change in place."""
    from selfspec.model import untrained_heads
    from tests.conftest import jitter, tiny_model

    model = tiny_model("llama")
    heads = untrained_heads("medusa", model, "t", num_heads=3, token_input=token_input).module
    jitter(heads, 0.3, seed=2)
    hidden, emb = torch.randn(2, model.config.hidden_size), torch.randn(2, model.config.hidden_size)
    for _ in range(2):
        with torch.no_grad():
            fast = heads(hidden, emb)
        assert fast.shape == (2, 3, model.config.hidden_size)
        assert torch.allclose(fast, heads(hidden, emb), atol=1e-5)
        with torch.no_grad():
            heads.blocks[1].linear.weight.mul_(1.5)
            heads.blocks[2].linear.bias.add_(0.2)
