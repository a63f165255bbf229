"""The master test: speculative greedy == plain greedy, token for token, whatever the draft proposes."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, tiny_model

from selfspec.core import cache as kv
from selfspec.core.backbone import Backbone
from selfspec.core.decode import decode
from selfspec.core.sampling import SamplingParams
from selfspec.core.tree import build_tree, chain, chain_with_siblings
from selfspec.core.types import DecodeState, Draft, Drafter
from selfspec.drafters import DraftModelDrafter, EarlyExitDrafter, MedusaDrafter, NoDrafter
from selfspec.model import untrained_heads
from selfspec.settings import MEDUSA_DEFAULT

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma", "phi3"]
GREEDY = SamplingParams()
N_NEW = 40


class OracleDrafter(Drafter):
    """Proposes plain greedy's own continuation, corrupted at draft position ``bad`` (0-based depth - 1).

    Chain: node at depth d holds the true token d, except depth bad + 1, which holds a wrong one.
    Tree: rank-0 children hold the same as the chain; at depth bad + 1 the *true* token moves to
    rank 1, so the verifier must take a non-first branch and keep going below it.
    """

    def __init__(self, reference: list[int], tree_paths, bad: int, vocab: int):
        self.reference, self.bad, self.vocab = reference, bad, vocab
        self.tree = build_tree(tree_paths)

    def draft(self, states: list[DecodeState]) -> list[Draft]:
        return [self._row(s) for s in states]

    def _row(self, state: DecodeState) -> Draft:
        start = len(state.ids)
        truth = self.reference[start:] + [0] * (self.tree.depth + 1)
        tokens = [state.ids[-1]]
        for path in self.tree.paths:
            d, rank = len(path), path[-1]
            true, wrong = truth[d - 1], (truth[d - 1] + 1 + rank) % self.vocab
            if d - 1 == self.bad:
                tokens.append(true if rank == 1 else wrong)
            else:
                tokens.append(true if rank == 0 else wrong)
        return Draft(tree=self.tree, tokens=torch.tensor(tokens))


def _all_true(path, bad: int) -> bool:
    """Whether every node on ``path`` holds the true token under OracleDrafter's layout."""
    return all(rank == (1 if depth == bad else 0) for depth, rank in enumerate(path))


def _prompt(vocab: int, seed: int, n: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, n), generator=g)


def _run(model, drafter, ids, n=N_NEW, backbone=None):
    new, stats = decode(backbone or Backbone(model), drafter, ids[0], params=GREEDY, max_new_tokens=n, eos_token_ids=set(),
                        generator=None)
    return torch.cat([ids, torch.tensor([new])], dim=1), stats


@pytest.mark.parametrize("arch", ARCHS)
def test_oracle_chain_and_tree_every_corruption(arch):
    model = tiny_model(arch)
    ids = _prompt(model.config.vocab_size, seed=1)
    ref = hf_greedy(model, ids, N_NEW)
    assert ref.shape[1] == ids.shape[1] + N_NEW
    reference = ref[0].tolist()
    k = 4
    trees = {"chain": chain(k), "tree": ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0),
                                         (0, 0, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1))}
    for kind, paths in trees.items():
        for bad in range(k + 1):  # bad == k: nothing corrupted, every draft is right
            drafter = OracleDrafter(reference, paths, bad, model.config.vocab_size)
            out, stats = _run(model, drafter, ids)
            assert torch.equal(out, ref), f"{arch} {kind} corrupt@{bad}: diverged"
            # The accepted length must be exactly what the corruption allows: proves the tree was walked.
            expected = max([len(p) for p in paths if _all_true(p, bad)], default=0)
            assert max(i for i, n in enumerate(stats.accepted_hist) if n) == expected, (kind, bad, stats.accepted_hist)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma"])
def test_untrained_drafters_match_plain_greedy(arch):
    model = tiny_model(arch)
    bb = Backbone(model)
    for seed in range(2):
        ids = _prompt(model.config.vocab_size, seed=seed + 10)
        ref = hf_greedy(model, ids, N_NEW)
        drafters = [
            NoDrafter(bb.device),
            MedusaDrafter(bb, untrained_heads("medusa", model, "t", token_input=False), build_tree(MEDUSA_DEFAULT)),
            MedusaDrafter(bb, _noisy(untrained_heads("medusa", model, "t", token_input=True)), build_tree(MEDUSA_DEFAULT)),
            EarlyExitDrafter(bb, untrained_heads("early-exit", model, "t", exit_layer=2), build_tree(chain(4))),
            EarlyExitDrafter(bb, untrained_heads("early-exit", model, "t", exit_layer=1),
                             build_tree(chain_with_siblings(3, 3))),
            DraftModelDrafter(tiny_model(arch, seed=5), build_tree(chain(3)), vocab_size=bb.vocab_size),
            DraftModelDrafter(_with_draft_vocab(tiny_model(arch, seed=5), bb.vocab_size), build_tree(chain(3)),
                              vocab_size=bb.vocab_size),
        ]
        for drafter in drafters:
            out, _ = _run(model, drafter, ids)
            assert torch.equal(out, ref), f"{arch} {drafter.name} diverged from plain greedy"


def _with_draft_vocab(draft, vocab_size: int):
    """A draft that scores only every other token (as a distilled draft's frequent-token subset)."""
    draft.config.selfspec_draft_vocab = list(range(0, vocab_size, 2))
    return draft


def _noisy(heads, scale: float = 0.05):
    """Heads with random (not zero) weights, so every input path of the module is exercised."""
    with torch.no_grad():
        for i, p in enumerate(heads.module.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * scale)
    return heads


def _identity_upper_layers(model, exit_layer: int, scale: float) -> None:
    """Scale the residual writes of layers >= exit_layer: at 0 they are the identity, so plain early
    exit *is* the full model and every draft is accepted; small scales give high but partial acceptance."""
    with torch.no_grad():
        for layer in model.model.layers[exit_layer:]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)


@pytest.mark.parametrize("scale", [0.0, 0.3])
@pytest.mark.parametrize("tree", [chain(4), chain_with_siblings(4, 2)])
def test_early_exit_kv_reuse_under_high_acceptance(scale, tree):
    """Deep acceptance exercises the reuse of the draft's layer < E KV in verification."""
    model = tiny_model("llama", num_hidden_layers=6)
    _identity_upper_layers(model, 3, scale)
    bb = Backbone(model)
    ids = _prompt(model.config.vocab_size, seed=3)
    ref = hf_greedy(model, ids, N_NEW)
    drafter = EarlyExitDrafter(bb, untrained_heads("early-exit", model, "t", exit_layer=3), build_tree(tree))
    out, stats = _run(model, drafter, ids)
    assert torch.equal(out, ref)
    if scale == 0.0:
        assert stats.tau > 4.5  # every chain accepted: 5 tokens per step (bar the last, cut by max_new_tokens)
    assert stats.steps < N_NEW


@pytest.mark.parametrize("threshold", [0.005, 0.05])
@pytest.mark.parametrize("tree", [chain(4), chain_with_siblings(3, 3)])
def test_confidence_pruned_early_exit_is_exact(tree, threshold):
    """Chains that stop early (and cut siblings) at varying depths: the cache written while drafting
    must still line up with the verified tree, and the output must still be plain greedy's."""
    model = tiny_model("llama", num_hidden_layers=6)
    _identity_upper_layers(model, 3, 0.3)
    bb = Backbone(model)
    ids = _prompt(model.config.vocab_size, seed=3)
    ref = hf_greedy(model, ids, N_NEW)
    drafter = EarlyExitDrafter(bb, untrained_heads("early-exit", model, "t", exit_layer=3), build_tree(tree),
                               threshold=threshold)
    out, stats = _run(model, drafter, ids)
    assert torch.equal(out, ref)
    assert 0 < stats.drafted < stats.steps * len(tree)   # some steps pruned, some proposed


@pytest.mark.parametrize("threshold,gate", [(0.01, 0.0), (0.05, 0.0), (0.0, 0.25)])
def test_confidence_pruned_medusa_is_exact(threshold, gate):
    model = tiny_model("llama")
    bb = Backbone(model)
    ids = _prompt(model.config.vocab_size, seed=3)
    ref = hf_greedy(model, ids, N_NEW)
    heads = _noisy(untrained_heads("medusa", model, "t", token_input=True))
    out, stats = _run(model, MedusaDrafter(bb, heads, build_tree(MEDUSA_DEFAULT), threshold=threshold, gate=gate),
                      ids)
    assert torch.equal(out, ref)
    assert 0 < stats.drafted < stats.steps * len(MEDUSA_DEFAULT)


def test_draft_model_identical_to_target_accepts_everything():
    model = tiny_model("qwen2")
    bb = Backbone(model)
    ids = _prompt(model.config.vocab_size, seed=4)
    ref = hf_greedy(model, ids, N_NEW)
    # float32 drafting: the draft is then the target itself, bit for bit (see the bfloat16 test below).
    out, stats = _run(model, DraftModelDrafter(tiny_model("qwen2"), build_tree(chain(5)), vocab_size=bb.vocab_size,
                                               dtype=torch.float32), ids)
    assert torch.equal(out, ref)
    assert stats.tau > 5.5


def test_draft_model_drafting_in_bfloat16_is_exact_and_leaves_the_given_model_alone():
    """The draft may run in bfloat16 (the default on CPUs with BF16 instructions): it only proposes.
    The drafter then works on a copy, so a caller still using the float32 model (the bench's
    transformers assisted generation) is unaffected."""
    model = tiny_model("qwen2")
    bb = Backbone(model)
    ids = _prompt(model.config.vocab_size, seed=4)
    ref = hf_greedy(model, ids, N_NEW)
    given = tiny_model("qwen2")
    drafter = DraftModelDrafter(given, build_tree(chain(4)), vocab_size=bb.vocab_size, dtype=torch.bfloat16)
    assert drafter.model is not given and next(drafter.model.parameters()).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in given.parameters())
    out, stats = _run(model, drafter, ids)
    assert torch.equal(out, ref)
    assert stats.tau > 2.0   # a bfloat16 copy of the target itself still agrees with it on most tokens


@pytest.mark.parametrize("threshold", [0.004, 0.06])   # tiny random models: top probabilities ~0.05-0.1
def test_confidence_stopped_draft_model_is_exact(threshold):
    """A draft close to the target (partial acceptance) whose chain stops where it doubts itself:
    its own cache must follow the drafts it actually fed, and the output stay plain greedy's."""
    model = tiny_model("qwen2")
    draft = tiny_model("qwen2")
    with torch.no_grad():
        g = torch.Generator().manual_seed(9)
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.abs().mean())
    bb = Backbone(model)
    ids = _prompt(model.config.vocab_size, seed=4)
    ref = hf_greedy(model, ids, N_NEW)
    drafter = DraftModelDrafter(draft, build_tree(chain(5)), vocab_size=bb.vocab_size, threshold=threshold)
    out, stats = _run(model, drafter, ids)
    assert torch.equal(out, ref)
    assert 0 < stats.drafted < stats.steps * 5            # some chains stopped early, some drafts proposed
    assert stats.tau > 1.0


def test_eos_and_max_new_tokens_are_respected():
    model = tiny_model("llama")
    ids = _prompt(model.config.vocab_size, seed=2)
    ref = hf_greedy(model, ids, 30)[0, ids.shape[1]:].tolist()
    eos = ref[12]
    first = ref.index(eos)
    drafter = OracleDrafter(ref and hf_greedy(model, ids, 30)[0].tolist(), chain(4), 4, model.config.vocab_size)
    new, _ = decode(Backbone(model), drafter, ids[0], params=GREEDY, max_new_tokens=30, eos_token_ids={eos},
                    generator=None)
    assert new == ref[: first + 1]
    for limit in (1, 2, 5, 7):
        new, _ = decode(Backbone(model), drafter, ids[0], params=GREEDY, max_new_tokens=limit, eos_token_ids=set(),
                        generator=None)
        assert new == ref[:limit]


def _layer_adapter_heads(model, exit_layer: int, noise: float):
    """A decoder-layer exit adapter with small random residual writes (a stand-in for a trained one)."""
    heads = untrained_heads("early-exit", model, "t", exit_layer=exit_layer, adapter="layer")
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for proj in (heads.module.layer.self_attn.o_proj, heads.module.layer.mlp.down_proj):
            proj.weight.copy_(torch.randn(proj.weight.shape, generator=g) * noise)
    return heads


@pytest.mark.parametrize("tree,threshold", [(chain(3), 0.0), (chain_with_siblings(3, 2), 0.0),
                                            (chain_with_siblings(3, 2), 0.004)])
@pytest.mark.parametrize("scale", [0.0, 1.0])
def test_layer_exit_adapter_exact_and_its_cache_matches_a_fresh_run(tree, threshold, scale):
    """The layer adapter's own KV cache must equal a from-scratch pass over the committed tokens,
    whatever was accepted (full chains, partial chains, sibling leaves)."""
    model = tiny_model("llama", num_hidden_layers=6)
    _identity_upper_layers(model, 3, scale)
    bb = Backbone(model)
    ids = _prompt(model.config.vocab_size, seed=5)
    ref = hf_greedy(model, ids, N_NEW)
    drafter = EarlyExitDrafter(bb, _layer_adapter_heads(model, 3, 0.05), build_tree(tree), threshold=threshold)
    out, stats = _run(model, drafter, ids)
    assert torch.equal(out, ref)
    if scale == 0.0 and threshold == 0.0:
        assert stats.tau > 2.0  # deep acceptance: the commit path that fills in unseen nodes is exercised
    if threshold > 0:
        assert 0 < stats.drafted < stats.steps * len(tree)   # chains cut at varying depths
    seq = out[:, : drafter.adapter_cache.layer(0)[0].shape[2]]
    with torch.no_grad():
        h_e = model(seq, output_hidden_states=True).hidden_states[3]
        pos = torch.arange(seq.shape[1])[None]
        fresh = kv.new_cache()
        drafter.heads.module(h_e, position_embeddings=bb.rotary_emb(h_e, position_ids=pos), position_ids=pos,
                             cache=fresh)
    n = seq.shape[1]
    torch.testing.assert_close(drafter.adapter_cache.layer(0)[0][:, :, :n], fresh.layer(0)[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(drafter.adapter_cache.layer(0)[1][:, :, :n], fresh.layer(0)[1], atol=1e-4, rtol=1e-4)
