"""The EAGLE drafter: exact on every architecture, its own cache kept right, training that matches
decoding, the dynamic tree it builds, and lossless sampling through it."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from conftest import chi2_check, distill_dataset, hf_greedy, jitter, tiny_model
from torch.nn import functional as F

from selfspec.core import cache as kv
from selfspec.core.backbone import Backbone, config_fingerprint
from selfspec.core.decode import decode
from selfspec.core.sampling import SamplingParams, probs_from_logits
from selfspec.core.tree import build_tree, parse_dynamic_tree
from selfspec.core.types import Draft
from selfspec.drafters.eagle import EagleDrafter
from selfspec.drafters.lookup import graft
from selfspec.heads import load_heads
from selfspec.model import untrained_heads
from selfspec.training.split import Sequence
from selfspec.training.tasks.eagle import pad_batch, target_pass

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma", "phi3"]
GREEDY = SamplingParams()


def _prompt(vocab: int, seed: int, n: int = 7) -> torch.Tensor:
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _decode(bb, drafter, ids, n=40, params=GREEDY, generator=None):
    return decode(bb, drafter, ids[0], params=params, max_new_tokens=n, eos_token_ids=set(), generator=generator)


@pytest.mark.parametrize("arch", ARCHS)
def test_eagle_greedy_is_exact_on_every_architecture(arch, one_thread):
    model = tiny_model(arch)
    bb = Backbone(model)
    heads = untrained_heads("eagle", model, "tiny")
    for seed in range(2):
        ids = _prompt(model.config.vocab_size, seed)
        ref = hf_greedy(model, ids, 40)[0, ids.shape[1]:].tolist()
        for depth, expand, nodes, lookup in ((5, 4, 8, 0), (3, 2, 4, 6), (1, 1, 1, 0), (6, 3, 16, 4)):
            drafter = EagleDrafter(bb, heads, depth=depth, expand=expand, nodes=nodes, lookup=lookup)
            new, stats = _decode(bb, drafter, ids)
            assert new == ref, f"{arch} dynamic-{depth}-{expand}-{nodes} lookup {lookup}: diverged"
            assert stats.drafted >= stats.steps * min(nodes, expand * depth)


class GraftingEagle(EagleDrafter):
    """The eagle drafter plus the true continuation grafted in, j tokens at step j mod 6: every
    accepted length from 0 to 5 happens, through nodes the head drafted and nodes it never ran."""

    def __init__(self, *args, references: list[list[int]], **kw):
        super().__init__(*args, **kw)
        self.references, self.step = references, 0

    def draft(self, states):
        return [self._grafted(d, s) for d, s in zip(super().draft(states), states)]

    def _grafted(self, d, state):
        j, self.step = self.step % 6, self.step + 1
        reference = next(r for r in self.references if r[: len(state.ids)] == state.ids)   # this row's
        chain = reference[len(state.ids): len(state.ids) + j]
        paths, tokens = graft(d.tree.paths, d.tokens.tolist(), chain)
        return Draft(tree=build_tree(paths), tokens=torch.tensor(tokens))


def _fresh_head_cache(bb, heads, ids: list[int]):
    """The head's cache and last output state computed from scratch over ids[:-1] (the committed tokens)."""
    P = len(ids) - 1
    t = torch.tensor([ids])
    out = bb.model.model(input_ids=t[:, :P], output_hidden_states=True, use_cache=False)
    aux = torch.cat([out.hidden_states[a] for a in heads.config.aux_layers], dim=-1)
    cache = kv.new_cache()
    pos = torch.arange(P)[None]
    states = heads.module(heads.module.fuse(aux), bb.embed_tokens(t[:, 1:P + 1]),
                          position_embeddings=bb.rotary_emb(aux, position_ids=pos), cache=cache)
    return cache, states[:, -1:]


@pytest.mark.parametrize("final_layer", [False, True], ids=["default-aux", "aux-with-final-state"])
def test_eagle_cache_rollback_matches_a_fresh_run_at_every_accepted_length(final_layer, one_thread):
    model = tiny_model("llama")
    bb = Backbone(model)
    N = model.config.num_hidden_layers
    # Aux layer N is the final state after the final norm, as transformers' hidden_states[N] reports it.
    heads = untrained_heads("eagle", model, "tiny", aux_layers=[1, N] if final_layer else None)
    ids = _prompt(model.config.vocab_size, 3)
    reference = hf_greedy(model, ids, 60)[0].tolist()
    # float32 drafting, compared with a float32 fresh run (the CPU default may draft in bfloat16).
    drafter = GraftingEagle(bb, heads, depth=3, expand=2, nodes=4, references=[reference], dtype=torch.float32)
    seen, checks = set(), 0
    original_commit = drafter.commit

    def checked_commit(states, accepted, outs):
        nonlocal checks
        original_commit(states, accepted, outs)
        (state,), (a,) = states, accepted
        seen.add(a.num_accepted)
        assert drafter.committed == [state.past_len]
        fresh, root = _fresh_head_cache(bb, heads, state.ids)
        layer, mine = fresh.layer(0), drafter.cache.layer(0)
        assert mine[0].shape[-2] == state.past_len
        torch.testing.assert_close(mine[0], layer[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(mine[1], layer[1], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(drafter.root_state[0], root, atol=1e-5, rtol=1e-4)
        checks += 1

    drafter.commit = checked_commit
    new, _ = _decode(bb, drafter, ids, n=60)
    assert new == reference[ids.shape[1]:]
    assert checks > 10 and set(range(6)) <= seen


class CheckedEagle(GraftingEagle):
    """After every batched commit, each row's head cache and root state are checked against a fresh run."""

    accepted: set = set()

    def commit(self, states, accepted, outs):
        super().commit(states, accepted, outs)
        self._flush()   # static and greedy, the commit runs with the next draft: run it now, to look
        for s, a in zip(states, accepted):
            type(self).accepted.add(a.num_accepted)
            assert self.committed[s.row] == s.past_len
            fresh, root = _fresh_head_cache(self.backbone, self.heads, s.ids)
            for mine, own in zip(self.cache.layer(0, s.row), fresh.layer(0)):
                assert mine.shape[-2] == s.past_len
                torch.testing.assert_close(mine, own, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(self.root_state[s.row], root, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_eagle_batched_commit_matches_a_fresh_run_in_every_row(static, one_thread):
    """A batch commits every row's accepted slots in one head call (paths of different lengths, rows
    of different lengths, rows leaving): each row's head cache equals a fresh run over its tokens.
    Static: the head cache preallocated and written at tensor slots, each commit padded to a bucket
    and finished rows idling in it (``compile=True``'s head passes, here uncompiled)."""
    from selfspec.core.decode import decode_rows
    from selfspec.runtime.step import StaticStep

    model = tiny_model("llama")
    bb = Backbone(model)
    heads = untrained_heads("eagle", model, "tiny")
    prompts = [_prompt(model.config.vocab_size, seed, n)[0] for seed, n in ((3, 7), (4, 3), (5, 10))]
    references = [hf_greedy(model, p[None], 40)[0].tolist() for p in prompts]
    conts = [r[p.shape[0]:] for p, r in zip(prompts, references)]
    eos = conts[1][12]                                  # row 1 (at least) stops early and leaves the batch
    expected = [c[: c.index(eos) + 1] if eos in c else c for c in conts]
    CheckedEagle.accepted = set()
    drafter = CheckedEagle(bb, heads, depth=3, expand=2, nodes=4, references=references, dtype=torch.float32,
                           static_head=True)
    new, _ = decode_rows(bb, drafter, prompts, params=GREEDY, max_new_tokens=40, eos_token_ids={eos}, generator=None,
                         step=StaticStep(bb, compile=False) if static else None)
    assert new == expected and len({len(x) for x in new}) > 1
    assert set(range(6)) <= CheckedEagle.accepted
    assert (drafter.cache.static and drafter._static is not None) == static


class LoggedEagle(EagleDrafter):
    """Records every step's drafts (each row's tree paths, tokens and path probabilities)."""

    log: list = []

    def draft(self, states):
        drafts = super().draft(states)
        type(self).log.append([(d.tree.paths, d.tokens.tolist(), d.path_p) for d in drafts])
        return drafts


@pytest.mark.parametrize("threshold", [0.04, 0.0], ids=["by-level", "whole-draft"])
@pytest.mark.parametrize("compile", [False, True], ids=["static", "compiled"])
def test_eagle_static_head_drafts_what_the_eager_head_drafts(compile, threshold, one_thread):
    """With a static verify step and ``static_head`` (the default on CUDA) the head runs at static shapes
    (its cache preallocated, each draft level or, greedy with no threshold, a step's whole draft
    (``_tree_pass``) and each commit one fixed-shape call over all rows; compiled with ``compile``):
    every step of a batch (ragged rows, rows stopping at different levels under a threshold, one row
    finishing early) drafts the trees, tokens and path probabilities the eager head drafts, and the
    output is the reference."""
    from selfspec.core.decode import decode_rows
    from selfspec.runtime.step import StaticStep

    model = tiny_model("llama")
    bb = Backbone(model)
    heads = untrained_heads("eagle", model, "t")
    jitter(heads.module, 0.3, seed=5)
    prompts = [_prompt(model.config.vocab_size, seed, n)[0] for seed, n in ((3, 7), (4, 3), (5, 10))]
    conts = [hf_greedy(model, p[None], 24)[0, p.shape[0]:].tolist() for p in prompts]
    eos = conts[1][9]
    expected = [c[: c.index(eos) + 1] if eos in c else c for c in conts]
    logs = []
    handed = []   # (cache, on the kept buffers?) for every static cache handed out, held here on purpose

    def spy(storage):
        hand = storage.cache

        def cache(batch, capacity):
            c = hand(batch, capacity)
            handed.append((c, any(c.keys is keys for keys, _ in storage._buffers.values())))
            return c
        storage.cache = cache

    for step in (None, StaticStep(bb, compile=compile)):
        LoggedEagle.log = []
        drafter = LoggedEagle(bb, heads, depth=3, expand=2, nodes=3, threshold=threshold, dtype=torch.float32,
                              static_head=True)
        if step is not None:   # as a benchmark's warm-up does: after it, decoding compiles nothing
            drafter.use_step(step)
            spy(step.storage)
            spy(drafter._head_storage)
            step.reserve(max(p.shape[0] for p in prompts) + 24)
            step.warm_up(batch=len(prompts), max_nodes=drafter.max_nodes, capture=drafter.capture_layers)
            drafter.warm_up(step, batch=len(prompts))
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            passes, whole = [], drafter._tree
            drafter._tree = lambda *a: passes.append(1) or whole(*a)   # noqa: E731
        new, _ = decode_rows(bb, drafter, prompts, params=GREEDY, max_new_tokens=24, eos_token_ids={eos},
                             generator=None, step=step)
        if step is not None:
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "decoding compiled a new shape"
            assert (len(passes) > 5) == (threshold == 0), "a greedy step with no threshold drafts in one pass"
        assert new == expected and len({len(x) for x in new}) > 1
        logs.append(LoggedEagle.log)
        if step is not None:
            # A second decode runs on the very buffers the first (and the warm-up) used, target's and head's
            # (CUDA graphs need their addresses fixed), marked static when compiled; stale slots change nothing.
            # The earlier caches are still referenced (``handed``): being handed back is what frees their buffers.
            buffers = [b for st in (step.storage, drafter._head_storage) for b in st._buffers.values()]
            ptrs = [t.data_ptr() for keys, values in buffers for t in keys + values]
            assert len(handed) == 4 and all(k for _, k in handed)   # warm-ups (step's, head's), first decode
            del handed[:]
            LoggedEagle.log = []
            again, _ = decode_rows(bb, drafter, prompts, params=GREEDY, max_new_tokens=24, eos_token_ids={eos},
                                   generator=None, step=step)
            trees = lambda log: [[(paths, tokens) for paths, tokens, _ in st] for st in log]  # noqa: E731
            assert again == expected and trees(LoggedEagle.log) == trees(logs[-1])
            assert [b for st in (step.storage, drafter._head_storage) for b in st._buffers.values()] == buffers
            assert [t.data_ptr() for keys, values in buffers for t in keys + values] == ptrs and len(ptrs) > 2
            assert all(getattr(t, "_dynamo_static_input_type", None) == ("unguarded" if compile else None)
                       for keys, values in buffers for t in keys + values)
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
            assert len(handed) == 2 and all(k for _, k in handed)
    eager, static = logs
    assert len(eager) == len(static) > 5
    sizes = set()
    for e_step, s_step in zip(eager, static):
        assert len(e_step) == len(s_step)
        for (e_paths, e_tokens, e_p), (s_paths, s_tokens, s_p) in zip(e_step, s_step):
            assert s_paths == e_paths and s_tokens == e_tokens
            torch.testing.assert_close(s_p, e_p, atol=1e-5, rtol=1e-4)
            sizes.add(len(e_paths))
    assert len(sizes) > 1 or threshold == 0   # not vacuous: the threshold cut trees to different sizes


class EveryThirdPlain:
    """A pace that makes every third step a plain one (as back-off does where drafting does not pay)."""

    def __init__(self):
        self.n = 0

    def start(self):
        self.n = 0

    def draft_now(self):
        self.n += 1
        return self.n % 3 != 0

    def observe(self, rows, tokens, drafted):
        pass


def test_static_greedy_steps_commit_with_the_next_draft_and_plain_steps_between(one_thread):
    """Static and greedy, a step's head commit runs in the next step's one draft call; a plain step (no draft)
    between them leaves that commit to run on its own before the next. Every row stays the reference, the
    head drafts as it does eagerly (the same tokens accepted), and plain steps really happened."""
    from selfspec.core.decode import decode_rows
    from selfspec.runtime.step import StaticStep

    model = tiny_model("llama")
    bb = Backbone(model)
    heads = untrained_heads("eagle", model, "t")
    jitter(heads.module, 0.3, seed=5)
    prompts = [_prompt(model.config.vocab_size, seed, n)[0] for seed, n in ((3, 7), (4, 3))]
    expected = [hf_greedy(model, p[None], 30)[0, p.shape[0]:].tolist() for p in prompts]
    runs = []
    for step in (None, StaticStep(bb, compile=False)):
        drafter = EagleDrafter(bb, heads, depth=3, expand=2, nodes=4, dtype=torch.float32)
        new, stats = decode_rows(bb, drafter, prompts, params=GREEDY, max_new_tokens=30, eos_token_ids=set(),
                                 generator=None, step=step, pace=EveryThirdPlain())
        assert new == expected and stats.plain_steps > 4 and stats.drafted > 0
        runs.append((stats.accepted_hist, stats.drafted, stats.steps))
    assert runs[0] == runs[1]


def test_training_time_test_equals_what_the_drafter_computes(one_thread):
    """Unrolled step j at slot i == the head drafting j tokens ahead of committed slot i - j."""
    model = tiny_model("qwen2")
    bb = Backbone(model)
    heads = untrained_heads("eagle", model, "tiny")
    head, L = heads.module, 14
    seq = Sequence(ids=torch.randint(3, 97, (L,), generator=torch.Generator().manual_seed(0)), response_start=4)
    ids, am, _ = pad_batch([seq])
    aux, _ = target_pass(bb, ids, am, aux_layers=heads.config.aux_layers, lm_weight=bb.lm_head.weight)
    feature = head.fuse(aux)
    emb = bb.embed_tokens(torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], dim=1))
    rope = lambda p: bb.rotary_emb(emb, position_ids=torch.as_tensor(p)[None])  # noqa: E731
    past, unrolled, f = [], [], feature
    for _ in range(4):
        states, kvs = head.ttt_step(f, emb, position_embeddings=rope(range(L)), past=past)
        past.append(kvs)
        unrolled.append(states)
        f = F.pad(states, (0, 0, 1, 0))[:, :L]
    for last in range(L - 4):
        cache = kv.new_cache()
        state = head(feature[:, :last + 1], emb[:, :last + 1], position_embeddings=rope(range(last + 1)), cache=cache)[:, -1:]
        torch.testing.assert_close(state, unrolled[0][:, last:last + 1], atol=1e-5, rtol=1e-4)
        for j in range(1, 4):
            state = head(state, emb[:, last + j:last + j + 1], position_embeddings=rope([last + j]), cache=cache)
            torch.testing.assert_close(state, unrolled[j][:, last + j:last + j + 1], atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------- the dynamic tree


class MarkovHead:
    """A stand-in head whose draft distribution depends only on the last token: logits = log T[token]."""

    def __init__(self, table: torch.Tensor):
        self.table = table

    def logits(self, states):            # states carry their token as a one-hot
        return self.table[states.argmax(-1)].clamp(min=1e-12).log()


class MarkovEagle(EagleDrafter):
    """The eagle drafter's tree search over a MarkovHead (no model calls)."""

    def __init__(self, table, **kw):
        rope = staticmethod(lambda x, position_ids, top=None: (position_ids[..., None].float(),) * 2)   # (unread: _run's)
        self.backbone = type("BB", (), {"device": torch.device("cpu"), "vocab_size": table.shape[0], "rope": rope})()
        self.head, self.vocab, self.lookup, self.threshold = MarkovHead(table), None, 0, kw.pop("threshold", 0.0)
        self.corpus = None
        self.log_threshold = torch.tensor(self.threshold).log().item() if self.threshold > 0 else -float("inf")
        self.depth, self.expand, self.nodes = kw["depth"], kw["expand"], kw["nodes"]
        self.cache, self.committed, self.dtype, self._layouts = kv.new_cache(), [0], torch.float32, {}

    def _run(self, feature, tokens, positions, mask, rows):
        return F.one_hot(tokens, self.table.shape[0]).float()

    def _logits(self, states):
        return self.head.logits(states)

    def start(self, token: int):
        self.root_state = [F.one_hot(torch.tensor([[token]]), self.table.shape[0]).float()]
        return self

    @property
    def table(self):
        return self.head.table


def _reference_tree(table, root, depth, expand, nodes):
    """EAGLE-2 by brute force: expand the best ``expand`` of each level, keep the best ``nodes`` paths."""
    logp = table.clamp(min=1e-12).log()
    level = [((int(t),), float(logp[root, t])) for t in logp[root].topk(expand).indices]
    pool = list(level)
    for _ in range(depth - 1):
        top = sorted(level, key=lambda x: -x[1])[:expand]
        level = [(p + (int(c),), s + float(logp[p[-1], c])) for p, s in top for c in logp[p[-1]].topk(expand).indices]
        pool += level
    return {p for p, _ in sorted(pool, key=lambda x: -x[1])[:nodes]}


def _token_paths(draft: Draft) -> set:
    toks = draft.tokens.tolist()
    return {tuple(toks[j] for j in draft.tree.path_to(i)[1:]) for i in range(1, draft.tree.size)}


def test_dynamic_tree_keeps_the_best_paths_of_hand_built_distributions():
    g = torch.Generator().manual_seed(0)
    from selfspec.core.types import DecodeState

    for trial in range(20):
        V = 7
        table = torch.rand(V, V, generator=g) ** 3
        table = table / table.sum(-1, keepdim=True)
        depth, expand, nodes = 2 + trial % 3, 2 + trial % 2, 3 + trial % 6
        drafter = MarkovEagle(table, depth=depth, expand=expand, nodes=nodes).start(0)
        state = DecodeState(ids=[5, 0], cache=None, params=GREEDY, generator=None)
        (d,) = drafter.draft([state])
        assert _token_paths(d) == _reference_tree(table, 0, depth, expand, nodes)
        assert d.tree.size == nodes + 1 and bool((d.tree.parents[1:] < torch.arange(1, d.tree.size)).all())
    # A threshold cuts paths the draft gives less than that probability (and keeps a tree).
    drafter = MarkovEagle(table, depth=3, expand=2, nodes=8, threshold=0.05).start(0)
    (d,) = drafter.draft([DecodeState(ids=[5, 0], cache=None, params=GREEDY, generator=None)])
    probs = {p: torch.tensor([float(table[a, b]) for a, b in zip((0,) + p[:-1], p)]).prod() for p in _token_paths(d)}
    assert all(v >= 0.05 for v in probs.values())


def test_dynamic_tree_spec_is_validated():
    assert parse_dynamic_tree("dynamic-5-4-8") == {"depth": 5, "expand": 4, "nodes": 8}
    for bad in ("dynamic-5-4", "chain-4", "dynamic-0-4-8", "dynamic-a-b-c"):
        with pytest.raises(ValueError, match="eagle tree"):
            parse_dynamic_tree(bad)


# ---------------------------------------------------------------------------------------------- sampling


# 2,400 samples, as the batched sampling checks of test_batch.py on the same drafter take: there they catch a
# subtle planted bias (a cut reading the drawn tokens: chi2 851 against a threshold of 329).
V_SMALL, L_SEQ, N_SAMPLES = 6, 3, 2400


def _exact_sequences(model, prompt: list[int], params) -> dict:
    """P(first L_SEQ sampled tokens) of the plain model, by enumerating every prefix."""
    out = {}
    with torch.no_grad():
        for seq in itertools.product(range(V_SMALL), repeat=L_SEQ):
            prob = 1.0
            for i in range(L_SEQ):
                logits = model(torch.tensor([prompt + list(seq[:i])])).logits[0, -1]
                prob *= float(probs_from_logits(logits, params)[seq[i]])
            out[seq] = prob
    return out


def _sampled_sequences(bb, drafter, prompt, params, seed, n=N_SAMPLES):
    g = torch.Generator().manual_seed(seed)
    counts = {}
    for _ in range(n):
        new, _ = decode(bb, drafter, torch.tensor(prompt), params=params, max_new_tokens=L_SEQ, eos_token_ids=set(),
                        generator=g)
        counts[tuple(new)] = counts.get(tuple(new), 0) + 1
    return counts


class TopTokensPassedOffAsDraws(EagleDrafter):
    """Planted bug: the head's likeliest tokens handed to acceptance as if drawn from a distribution q (a
    uniform one), so they are accepted with chance min(1, p/q) and siblings tried against p - q."""

    def draft(self, states):
        V = self.backbone.vocab_size
        return [dataclasses.replace(d, q=torch.full((int(d.tree.depths.max()) + 1, V), 1.0 / V), q_index=None)
                for d in super().draft(states)]


@pytest.mark.parametrize("lookup", [2])
def test_eagle_dynamic_tree_sampling_is_lossless(lookup, one_thread):
    """Lossless through the real decode loop: the head's likeliest tokens (point masses, the greedy tree),
    plus copied chains when the context repeats (lookup)."""
    model = tiny_model("llama", vocab_size=V_SMALL)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.25)   # undo most of the sharpening: spread-out p
    bb = Backbone(model)
    heads = untrained_heads("eagle", model, "tiny")
    params = SamplingParams(do_sample=True, temperature=1.0, top_p=0.95)
    prompt = [1, 2, 3, 1, 2]
    exact = _exact_sequences(model, prompt, params)
    drafter = EagleDrafter(bb, heads, depth=3, expand=2, nodes=4, lookup=lookup)
    stat, threshold = chi2_check(_sampled_sequences(bb, drafter, prompt, params, seed=1), exact, N_SAMPLES)
    assert stat < threshold, f"chi2={stat:.1f} >= {threshold:.1f}: not the target distribution"


def test_eagle_sampling_check_catches_a_planted_bug(one_thread):
    model = tiny_model("llama", vocab_size=V_SMALL)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.25)
    bb = Backbone(model)
    heads = untrained_heads("eagle", model, "tiny")
    params = SamplingParams(do_sample=True, temperature=1.0, top_p=0.95)
    prompt = [1, 2, 3, 1, 2]
    drafter = TopTokensPassedOffAsDraws(bb, heads, depth=3, expand=2, nodes=4)
    n = 500   # the bug is gross
    stat, threshold = chi2_check(_sampled_sequences(bb, drafter, prompt, params, seed=1, n=n),
                                 _exact_sequences(model, prompt, params), n)
    assert stat > 10 * threshold


# ---------------------------------------------------------------------------------------------- training


def test_train_eagle_head_learns_and_stays_exact(tmp_path, one_thread):
    from selfspec.training.train import TrainConfig, train_heads

    model = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(48):
        prompt = torch.randint(3, 97, (6,), generator=g)
        full = hf_greedy(model, prompt[None], 24)[0].tolist()
        rows.append((full, 6))
    config = TrainConfig(kind="eagle", steps=60, lr=3e-3, warmup=5, batch_size=8, eval_every=30, save_every=30,
                         draft_vocab_size=0, ttt_steps=3, eval_fraction=0.1,
                         out=str(tmp_path / "eagle"))
    result = train_heads(model, distill_dataset(rows), config=config, name="tiny", eos_token_ids=[], progress=False)
    first, last = result.evals[0], result.evals[-1]
    # A random tiny target is hard to predict two tokens ahead: the loss must fall, and every step's top-5 rise.
    assert last.loss < 0.7 * first.loss and all(b > a for a, b in zip(first.top5, last.top5))
    assert "top-1/top-5 by draft step:" in last.line()   # its columns are unrolled draft steps, not heads
    heads = load_heads(tmp_path / "eagle", expect_kind="eagle", fingerprint=config_fingerprint(model.config), model=model)
    # The LM head is the target's own (shared, not stored): the file holds the rest only.
    assert (tmp_path / "eagle" / "model.safetensors").stat().st_size < 4 * sum(
        p.numel() for n, p in heads.module.named_parameters() if not n.startswith("lm_head")) + 10_000
    bb = Backbone(model)
    for seed in range(3):
        ids = torch.tensor([rows[-1 - seed][0][:6]])
        ref = hf_greedy(model, ids, 30)[0, 6:].tolist()
        new, _ = _decode(bb, EagleDrafter(bb, heads, depth=4, expand=2, nodes=6), ids, n=30)
        assert new == ref


def test_an_eagle_head_with_its_own_lm_head_trains_stores_and_reloads_it(tmp_path, one_thread):
    """--shared-lm-head false: the draft vocabulary's LM-head rows start as the target's, train with the
    rest, are stored, and come back on load (not replaced by the target's rows); output stays exact."""
    from selfspec.training.train import TrainConfig, train_heads

    model = tiny_model("llama")
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(16):
        prompt = torch.randint(3, 97, (6,), generator=g)
        rows.append((hf_greedy(model, prompt[None], 16)[0].tolist(), 6))
    config = TrainConfig(kind="eagle", steps=8, lr=3e-3, warmup=1, batch_size=8, eval_every=8, save_every=8,
                         draft_vocab_size=64, ttt_steps=2, eval_fraction=0.1, shared_lm_head=False,
                         out=str(tmp_path / "eagle"))
    train_heads(model, distill_dataset(rows), config=config, name="tiny", eos_token_ids=[], progress=False)
    heads = load_heads(tmp_path / "eagle", expect_kind="eagle", fingerprint=config_fingerprint(model.config), model=model)
    assert heads.config.shared_lm_head is False
    target_rows = model.lm_head.weight.detach().index_select(0, heads.draft_vocab)
    from safetensors.torch import load_file

    stored = load_file(tmp_path / "eagle" / "model.safetensors")["lm_head.weight"]
    assert not torch.allclose(stored.float(), target_rows), "the LM head did not train"
    assert torch.equal(heads.module.lm_head.weight.detach(), stored.to(heads.module.lm_head.weight.dtype))
    bb = Backbone(model)
    ids = torch.tensor([rows[0][0][:6]])
    new, _ = _decode(bb, EagleDrafter(bb, heads, depth=3, expand=2, nodes=4), ids, n=20)
    assert new == hf_greedy(model, ids, 20)[0, 6:].tolist()


def test_eval_heads_scores_an_eagle_head_per_draft_step(one_thread):
    from selfspec.training.evaluate import eagle_rank_accuracy
    from selfspec.training.tasks.eagle import ttt_loss

    model = tiny_model("llama")
    bb = Backbone(model)
    heads = untrained_heads("eagle", model, "tiny")
    g = torch.Generator().manual_seed(1)
    seqs = []
    for _ in range(3):
        prompt = torch.randint(3, 97, (1, 5), generator=g)
        seqs.append(Sequence(ids=hf_greedy(model, prompt, 12)[0], response_start=5))
    acc = eagle_rank_accuracy(model, heads, seqs, max_rank=5, steps=3)
    assert len(acc) == 3 and all(len(a) == 5 and 0 <= sum(a) <= 1 + 1e-6 for a in acc)
    # Rank 0 at each step is the training loss's top-1 on the same rows (greedy data: the target's own tokens).
    ids, am, rows = pad_batch(seqs)
    aux, teacher = target_pass(bb, ids, am, aux_layers=heads.config.aux_layers, lm_weight=bb.lm_head.weight)
    with torch.no_grad():
        r = ttt_loss(heads.module, bb, ids, am, rows, aux=aux, teacher=teacher, steps=3)
    assert [round(a[0], 5) for a in acc] == [round(float(t), 5) for t in r.top1]


def _random_ttt_batch(*, seed: int, rows: int, length: int, response_start: int):
    """A tiny llama target, an untrained eagle head and one batch of random sequences as the loss reads
    it: (backbone, heads, (ids, am, rows, aux, teacher))."""
    model = tiny_model("llama")
    bb = Backbone(model)
    heads = untrained_heads("eagle", model, "tiny")
    g = torch.Generator().manual_seed(seed)
    seqs = [Sequence(ids=torch.randint(3, 97, (length,), generator=g), response_start=response_start) for _ in range(rows)]
    ids, am, resp = pad_batch(seqs)
    aux, teacher = target_pass(bb, ids, am, aux_layers=heads.config.aux_layers, lm_weight=bb.lm_head.weight)
    return bb, heads, (ids, am, resp, aux, teacher)


def test_ttt_loss_runs_under_bf16_autocast_and_agrees_with_float32(one_thread):
    """The loss as mixed-precision training computes it (bf16 autocast: CUDA by default, CPUs with
    --mixed-precision bf16). Masks must fill in the scores' own dtype, not q's."""
    from selfspec.training.tasks.eagle import ttt_loss

    bb, heads, (ids, am, rows, aux, teacher) = _random_ttt_batch(seed=2, rows=3, length=14, response_start=5)
    ref = ttt_loss(heads.module, bb, ids, am, rows, aux=aux, teacher=teacher, steps=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = ttt_loss(heads.module, bb, ids, am, rows, aux=aux, teacher=teacher, steps=3)
    low.loss.backward()
    assert heads.module.fc.weight.grad is not None and torch.isfinite(heads.module.fc.weight.grad).all()
    assert abs(float(low.loss) - float(ref.loss)) < 0.05 * abs(float(ref.loss)) + 1e-3


def test_ttt_loss_hard_weight_adds_cross_entropy_on_the_targets_top_token(one_thread):
    """--hard-weight for eagle: each unrolled step's loss gains hard_weight x the mean cross-entropy of
    the draft on the teacher's top token (what greedy verification accepts), weighted as its KL is;
    the KL diagnostics stay KL."""
    from selfspec.training.tasks.eagle import ttt_loss

    bb, heads, (ids, am, rows, aux, teacher) = _random_ttt_batch(seed=3, rows=2, length=12, response_start=4)
    with torch.no_grad():
        soft = ttt_loss(heads.module, bb, ids, am, rows, aux=aux, teacher=teacher, steps=2, decay=0.5)
        hard = ttt_loss(heads.module, bb, ids, am, rows, aux=aux, teacher=teacher, steps=2, decay=0.5, hard_weight=2.0)
        # The cross-entropy by hand: re-run the two steps as ttt_loss does and score the teacher's argmax.
        feature, past, ce = heads.module.fuse(aux), [], 0.0
        nxt = torch.cat([ids[:, 1:], ids.new_zeros(ids.shape[0], 1)], dim=1)
        emb = bb.embed_tokens(nxt).float()
        pos_emb = tuple(t.float() for t in bb.rotary_emb(emb, position_ids=torch.arange(ids.shape[1])[None]))
        signal = F.pad(rows[:, 1:] & am[:, 1:].bool(), (0, 1))
        for j in range(2):
            states, kv = heads.module.ttt_step(feature, emb, position_embeddings=pos_emb, past=past)
            past.append(kv)
            valid = signal.clone()
            valid[:, :j] = False
            want = teacher[:, 1:][valid[:, :-1]].argmax(-1)
            log_q = heads.module.logits(states[valid]).float().log_softmax(-1)
            ce += 0.5 ** j * float(-log_q.gather(1, want[:, None]).mean())
            feature = F.pad(states, (0, 0, 1, 0))[:, : ids.shape[1]]
    assert ce > 0
    assert float(hard.loss) == pytest.approx(float(soft.loss) + 2.0 * ce, rel=1e-5)
    assert torch.allclose(hard.kl, soft.kl) and torch.equal(hard.top1, soft.top1)


def test_warm_start_may_add_or_drop_aux_layers(one_thread):
    from selfspec.training.warm_start import check_init_shape, load_grown

    model = tiny_model("llama")
    N, H = model.config.num_hidden_layers, model.config.hidden_size
    init = untrained_heads("eagle", model, "tiny", aux_layers=[1, N - 1])
    torch.nn.init.normal_(init.module.fc.weight, std=0.1)
    grown = untrained_heads("eagle", model, "tiny", aux_layers=[1, N - 1, N])
    check_init_shape(init, grown, "init")
    load_grown(grown.module, init, grown.config.aux_layers)
    feats = {a: torch.randn(2, 5, H) for a in (1, N - 1, N)}
    old = init.module.fuse(torch.cat([feats[1], feats[N - 1]], dim=-1))
    new = grown.module.fuse(torch.cat([feats[1], feats[N - 1], feats[N]], dim=-1))
    torch.testing.assert_close(new, old)
    # Fewer layers: the shared layers keep their fc blocks, the dropped ones' go.
    fewer = untrained_heads("eagle", model, "tiny", aux_layers=[N - 1, N])
    check_init_shape(grown, fewer, "init")
    load_grown(fewer.module, grown, fewer.config.aux_layers)
    H = model.config.hidden_size
    torch.testing.assert_close(fewer.module.fc.weight[:, :H], init.module.fc.weight[:, H:])
    assert not fewer.module.fc.weight[:, H:].any()
    disjoint = untrained_heads("eagle", model, "tiny", aux_layers=[2])
    with pytest.raises(ValueError, match="aux_layers"):
        check_init_shape(init, disjoint, "init")


def test_the_head_runs_static_under_a_static_step_unless_told():
    """``static_head=None`` (the default): under a static verify step the head's calls run static too; True or
    False decide; without a static step it is always eager."""
    from selfspec.runtime.step import StaticStep

    model = tiny_model("llama")
    bb = Backbone(model)
    heads = untrained_heads("eagle", model, "t")
    step = StaticStep(bb, compile=False)
    for static_head, expected in ((None, True), (True, True), (False, False)):
        drafter = EagleDrafter(bb, heads, static_head=static_head)
        drafter.use_step(step)
        assert (drafter._static is not None) == expected and (drafter.static_step is step) == expected
        drafter.use_step(None)
        assert drafter._static is None and drafter.static_step is None
    with pytest.raises(ValueError, match="static_head must be"):
        EagleDrafter(bb, heads, static_head="yes")


@pytest.mark.parametrize("depth, expand, nodes", [(1, 2, 2), (2, 2, 3), (3, 2, 4), (4, 3, 12), (5, 4, 8), (3, 4, 40)])
def test_the_device_side_cut_gives_every_row_the_tree_the_row_by_row_cut_gives(depth, expand, nodes,
                                                                             monkeypatch, one_thread):
    """``_cut`` (every row's tree picked, renumbered and its mask built at once on the device) against
    ``_cut_row`` (the row-by-row cut on the host that came before it), on the same pools of a batch of rows
    drafted by a jittered head: the same tree (parents, depths, ranks, ancestors), the same tokens in the
    same order, the same path probabilities, at every depth and width."""
    from selfspec.drafters import eagle as eagle_mod

    model = tiny_model("llama")
    bb = Backbone(model)
    heads = untrained_heads("eagle", model, "t")
    jitter(heads.module, 0.3, seed=depth * 10 + expand)
    drafter = EagleDrafter(bb, heads, depth=depth, expand=expand, nodes=nodes)
    pools = []
    real_cut = eagle_mod.EagleDrafter._cut
    monkeypatch.setattr(eagle_mod.EagleDrafter, "_cut", lambda self, pool: pools.append(pool) or real_cut(self, pool))
    prompts = [torch.randint(1, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 7)]
    from selfspec.core.decode import decode_rows

    decode_rows(bb, drafter, prompts, params=SamplingParams(), max_new_tokens=10, eos_token_ids=set(), generator=None)
    assert pools, "not vacuous: steps were cut"
    for pool in pools:
        batched = real_cut(drafter, pool)
        for b, got in enumerate(batched):
            want = drafter._cut_row(pool, b)
            for name in ("parents", "depths", "ranks", "ancestors"):
                assert torch.equal(getattr(got.tree, name), getattr(want.tree, name)), (b, name)
            assert torch.equal(got.tokens, want.tokens) and torch.allclose(got.path_p, want.path_p)


@pytest.mark.parametrize("kind", ["none", "medusa", "eagle", "eagle-static"])
def test_a_greedy_step_reads_the_host_once(kind, one_thread, monkeypatch):
    """Counted with every tensor -> host conversion patched (``item``, ``tolist``, ``bool``, ``int``,
    ``float``, ``index``, ``cpu``, ``numpy``): with width fitting off, a greedy step of plain decoding,
    Medusa or EAGLE, eager or at static shapes (``compile=True``'s passes, here uncompiled: the verify
    pass, the head's whole draft and its commit), reads the host once (the accepted paths); the prefill
    reads a few times."""
    from selfspec.runtime.step import StaticStep

    from selfspec.core.decode import decode_rows
    from selfspec.drafters import MedusaDrafter, NoDrafter
    from selfspec.settings import MEDUSA_DEFAULT

    model = tiny_model("llama")
    bb = Backbone(model)
    drafter = {"none": lambda: NoDrafter(bb.device),
               "medusa": lambda: MedusaDrafter(bb, untrained_heads("medusa", model, "t"), build_tree(MEDUSA_DEFAULT)),
               "eagle": lambda: EagleDrafter(bb, untrained_heads("eagle", model, "t"), depth=4, expand=3, nodes=8)}[
        kind.split("-")[0]]()
    step = StaticStep(bb, compile=False) if kind.endswith("static") else None
    prompts = [torch.randint(1, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (6, 9)]
    run = lambda: decode_rows(bb, drafter, prompts, params=SamplingParams(), max_new_tokens=24,  # noqa: E731
                              eos_token_ids=set(), generator=None, step=step)
    run()   # warm-up: lazily built trees and caches
    reads = []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, (lambda real, name: lambda self, *a, **k: reads.append(name) or
                                                 real(self, *a, **k))(real, name))
    _, stats = run()
    monkeypatch.undo()
    steps = stats.target_forwards - 1          # one pass serves every row: one read a pass
    assert steps > 5 and (kind == "none" or stats.drafted > 0), "not vacuous"
    assert step is None or drafter._tree is not None
    assert len(reads) <= steps + 4, f"{len(reads)} host reads over {steps} steps: {sorted(set(reads))}"
