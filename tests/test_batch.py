"""Batches of prompts: every row of a batch is exactly what the plain model gives that prompt alone.

Rows of different lengths share one KV cache (each row at its own length), accept different
numbers of drafts each step, hit EOS at different times and leave the batch; none of that may
change a single token. Sampled rows must keep the target's distribution.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import chi2_check, hf_greedy, jitter, tiny_model

from selfspec.core import decode as decode_mod
from selfspec.core.accept import greedy_accept, greedy_accept_rows
from selfspec.core.backbone import Backbone
from selfspec.core.cache import KVCache
from selfspec.core.decode import decode_rows
from selfspec.core.sampling import SamplingParams
from selfspec.core.tree import build_tree, chain, chain_with_siblings
from selfspec.core.types import DecodeState, Draft, Drafter, Drafts, Resume
from selfspec.drafters import DraftModelDrafter, EagleDrafter, EarlyExitDrafter, LookupDrafter, MedusaDrafter, NoDrafter
from selfspec.drafters.base import row_candidates
from selfspec.drafters.draft_model import truncated_copy
from selfspec.model import SelfSpeculativeModel, untrained_heads
from selfspec.runtime.step import StaticStep
from selfspec.settings import MEDUSA_DEFAULT

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma", "phi3"]
GREEDY = SamplingParams()
N_NEW = 30
LENGTHS = (7, 3, 11, 5)
# Each exactness test runs the eager verify pass and the static-shape one (``compile=True``'s pass,
# here uncompiled: the same shapes, masks and in-place cache writes, minus torch.compile's build).
STEPS = ["eager", "static"]


def _step(kind: str, bb: Backbone) -> StaticStep | None:
    return None if kind == "eager" else StaticStep(bb, compile=False)


def _prompts(vocab: int, lengths=LENGTHS, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def _alone(model, prompts, n=N_NEW) -> list[list[int]]:
    return [hf_greedy(model, p[None], n)[0, p.shape[0]:].tolist() for p in prompts]


class RowOracle(Drafter):
    """Proposes each row's true greedy continuation (found by its prompt), corrupted at a depth that
    depends on the row and the step, so rows accept different lengths every step."""

    def __init__(self, references: list[list[int]], paths):
        self.references, self.tree = references, build_tree(paths)
        self.steps = 0

    def draft(self, states: list[DecodeState]) -> list[Draft]:
        return [self._row(s) for s in states]

    def _row(self, state: DecodeState) -> Draft:
        ref = next(r for r in self.references if r[: len(state.ids)] == state.ids)
        truth = ref[len(state.ids):] + [0] * (self.tree.depth + 1)
        self.steps += 1
        cycle = self.tree.depth + 2
        bad = (len(self.references) + self.steps // 2) % cycle   # depth - 1 of the corrupt node (or none)
        every = self.steps % 2 == 1     # every candidate at that depth wrong (else the truth moves to rank 1)
        tokens = [state.ids[-1]]
        for path in self.tree.paths:
            d, rank = len(path), path[-1]
            right = rank == (1 if d - 1 == bad else 0) and not (every and d - 1 == bad)
            tokens.append(truth[d - 1] if right else (truth[d - 1] + 1 + rank) % 97)
        return Draft(tree=self.tree, tokens=torch.tensor(tokens))


# ---------------------------------------------------------------------------------------------- acceptance


def test_batched_greedy_acceptance_on_hand_built_rows():
    """Three rows with different trees accepting 0, a branch below a rejected sibling, and a full
    chain: one batched rule gives each row what the one-row rule gives it."""
    trees = [build_tree(chain(3)), build_tree(((0,), (1,), (0, 0), (1, 0), (1, 0, 0))), build_tree(chain(2))]
    tokens = [torch.tensor([5, 9, 9, 9]), torch.tensor([5, 6, 7, 1, 8, 2]), torch.tensor([5, 3, 4])]
    argmax = [torch.tensor([1, 2, 3, 4]),          # row 0: first draft wrong -> accept 0, bonus 1
              torch.tensor([7, 0, 8, 0, 2, 6]),    # row 1: (0,)=6 wrong, (1,)=7 right, (1,0)=8 right, (1,0,0)=2 right
              torch.tensor([3, 4, 9])]             # row 2: whole chain, bonus 9
    drafts = Drafts([Draft(tree=t, tokens=x) for t, x in zip(trees, tokens)])
    assert drafts.offsets == (0, 4, 10, 13)
    got = greedy_accept_rows(drafts.tokens, drafts.parents, torch.cat(argmax), drafts.offsets)
    assert [a.path for a in got] == [(0,), (0, 2, 4, 5), (0, 1, 2)]
    assert [a.bonus for a in got] == [1, 6, 9]
    assert [a.depth for a in got] == [3, 3, 2]
    assert got == [greedy_accept(t, x, y) for t, x, y in zip(trees, tokens, argmax)]


def test_a_step_batch_pads_its_rows_as_row_by_row():
    """``Drafts.padded``: every row's tokens, depths and ancestor sets where a per-row layout puts them (draft i
    at row rows[i] of a larger batch, ragged sizes; rows of one size; one tree shared by every row), each
    padding node token 0 at depth 0 seeing only itself."""
    trees = [build_tree(chain(3)), build_tree(((0,), (1,), (0, 0), (1, 0), (1, 0, 0))), build_tree(()),
             build_tree(chain_with_siblings(2, 2))]
    g = torch.Generator().manual_seed(0)
    drafts = [Draft(tree=t, tokens=torch.randint(1, 90, (t.size,), generator=g)) for t in trees]

    def expect(ds, n, rows, B):
        tokens, depths = torch.zeros(B, n, dtype=torch.long), torch.zeros(B, n, dtype=torch.long)
        ancestors = torch.eye(n, dtype=torch.bool).repeat(B, 1, 1)
        for b, d in zip(rows, ds):
            m = d.tree.size
            tokens[b, :m], depths[b, :m], ancestors[b, :m, :m] = d.tokens, d.tree.depths, d.tree.ancestors
        return tokens, depths, ancestors

    cases = [(drafts, 8, None, None), (drafts, 16, [4, 0, 2, 5], 6), (drafts[:1] * 3, 4, None, None),
             ([drafts[0], Draft(tree=build_tree(((0,), (1,), (0, 0))), tokens=torch.tensor([7, 8, 9, 10]))], 4, None, None)]
    for ds, n, rows, B in cases:
        got = Drafts(ds).padded(n, "cpu", rows=rows, batch=B)
        want = expect(ds, n, list(range(len(ds))) if rows is None else rows, len(ds) if B is None else B)
        for x, y in zip((got.tokens, got.depths, got.ancestors), want):
            assert torch.equal(x, y)
        assert got.sizes == [d.tree.size for d in ds]


@pytest.mark.parametrize("step", STEPS)
def test_drafters_lay_out_a_step_flat_as_their_rows(step, one_thread):
    """Medusa and EAGLE draft every row at once and hand the loop its flat tokens and parents with the rows:
    those are the rows' own, end to end (so a verify pass reads what each row drafted)."""
    model = tiny_model("llama")
    bb = Backbone(model)
    prompts = _prompts(model.config.vocab_size, lengths=(7, 3, 11, 5))
    medusa = untrained_heads("medusa", model, "t")
    jitter(medusa.module, 0.5, seed=3)
    eagle = untrained_heads("eagle", model, "t")
    jitter(eagle.module, 0.3, seed=5)
    for drafter in (MedusaDrafter(bb, medusa, build_tree(MEDUSA_DEFAULT)),
                    EagleDrafter(bb, eagle, depth=3, expand=2, nodes=5, dtype=torch.float32, static_head=True)):
        seen = []
        real = drafter.draft

        def spy(states, real=real):
            got = real(states)
            seen.append(got)
            return got

        drafter.draft = spy
        decode_rows(bb, drafter, prompts, params=GREEDY, max_new_tokens=6, eos_token_ids=set(), generator=None,
                    step=_step(step, bb))
        assert seen and isinstance(seen[0], Drafts) and len(seen[0]) == len(prompts)
        for d in seen:
            assert torch.equal(d.tokens, torch.cat([r.tokens for r in d]))
            assert torch.equal(d.parents, torch.cat([r.tree.parents for r in d]))
            assert d.offsets[-1] == sum(r.tree.size for r in d)


# ---------------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_row_matches_its_prompt_alone_for_every_drafter(arch, step, one_thread):
    model, bb, prompts, ref, drafters = every_drafter(arch)
    for drafter in drafters:
        new, stats = decode_rows(bb, drafter, prompts, params=GREEDY, max_new_tokens=N_NEW, eos_token_ids=set(),
                                 generator=None, step=_step(step, bb))
        assert new == ref, f"{arch} {drafter.name} ({step}): a row differs from its prompt decoded alone"
        assert stats.new_tokens == N_NEW * len(prompts)
        if isinstance(drafter, RowOracle) or (drafter.name == "draft-model" and drafter.threshold == 0):
            assert stats.tau > 1.8, f"{arch} {drafter.name}: rows should accept deep drafts (tau {stats.tau:.2f})"


@pytest.mark.parametrize("step", STEPS)
def test_every_row_matches_transformers_with_a_repetition_penalty(step, one_thread):
    """Greedy with repetition_penalty: every drafter's rows are what transformers' generate gives each prompt
    alone with the same penalty (a drafted node is judged by logits penalised for its own path)."""
    model, bb, prompts, plain, drafters = every_drafter("llama")
    params = SamplingParams(repetition_penalty=1.8)
    ref = [model.generate(p[None], attention_mask=torch.ones_like(p[None]), max_new_tokens=N_NEW, do_sample=False,
                          repetition_penalty=1.8, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert ref != plain, "not vacuous: the penalty changes the output"
    # The oracles propose the penalised continuation, so deep drafts are accepted only if judged by logits
    # penalised for the path above them.
    refs_full = [p.tolist() + r for p, r in zip(prompts, ref)]
    oracles = [RowOracle(refs_full, chain(4)), RowOracle(refs_full, ((0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0)))]
    for drafter in [d for d in drafters if not isinstance(d, RowOracle)] + oracles:
        new, stats = decode_rows(bb, drafter, prompts, params=params, max_new_tokens=N_NEW, eos_token_ids=set(),
                                 generator=None, step=_step(step, bb))
        assert new == ref, f"{drafter.name} ({step}): a row differs from transformers' penalised greedy output"
        if isinstance(drafter, RowOracle):
            assert stats.tau > 1.8, f"oracle rows should accept deep drafts (tau {stats.tau:.2f})"


def test_generate_reads_the_models_generation_config_and_refuses_what_it_cannot_apply(one_thread):
    """A model whose generation_config.json sets a repetition penalty (as Qwen2.5's instruct models do)
    decodes with it, as transformers' generate does; a setting selfspec does not apply (an n-gram ban,
    suppressed tokens, typical-p when sampling) is refused in one line, never decoded differently."""
    from transformers import GenerationConfig

    model = tiny_model("llama")
    sm = SelfSpeculativeModel(model, None, drafter_name="medusa", heads=untrained_heads("medusa", model, "tiny"),
                              tree="auto", name="tiny")
    p = _prompts(model.config.vocab_size, lengths=(6,))[0][None]
    plain = sm.generate(p, max_new_tokens=N_NEW)
    model.generation_config.repetition_penalty = 1.8
    try:
        ref = model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=N_NEW)
        assert not torch.equal(ref, plain) and torch.equal(sm.generate(p, max_new_tokens=N_NEW), ref)
    finally:
        model.generation_config.repetition_penalty = None
    for gc, match in ((GenerationConfig(no_repeat_ngram_size=2), "no_repeat_ngram_size=2"),
                      (GenerationConfig(suppress_tokens=[5]), r"suppress_tokens=\[5\]"),
                      (GenerationConfig(do_sample=True, typical_p=0.9), "typical_p=0.9")):
        with pytest.raises(ValueError, match=f"generation config sets {match}, which selfspec does not apply"):
            sm.generate(p, max_new_tokens=4, generation_config=gc)
    assert sm.generate(p, max_new_tokens=4, generation_config=GenerationConfig(typical_p=0.9)).shape[1] == 6 + 4   # greedy


def every_drafter(arch: str):
    """(model, backbone, prompts, each prompt's greedy continuation alone, one drafter of every kind)."""
    model = tiny_model(arch)
    bb = Backbone(model)
    prompts = _prompts(model.config.vocab_size)
    ref = _alone(model, prompts)
    refs_full = [p.tolist() + r for p, r in zip(prompts, ref)]
    return model, bb, prompts, ref, [
        NoDrafter(bb.device),
        LookupDrafter(bb.device, 4, vocab_size=bb.vocab_size),
        RowOracle(refs_full, chain(4)),
        RowOracle(refs_full, ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 0, 0, 0))),
        MedusaDrafter(bb, untrained_heads("medusa", model, "t", token_input=False), build_tree(MEDUSA_DEFAULT), lookup=4),
        EarlyExitDrafter(bb, untrained_heads("early-exit", model, "t", exit_layer=2), build_tree(chain(3))),
        EarlyExitDrafter(bb, untrained_heads("early-exit", model, "t", exit_layer=2, adapter="layer"),
                         build_tree(chain_with_siblings(3, 2))),
        DraftModelDrafter(tiny_model(arch), build_tree(chain(3)), vocab_size=bb.vocab_size),   # the target itself
        DraftModelDrafter(truncated_copy(model, 2), build_tree(chain(3)), vocab_size=bb.vocab_size, threshold=0.3),
        EagleDrafter(bb, untrained_heads("eagle", model, "t"), depth=3, expand=2, nodes=4, lookup=4,
                     static_head=True),   # its head static too under the static step (the default on CUDA)
    ]


@pytest.mark.parametrize("token_input", [True, False])
def test_medusa_drafts_a_batch_in_one_call_exactly_as_row_by_row(token_input, one_thread):
    """``MedusaDrafter.draft`` (every row's heads in one call) gives each row the tree and tokens it gets
    drafted alone, thresholds, gate and lookup included."""
    model = tiny_model("llama")
    bb = Backbone(model)
    heads = untrained_heads("medusa", model, "t", token_input=token_input)
    g = jitter(heads.module, 0.5, seed=3)
    drafter = MedusaDrafter(bb, heads, build_tree(MEDUSA_DEFAULT), threshold=0.01, gate=0.1, lookup=3)
    hidden = [torch.randn(model.config.hidden_size, generator=g) for _ in range(4)]
    states = []
    for i in range(4):
        ids = torch.randint(3, 97, (9,), generator=g).tolist()
        states.append(DecodeState(ids=ids + ids[2:5] if i % 2 else ids, cache=None, params=GREEDY, generator=None,
                                  row=i))
    drafter.hidden = list(hidden)
    together = drafter.draft(states)
    for s, h, got in zip(states, hidden, together):
        drafter.hidden = [h]
        alone = drafter.draft([DecodeState(ids=s.ids, cache=None, params=GREEDY, generator=None)])[0]
        assert got.tree.paths == alone.tree.paths and torch.equal(got.tokens, alone.tokens)
    assert len({t.tree.size for t in together}) > 1     # the rows' trees differ: the check is not vacuous


def _prefilled(bb, prompts, capture):
    """Greedy decode states of ``prompts`` prefilled as one batch (their first token chosen), and the prefill outputs."""
    from selfspec.core.decode import prefill_rows

    cache = KVCache(len(prompts))
    outs = prefill_rows(bb, cache, prompts, capture=capture)
    return [DecodeState(ids=p.tolist() + [int(o.logits[-1].argmax())], cache=cache.row(b), params=GREEDY,
                        generator=None, row=b) for b, (p, o) in enumerate(zip(prompts, outs))], outs


@pytest.mark.parametrize("threshold", [0.0, 0.04])
def test_eagle_drafts_a_batch_one_level_at_a_time_exactly_as_row_by_row(threshold, one_thread):
    """``EagleDrafter.draft`` (each level of every row in one head call, on one batched head cache
    whose rows have different lengths) gives each row the tree, tokens and path probabilities that the
    row drafting alone on its own cache gives; with a threshold, rows stop at different levels."""
    model = tiny_model("llama")
    bb = Backbone(model)
    heads = untrained_heads("eagle", model, "t")
    jitter(heads.module, 0.3, seed=5)
    prompts = _prompts(model.config.vocab_size, lengths=(7, 3, 11, 5, 9))
    drafter = EagleDrafter(bb, heads, depth=4, expand=3, nodes=7, threshold=threshold, lookup=2, dtype=torch.float32)
    alone_drafter = EagleDrafter(bb, heads, depth=4, expand=3, nodes=7, threshold=threshold, lookup=2,
                                 dtype=torch.float32)
    states, outs = _prefilled(bb, prompts, drafter.capture_layers)
    drafter.begin(states, outs)
    together = drafter.draft(states)
    for s, o, got in zip(states, outs, together):
        alone = dataclasses.replace(s, row=0)      # the row alone, on a head cache of its own
        alone_drafter.begin([alone], [o])
        alone = alone_drafter.draft([alone])[0]
        assert got.tree.paths == alone.tree.paths and torch.equal(got.tokens, alone.tokens)
        torch.testing.assert_close(got.path_p, alone.path_p)
    assert len({tuple(t.tokens.tolist()) for t in together}) == len(prompts)   # not vacuous: the rows differ
    if threshold:
        assert len({t.tree.size for t in together}) > 1


@pytest.mark.parametrize("adapter", ["mlp", "layer"])
def test_early_exit_drafts_a_batch_one_chain_step_at_a_time_exactly_as_row_by_row(adapter, one_thread):
    """``EarlyExitDrafter.draft`` (one call of layers[0:E] and the exit head per chain step for every
    row still drafting, each row writing after its own slots) gives each row the tree, tokens and saved
    states it gets drafting alone; the confidence threshold stops rows at different depths."""

    model = tiny_model("llama", num_hidden_layers=6)
    bb = Backbone(model)
    heads = untrained_heads("early-exit", model, "t", exit_layer=3, adapter=adapter)
    jitter(heads.module, 0.05, seed=2)
    prompts = _prompts(model.config.vocab_size, lengths=(7, 3, 11, 5, 9))
    start = lambda batch: _prefilled(bb, batch, (3,) if adapter == "layer" else ())   # noqa: E731

    depths = set()
    for threshold in (0.0, 0.002, 0.005, 0.01):
        tree = build_tree(chain_with_siblings(4, 2))
        drafter, alone_drafter = (EarlyExitDrafter(bb, heads, tree, threshold=threshold) for _ in range(2))
        states, outs = start(prompts)
        drafter.begin(states, outs)
        together = drafter.draft(states)
        for b, (p, got) in enumerate(zip(prompts, together)):
            (s,), (o,) = start([p])                     # the row alone, on its own cache
            alone_drafter.begin([s], [o])
            alone = alone_drafter.draft([s])[0]
            assert got.tree.paths == alone.tree.paths and torch.equal(got.tokens, alone.tokens)
            assert drafter.drafted[b] == alone_drafter.drafted[0]
            torch.testing.assert_close(got.resume.hidden, alone.resume.hidden, atol=1e-5, rtol=1e-4)
            if adapter == "layer":                      # the adapter's cache row, drafted slots included
                for mine, own in zip(drafter.adapter_cache.layer(0, b), alone_drafter.adapter_cache.layer(0)):
                    torch.testing.assert_close(mine, own, atol=1e-5, rtol=1e-4)
        depths.add(tuple(t.resume.hidden.shape[1] for t in together))
    assert any(len(set(d)) > 1 for d in depths)   # not vacuous: some threshold stopped rows at different depths


def test_draft_model_drafts_a_batch_one_chain_step_at_a_time_exactly_as_row_by_row(one_thread):
    """``DraftModelDrafter.draft`` (the catch-up of every row's unseen tokens, ragged, in one draft
    forward, then one forward per chain step for every row still drafting) gives each row the chain it
    gets alone, and leaves each row's draft cache as the row alone leaves its own."""

    model = tiny_model("qwen2")
    bb = Backbone(model)
    g = torch.Generator().manual_seed(4)
    draft = truncated_copy(model, 2)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    prompts = _prompts(model.config.vocab_size, lengths=(7, 3, 11, 5, 9))
    states = [DecodeState(ids=p.tolist() + [int(p[-1]) % 90 + 3], cache=None, params=GREEDY, generator=None, row=b)
              for b, p in enumerate(prompts)]
    depths = set()
    for threshold in (0.0, 0.05, 0.1, 0.2):
        drafter, alone_drafter = (DraftModelDrafter(draft, build_tree(chain(4)), vocab_size=bb.vocab_size,
                                                    threshold=threshold, dtype=torch.float32) for _ in range(2))
        drafter.begin(states, [None] * len(states))
        together = drafter.draft(states)
        for b, (s, got) in enumerate(zip(states, together)):
            alone_state = DecodeState(ids=s.ids, cache=None, params=GREEDY, generator=None)
            alone_drafter.begin([alone_state], [None])
            alone = alone_drafter.draft([alone_state])[0]
            assert got.tree.paths == alone.tree.paths and torch.equal(got.tokens, alone.tokens)
            assert (drafter.seen[b], drafter.fed[b]) == (alone_drafter.seen[0], alone_drafter.fed[0])
            for mine, own in zip(drafter.cache.layer(0, b), alone_drafter.cache.layer(0)):
                torch.testing.assert_close(mine, own, atol=1e-5, rtol=1e-4)
        depths.add(tuple(t.tree.size for t in together))
    assert any(len(set(d)) > 1 for d in depths)   # not vacuous: some threshold stopped rows at different depths


@pytest.mark.parametrize("step", STEPS)
def test_rows_stop_at_their_own_eos_and_leave_the_batch(step, one_thread):
    model = tiny_model("llama")
    bb = Backbone(model)
    prompts = _prompts(model.config.vocab_size, lengths=(6, 4, 9, 5, 8, 3, 7, 10))
    long = _alone(model, prompts, 40)
    eos = {long[1][4], long[5][20]}   # row 1 stops early, row 5 later, others when they meet one of these
    expected = []
    for r in long:
        cut = next((i for i, t in enumerate(r) if t in eos), None)
        expected.append(r if cut is None else r[: cut + 1])
    drafter = RowOracle([p.tolist() + r for p, r in zip(prompts, long)], chain(3))
    new, stats = decode_rows(bb, drafter, prompts, params=GREEDY, max_new_tokens=40, eos_token_ids=eos, generator=None,
                             step=_step(step, bb))
    assert new == expected
    assert stats.new_tokens == sum(len(x) for x in expected)


def char_tokenizer(vocab_size: int):
    """A tokenizer whose tokens are single printable characters (ids 3 on; 0-2 pad, unk, eos), whose strings
    join as they are: the kind of vocabulary transformers' stop-string matching reads."""
    import string

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = (string.ascii_letters + string.digits + string.punctuation)[: vocab_size - 3]
    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


@pytest.mark.parametrize("step", STEPS)
def test_rows_stop_at_stop_strings_where_transformers_stops_them(step, one_thread):
    """stop_strings: every row, with every drafter, ends on the token transformers' generate(stop_strings=...)
    ends that prompt on alone (kept), whichever number of tokens the step that met it accepted."""
    from selfspec.core.stopping import StopStrings

    model, bb, prompts, _, drafters = every_drafter("llama")
    tok = char_tokenizer(model.config.vocab_size)
    long = _alone(model, prompts, 40)
    # One row meets a string early, one late; a four-token string spans steps; others may meet them too.
    strings = [tok.convert_ids_to_tokens(long[1][3]), tok.convert_ids_to_tokens(long[3][25]),
               "".join(tok.convert_ids_to_tokens(long[0][12:16]))]
    expected = [model.generate(p[None], attention_mask=torch.ones_like(p[None]), max_new_tokens=40, do_sample=False,
                               stop_strings=strings, tokenizer=tok, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
    assert len(expected[1]) <= 4 and len({len(x) for x in expected}) > 1   # the rows stop at different places
    stop = StopStrings(tok, strings)
    for drafter in drafters:
        new, stats = decode_rows(bb, drafter, prompts, params=GREEDY, max_new_tokens=40, eos_token_ids=set(),
                                 generator=None, step=_step(step, bb), stop=stop)
        assert new == expected, f"{drafter.name} ({step}): a row stopped elsewhere than transformers stops it"
        assert stats.new_tokens == sum(len(x) for x in expected)


@pytest.mark.parametrize("step", STEPS)
def test_rows_hold_back_eos_until_min_new_tokens_as_transformers_does(step, one_thread):
    """min_new_tokens / min_length: EOS is masked at every tree node whose text is still too short, so every
    drafter's rows end where transformers' generate ends each prompt alone with the same settings."""
    model, bb, prompts, _, drafters = every_drafter("llama")
    long = _alone(model, prompts, 40)
    eos = {long[1][2], long[3][5]}   # rows would end early; the floors below hold them longer
    for floors in (dict(min_new_tokens=12), dict(min_length=20)):
        ref = []
        for p in prompts:
            out = model.generate(p[None], attention_mask=torch.ones_like(p[None]), max_new_tokens=40, do_sample=False,
                                 eos_token_id=list(eos), pad_token_id=0, **floors)[0, len(p):].tolist()
            cut = next((i for i, t in enumerate(out) if t in eos), None)
            ref.append(out if cut is None else out[: cut + 1])
        bare = [next((r[: i + 1] for i, t in enumerate(r) if t in eos), r) for r in long]
        assert ref != bare, "not vacuous: the floor keeps some row going past an EOS"
        for drafter in [d for d in drafters if not isinstance(d, RowOracle)]:
            new, _ = decode_rows(bb, drafter, prompts, params=GREEDY, max_new_tokens=40, eos_token_ids=eos,
                                 generator=None, step=_step(step, bb), **floors)
            assert new == ref, f"{drafter.name} ({step}, {floors}): a row ended elsewhere than transformers ends it"


class ResumingOracle(RowOracle):
    """Drafts as early exit does: runs layers[0:E] on the pending token and the first m - 1 chain
    drafts through the row's cache, one token at a time, and hands their states to the verifier;
    m depends on the row and the step, so rows of one batch resume with different numbers of nodes."""

    def __init__(self, bb: Backbone, references, paths, exit_layer: int):
        super().__init__(references, paths)
        self.bb, self.exit_layer = bb, exit_layer

    def _row(self, state: DecodeState) -> Draft:
        d = super()._row(state)
        m = 1 + (self.steps + len(state.ids)) % (d.tree.depth + 1)        # root + 0..depth chain drafts
        hidden = [self.bb.run_layers(self.bb.embed(d.tokens[j:j + 1]), start=0, end=self.exit_layer,
                                     position_ids=torch.tensor([[state.past_len + j]]), attention_mask=None,
                                     cache=state.cache) for j in range(m)]
        return Draft(tree=d.tree, tokens=d.tokens, resume=Resume(layer=self.exit_layer, hidden=torch.cat(hidden, dim=1)))


def _check_row_cache(bb: Backbone, state: DecodeState) -> None:
    """Every layer of the row's KV equals a fresh pass over its committed tokens (the pending one aside)."""
    fresh = KVCache()
    ids = torch.tensor(state.ids[:-1])
    bb.run_layers(bb.embed(ids), start=0, end=bb.num_layers, position_ids=torch.arange(len(ids))[None],
                  attention_mask=None, cache=fresh)
    row = state.cache
    for layer in range(bb.num_layers):
        k, v = row.cache.layer(layer, row.index)
        assert k.shape[2] == len(ids)
        torch.testing.assert_close(k, fresh.layer(layer)[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(v, fresh.layer(layer)[1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("step", STEPS)
def test_rows_resuming_at_the_exit_layer_keep_the_cache_exact(step, one_thread):
    """Early exit at B > 1: the verifier reuses each row's drafted layer < E KV (a different number
    of nodes per row) and runs layers < E only for the rest; every row stays exact and its cache
    equals a fresh pass at every accepted length."""
    model = tiny_model("llama")
    bb = Backbone(model)
    prompts = _prompts(model.config.vocab_size)
    ref = _alone(model, prompts, 40)
    seen, resumed = set(), []

    class Checked(ResumingOracle):
        def _row(self, state):
            d = super()._row(state)
            resumed.append(d.resume.hidden.shape[1])
            return d

        def commit(self, states, accepted, outs):
            for s, a in zip(states, accepted):
                seen.add(a.num_accepted)
                _check_row_cache(bb, s)

    drafter = Checked(bb, [p.tolist() + r for p, r in zip(prompts, ref)], chain_with_siblings(3, 2), exit_layer=2)
    # (rows, nodes) of every batched pass through layer 0: the eager verifier runs the 7-node trees'
    # layers < E only for nodes no row drafted, so never for all 7.
    shapes = []
    hook = bb.layers[0].register_forward_pre_hook(lambda _m, args, kw: shapes.append(tuple(
        (args[0] if args else kw["hidden_states"]).shape[:2])), with_kwargs=True)
    try:
        new, _ = decode_rows(bb, drafter, prompts, params=GREEDY, max_new_tokens=40, eos_token_ids=set(),
                             generator=None, step=_step(step, bb))
    finally:
        hook.remove()
    assert new == ref
    assert seen >= {0, 1, 2, 3} and set(resumed) == {1, 2, 3, 4}
    batched = [n for b, n in shapes if b > 1 and n != max(LENGTHS)]     # verify passes (prefill aside)
    assert batched
    if step == "eager":
        assert max(batched) < 7, "the batched verifier recomputed layers < E for nodes a row had drafted"


@pytest.mark.parametrize("step", STEPS)
def test_target_cache_rows_equal_a_fresh_forward_at_every_accepted_length(step, one_thread):
    """After each step, every live row's KV (all layers) equals a fresh pass over its committed tokens."""
    model = tiny_model("qwen2")
    bb = Backbone(model)
    prompts = _prompts(model.config.vocab_size)
    ref = _alone(model, prompts, 60)
    seen, checks = set(), 0

    class Checked(RowOracle):
        def commit(self, states, accepted, outs):
            nonlocal checks
            for s, a in zip(states, accepted):
                seen.add(a.num_accepted)
                _check_row_cache(bb, s)
                checks += 1

    drafter = Checked([p.tolist() + r for p, r in zip(prompts, ref)],
                      ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 0, 0, 0)))
    new, _ = decode_rows(bb, drafter, prompts, params=GREEDY, max_new_tokens=60, eos_token_ids=set(), generator=None,
                         step=_step(step, bb))
    assert new == ref
    assert seen >= {0, 1, 2, 3, 4} and checks > 20


def test_generate_takes_left_padded_batches_and_lists(one_thread):
    """The API as transformers users call it: a left-padded batch with its attention_mask, or a list."""
    model = tiny_model("llama")
    heads = untrained_heads("medusa", model, "tiny")

    class Tok:
        eos_token_id = None
        pad_token_id = 0

    sm = SelfSpeculativeModel(model, Tok(), drafter_name="medusa", heads=heads, tree="auto", name="tiny")
    prompts = _prompts(model.config.vocab_size, lengths=(5, 8, 3))
    ref = _alone(model, prompts, 12)
    T = 8
    ids = torch.stack([torch.cat([torch.zeros(T - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(T - len(p), dtype=torch.long), torch.ones(len(p), dtype=torch.long)])
                        for p in prompts])
    out = sm.generate(ids, attention_mask=mask, max_new_tokens=12)
    assert out.shape == (3, T + 12) and torch.equal(out[:, :T], ids)
    assert [out[b, T:].tolist() for b in range(3)] == ref
    # EOS in one row: that row is padded with pad_token_id afterwards, as transformers pads it.
    eos = ref[2][3]
    out = sm.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    row = out[2, T:].tolist()
    assert row[:4] == ref[2][:4] and row[4:] == [0] * (len(row) - 4)
    listed = sm.generate([p.tolist() for p in prompts], max_new_tokens=12)
    assert [listed[b, T:].tolist() for b in range(3)] == ref and torch.equal(listed[:, :T], ids)
    assert sm.last_stats.new_tokens == 36
    # A tokenizer's output whole (a BatchEncoding: what transformers 5's apply_chat_template returns).
    from transformers import BatchEncoding

    encoded = BatchEncoding({"input_ids": ids, "attention_mask": mask})
    assert torch.equal(sm.generate(encoded, max_new_tokens=12), listed)
    assert torch.equal(sm.generate(**encoded, max_new_tokens=12), listed)
    with pytest.raises(ValueError, match="without 'input_ids'"):
        sm.generate({"attention_mask": mask}, max_new_tokens=12)


def test_generate_takes_stop_strings_as_transformers_does(one_thread):
    """generate(stop_strings=...) with the model's own tokenizer (or tokenizer=, or the generation config's
    strings), rows padded after their stop as transformers pads them; no tokenizer at all is one line."""
    model = tiny_model("llama")
    tok = char_tokenizer(model.config.vocab_size)
    sm = SelfSpeculativeModel(model, tok, drafter_name="eagle", heads=untrained_heads("eagle", model, "tiny"),
                              tree="auto", name="tiny")
    prompts = _prompts(model.config.vocab_size, lengths=(5, 8, 3))
    long = _alone(model, prompts, 16)
    strings = [tok.convert_ids_to_tokens(long[0][5]), "".join(tok.convert_ids_to_tokens(long[2][9:11]))]
    T = 8
    ids = torch.stack([torch.cat([torch.zeros(T - len(p), dtype=torch.long), p]) for p in prompts])
    mask = (ids != 0).long()
    for p, row in zip(prompts, sm.generate(ids, attention_mask=mask, max_new_tokens=16, stop_strings=strings,
                                           pad_token_id=0)):
        alone = model.generate(p[None], attention_mask=torch.ones_like(p[None]), max_new_tokens=16, do_sample=False,
                               stop_strings=strings, tokenizer=tok, pad_token_id=0)[0, len(p):].tolist()
        assert row[T:].tolist() == alone + [0] * (16 - len(alone))
    assert len(sm.generate(prompts[0][None], max_new_tokens=16, stop_strings=strings[0])[0]) == 5 + 6
    model.generation_config.stop_strings = strings[0]
    assert len(sm.generate(prompts[0][None], max_new_tokens=16, tokenizer=tok)[0]) == 5 + 6
    model.generation_config.stop_strings = None
    bare = SelfSpeculativeModel(model, None, drafter_name="none", heads=None, name="tiny")
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        bare.generate(prompts[0][None], max_new_tokens=4, stop_strings="x")
    with pytest.raises(ValueError, match="non-empty strings"):
        sm.generate(prompts[0][None], max_new_tokens=4, stop_strings=["x", ""])


def test_generate_returns_several_samples_a_prompt_and_refuses_beams(one_thread):
    """num_return_sequences=n samples n rows a prompt, side by side as transformers orders them (the same
    rows as the prompts repeated by hand, under one seed: width fitting off, since its cuts follow the
    machine's timings and with them the draws); greedy with n > 1 and num_beams > 1 are refused."""
    model = tiny_model("llama")
    sm = SelfSpeculativeModel(model, None, drafter_name="medusa", heads=untrained_heads("medusa", model, "tiny"),
                              tree="auto", name="tiny", fit_width=False)
    prompts = [p.tolist() for p in _prompts(model.config.vocab_size, lengths=(5, 3))]
    kw = dict(max_new_tokens=10, do_sample=True, temperature=1.5)
    out = sm.generate(prompts, num_return_sequences=3, generator=torch.Generator().manual_seed(1), **kw)
    by_hand = sm.generate([p for p in prompts for _ in range(3)], generator=torch.Generator().manual_seed(1), **kw)
    assert out.shape == (6, 5 + 10) and torch.equal(out, by_hand)
    assert len({tuple(r) for r in out[:3, 5:].tolist()}) > 1          # three samples, not one copied
    for bad, match in ((dict(num_beams=4), "beam search"), (dict(num_return_sequences=2), "greedy decoding returns one"),
                       (dict(num_return_sequences=0, do_sample=True), "must be >= 1")):
        with pytest.raises(ValueError, match=match):
            sm.generate(prompts, max_new_tokens=4, **bad)


# ---------------------------------------------------------------------------------------------- sampling

V, L, N = 6, 3, 2400
ROWS = 48   # rows per batch: the loop's per-row work costs less in bigger batches (6.5 ms a row at 8, 3.8 at 48)


def _exact(model, prompt, params, min_new_tokens=0, eos=0):
    """Every L-token continuation's probability under the target, the repetition penalty and the EOS
    ban below ``min_new_tokens`` (of token ``eos``) applied by transformers' own processors (not selfspec's)."""
    import itertools

    from transformers import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

    from selfspec.core.sampling import probs_from_logits

    penalty = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
    floor = MinNewTokensLengthLogitsProcessor(len(prompt), min_new_tokens, eos)
    out = {}
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=L):
            prob = 1.0
            for i in range(L):
                ids = torch.tensor([prompt + list(seq[:i])])
                logits = floor(ids, penalty(ids, model(ids).logits[:, -1]))[0]
                prob *= float(probs_from_logits(logits, params)[seq[i]])
            out[seq] = prob
    return out


class _CyclingWidths:
    """Width fitting's cost stand-in: every step picks the next width in 1 .. widest, so steps cut the
    rows' trees to every size (``budget.trim`` then keeps each row's likeliest nodes)."""

    def __init__(self):
        self.steps, self.cut = 0, 0

    def width(self, chances, widest, rows=None):
        self.steps += 1
        w = 1 + self.steps % widest
        self.cut += sum(int(len(c) >= w) for c in chances)   # rows that lose nodes this step
        return w

    def level_pays(self, chances, children, *, rows, widest, running, depths=None):
        from selfspec.runtime import width

        # A level priced as a tiny head's is, against this table's pass: no clock, the same decisions every run.
        return width.level_pays(chances, children, self.table(rows, widest), spent=2e-4 * running, level=2e-4)

    def fit(self, drafts, widest, rows=None, calibration=None):
        from selfspec.runtime.width import fit_width

        return fit_width(drafts, self, widest, rows, calibration)

    def observe(self, rows, width, accepted=None):
        pass

    def table(self, rows, width):
        """Prices for the EAGLE head's level stop (``budget.level_pays``), in turn: a slow flat pass (a level
        of the tiny head always pays), fast passes growing gently to steeply with the width (it rarely
        or never pays), so that trees stop at every depth."""
        self.tables = getattr(self, "tables", 0) + 1
        base, slope = ((1.0, 0.0), (1e-3, 0.3), (1e-3, 1.0), (1e-3, 5.0))[self.tables % 4]
        return [base * (1.0 + slope * (w - 1)) for w in range(1, width + 1)]


class _OneNode(_CyclingWidths):
    """Every step cut to the root and one node: where a cut that prefers a later-drawn sibling biases most."""

    def width(self, chances, widest, rows=None):
        self.steps += 1
        self.cut += sum(int(len(c) >= 2) for c in chances)
        return 2


def _batched_counts(bb, drafter, prompts, params, batches, cost=None, eos=(), min_new_tokens=0, pace=None, step=None):
    """Rows alternate between the prompts (different lengths); counts of each prompt's first L tokens."""
    g = torch.Generator().manual_seed(3)
    counts = [{} for _ in prompts]
    rows = [torch.tensor(prompts[i % len(prompts)]) for i in range(ROWS)]
    for _ in range(batches):
        new, _ = decode_rows(bb, drafter, rows, params=params, max_new_tokens=L, eos_token_ids=set(eos), generator=g,
                             cost=cost, min_new_tokens=min_new_tokens, pace=pace, step=step)
        for i, toks in enumerate(new):
            c = counts[i % len(prompts)]
            c[tuple(toks)] = c.get(tuple(toks), 0) + 1
    return counts


def _sampling_setup():
    model = tiny_model("llama", vocab_size=V)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.25)   # spread-out p: plenty of rejections
    bb = Backbone(model)
    params = SamplingParams(do_sample=True, temperature=1.0, top_p=0.95)
    prompts = [[1, 2, 3, 1, 2], [4, 5]]
    drafter = EagleDrafter(bb, untrained_heads("eagle", model, "tiny"), depth=3, expand=2, nodes=4, lookup=2)
    return model, bb, params, prompts, drafter


@pytest.mark.parametrize("fitted", ["whole", "fitted", "calibrated", "one-node"])
def test_sampling_in_a_batch_is_lossless(fitted, one_thread, monkeypatch):
    """Sampled rows of a batch (EAGLE's trees of likeliest tokens plus copied chains) keep the target's distribution; fitted:
    with every step's trees cut to a width that cycles through every size (width fitting's cuts), and
    the head's drafting stopped at levels priced to stop at every depth (``budget.level_pays``);
    calibrated: those cuts made on chances scaled by what earlier steps accepted (``Calibration``: which
    nodes a cut keeps then follows earlier draws); one-node: every tree cut to its root and one node."""
    from selfspec.runtime import width as budget

    decided = []
    real = budget.level_pays
    monkeypatch.setattr(budget, "level_pays", lambda *a, **k: decided.append(real(*a, **k)) or decided[-1])
    model, bb, params, prompts, drafter = _sampling_setup()
    cycling = _CyclingWidths()
    cost = {"whole": None, "fitted": cycling, "calibrated": budget.Calibrated(cycling, budget.Calibration()),
            "one-node": _OneNode()}[fitted]
    counts = _batched_counts(bb, drafter, prompts, params, batches=2 * N // ROWS, cost=cost)
    for prompt, c in zip(prompts, counts):
        stat, threshold = chi2_check(c, _exact(model, prompt, params), N)
        assert stat < threshold, f"chi2={stat:.1f} >= {threshold:.1f}: prompt {prompt} lost the target distribution"
    if fitted == "calibrated":
        assert cost.calibration.factors(2)[1:] != [1.0, 1.0], "not vacuous: the cuts read scaled chances"
        cost = cycling
    if cost is not None:
        assert cost.cut > N // 4, "not vacuous: many rows' trees were cut"
        assert decided.count(True) > 5 and decided.count(False) > 5, "not vacuous: levels both drafted and stopped"
    else:
        assert not decided, "without width fitting nothing prices the head's levels"


def test_sampling_in_a_batch_at_static_shapes_is_lossless(one_thread, monkeypatch):
    """``compile=True``'s passes (here uncompiled) when sampling: each step's whole EAGLE draft, the last
    commit included, in one head pass (``_tree_pass``), the verify pass at static shapes."""
    model, bb, params, prompts, drafter = _sampling_setup()
    calls = []
    real = EagleDrafter._tree_pass
    monkeypatch.setattr(EagleDrafter, "_tree_pass", lambda self, *a: calls.append(1) or real(self, *a))
    counts = _batched_counts(bb, drafter, prompts, params, batches=2 * N // ROWS, step=StaticStep(bb, compile=False))
    assert len(calls) > N // ROWS, "not vacuous: the steps drafted in one head pass"
    for prompt, c in zip(prompts, counts):
        stat, threshold = chi2_check(c, _exact(model, prompt, params), N)
        assert stat < threshold, f"chi2={stat:.1f} >= {threshold:.1f}: prompt {prompt} lost the target distribution"


class _TwoDrawnSiblings(Drafter):
    """Two siblings drawn without replacement from one fixed q (``row_candidates(draw=True)``, as early exit
    draws its candidates), their chances the row's largest probability, as drawn drafts' are. q puts half
    its mass on one token, so the likelier of two draws is that token far more often than a first draw is."""

    name = "two-drawn"

    def __init__(self, vocab: int, token: int):
        self.logits = torch.zeros(1, vocab)
        self.logits[0, token] = math.log(vocab - 1)

    def draft(self, states):
        tree, drafts = build_tree(((0,), (1,))), []
        for s in states:
            c = row_candidates(self.logits, 2, vocab=None, vocab_size=self.logits.shape[1], state=s, draw=True)
            drafts.append(Draft(tree=tree, tokens=torch.cat([torch.tensor([s.ids[-1]]), c.tokens[0]]), q=c.q,
                                path_p=torch.cat([torch.ones(1), c.conf[0]])))
        return drafts


def test_sampling_check_catches_a_cut_that_reads_the_drawn_tokens(one_thread, monkeypatch):
    """Planted bug: width fitting scores a sampled node by the draft probability of the token drawn there
    (so a cut may keep a later-drawn sibling and drop the first), which recursive rejection sampling does
    not allow. Cut to one node a step, the same check must fail; without the bug it passes."""
    from selfspec.runtime import width as budget

    real = budget.path_p

    def by_drawn_token(draft):
        if draft.q is None:
            return real(draft)
        own = draft.q[draft.q_rows(), draft.tokens].float().cpu()
        chance = torch.ones(draft.tree.size)
        for i, parent in enumerate(draft.tree.parents.tolist()[1:], start=1):
            chance[i] = chance[parent] * own[i]
        return chance

    model, bb, params, prompts, _ = _sampling_setup()
    drafter = _TwoDrawnSiblings(V, 0)
    exact = [_exact(model, p, params) for p in prompts]
    counts = _batched_counts(bb, drafter, prompts, params, batches=2 * N // ROWS, cost=_OneNode())
    assert all(stat < threshold for stat, threshold in (chi2_check(c, e, N) for c, e in zip(counts, exact)))
    monkeypatch.setattr(budget, "path_p", by_drawn_token)
    counts = _batched_counts(bb, drafter, prompts, params, batches=2 * N // ROWS, cost=_OneNode())
    assert any(stat > threshold for stat, threshold in (chi2_check(c, e, N) for c, e in zip(counts, exact)))


def test_batch_sampling_check_catches_rows_judged_by_each_others_logits(one_thread, monkeypatch):
    """Planted bug: acceptance reads the next row's target distribution. The same check must fail."""
    model, bb, params, prompts, drafter = _sampling_setup()
    real = decode_mod.accept_rows

    def swapped(drafts, outs, params, generator, *context):
        outs = outs[1:] + outs[:1]
        fixed = [type(o)(logits=o.logits[: d.tree.size] if o.logits.shape[0] >= d.tree.size else
                         torch.cat([o.logits, o.logits[-1:].expand(d.tree.size - o.logits.shape[0], -1)]),
                         hidden=o.hidden, captured=o.captured) for d, o in zip(drafts, outs)]
        return real(drafts, fixed, params, generator, *context)

    monkeypatch.setattr(decode_mod, "accept_rows", swapped)
    counts = _batched_counts(bb, drafter, prompts, params, batches=2 * N // ROWS)
    stats = [chi2_check(c, _exact(model, p, params), N) for p, c in zip(prompts, counts)]
    assert any(stat > threshold for stat, threshold in stats)


PENALTY = 0.15


def test_sampling_with_a_repetition_penalty_is_lossless(one_thread):
    """Sampled rows keep the distribution transformers' repetition penalty gives the target: each tree node's
    logits penalised for the tokens of its own text (context and path). The penalty is below 1 (repeats
    favoured): on this tiny model's small logits it moves the distribution far more than one above 1 does
    (2.5 moves it by 0.10 in total variation), so that a penalty read from the wrong tokens shows."""
    model, bb, _, prompts, drafter = _sampling_setup()
    params = SamplingParams(do_sample=True, temperature=1.0, top_p=0.95, repetition_penalty=PENALTY)
    counts = _batched_counts(bb, drafter, prompts, params, batches=2 * N // ROWS)
    for prompt, c in zip(prompts, counts):
        stat, threshold = chi2_check(c, _exact(model, prompt, params), N)
        assert stat < threshold, f"chi2={stat:.1f} >= {threshold:.1f}: prompt {prompt} lost the penalised distribution"


def test_sampling_check_catches_a_penalty_blind_to_the_committed_text(one_thread, monkeypatch):
    """Planted bug: the tree's nodes penalised for the tokens on their own path only, not for the committed
    text before it (the prompt's and earlier steps' tokens). The same check must fail. (A penalty blind
    to the drafted path instead is caught by the greedy test above, whose oracle drafts are judged deep.)"""
    from selfspec.core import sampling

    model, bb, _, prompts, drafter = _sampling_setup()
    real = sampling.penalize_repeats
    monkeypatch.setattr(sampling, "penalize_repeats",
                        lambda z, context, penalty, *tree: real(z, context if not tree else (), penalty, *tree))
    params = SamplingParams(do_sample=True, temperature=1.0, repetition_penalty=PENALTY)   # no top-p: no impossible cell
    counts = _batched_counts(bb, drafter, prompts, params, batches=2 * N // ROWS)
    stats = [chi2_check(c, _exact(model, p, params), N) for p, c in zip(prompts, counts)]
    assert any(stat > threshold for stat, threshold in stats)


@pytest.mark.parametrize("ban", ["tree", "root-only"])
def test_sampling_with_min_new_tokens_is_lossless(ban, one_thread, monkeypatch):
    """Sampled rows whose EOS token may not come within the L tokens keep the distribution transformers'
    min_new_tokens processor gives the target (EOS masked at every node still too early). Planted bug
    (root-only): EOS masked at each step's root alone, so a drafted node's bonus may be EOS; the same
    check must fail."""
    from selfspec.core import sampling

    if ban == "root-only":
        real = sampling.target_logits
        monkeypatch.setattr(decode_mod, "target_logits", lambda z, params, context, **kw: real(
            z, params, context, **{**kw, "eos_until": min(kw.get("eos_until", 0), 1)}))
    model, bb, params, prompts, drafter = _sampling_setup()
    eos = 0
    counts = _batched_counts(bb, drafter, prompts, params, batches=2 * N // ROWS, eos=[eos], min_new_tokens=L)
    exact = [_exact(model, p, params, min_new_tokens=L, eos=eos) for p in prompts]
    if ban == "tree":
        for prompt, c, e in zip(prompts, counts, exact):
            stat, threshold = chi2_check(c, e, N)
            assert stat < threshold, f"chi2={stat:.1f} >= {threshold:.1f}: prompt {prompt} lost the distribution"
        unbanned = _exact(model, prompts[0], params)
        assert sum(q for k, q in unbanned.items() if eos in k) > 0.2, "not vacuous: without the ban EOS is common"
    else:
        assert any(eos in k for c in counts for k in c), "the planted bug lets EOS through"
        with pytest.raises(AssertionError, match="zero target probability"):
            for c, e in zip(counts, exact):
                chi2_check(c, e, N)


def test_tree_mask_lets_each_query_see_its_rows_past_and_its_ancestors():
    """The mask a verify pass builds from row lengths and padded ancestor matrices (``tree_mask``, eager
    and inside the static step), slot by slot: row b's query sees slots [0, lengths[b]) and slot
    lengths[b] + j where its ancestors hold node j, nothing else; queries may be some nodes' rows only
    (early exit's resumed pass: each row's nodes from the first it had not run)."""
    from selfspec.core.tree import tree_mask

    trees = [build_tree(((0,), (1,), (0, 0))), build_tree(chain(1)), build_tree(())]
    n, capacity, lengths = 4, 24, [5, 9, 2]
    anc = torch.eye(n, dtype=torch.bool).repeat(3, 1, 1)   # padding nodes see themselves only
    for b, t in enumerate(trees):
        anc[b, :t.size, :t.size] = t.ancestors
    low = torch.finfo(torch.float32).min
    for queries in (torch.arange(n).repeat(3, 1), torch.tensor([[1, 2], [0, 1], [0, 3]])):
        got = tree_mask(anc.gather(1, queries[..., None].expand(-1, -1, n)), torch.tensor(lengths), capacity,
                        torch.float32)
        assert got.shape == (3, 1, queries.shape[1], capacity)
        for b, length in enumerate(lengths):
            for i, node in enumerate(queries[b].tolist()):
                want = [t < length or (0 <= t - length < n and bool(anc[b, node, t - length])) for t in range(capacity)]
                assert got[b, 0, i].tolist() == [0.0 if w else low for w in want]
    assert got[0, 0, 0, 5:10].tolist() == [0.0, 0.0, low, low, low]   # node 1 of the first tree: the root and itself


@pytest.mark.parametrize("compile", [False, True], ids=["static", "compiled"])
def test_a_static_steps_path_moves_are_the_per_layer_moves(compile, one_thread):
    """A static step's cache moves accepted paths into place in one pass over every layer (``StaticStep.move``:
    paths padded to a bucket, rows with nothing to move copying their first slots onto themselves);
    each row then holds exactly the slots the per-layer gather leaves, after one step and after another
    (whatever either leaves past a row's length is stale: the next step's tree overwrites it)."""
    model = tiny_model("llama")
    step = StaticStep(Backbone(model), compile=compile)
    layers, B = model.config.num_hidden_layers, 3
    attn = model.model.layers[0].self_attn
    kv_heads, head_dim = model.config.num_key_value_heads, attn.head_dim
    g = torch.Generator().manual_seed(0)
    one = step.new_cache(B, 40)
    one.allocate(layers, kv_heads, head_dim, dtype=torch.float32, device="cpu")
    plain = KVCache(B, capacity=one.capacity)
    plain.allocate(layers, kv_heads, head_dim, dtype=torch.float32, device="cpu")
    assert one.mover is not None and plain.mover is None
    for buf, ref in zip(one.keys + one.values, plain.keys + plain.values):
        buf.copy_(torch.randn(buf.shape, generator=g))
        ref.copy_(buf)
    steps = [([7, 9, 13], [torch.tensor([0, 2, 5]), torch.tensor([0, 1]), torch.tensor([0, 3])]),   # row 1: a prefix
             ([10, 11, 15], [torch.tensor([0]), torch.tensor([0, 4, 5, 9, 12]), torch.tensor([0, 1, 2])])]
    for starts, paths in steps:
        for buf, ref in zip(one.keys + one.values, plain.keys + plain.values):   # each row's tree: 16 new slots
            for b, start in enumerate(starts):
                buf[b, :, start:start + 16] = torch.randn(kv_heads, 16, head_dim, generator=g)
                ref[b, :, start:start + 16] = buf[b, :, start:start + 16]
        for c in (one, plain):
            c.lengths = [[s + 16 for s in starts] for _ in range(layers)]
            c.keep(starts, paths)
        assert one.lengths == plain.lengths
        for b in range(B):
            n = one.lengths[0][b]
            for got, want in zip(one.keys + one.values, plain.keys + plain.values):
                assert torch.equal(got[b, :, :n], want[b, :, :n])
    assert one.lengths[0] == [10 + 1, 11 + 5, 15 + 3]


def test_a_compiled_cpu_pass_freezes_the_weights(one_thread):
    """On CPU a compiled static pass built with ``freeze`` (the verify pass of trees of several nodes)
    freezes its weights: constants of the compiled code, packed once, as ``StaticFunction`` documents. It
    gives the eager products, a second model of the same shape gets its own graph, and a weight changed in
    place after its shape compiled is not seen; without ``freeze`` the pass reads the weights as they are."""
    from selfspec.runtime.static import StaticFunction

    torch.manual_seed(0)
    linears = [torch.nn.Linear(16, 8, bias=False) for _ in range(3)]
    cpu = torch.device("cpu")
    frozen = [StaticFunction(lambda x, lin=lin: torch.relu(lin(x)) * 2, compile=True, device=cpu, freeze=True)
              for lin in linears[:2]]
    plain = StaticFunction(lambda x: torch.relu(linears[2](x)) * 2, compile=True, device=cpu)
    x = torch.randn(4, 16)
    with torch.inference_mode():
        for lin, f in zip(linears, frozen + [plain]):
            assert torch.allclose(f(x), torch.relu(lin(x)) * 2, atol=1e-6)
        before = frozen[0](x)
        for lin in (linears[0], linears[2]):
            lin.weight.mul_(3.0)
        assert torch.equal(frozen[0](x), before), "a frozen CPU pass re-read its weights"
        assert torch.allclose(frozen[1](x), torch.relu(linears[1](x)) * 2, atol=1e-6)
        assert torch.allclose(plain(x), torch.relu(linears[2](x)) * 2, atol=1e-6), "an unfrozen pass froze"
