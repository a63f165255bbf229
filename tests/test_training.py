"""Training: loss alignment on hand-built tensors, draft vocabulary, checkpoint/resume, a tiny end-to-end run."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, replace

import pytest
import torch
from conftest import distill_dataset, hf_greedy, tiny_model
from torch.nn import functional as F

from selfspec.core.backbone import config_fingerprint
from selfspec.heads import load_heads, read_heads_config
from selfspec.model import SelfSpeculativeModel
from selfspec.settings import DecodeSettings
from selfspec.training.checkpoint import STATE_FILE
from selfspec.training.losses import exit_loss, medusa_loss, to_subset_ids
from selfspec.training.split import GROUP_BATCHES, batch_indices, collate, frequent_vocab, to_sequences
from selfspec.training.train import TrainConfig, train_heads


@pytest.fixture(autouse=True)
def _private_home(tmp_path, monkeypatch):
    """Feature caches and other artefacts go to a per-test SELFSPEC_HOME, not the user's."""
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))


# ---------------------------------------------------------------------------------------------- losses


def _target(B=2, T=7, V=11, seed=0):
    """Random target logits whose rows all differ (distinct argmax per row), so only one alignment matches."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    best = torch.arange(B * T).reshape(B, T) % V
    logits.scatter_(-1, best[..., None], 6.0)
    return logits


def _heads_copying(target, K, delta):
    """Head k at t copies target row t + k + 1 + delta (rows out of range: noise)."""
    B, T, V = target.shape
    out = torch.randn(B, T, K, V, generator=torch.Generator().manual_seed(1))
    for k in range(K):
        for t in range(T):
            s = t + k + 1 + delta
            if 0 <= s < T:
                out[:, t, k] = target[:, s]
    return out


def test_medusa_loss_shift_only_correct_alignment_is_zero():
    target = _target()
    mask = torch.ones(2, 7, dtype=torch.bool)
    right = medusa_loss(_heads_copying(target, 3, 0), target, mask)
    assert float(right.loss) == pytest.approx(0.0, abs=1e-6)
    assert right.top1.tolist() == [1.0, 1.0, 1.0] and right.top5.tolist() == [1.0, 1.0, 1.0]
    assert right.count.tolist() == [2 * 6, 2 * 5, 2 * 4]  # head k has T - k - 1 target rows per sequence
    for delta in (-1, 1, -2):
        wrong = medusa_loss(_heads_copying(target, 3, delta), target, mask)
        assert float(wrong.loss) > 0.5
        assert (wrong.top1 < 1).all()


def test_medusa_loss_mask_selects_target_rows_and_weights_heads():
    target = _target(B=1, T=6)
    heads = _heads_copying(target, 2, 0)
    mask = torch.ones(1, 6, dtype=torch.bool)
    mask[0, :3] = False  # prompt rows: no signal
    heads[0, 0, 0] = torch.randn(11)  # head 0 at t=0 learns from row 1 (masked): garbage there is ignored
    heads[0, 1, 1] = torch.randn(11)  # head 1 at t=1 learns from row 3 (marked): garbage counts
    r = medusa_loss(heads, target, mask, weight_decay_base=0.5)
    assert r.count.tolist() == [3, 3]  # rows 3, 4, 5 for both heads
    assert float(r.kl[0]) == pytest.approx(0.0, abs=1e-6) and float(r.kl[1]) > 0
    assert float(r.loss) == pytest.approx(0.5 * float(r.kl[1]), rel=1e-5)  # weight 0.5**1 on head 1


def test_medusa_hard_tokens_share_the_target_shift():
    target = _target(B=1, T=5, V=7)
    heads = _heads_copying(target, 2, 0)
    mask = torch.ones(1, 5, dtype=torch.bool)
    hard = target.argmax(-1)  # row s's "actual next token" = the target's own argmax
    r = medusa_loss(heads, target, mask, hard_tokens=hard, hard_weight=1.0)
    # With copies of the target, the CE equals the target's own entropy-like term; recompute it by hand.
    expect = 0.0
    for k in range(2):
        rows = torch.arange(k + 1, 5)
        lq = F.log_softmax(target[0, rows], -1)
        expect += 0.8**k * float(-lq.gather(-1, hard[0, rows, None]).mean())
    assert float(r.loss) == pytest.approx(expect, rel=1e-5)


def test_exit_loss_same_position():
    target = _target()
    mask = torch.ones(2, 7, dtype=torch.bool)
    right = exit_loss(target.clone(), target, mask)
    assert float(right.loss) == pytest.approx(0.0, abs=1e-6) and right.top1.tolist() == [1.0]
    wrong = exit_loss(torch.roll(target, 1, dims=1), target, mask)  # the Medusa-style shift is wrong here
    assert float(wrong.loss) > 0.5 and float(wrong.top1[0]) < 1


def test_restricted_vocab_renormalises_the_target():
    target = _target(B=1, T=4, V=10)
    vocab = torch.tensor([1, 3, 4, 7])
    mask = torch.ones(1, 4, dtype=torch.bool)
    # Heads that rank the subset exactly as the target does (any constant offset) have zero loss.
    sub = target[..., vocab] + 3.0
    assert float(exit_loss(sub, target, mask, vocab=vocab).loss) == pytest.approx(0.0, abs=1e-6)
    # Same loss whether the target comes full-width or already restricted.
    other = torch.randn(1, 4, 4)
    a = exit_loss(other, target, mask, vocab=vocab)
    b = exit_loss(other, target[..., vocab], mask, vocab=vocab)
    assert float(a.loss) == pytest.approx(float(b.loss), rel=1e-6)
    p = F.softmax(target[..., vocab], -1)  # renormalised over the subset
    manual = (p * (p.log() - F.log_softmax(other, -1))).sum(-1).mean()
    assert float(a.loss) == pytest.approx(float(manual), rel=1e-5)
    # Medusa too: full-width target with vocab == pre-restricted target.
    h = torch.randn(1, 4, 2, 4)
    assert float(medusa_loss(h, target, mask, vocab=vocab).loss) == pytest.approx(
        float(medusa_loss(h, target[..., vocab], mask).loss), rel=1e-6)
    # Hard tokens map to subset columns; tokens outside the subset have none.
    assert to_subset_ids(torch.tensor([3, 2, 7, 1]), vocab).tolist() == [1, -1, 3, 0]


# ---------------------------------------------------------------------------------------------- data side




def test_frequent_vocab_counts_responses_and_keeps_eos():
    ds = distill_dataset([([9, 9, 9, 5, 5, 2], 3), ([9, 9, 5, 6, 6, 1], 2)])  # responses: 5 5 2 | 5 6 6 1
    assert frequent_vocab(ds, 3, vocab_size=10, eos_token_ids=[8]).tolist() == [5, 6, 8]  # 9 is prompt-only
    assert frequent_vocab(ds, 2, vocab_size=10).tolist() == [5, 6]
    assert frequent_vocab(ds, 4, vocab_size=10).tolist() == [1, 2, 5, 6]  # ties: smaller ids first
    assert frequent_vocab(ds, 0, vocab_size=10) is None and frequent_vocab(ds, 10, vocab_size=10) is None


def test_collate_window_and_mask():
    seqs = to_sequences(distill_dataset([([10, 11, 12, 20, 21, 22], 3), ([10, 20, 21], 1)]), max_len=100)
    b = collate(seqs, lead=0)
    # Rows 2..4 of sequence 0 predict 20, 21, 22; rows 0..1 of sequence 1 predict 20, 21.
    assert b.window[0].tolist() == [2, 3, 4] and b.mask[0].tolist() == [True] * 3
    assert b.next_tokens[0].tolist() == [20, 21, 22]
    assert b.mask[1].tolist() == [True, True, False] and b.next_tokens[1, :2].tolist() == [20, 21]
    b = collate(seqs, lead=2)  # Medusa with 2 heads reads from two positions earlier
    assert b.window[0].tolist() == [0, 1, 2, 3, 4] and b.mask[0].tolist() == [False, False, True, True, True]
    assert to_sequences(distill_dataset([([1, 2, 3, 4, 5, 6], 4)]), max_len=3)[0].response_start == 1


def test_length_grouped_batches_cover_an_epoch_once_with_little_padding():
    g = torch.Generator().manual_seed(0)
    n, bs = 3000, 8
    lengths = tuple(int(x) for x in torch.randint(20, 500, (n,), generator=g))
    per_epoch = n // bs

    def epoch(e, grouped):
        return [batch_indices(n, micro_step=e * per_epoch + s, batch_size=bs, seed=3, lengths=lengths if grouped else None)
                for s in range(per_epoch)]

    def padding(batches):
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches) / \
            sum(lengths[i] for b in batches for i in b)

    first = epoch(0, True)
    seen = [i for b in first for i in b]
    assert all(len(b) == bs for b in first) and len(set(seen)) == len(seen) == per_epoch * bs   # whole batches, no repeats
    assert padding(first) < 0.05 < 0.5 < padding(epoch(0, False))
    assert epoch(0, True) == first and epoch(1, True) != first            # a pure function of (seed, step); epochs differ
    tops = [max(lengths[i] for i in b) for b in first[:2 * GROUP_BATCHES]]
    assert tops != sorted(tops) and tops != sorted(tops, reverse=True)    # batches come in random order, not by length
    small = batch_indices(5, micro_step=1, batch_size=bs, seed=3, lengths=lengths[:5])   # fewer sequences than a batch
    assert len(small) == bs and set(small) <= set(range(5))


# ---------------------------------------------------------------------------------------------- runs


def _self_generated(model, *, n=24, new=24, seed=0):
    """Sequences the tiny model wrote itself: random prompts + its greedy continuation."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        prompt = torch.randint(1, 97, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g)
        out = hf_greedy(model, prompt[None], new)[0]
        rows.append((out.tolist(), len(prompt)))
    return distill_dataset(rows)


def _cfg(tmp_path, name, **kw):
    base = dict(kind="medusa", num_heads=2, steps=4, lr=1e-2, warmup=1, batch_size=4, draft_vocab_size=32,
                eval_fraction=0.2, eval_every=100, save_every=2, out=str(tmp_path / name))
    return TrainConfig(**{**base, **kw})


def test_checkpoint_is_atomic_and_resume_matches_uninterrupted(tmp_path):
    torch.set_num_threads(1)
    model = tiny_model(seed=1)
    ds = distill_dataset([(torch.randint(1, 97, (20,), generator=torch.Generator().manual_seed(i)).tolist(), 8) for i in range(12)])

    straight = train_heads(model, ds, config=_cfg(tmp_path, "a"), name="tiny", progress=False)
    assert straight.step == 4 and not straight.interrupted

    def stop_at_3(step):
        if step == 3:
            raise KeyboardInterrupt

    cut = train_heads(model, ds, config=_cfg(tmp_path, "b"), name="tiny", progress=False, callback=stop_at_3)
    assert cut.interrupted and cut.step == 2
    state = torch.load(tmp_path / "b" / STATE_FILE, weights_only=True)
    assert state["step"] == 2 and state["optimizer"]["state"]  # Adam moments were saved
    fp = config_fingerprint(model.config)
    assert load_heads(tmp_path / "b", expect_kind="medusa", fingerprint=fp).config.provenance["steps"] == 2
    assert not list((tmp_path / "b").glob("*.tmp"))

    with pytest.raises(ValueError, match="--resume"):
        train_heads(model, ds, config=_cfg(tmp_path, "b"), name="tiny", progress=False)
    resumed = train_heads(model, ds, config=_cfg(tmp_path, "b"), name="tiny", progress=False, resume=True)
    assert resumed.step == 4
    a = load_heads(tmp_path / "a", expect_kind="medusa", fingerprint=fp)
    b = load_heads(tmp_path / "b", expect_kind="medusa", fingerprint=fp)
    # Same weights only if the optimizer moments, schedule and batch order all carried over.
    for (k, va), vb in zip(a.module.state_dict().items(), b.module.state_dict().values()):
        torch.testing.assert_close(va, vb, msg=k)
    assert torch.equal(a.draft_vocab, b.draft_vocab) and a.config.provenance["steps"] == 4


def test_lora_medusa2_trains_saves_adapter_and_leaves_the_callers_model_alone(tmp_path):
    import warnings

    torch.set_num_threads(1)
    model = tiny_model(seed=2)
    ids = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    before = model(ids).logits.detach().clone()
    ds = _self_generated(model, n=12, new=12)
    cfg = _cfg(tmp_path, "l", lora=2, num_heads=2, steps=6, lr=5e-2, warmup=1, batch_size=4, save_every=3)
    result = train_heads(model, ds, config=cfg, name="tiny", progress=False)
    assert result.step == 6
    # The caller's model is unchanged: adapters were unloaded, not merged.
    assert not any("lora" in n for n, _ in model.named_parameters())
    torch.testing.assert_close(model(ids).logits, before)

    heads = load_heads(cfg.out, expect_kind="medusa", fingerprint=config_fingerprint(model.config))
    assert heads.config.lora["rank"] == 2 and (tmp_path / "l" / "lora" / "adapter_config.json").is_file()
    tuned = tiny_model(seed=2)
    with pytest.warns(UserWarning, match="fine-tuned"):
        SelfSpeculativeModel._apply_lora(tuned, tmp_path / "l", heads.config)
    after = tuned(ids).logits.detach()
    assert not torch.allclose(after, before)  # Medusa-2 changes the model, and says so
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sm = SelfSpeculativeModel(tuned, None, drafter_name="medusa", heads=heads, tree="auto", name="tiny")
    assert torch.equal(sm.generate(ids, max_new_tokens=16), hf_greedy(tuned, ids, 16))
    with pytest.raises(ValueError, match="lora"):  # resuming with another rank is refused
        train_heads(model, ds, config=_cfg(tmp_path, "l", lora=4, num_heads=2), name="tiny", progress=False, resume=True)


@pytest.mark.parametrize("kind,adapter", [("medusa", "mlp"), ("early-exit", "mlp"), ("early-exit", "layer")])
def test_end_to_end_trained_heads_learn_and_stay_exact(tmp_path, kind, adapter):
    torch.set_num_threads(1)
    model = tiny_model(seed=2)
    ds = _self_generated(model)
    cfg = _cfg(tmp_path, kind, kind=kind, exit_adapter=adapter, num_heads=4, steps=30,
               lr=3e-2 if kind == "medusa" else 3e-3, warmup=3, batch_size=6, draft_vocab_size=48,
               eval_fraction=0.25, eval_every=10, save_every=15)
    result = train_heads(model, ds, config=cfg, name="tiny", progress=False)
    assert result.evals[0].step == 0 and result.evals[-1].step == 30
    assert result.evals[-1].loss < 0.9 * result.evals[0].loss, [e.loss for e in result.evals]

    heads = load_heads(cfg.out, expect_kind=kind, fingerprint=config_fingerprint(model.config), model=model)
    assert heads.config.adapter == adapter
    assert heads.draft_vocab.numel() == 48 and heads.config.draft_vocab_size == 48
    assert heads.config.provenance["steps"] == 30 and heads.config.provenance["tokens_seen"] > 0
    sm = SelfSpeculativeModel(model, None, drafter_name=kind, heads=heads, tree="auto", name="tiny")
    for i in range(3):
        prompt = torch.randint(1, 97, (1, 5), generator=torch.Generator().manual_seed(100 + i))
        out = sm.generate(prompt, max_new_tokens=24, do_sample=False)
        assert torch.equal(out, hf_greedy(model, prompt, 24))


def test_tune_tree_picks_a_measured_tree_that_auto_then_uses(tmp_path):
    from selfspec.heads import save_heads
    from selfspec.training.tune import medusa_rank_accuracy, pick, tune_tree

    torch.set_num_threads(1)
    model = tiny_model(seed=2)
    ds = _self_generated(model, n=12)
    cfg = _cfg(tmp_path, "m", num_heads=3, steps=20, lr=3e-2, warmup=2, batch_size=6, draft_vocab_size=48)
    train_heads(model, ds, config=cfg, name="tiny", progress=False)
    fp = config_fingerprint(model.config)
    heads = load_heads(cfg.out, expect_kind="medusa", fingerprint=fp)
    seqs = to_sequences(ds, max_len=1024)
    acc = medusa_rank_accuracy(model, heads, seqs, max_rank=4)
    assert len(acc) == 3 and all(len(a) == 4 for a in acc)
    assert all(0 <= sum(a) <= 1 + 1e-6 for a in acc)
    best, cands, _ = tune_tree(model, heads, seqs, n_prompts=2, max_new_tokens=8, repeats=1, progress=False)
    assert best == pick(cands) and all(c.tau >= 1.0 and c.speedup > 0 for c in cands)
    assert {c.gate for c in cands} > {0.0} and {c.lookup for c in cands} > {0}   # gated and lookup ones timed too
    for c in cands:   # gates and width fitting only ever verify fewer nodes than the tree has; lookup adds some
        assert 0 <= c.nodes_per_step <= c.size + c.lookup
    heads.config.decode = DecodeSettings(tree=[list(p) for p in best.spec], threshold=best.threshold, gate=best.gate,
                                         lookup=best.lookup)
    save_heads(heads, cfg.out)
    tuned = load_heads(cfg.out, expect_kind="medusa", fingerprint=fp)
    sm = SelfSpeculativeModel(model, None, drafter_name="medusa", heads=tuned, tree="auto", name="tiny")
    assert sm.drafter.tree.paths == tuple(tuple(p) for p in best.spec)
    assert sm.drafter.threshold == best.threshold and sm.drafter.gate == best.gate
    assert sm.drafter.lookup == best.lookup
    prompt = torch.randint(1, 97, (1, 5), generator=torch.Generator().manual_seed(7))
    assert torch.equal(sm.generate(prompt, max_new_tokens=16), hf_greedy(model, prompt, 16))


def test_pick_prefers_the_best_drafting_then_the_cheapest_candidate_within_the_timing_tolerance():
    from selfspec.training.tune import Candidate, pick

    def c(name, speedup, rows):
        return Candidate(spec=name, size=int(rows), tokens_per_s=10 * speedup, tau=1.5, nodes_per_step=rows, speedup=speedup)

    big, small, tiny = c("big", 1.39, 10.7), c("small", 1.33, 4.0), c("tiny", 1.10, 1.0)
    assert pick([big, small, tiny], tolerance=0.05) is small        # 1.33 >= 0.95 * 1.39: tied, and cheaper
    assert pick([big, small, tiny], tolerance=0.0) is big           # no tolerance: the fastest
    assert pick([big, c("small-slow", 1.30, 4.0)], tolerance=0.05) is big   # 1.30 < 1.32: clearly slower
    assert pick([c("a", 1.2, 4.0), c("b", 1.25, 4.0)], tolerance=0.05).spec == "b"   # equal cost: the faster
    with pytest.raises(ValueError):
        pick([])
    # After a second round only the finalists (timed on the most runs) compete.
    fin_big, fin_small = replace(big, runs=24, speedup=1.45), replace(small, runs=24, speedup=1.30)
    assert pick([fin_big, fin_small, replace(tiny, runs=12, speedup=1.50)], tolerance=0.05) is fin_big
    # Of the tied ones, the one that drafts best: the highest tau, taus within TAU_TOLERANCE tied.
    wide = replace(big, tau=2.4)
    assert pick([wide, small, tiny], tolerance=0.05) is wide                      # tied in speed, more tokens a step
    assert pick([wide, small], tolerance=0.0) is wide                             # and the fastest anyway
    assert pick([replace(big, tau=1.52), small], tolerance=0.05) is small         # 1.5 >= 0.98 * 1.52: tied, the cheaper
    assert pick([replace(big, tau=1.6), small], tolerance=0.05).spec == "big"     # 1.5 < 0.98 * 1.6: small drafts clearly worse
    assert pick([replace(big, speedup=1.30, tau=3.0), c("fast", 1.40, 4.0)], tolerance=0.05).spec == "fast"  # speed first


def test_lookup_0_reads_the_same_pick_with_the_lookup_off_and_an_older_second_pick_is_dropped():
    from selfspec.settings import resolve_settings

    decode = DecodeSettings(tree="chain-2", threshold=0.2, gate=0.5, lookup=8)
    assert DecodeSettings.from_json(decode.to_json()) == decode
    assert resolve_settings("medusa", decode) == resolve_settings("medusa", decode, lookup=8)
    off = resolve_settings("medusa", decode, lookup=0)
    assert (off.tree, off.threshold, off.gate, off.lookup) == ("chain-2", 0.2, 0.5, 0)   # one record: its lookup off
    assert resolve_settings("medusa", decode, lookup="0", tree="chain-1").tree == "chain-1"   # a given tree still wins
    # A record of an older tune-tree, which kept a second pick without the lookup: it reads, the second pick dropped.
    old = DecodeSettings.from_json({**decode.to_json(), "without_lookup": {"tree": "chain-4", "lookup": 0}})
    assert old == decode and "without_lookup" not in old.to_json()
    with pytest.raises(ValueError, match="tree must be a tree spec"):
        DecodeSettings.from_json({"lookup": 8, "tree": 3})


def test_sampled_settings_are_what_auto_gives_a_sampled_generate(tmp_path):
    from selfspec.heads import save_heads
    from selfspec.model import untrained_heads
    from selfspec.settings import resolve_settings

    sampled = DecodeSettings(tree="chain-1", threshold=0.3, gate=0.0, lookup=4)
    decode = DecodeSettings(tree="chain-3", threshold=0.0, lookup=8, sampled=sampled)
    assert DecodeSettings.from_json(decode.to_json()) == decode
    assert "sampled" not in decode.to_json()["sampled"] and "sampled" not in DecodeSettings().to_json()
    assert resolve_settings("medusa", decode).tree == "chain-3"                       # greedy: the greedy pick
    on = resolve_settings("medusa", decode, sampling=True)
    assert (on.tree, on.threshold, on.lookup) == ("chain-1", 0.3, 4)                  # sampling: the sampled pick
    off = resolve_settings("medusa", decode, sampling=True, lookup=0)
    assert (off.tree, off.threshold, off.lookup) == ("chain-1", 0.3, 0)               # the sampled pick, lookup off
    assert resolve_settings("medusa", decode, sampling=True, tree="chain-2").tree == "chain-2"   # given values win
    assert resolve_settings("medusa", replace(decode, sampled=None), sampling=True).tree == "chain-3"   # never timed
    for raw, match in (({"sampled": {"sampled": {}}}, "sampled must be a mapping"),
                       ({"sampled": {"tree": 5}}, "tree must be a tree spec")):
        with pytest.raises(ValueError, match=match):
            DecodeSettings.from_json(raw)
    # A model whose heads record both: greedy generate drafts with the greedy pick, sampled with the sampled one.
    model = tiny_model(seed=2)
    heads = untrained_heads("medusa", model, "tiny", num_heads=3)
    heads.config.decode = DecodeSettings(tree=[[0], [0, 0], [0, 0, 0]], lookup=2,
                                         sampled=DecodeSettings(tree=[[0], [1]], threshold=0.2))
    save_heads(heads, tmp_path / "h")
    tuned = load_heads(tmp_path / "h", expect_kind="medusa", fingerprint=config_fingerprint(model.config))
    sm = SelfSpeculativeModel(model, None, drafter_name="medusa", heads=tuned, name="tiny")
    assert sm.drafter.tree.paths == ((0,), (0, 0), (0, 0, 0)) and sm.drafter.lookup == 2
    assert sm.sampled_drafter.tree.paths == ((0,), (1,)) and sm.sampled_drafter.threshold == 0.2
    assert sm.sampled_drafter.lookup == 0 and sm.drafters() == [sm.drafter, sm.sampled_drafter]
    used = []
    for d in sm.drafters():
        d.draft = (lambda real, d=d: lambda *a: used.append(d) or real(*a))(d.draft)
    prompt = torch.randint(1, 97, (1, 5), generator=torch.Generator().manual_seed(7))
    assert torch.equal(sm.generate(prompt, max_new_tokens=12), hf_greedy(model, prompt, 12))
    assert used and all(d is sm.drafter for d in used)
    used.clear()
    sm.generate(prompt, max_new_tokens=12, do_sample=True, temperature=0.7, generator=torch.Generator().manual_seed(1))
    assert used and all(d is sm.sampled_drafter for d in used)
    # Settings the user gives hold for both; where nothing differs the two are one drafter.
    same = SelfSpeculativeModel(model, None, drafter_name="medusa", heads=tuned, name="tiny", tree="chain-2",
                                threshold=0.0, lookup=0)
    assert same.sampled_drafter is same.drafter and same.drafters() == [same.drafter]


def test_tune_tree_at_a_temperature_records_the_sampled_pick_beside_the_greedy_one(tmp_path, capsys):
    from selfspec.card import card
    from selfspec.cli import main
    from selfspec.heads import SAMPLED_SEARCH_FILE, SEARCH_FILE, save_heads
    from selfspec.model import untrained_heads
    from selfspec.training.tune import _record, _rule, pick, tune_tree

    torch.set_num_threads(1)
    model = tiny_model(seed=2)
    heads = untrained_heads("eagle", model, "tiny")
    greedy = DecodeSettings(tree="dynamic-3-2-3", threshold=0.1, lookup=0)
    heads.config.decode = greedy
    save_heads(heads, tmp_path / "e")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 97, (n,), generator=g) for n in (5, 7)]
    _, cands, _ = tune_tree(model, heads, [], n_prompts=1, max_new_tokens=6, progress=False, prompts=prompts,
                            finalists=2, temperature=0.7)
    assert all(c.tau >= 1.0 and c.speedup > 0 for c in cands)
    search = {"prompts": "p.jsonl", "n_prompts": 1, "seed": 0, "finalists": 2,
              "max_new_tokens": 6, "temperature": 0.7, "threads": 1, "candidates": [asdict(c) for c in cands]}
    config = read_heads_config(tmp_path / "e")
    assert _record(tmp_path / "e", config, cands, {**search, **_rule(0.03)}, sampled=True) == 0
    decode = read_heads_config(tmp_path / "e").decode
    best = pick(cands)
    assert replace(decode, sampled=None) == greedy                   # the greedy pick stays
    assert (decode.sampled.tree, decode.sampled.threshold, decode.sampled.lookup) == (best.spec, best.threshold, best.lookup)
    assert not (tmp_path / "e" / SEARCH_FILE).exists() and (tmp_path / "e" / SAMPLED_SEARCH_FILE).is_file()
    text = card(tmp_path / "e", None, None, "cpu")
    assert "## When sampling" in text and "sampled at temperature 0.7" in text
    # --recorded re-picks every record there is; a greedy one recorded later keeps the sampled pick.
    assert main(["tune-tree", "--heads", str(tmp_path / "e"), "--prompts", "unused", "--recorded", "--tolerance", "0"]) == 0
    assert json.loads((tmp_path / "e" / SAMPLED_SEARCH_FILE).read_text())["tolerance"] == 0
    sampled = read_heads_config(tmp_path / "e").decode.sampled
    _record(tmp_path / "e", read_heads_config(tmp_path / "e"), cands, {**search, **_rule(0.03)})
    assert read_heads_config(tmp_path / "e").decode.sampled == sampled
    capsys.readouterr()
    heads_args = ["--heads", str(tmp_path / "e"), "--prompts", "unused"]
    for argv, match in ((heads_args + ["--temperature", "-1"], "--temperature must be a finite number >= 0"),
                        (heads_args + ["--temperature", "inf"], "--temperature must be a finite number >= 0"),
                        (heads_args + ["--temperature", "0.7", "--recorded"], "drop --temperature")):
        assert main(["tune-tree"] + argv) == 2
        assert match in capsys.readouterr().err


def test_settings_tuned_on_a_gpu_are_what_auto_reads_there_and_the_cpu_keeps_its_own(tmp_path, capsys):
    from selfspec.card import card
    from selfspec.cli import main
    from selfspec.core.tree import parse_dynamic_tree
    from selfspec.heads import SEARCH_FILE, recorded_devices, save_heads, search_file
    from selfspec.model import untrained_heads
    from selfspec.runtime.static import BUCKETS
    from selfspec.settings import resolve_settings
    from selfspec.training.tune import EAGLE_GRID, EAGLE_WIDE, Candidate, _record, _rule, eagle_grid

    # A GPU times wide trees too, none over the largest static bucket with its root and copied tokens.
    assert eagle_grid("cpu") == EAGLE_GRID and eagle_grid("cuda") == EAGLE_GRID + EAGLE_WIDE
    assert all(1 + parse_dynamic_tree(t)["nodes"] + k <= BUCKETS[-1] for t, _, k in eagle_grid("cuda"))
    assert max(1 + parse_dynamic_tree(t)["nodes"] + k for t, _, k in EAGLE_WIDE) == BUCKETS[-1]

    cpu = DecodeSettings(tree="chain-3", threshold=0.1, lookup=8, sampled=DecodeSettings(tree="chain-1"))
    gpu = DecodeSettings(tree="chain-6", lookup=12)
    decode = cpu.with_device("cuda", gpu)
    assert DecodeSettings.from_json(decode.to_json()) == decode and decode.to_json()["devices"]["cuda"]["tree"] == "chain-6"
    assert "devices" not in cpu.to_json() and decode.measured_devices() == ("cuda",)
    assert decode.for_device("cpu") == cpu and decode.for_device("cuda") == gpu and decode.for_device("mps") == cpu
    assert decode.with_device("cpu", DecodeSettings(tree="chain-4")).for_device("cuda") == gpu   # each device its own
    assert decode.with_pick(DecodeSettings(tree="chain-4"), sampled=False).for_device("cuda") == gpu
    # "auto" on each kind of device: its own settings (lookup off and sampling alike), else the CPU's.
    assert resolve_settings("medusa", decode, device="cuda").tree == "chain-6"
    assert resolve_settings("medusa", decode, device="cuda", lookup=0).tree == "chain-6"
    assert resolve_settings("medusa", decode, device="cuda", sampling=True).tree == "chain-6"   # not timed sampled there
    assert resolve_settings("medusa", decode).tree == "chain-3" and resolve_settings("medusa", decode, device="mps").tree == "chain-3"
    assert resolve_settings("medusa", decode, device="cpu", sampling=True).tree == "chain-1"
    for raw, match in (({"devices": {"cpu": {}}}, "devices must map device types other than 'cpu'"),
                       ({"devices": ["cuda"]}, "devices must map"),
                       ({"devices": {"cuda": {"devices": {}}}}, "cuda settings must be a mapping"),
                       ({"devices": {"cuda": {"tree": 3}}}, "tree must be a tree spec")):
        with pytest.raises(ValueError, match=match):
            DecodeSettings.from_json(raw)
    # tune-tree on a GPU records there and in its own timings file; the CPU's pick and file stay as they were.
    model = tiny_model(seed=2)
    heads = untrained_heads("medusa", model, "tiny", num_heads=3)
    heads.config.decode = cpu
    save_heads(heads, tmp_path / "h")

    def c(name, speedup, tau, lookup=0):
        return Candidate(spec=name, size=int(name[-1]), tokens_per_s=10 * speedup, tau=tau, nodes_per_step=2.0,
                         speedup=speedup, lookup=lookup, runs=12)

    cands = [c("chain-6", 2.0, 3.0, lookup=12), c("chain-5", 1.6, 2.5), c("chain-2", 1.2, 1.5)]
    search = {"prompts": "p.jsonl", "n_prompts": 1, "seed": 0, "finalists": 0, "max_new_tokens": 6, "threads": 1,
              "hardware": "one NVIDIA H200", "candidates": [asdict(x) for x in cands]}
    assert _record(tmp_path / "h", read_heads_config(tmp_path / "h"), cands, {**search, **_rule(0.03)}, device="cuda") == 0
    assert "on cuda" in capsys.readouterr().out
    got = read_heads_config(tmp_path / "h").decode
    assert got.for_device("cpu") == cpu                                    # the CPU's settings untouched
    mine = got.for_device("cuda")
    assert (mine.tree, mine.lookup) == ("chain-6", 12)
    assert mine.sampled == cpu.sampled   # the mode not timed there reads what it read before
    assert search_file(device="cuda") == "tune-tree-cuda.json" and search_file(sampled=True, device="cuda") == "tune-tree-cuda-sampled.json"
    assert not (tmp_path / "h" / SEARCH_FILE).exists() and (tmp_path / "h" / "tune-tree-cuda.json").is_file()
    assert json.loads((tmp_path / "h" / "tune-tree-cuda.json").read_text())["device"] == "cuda"
    assert recorded_devices(tmp_path / "h") == ("cuda",)
    # A CPU run later replaces only the CPU's; the card shows both, each under its device.
    cpu_cands = [c("chain-2", 1.3, 1.5), c("chain-3", 1.1, 2.5)]
    _record(tmp_path / "h", read_heads_config(tmp_path / "h"), cpu_cands,
            {**search, "hardware": "2 CPU cores", "candidates": [asdict(x) for x in cpu_cands], **_rule(0.03)})
    got = read_heads_config(tmp_path / "h").decode
    assert got.for_device("cpu").tree == "chain-2" and got.for_device("cuda").tree == "chain-6"
    assert recorded_devices(tmp_path / "h") == ("cpu", "cuda")
    text = card(tmp_path / "h", None, None, "cpu")
    assert 'threshold="auto")' in text and 'threshold="auto", on cuda)' in text and "on one NVIDIA H200" in text
    assert "Devices with settings of their own: cuda" in text
    # --recorded picks again on every device's timings, each into its own settings.
    assert main(["tune-tree", "--heads", str(tmp_path / "h"), "--data", "unused", "--recorded", "--tolerance", "0.5"]) == 0
    got = read_heads_config(tmp_path / "h").decode
    assert got.for_device("cuda").tree == "chain-6" and got.for_device("cpu").tree == "chain-3"   # tied at 0.5: higher tau
    assert json.loads((tmp_path / "h" / "tune-tree-cuda.json").read_text())["tolerance"] == 0.5
    # A model on the CPU drafts with the CPU's settings.
    sm = SelfSpeculativeModel(model, None, drafter_name="medusa", heads=load_heads(
        tmp_path / "h", expect_kind="medusa", fingerprint=config_fingerprint(model.config)), name="tiny")
    assert sm.drafter.tree.paths == ((0,), (0, 0), (0, 0, 0))


def test_tune_tree_recorded_chooses_again_from_the_recorded_timings(tmp_path, capsys):
    from selfspec.cli import main
    from selfspec.heads import save_heads
    from selfspec.model import untrained_heads

    model = tiny_model(seed=2)
    heads = untrained_heads("medusa", model, "tiny", num_heads=2)
    rows = lambda spec, speedup, n, k=8: {"spec": spec, "size": len(spec), "tokens_per_s": speedup, "tau": 1.5,  # noqa: E731
                                          "threshold": 0.0, "gate": 0.0, "lookup": k, "nodes_per_step": n, "speedup": speedup}
    save_heads(heads, tmp_path / "h")
    # Heads tuned before the decode/provenance split kept everything, timings included, under "extra".
    cfg_path = tmp_path / "h" / "config.json"
    raw = json.loads(cfg_path.read_text())
    for key in ("decode", "provenance"):
        raw.pop(key)
    raw["extra"] = {"steps": 7, "tree_search": {"held_out_prompts": 8, "max_new_tokens": 16, "threads": 1, "candidates": [
        rows([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], 1.39, 10.7), rows([[0], [0, 0]], 1.33, 4.0),
        rows([[0], [1], [0, 0]], 1.2, 3.0, 0), rows([[0]], 1.1, 1.0, 0)]}}
    cfg_path.write_text(json.dumps(raw))
    before = (tmp_path / "h" / "model.safetensors").read_bytes()
    assert main(["tune-tree", "--heads", str(tmp_path / "h"), "--data", "unused", "--recorded", "--tolerance", "0.05"]) == 0
    fp = config_fingerprint(model.config)
    config = load_heads(tmp_path / "h", expect_kind="medusa", fingerprint=fp).config
    assert config.decode.tree == [[0], [0, 0]] and config.decode.lookup == 8 and config.provenance == {"steps": 7}
    assert "extra" not in json.loads(cfg_path.read_text())
    assert "without_lookup" not in json.loads(cfg_path.read_text())["decode"]   # one pick: lookup=0 runs it without
    tuned = load_heads(tmp_path / "h", expect_kind="medusa", fingerprint=fp)
    for lookup, paths in (("auto", ((0,), (0, 0))), (8, ((0,), (0, 0))), (0, ((0,), (0, 0)))):
        sm = SelfSpeculativeModel(model, None, drafter_name="medusa", heads=tuned, name="tiny", lookup=lookup)
        assert sm.drafter.tree.paths == paths and sm.drafter.lookup == (0 if lookup == 0 else 8)
    from selfspec.card import card
    from selfspec.training.tune import TAU_TOLERANCE

    text = card(tmp_path / "h", None, None, "cpu")   # the model card names the pick
    assert "lookup 8." in text and "[(0,), (0, 0)]" in text
    assert json.loads((tmp_path / "h" / "tune-tree.json").read_text())["tolerance"] == 0.05
    assert json.loads((tmp_path / "h" / "tune-tree.json").read_text())["tau_tolerance"] == TAU_TOLERANCE
    assert "drafts best: the highest tau" in text          # the card states the rule the pick followed
    record = json.loads((tmp_path / "h" / "tune-tree.json").read_text())
    (tmp_path / "h" / "tune-tree.json").write_text(json.dumps({k: v for k, v in record.items() if k != "tau_tolerance"}))
    old_rule = card(tmp_path / "h", None, None, "cpu")     # a record made before that rule: the rule of its day
    assert "the one that verifies the fewest nodes per step." in old_rule and "highest tau" not in old_rule
    assert main(["tune-tree", "--heads", str(tmp_path / "h"), "--data", "unused", "--recorded", "--tolerance", "0"]) == 0
    assert load_heads(tmp_path / "h", expect_kind="medusa", fingerprint=fp).config.decode.tree[-1] == [0, 0, 0]
    assert (tmp_path / "h" / "model.safetensors").read_bytes() == before   # only the choice changes
    capsys.readouterr()
    empty = untrained_heads("medusa", model, "tiny", num_heads=2)
    save_heads(empty, tmp_path / "e")
    assert main(["tune-tree", "--heads", str(tmp_path / "e"), "--data", "unused", "--recorded"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "records no tune-tree timings" in err[0]
    (tmp_path / "h" / "tune-tree.json").write_text('{"candidates": [')   # torn by hand: refused in one line
    config_before = (tmp_path / "h" / "config.json").read_text()
    assert main(["tune-tree", "--heads", str(tmp_path / "h"), "--data", "unused", "--recorded"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tune-tree.json is not a tune-tree record" in err[0]
    assert (tmp_path / "h" / "config.json").read_text() == config_before


@pytest.mark.parametrize("kind,adapter", [("medusa", "mlp"), ("early-exit", "layer")])
def test_cached_features_give_the_losses_of_a_live_backbone_pass(tmp_path, kind, adapter):
    from selfspec.training.features import extract_features, feature_cache_path, target_view
    from selfspec.training.tasks import HEAD_TASKS

    torch.set_num_threads(1)
    model = tiny_model(seed=3)
    ds = _self_generated(model, n=8, new=10)
    seqs = to_sequences(ds, max_len=1024)
    cfg = _cfg(tmp_path, "f", kind=kind, exit_adapter=adapter, num_heads=3, batch_size=3)
    from selfspec.model import untrained_heads

    heads = untrained_heads(kind, model, "tiny", num_heads=3, exit_layer=2, adapter=adapter)
    with torch.no_grad():  # non-trivial heads, so the comparison means something
        for p in heads.module.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    target = target_view(model, vocab=None, exit_layer=2 if kind == "early-exit" else None)
    feats = extract_features(model, seqs, exit_layer=2, batch_size=3, device="cpu", progress=False)
    assert feature_cache_path(model, seqs, exit_layer=2).is_file()
    task = HEAD_TASKS[kind](cfg, target=target, device="cpu")
    live = task.evaluate(heads.module, seqs, step=0)
    cached = task.evaluate(heads.module, seqs, step=0, features=feats, feature_ids=list(range(len(seqs))))
    assert cached.loss == pytest.approx(live.loss, rel=2e-2, abs=1e-3)   # float16 storage, nothing else
    assert cached.top1 == pytest.approx(live.top1, abs=0.05)
    again = extract_features(model, seqs, exit_layer=2, batch_size=3, device="cpu", progress=False)
    assert torch.equal(again.final[0], feats.final[0])  # read back from disk


def test_feature_cache_is_chunked_so_appended_data_reuses_earlier_chunks(tmp_path, monkeypatch):
    import selfspec.training.features as features_mod

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(features_mod, "FEATURE_CHUNK", 3)
    torch.set_num_threads(1)
    model = tiny_model(seed=3)
    seqs = to_sequences(_self_generated(model, n=10, new=6), max_len=1024)
    first = features_mod.extract_features(model, seqs[:6], exit_layer=2, batch_size=4, device="cpu", progress=False)
    files = {p: p.stat().st_mtime_ns for p in (tmp_path / "features").iterdir()}
    assert len(files) == 2
    grown = features_mod.extract_features(model, seqs, exit_layer=2, batch_size=4, device="cpu", progress=False)
    after = {p: p.stat().st_mtime_ns for p in (tmp_path / "features").iterdir()}
    assert len(after) == 2 + 2 and all(after[p] == t for p, t in files.items())  # old chunks untouched
    assert all(torch.equal(a, b) for a, b in zip(first.final, grown.final[:6]))
    for a, s in zip(grown.exit, seqs):
        assert a.shape == (len(s.ids), model.config.hidden_size)
    bf16 = features_mod.extract_features(model, seqs, exit_layer=2, batch_size=4, device="cpu", dtype="bfloat16", progress=False)
    assert len(list((tmp_path / "features").iterdir())) == 4 + 4  # another precision, another key
    for a, b in zip(grown.final, bf16.final):
        assert (a.float() - b.float()).abs().max() < 0.1 * a.float().abs().max()
        assert not torch.equal(a, b)
    with pytest.raises(ValueError, match="feature dtype"):
        features_mod.extract_features(model, seqs, exit_layer=2, batch_size=4, device="cpu", dtype="float16", progress=False)


def test_token_input_heads_see_the_same_root_in_training_eval_and_tree_tuning(tmp_path):
    """Training (window + next_tokens) and tune-tree (explicit indexing) pick the root independently:
    with random token weights, their head-k top-1 accuracies agree only if both feed x[t + 1]."""
    from selfspec.model import untrained_heads
    from selfspec.training.features import target_view
    from selfspec.training.tasks import MedusaTask
    from selfspec.training.tune import medusa_rank_accuracy

    torch.set_num_threads(1)
    model = tiny_model(seed=4)
    from selfspec.training.split import Sequence

    # Wholly self-generated (one-token prompts, response from position 1): both count the same
    # positions, and the data's tokens are the teacher's argmax.
    seqs = [Sequence(ids=hf_greedy(model, torch.tensor([[t]]), 16)[0], response_start=1) for t in (3, 17, 42, 80)]
    heads = untrained_heads("medusa", model, "tiny", num_heads=3, token_input=True)
    with torch.no_grad():
        for block in heads.module.blocks:
            block.token.weight.copy_(torch.randn(block.token.weight.shape, generator=torch.Generator().manual_seed(5)))
    cfg = _cfg(tmp_path, "r", kind="medusa", num_heads=3, batch_size=2)
    ev = MedusaTask(cfg, target=target_view(model, vocab=None, exit_layer=None), device="cpu").evaluate(heads.module, seqs, step=0)
    ranks = medusa_rank_accuracy(model, heads, seqs, max_rank=1)
    assert [r[0] for r in ranks] == pytest.approx(ev.top1, abs=1e-6)
    assert 0 < ev.top1[0] < 1  # the token weights matter: neither all right nor all wrong
    with pytest.raises(ValueError, match="root"):
        heads.module(torch.zeros(2, model.config.hidden_size))


def test_rank_accuracy_skips_heads_a_short_response_cannot_reach():
    """A response of one or two tokens gives deeper heads no target; it must count nothing for them, not fail."""
    from selfspec.model import untrained_heads
    from selfspec.training.split import Sequence
    from selfspec.training.tune import medusa_rank_accuracy

    torch.set_num_threads(1)
    model = tiny_model(seed=4)
    heads = untrained_heads("medusa", model, "tiny", num_heads=3, token_input=True)
    ids = hf_greedy(model, torch.tensor([[3, 9, 11]]), 8)[0]
    seqs = [Sequence(ids=ids[:4], response_start=3), Sequence(ids=ids[:5], response_start=3),
            Sequence(ids=ids, response_start=3)]
    acc = medusa_rank_accuracy(model, heads, seqs, max_rank=1)
    assert [a[0] for a in acc] == pytest.approx(_brute_force_top1(model, heads, seqs), abs=1e-6)


def _brute_force_top1(model, heads, seqs):
    """Per head: share of decode positions t whose drafted top-1 (one fresh forward of ids[:t + 1]) is right."""
    from selfspec.core.backbone import Backbone

    bb, vocab = Backbone(model), heads.draft_vocab
    w = bb.lm_head.weight if vocab is None else bb.lm_head.weight[vocab]
    K = heads.config.num_heads if heads.config.kind == "medusa" else 1
    hits, total = [0] * K, [0] * K
    with torch.no_grad():
        for s in seqs:
            ids = s.ids
            for t in range(s.response_start - 1, len(ids) - 1):
                out = model.model(input_ids=ids[None, : t + 1], output_hidden_states=True)
                for k in range(K):
                    target = t + k + 2 if heads.config.kind == "medusa" else t + 1
                    if target >= len(ids):
                        continue
                    if heads.config.kind == "medusa":
                        root = bb.embed_tokens(ids[t + 1 : t + 2])[0]
                        z = heads.module(out.last_hidden_state[0, -1], root)[k] @ w.T
                    else:
                        h = heads.module(out.hidden_states[heads.config.exit_layer][:, -1:])
                        z = bb.final_norm(h)[0, 0] @ w.T
                    best = int(z.argmax()) if vocab is None else int(vocab[z.argmax()])
                    hits[k] += best == int(ids[target])
                    total[k] += 1
    return [h / n for h, n in zip(hits, total)]


@pytest.mark.parametrize("kind", ["medusa", "early-exit"])
def test_eval_heads_scores_unseen_prompts_where_decoding_uses_the_heads(tmp_path, monkeypatch, kind):
    from test_training_data import make_model, make_tokenizer

    from selfspec.training.data import generate_distillation_data, load_distillation_data
    from selfspec.training.evaluate import eval_heads

    torch.set_num_threads(1)
    model, tokenizer = make_model(), make_tokenizer(chat=True)
    g = torch.Generator().manual_seed(0)
    words = lambda n: " ".join(f"w{int(i)}" for i in torch.randint(0, 58, (n,), generator=g))  # noqa: E731
    train_rows = [{"id": f"t{i}", "prompt": words(5)} for i in range(16)]
    dev_rows = [{"id": f"d{i}", "prompt": words(6)} for i in range(4)]
    ds = generate_distillation_data(model, tokenizer, train_rows, tmp_path / "train", max_new_tokens=10,
                                    batch_size=1, progress=False)
    cfg = _cfg(tmp_path, "h", kind=kind, num_heads=3, steps=15, lr=3e-2, warmup=2, batch_size=4,
               draft_vocab_size=40, exit_intermediate=32)
    train_heads(model, ds, config=cfg, name="tiny", progress=False)
    heads = load_heads(cfg.out, expect_kind=kind, fingerprint=config_fingerprint(model.config))

    held = to_sequences(ds, max_len=1024)[:3]
    r = eval_heads(model, tokenizer, heads, dev_rows, max_new_tokens=10, batch_size=1, held_out=held, progress=False)
    n_heads = 3 if kind == "medusa" else 1
    assert r["kind"] == kind and r["prompts"] == 4 and len(r["top1"]) == n_heads
    assert all(0 <= a <= b <= 1 for a, b in zip(r["top1"], r["top5"]))
    # An independent count: draft from a fresh forward at every decode position, compare with the answer.
    seqs = to_sequences(load_distillation_data(r["data"]), max_len=1024)
    assert r["top1"] == pytest.approx(_brute_force_top1(model, heads, seqs), abs=1e-6)
    assert r["held_out_train_split"]["top1"] == pytest.approx(_brute_force_top1(model, heads, held), abs=1e-6)
    # The answers are cached: a second evaluation does not generate again.
    monkeypatch.setattr(model, "generate", lambda *a, **k: pytest.fail("answers were generated twice"))
    assert eval_heads(model, tokenizer, heads, dev_rows, max_new_tokens=10, batch_size=1, progress=False)["top1"] == r["top1"]
    from selfspec.training.evaluate import plot_accuracy

    plot_accuracy({**r, "heads": str(cfg.out), "prompts_file": "dev.jsonl"}, tmp_path / "acc.png", name=str)
    assert (tmp_path / "acc.png").stat().st_size > 1000


def test_eval_heads_cli_rejects_a_directory_without_heads(tmp_path, capsys):
    from selfspec.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    assert main(["eval-heads", "--heads", str(tmp_path), "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a heads directory" in err[0]


def _grown_data_run(tmp_path, *, n_rows: int, first: int, **cfg):
    """A tiny model with ``first`` of ``n_rows`` prompts answered into tmp_path/data and heads trained on
    them; returns (model, data, config, answer), where ``answer(n, out)`` answers the first n prompts."""
    from test_training_data import make_model, make_tokenizer

    from selfspec.training.data import generate_distillation_data

    torch.set_num_threads(1)
    model, tokenizer = make_model(), make_tokenizer(chat=True)
    rows = [{"id": f"p{i}", "prompt": " ".join(f"w{(i * 7 + j) % 58}" for j in range(4))} for i in range(n_rows)]
    data = tmp_path / "data"
    ds = generate_distillation_data(model, tokenizer, rows[:first], data, max_new_tokens=4, batch_size=4, progress=False)
    run = _cfg(tmp_path, "first", **cfg)
    train_heads(model, ds, config=run, name="tiny", data_dir=str(data), progress=False)

    def answer(n: int = n_rows, out=data):  # answer the first n prompts into out (resumes)
        return generate_distillation_data(model, tokenizer, rows[:n], out, max_new_tokens=4, batch_size=4, progress=False)

    return model, data, run, answer


def test_held_out_split_ignores_data_appended_after_training(tmp_path):
    from selfspec.training.tune import heldout_sequences

    model, data, cfg, answer = _grown_data_run(tmp_path, n_rows=30, first=20, steps=2, draft_vocab_size=0,
                                             eval_fraction=0.25)
    heads = load_heads(cfg.out, expect_kind="medusa", fingerprint=config_fingerprint(model.config))
    assert heads.config.provenance["sequences"] == 20
    before = [s.ids.tolist() for s in heldout_sequences(str(data), heads)]
    assert len(before) == 5
    # The directory grows (gen-data resumed with more prompts): the held-out split must not move.
    answer()
    assert [s.ids.tolist() for s in heldout_sequences(str(data), heads)] == before
    # A directory with fewer sequences than the run saw is the wrong one.
    small = tmp_path / "small"
    answer(10, small)
    with pytest.raises(ValueError, match="trained on 20 sequences"):
        heldout_sequences(str(small), heads)


def test_held_out_split_over_several_directories_is_pinned_per_directory(tmp_path):
    from test_training_data import make_model, make_tokenizer

    from selfspec.training.data import generate_distillation_data, load_distillation_data, row_counts, select_prompts
    from selfspec.training.tune import heldout_sequences

    torch.set_num_threads(1)
    model, tokenizer = make_model(), make_tokenizer(chat=True)
    rows = [{"id": f"p{i}", "prompt": " ".join(f"w{(i * 7 + j) % 58}" for j in range(4))} for i in range(30)]
    a, b = tmp_path / "a", tmp_path / "b"
    generate_distillation_data(model, tokenizer, rows[:12], a, max_new_tokens=4, batch_size=4, progress=False)
    generate_distillation_data(model, tokenizer, select_prompts(rows[:4], samples=2), b, max_new_tokens=4, batch_size=4,
                               temperature=1.0, progress=False)
    spec = f"{a},{b}"
    cfg = _cfg(tmp_path, "h", steps=2, draft_vocab_size=0, eval_fraction=0.25)
    train_heads(model, load_distillation_data(spec), config=cfg, name="tiny", data_dir=spec, data_rows=row_counts(spec),
                progress=False)
    heads = load_heads(cfg.out, expect_kind="medusa", fingerprint=config_fingerprint(model.config))
    assert heads.config.provenance["rows"] == [12, 8] and heads.config.provenance["data"] == spec
    before = [s.ids.tolist() for s in heldout_sequences(spec, heads)]
    assert len(before) == 5
    # The first directory grows: rows appended to it must not shift the second's rows into the split.
    generate_distillation_data(model, tokenizer, rows, a, max_new_tokens=4, batch_size=4, progress=False)
    assert [s.ids.tolist() for s in heldout_sequences(spec, heads)] == before
    with pytest.raises(ValueError, match="read 2 data directories but 1 were given"):
        heldout_sequences(str(a), heads)


def test_warm_start_keeps_the_init_weights_vocabulary_and_held_out_split(tmp_path):
    from selfspec.training.split import recorded_split
    from selfspec.training.tune import heldout_sequences

    model, data, first, answer = _grown_data_run(tmp_path, n_rows=40, first=20, steps=3, draft_vocab_size=16,
                                               eval_fraction=0.25)
    fp = config_fingerprint(model.config)
    init = load_heads(first.out, expect_kind="medusa", fingerprint=fp)
    init_train, init_held = recorded_split(str(data), init)
    key = lambda s: tuple(s.ids.tolist())  # noqa: E731

    # The data grows, then a warm-started run with lr 0 must end where the init ended, on the init's vocabulary.
    ds = answer()
    warm = _cfg(tmp_path, "warm", steps=2, lr=0.0, draft_vocab_size=16, eval_fraction=0.25, init=first.out)
    train_heads(model, ds, config=warm, name="tiny", data_dir=str(data), progress=False)
    heads = load_heads(warm.out, expect_kind="medusa", fingerprint=fp)
    assert torch.equal(heads.draft_vocab, init.draft_vocab)
    for name, tensor in heads.module.state_dict().items():
        torch.testing.assert_close(tensor, init.module.state_dict()[name])
    # Its held-out split keeps every sequence the init held out and none it trained on, and tune-tree
    # and eval-heads rebuild exactly that split.
    trained, held = recorded_split(str(data), heads)
    held_keys = {key(s) for s in held}
    assert {key(s) for s in init_held} <= held_keys
    assert not held_keys & {key(s) for s in init_train}
    assert len(trained) + len(held) == 40 and len(held) > len(init_held)
    assert [key(s) for s in heldout_sequences(str(data), heads)] == [key(s) for s in held]

    with pytest.raises(ValueError, match="num_heads 2 \\(this run: 3\\)"):
        train_heads(model, ds, config=_cfg(tmp_path, "bad", num_heads=3, init=first.out), name="tiny",
                    data_dir=str(data), progress=False)
    assert heads.config.provenance["init"]["path"] == first.out and heads.config.provenance["init"]["steps"] == 3
    # Each stage records where it trained, and the model card names that, not the machine writing the card.
    from selfspec.card import card, this_hardware
    assert heads.config.provenance["hardware"] == heads.config.provenance["init"]["hardware"] == this_hardware("cpu")
    raw = json.loads((tmp_path / "warm" / "config.json").read_text())
    raw["provenance"]["init"]["hardware"] = "one test GPU"
    (tmp_path / "warm" / "config.json").write_text(json.dumps(raw))
    text = card(tmp_path / "warm", None, None, "the card writer's box")
    assert f"s on {this_hardware('cpu')} (the one-off" in text and "s on one test GPU) on:" in text
    assert "card writer" not in text
    # On a machine without the init's data its split cannot be rebuilt: one line that says so, not a data error.
    moved = tmp_path / "moved"
    data.rename(moved)
    with pytest.raises(ValueError, match="trained on .*, which is not here"):
        train_heads(model, ds, config=_cfg(tmp_path, "gone", steps=1, draft_vocab_size=16, init=first.out), name="tiny",
                    data_dir=str(moved), progress=False)


def test_head_mlp_grows_trained_heads_without_changing_them_then_trains(tmp_path):
    """--head-mlp on a warm start adds a zero-initialised residual MLP to chosen heads: at lr 0 the
    grown heads predict exactly what the init did; trained, the MLP moves and the loss goes down."""
    model, data, first, answer = _grown_data_run(tmp_path, n_rows=20, first=20, steps=3, draft_vocab_size=16)
    ds, d = answer(), str(data)
    fp = config_fingerprint(model.config)
    init = load_heads(first.out, expect_kind="medusa", fingerprint=fp)
    start = float(init.config.provenance["eval"]["loss"])

    same = _cfg(tmp_path, "same", steps=1, lr=0.0, draft_vocab_size=16, head_mlp="16", init=first.out)
    train_heads(model, ds, config=same, name="tiny", data_dir=d, progress=False)
    grown = load_heads(same.out, expect_kind="medusa", fingerprint=fp)
    assert grown.config.head_mlp == [16, 0]
    assert grown.module.blocks[0].mlp.up.weight.shape == (16, model.config.hidden_size)
    assert grown.module.blocks[1].mlp is None
    h, e = torch.randn(5, model.config.hidden_size), torch.randn(5, model.config.hidden_size)
    torch.testing.assert_close(grown.module(h, e), init.module(h, e))

    run = _cfg(tmp_path, "grown", steps=6, draft_vocab_size=16, head_mlp="16", init=first.out)
    trained = train_heads(model, ds, config=run, name="tiny", data_dir=d, progress=False)
    heads = load_heads(run.out, expect_kind="medusa", fingerprint=fp)
    assert heads.module.blocks[0].mlp.down.weight.abs().sum() > 0
    assert trained.evals[-1].loss < start
    # Greedy output is still the target's own with the grown heads.
    sm = SelfSpeculativeModel(model, None, drafter_name="medusa", heads=heads, tree="chain-2", name="tiny")
    prompt = torch.tensor([ds[0]["input_ids"][:6]])
    assert sm.generate(prompt, max_new_tokens=12).tolist() == hf_greedy(model, prompt, 12).tolist()

    with pytest.raises(ValueError, match="head_mlp \\[16, 0\\] \\(this run: \\[8, 0\\]\\)"):
        train_heads(model, ds, config=_cfg(tmp_path, "bad", head_mlp="8", init=run.out), name="tiny", data_dir=d, progress=False)
    with pytest.raises(ValueError, match="--head-mlp takes comma-separated widths"):
        train_heads(model, ds, config=_cfg(tmp_path, "bad2", head_mlp="wide"), name="tiny", data_dir=d, progress=False)
    with pytest.raises(ValueError, match="--head-mlp widens Medusa heads"):
        train_heads(model, ds, config=_cfg(tmp_path, "bad3", kind="early-exit", head_mlp="8"), name="tiny", data_dir=d, progress=False)


def test_held_out_rows_are_recorded_as_a_compact_string():
    from selfspec.training.split import decode_rows, encode_rows

    rows = [0, 1, 2, 5, 9, 10, 11, 40]
    assert encode_rows(rows) == "0-2,5,9-11,40" and decode_rows("0-2,5,9-11,40") == rows
    assert encode_rows([]) == "" and decode_rows("") == [] and decode_rows(None) is None
    assert decode_rows([3, 4]) == [3, 4]   # configs written before the string form hold a plain list


def test_tune_tree_times_eagle_heads_on_given_prompts(tmp_path, capsys):
    from selfspec.cli import main
    from selfspec.heads import save_heads
    from selfspec.model import untrained_heads
    from selfspec.training.tune import EAGLE_GRID, pick, tune_tree

    torch.set_num_threads(1)
    model = tiny_model(seed=2)
    heads = untrained_heads("eagle", model, "tiny")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 97, (n,), generator=g) for n in (5, 7, 6)]
    best, cands, acc = tune_tree(model, heads, [], n_prompts=2, max_new_tokens=6, repeats=1, progress=False,
                                 prompts=prompts, finalists=3)
    assert acc is None and best == pick(cands) and len(cands) == len(EAGLE_GRID)
    # The second round re-timed at most 3 of the fastest on the prompt left over; the pick is one of them.
    finalists = [c for c in cands if c.runs == 3]
    assert 1 <= len(finalists) <= 3
    assert best in finalists and all(c.runs in (2, 3) for c in cands)
    assert {c.threshold for c in cands} > {0.0} and all(c.tau >= 1.0 and c.speedup > 0 for c in cands)
    with pytest.raises(ValueError, match="no prompts"):
        tune_tree(model, heads, [], n_prompts=2, progress=False, prompts=[])
    # The CLI needs the training data, or prompts to time on (Medusa: the data in any case).
    save_heads(heads, tmp_path / "e")
    save_heads(untrained_heads("medusa", model, "tiny", num_heads=2), tmp_path / "m")
    (tmp_path / "p.jsonl").write_text('{"prompt": "hello"}\n')
    assert main(["tune-tree", "--heads", str(tmp_path / "e")]) == 2
    assert "--prompts" in capsys.readouterr().err
    assert main(["tune-tree", "--heads", str(tmp_path / "m"), "--prompts", str(tmp_path / "p.jsonl")]) == 2
    assert "rank accuracy" in capsys.readouterr().err
    assert main(["tune-tree", "--heads", str(tmp_path / "e"), "--prompts", str(tmp_path / "missing.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.parametrize("var", ["ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"])
def test_sharded_launches_are_refused_even_where_accelerate_would_fall_back_to_ddp(monkeypatch, var):
    # On a CPU accelerate runs an FSDP or DeepSpeed launch as plain data parallelism; the launcher's flag tells.
    from selfspec.training.loop import make_accelerator

    monkeypatch.setenv(var, "true")
    with pytest.raises(ValueError, match="launches are not supported.*multi_gpu.yaml"):
        make_accelerator(torch.nn.Linear(2, 2), grad_accum=1)


def test_tune_tree_for_a_draft_model_records_the_pick_for_that_pair(tmp_path, monkeypatch, capsys):
    """tune-tree --draft-model times the chains of DRAFT_GRID, records the pick under $SELFSPEC_HOME
    for this (target, draft) pair, and the draft-model drafter's "auto" settings then read it; another
    draft keeps the defaults, and decoding stays exact."""
    from test_bad_input import _tokenizer

    from selfspec.cli import main
    from selfspec.settings import DRAFTER_SETTINGS
    from selfspec.training.tune import DRAFT_GRID, pick, tune_draft_model
    from selfspec.tuned_pairs import pair_record_path, write_pair_record

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    torch.set_num_threads(1)
    model = tiny_model("llama", seed=3)
    draft = tiny_model("llama", seed=3)
    with torch.no_grad():   # a draft close to the target: partial acceptance
        g = torch.Generator().manual_seed(9)
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.abs().mean())
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 97, (n,), generator=g) for n in (5, 7)]
    best, cands = tune_draft_model(model, draft, prompts, max_new_tokens=6, repeats=1, progress=False)
    assert best == pick(cands) and [(c.spec, c.threshold) for c in cands] == list(DRAFT_GRID)
    assert all(c.tau >= 1.0 and c.speedup > 0 and 0 <= c.nodes_per_step <= c.size for c in cands)
    with pytest.raises(ValueError, match="no prompts"):
        tune_draft_model(model, draft, [], progress=False)

    default = DRAFTER_SETTINGS["draft-model"]
    sm = SelfSpeculativeModel(model, None, drafter_name="draft-model", heads=None, draft_model=draft, name="tiny")
    assert (sm.settings.tree, sm.settings.threshold) == (default.tree, default.threshold)   # not tuned yet
    write_pair_record(model, draft, DecodeSettings(tree="chain-6", threshold=0.3), {("cpu", False): {"candidates": []}})
    sm = SelfSpeculativeModel(model, None, drafter_name="draft-model", heads=None, draft_model=draft, name="tiny")
    assert (sm.settings.tree, sm.settings.threshold) == ("chain-6", 0.3)
    assert sm.drafter.threshold == 0.3 and sm.drafter.tree.size == 7
    prompt = torch.randint(3, 97, (1, 6), generator=g)
    assert torch.equal(sm.generate(prompt, max_new_tokens=16), hf_greedy(model, prompt, 16))
    given = SelfSpeculativeModel(model, None, drafter_name="draft-model", heads=None, draft_model=draft, name="tiny", tree="chain-2",
                                 threshold=0)
    assert (given.settings.tree, given.settings.threshold) == ("chain-2", 0.0)   # what the user gives wins
    # The same draft converted to bfloat16 (as drafting does) is the same pair; another draft is not.
    bf16 = SelfSpeculativeModel(model, None, drafter_name="draft-model", heads=None, draft_model=copy.deepcopy(draft).bfloat16(),
                                name="tiny")
    assert bf16.settings.tree == "chain-6"
    other = SelfSpeculativeModel(model, None, drafter_name="draft-model", heads=None, draft_model=tiny_model("llama", seed=5),
                                 name="tiny")
    assert other.settings.tree == default.tree
    # A torn record is refused in one line.
    pair_record_path(model, draft).write_text('{"decode": ')
    with pytest.raises(ValueError, match="not a tune-tree record"):
        SelfSpeculativeModel(model, None, drafter_name="draft-model", heads=None, draft_model=draft, name="tiny")
    # ... but settings given in full never read it, so a torn record cannot block them.
    given = SelfSpeculativeModel(model, None, drafter_name="draft-model", heads=None, draft_model=draft, name="tiny",
                                 tree="chain-3", threshold=0.5)
    assert (given.settings.tree, given.settings.threshold) == ("chain-3", 0.5)

    # The command: times, prints every candidate, records; --recorded chooses again without timing.
    for name, m in (("target", model), ("draft", draft)):
        m.save_pretrained(tmp_path / name)
        _tokenizer().save_pretrained(tmp_path / name)
    (tmp_path / "p.jsonl").write_text('{"prompt": "w3 w4 w5"}\n{"prompt": "w6 w7 w8 w9"}\n')
    argv = ["tune-tree", "--model", str(tmp_path / "target"), "--draft-model", str(tmp_path / "draft"),
            "--prompts", str(tmp_path / "p.jsonl"), "--prompts-n", "2", "--max-new-tokens", "4", "--repeats", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("verified/step") == len(DRAFT_GRID) and "recorded in" in out
    record = json.loads(next((tmp_path / "home" / "tuned" / "draft-model").glob("*.json")).read_text())
    assert len(record["candidates"]) == len(DRAFT_GRID) and record["decode"]["tree"].startswith("chain-")
    assert main(argv[:5] + ["--recorded", "--tolerance", "0"]) == 0
    fastest = max(record["candidates"], key=lambda c: c["speedup"])
    assert f"is now {fastest['spec']}, threshold=auto {fastest['threshold']}" in capsys.readouterr().out
    # --temperature: a sampled pick beside the greedy one, which stays; "auto" gives it to sampled decoding.
    path = next((tmp_path / "home" / "tuned" / "draft-model").glob("*.json"))
    greedy = json.loads(path.read_text())
    assert main(argv + ["--temperature", "0.7"]) == 0
    assert "when sampling is now chain-" in capsys.readouterr().out
    both = json.loads(path.read_text())
    assert {k: v for k, v in both["decode"].items() if k != "sampled"} == greedy["decode"]
    assert both["sampled_search"]["temperature"] == 0.7 and len(both["sampled_search"]["candidates"]) == len(DRAFT_GRID)
    assert both["candidates"] == greedy["candidates"]   # the greedy timings stay too
    sampled = DecodeSettings.from_json(both["decode"]).sampled
    sm = SelfSpeculativeModel(model, None, drafter_name="draft-model", heads=None, draft_model=draft, name="tiny")
    assert (sm.sampled_settings.tree, sm.sampled_settings.threshold) == (sampled.tree, sampled.threshold)
    assert sm.settings.tree == greedy["decode"]["tree"]
    assert main(argv[:5] + ["--recorded", "--tolerance", "0"]) == 0   # re-picks both records
    out = capsys.readouterr().out
    assert "when sampling is now" in out and out.count("is now") == 2
    assert json.loads(path.read_text())["sampled_search"]["tolerance"] == 0

    # Per kind of device, as for heads: a GPU's pick (what a run there records) is what "auto" reads on
    # a GPU; a CPU run leaves it and its timings alone; --recorded re-picks it with the rest.
    from selfspec.settings import resolve_settings
    from selfspec.tuned_pairs import pair_decode, pair_searches, read_pair_record

    rec = read_pair_record(model, draft)
    gpu_cands = [dict(c, speedup=9.0 if c["spec"] == "chain-2" and c["threshold"] == 0.0 else c["speedup"])
                 for c in rec["candidates"]]
    gpu_search = {"device": "cuda", "candidates": gpu_cands, "tolerance": 0.0}
    decode = DecodeSettings.from_json(rec["decode"])
    write_pair_record(model, draft, decode.with_device("cuda", DecodeSettings(tree="chain-2", threshold=0.0)),
                      {**pair_searches(rec), ("cuda", False): gpu_search})
    on_gpu = resolve_settings("draft-model", pair_decode(model, draft), device="cuda")
    assert (on_gpu.tree, on_gpu.threshold) == ("chain-2", 0.0)
    sm = SelfSpeculativeModel(model, None, drafter_name="draft-model", heads=None, draft_model=draft, name="tiny")
    assert sm.settings.tree == rec["decode"]["tree"]                       # the CPU reads its own
    assert main(argv) == 0                                                  # a CPU run: the GPU's record stays
    capsys.readouterr()
    after = json.loads(path.read_text())
    assert after["device_searches"]["cuda"]["greedy"] == gpu_search
    assert DecodeSettings.from_json(after["decode"]).for_device("cuda").tree == "chain-2"
    assert set(pair_searches(after)) == {("cpu", False), ("cpu", True), ("cuda", False)}
    assert main(argv[:5] + ["--recorded", "--tolerance", "0"]) == 0
    out = capsys.readouterr().out
    assert "on cuda is now chain-2, threshold=auto 0.0" in out and out.count("is now") == 3
    path.write_text(json.dumps({**after, "device_searches": {"cuda": {"warm": {}}}}))
    with pytest.raises(ValueError, match="not a tune-tree record"):
        read_pair_record(model, draft)
