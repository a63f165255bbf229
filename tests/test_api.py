"""Public API behaviour: errors users see, heads IO, stats, streaming, sampling through the loop."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import chi2_check, hf_greedy, tiny_model

from selfspec.core.backbone import config_fingerprint
from selfspec.heads import load_heads, save_heads
from selfspec.model import SelfSpeculativeModel, untrained_heads


class _Tok:
    chat_template = None


def _sm(model, drafter="medusa", **kw):
    heads = untrained_heads(drafter, model, "tiny") if drafter in ("medusa", "early-exit") else None
    return SelfSpeculativeModel(model, _Tok(), drafter_name=drafter, heads=heads, tree=kw.pop("tree", "auto"),
                                name="tiny", **kw)


def test_bad_inputs_raise_clear_errors():
    sm = _sm(tiny_model())
    with pytest.raises(ValueError, match="padding inside the prompt"):
        sm.generate(torch.ones(1, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 0, 1, 1]]))
    with pytest.raises(ValueError, match="all padding"):
        sm.generate(torch.ones(2, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]]))
    with pytest.raises(ValueError, match="must match"):
        sm.generate(torch.ones(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="one sequence"):
        sm.generate(torch.ones(2, 4, dtype=torch.long), streamer=object())
    with pytest.raises(ValueError, match="max_new_tokens"):
        sm.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=0)
    with pytest.raises(ValueError, match="does not support"):
        sm.generate(torch.ones(1, 4, dtype=torch.long), num_beam_groups=2)
    with pytest.raises(ValueError, match="temperature"):
        sm.generate(torch.ones(1, 4, dtype=torch.long), do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="unknown drafter"):
        _sm(tiny_model(), drafter="lookahead")
    with pytest.raises(ValueError, match="exceeds the 4 Medusa heads"):
        _sm(tiny_model(), tree="chain-5")
    with pytest.raises(ValueError, match="not supported"):
        from transformers import GPT2Config, GPT2LMHeadModel

        from selfspec.core.backbone import Backbone
        Backbone(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)))


def test_heads_roundtrip_and_mismatch_refused(tmp_path):
    model = tiny_model()
    heads = untrained_heads("medusa", model, "tiny")
    with torch.no_grad():
        heads.module.blocks[0].linear.weight.normal_()
    save_heads(heads, tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["kind"] == "medusa" and cfg["num_heads"] == 4 and cfg["base_fingerprint"] == config_fingerprint(model.config)
    back = load_heads(tmp_path / "h", expect_kind="medusa", fingerprint=config_fingerprint(model.config))
    assert torch.equal(back.module.blocks[0].linear.weight, heads.module.blocks[0].linear.weight)
    heads.config.storage_dtype = "float16"
    save_heads(heads, tmp_path / "h16")
    half = load_heads(tmp_path / "h16", expect_kind="medusa", fingerprint=config_fingerprint(model.config))
    torch.testing.assert_close(half.module.blocks[0].linear.weight, heads.module.blocks[0].linear.weight, atol=2e-3, rtol=1e-3)
    assert half.module.blocks[0].linear.weight.dtype == torch.float32 and half.config.storage_dtype == "float16"
    assert (tmp_path / "h16" / "model.safetensors").stat().st_size < 0.6 * (tmp_path / "h" / "model.safetensors").stat().st_size
    other = tiny_model(hidden_size=48)
    with pytest.raises(ValueError, match="does not match this model"):
        load_heads(tmp_path / "h", expect_kind="medusa", fingerprint=config_fingerprint(other.config))
    with pytest.raises(ValueError, match="drafter is 'early-exit'"):
        load_heads(tmp_path / "h", expect_kind="early-exit", fingerprint=config_fingerprint(model.config))
    with pytest.raises(ValueError, match="not a heads directory"):
        load_heads(tmp_path, expect_kind="medusa", fingerprint="x")


def test_generate_returns_like_transformers_with_stats_and_streamer():
    model = tiny_model()
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    ref = hf_greedy(model, ids, 20)

    class Streamer:
        def __init__(self):
            self.chunks = []
            self.ended = False

        def put(self, t):
            self.chunks.append(t.reshape(-1).tolist())

        def end(self):
            self.ended = True

    sm = _sm(model, drafter="early-exit")
    streamer = Streamer()
    out = sm.generate(ids, max_new_tokens=20, streamer=streamer)
    assert torch.equal(out, ref)
    # Decoding runs under inference mode; what comes back is an ordinary tensor the caller may change in place.
    assert not out.is_inference()
    out[0, -1] += 0
    assert streamer.ended and streamer.chunks[0] == ids[0].tolist()
    assert sum(streamer.chunks[1:], []) == ref[0, 6:].tolist()
    st = sm.last_stats
    assert st.new_tokens == 20 and st.target_forwards == st.steps + 1
    assert math.isclose(st.tau, sum((a + 1) * n for a, n in enumerate(st.accepted_hist)) / st.steps)
    assert len(st.acceptance_by_depth) == 4 and st.wall_s > 0
    res = sm.generate(ids, max_new_tokens=5, return_dict_in_generate=True)
    assert res.sequences.shape == (1, 11) and res.stats.new_tokens == 5
    # eos from generation_config / kwarg stops early and keeps the eos token
    eos = int(ref[0, 10])
    out = sm.generate(ids, max_new_tokens=20, eos_token_id=[eos])
    assert out[0, -1] == eos and out.shape[1] <= 11


@pytest.mark.parametrize("drafter", ["medusa", "early-exit"])
def test_sampling_through_the_loop_matches_target_distribution(drafter):
    """End to end on a tiny model with an 8-token vocabulary: the first two sampled tokens follow the
    target's exact joint distribution (computed by enumeration), within a chi-square bound."""
    model = tiny_model("llama", vocab_size=8)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.15)   # undo most of the sharpening: a spread distribution
    ids = torch.tensor([[1, 2, 3]])
    # fit_width=False: every row verifies its whole tree, as one row alone does
    sm = _sm(model, drafter=drafter, tree="chain-2-w2" if drafter == "early-exit" else ((0,), (1,), (0, 0), (1, 0)),
             fit_width=False)
    temp, top_p = 0.9, 0.95
    from selfspec.core.sampling import SamplingParams, probs_from_logits

    params = SamplingParams(do_sample=True, temperature=temp, top_p=top_p)
    with torch.no_grad():
        p1 = probs_from_logits(model(ids).logits[0, -1], params)
        exact = {}
        for a in range(8):
            p2 = probs_from_logits(model(torch.cat([ids, torch.tensor([[a]])], 1)).logits[0, -1], params)
            for b in range(8):
                exact[(a, b)] = float(p1[a] * p2[b])
    n, rows = 1500, 50   # batches of 50 copies of the prompt: independent samples, cheaper a row
    gen = torch.Generator().manual_seed(0)
    counts, drafted = {}, 0
    for _ in range(n // rows):
        out = sm.generate(ids.repeat(rows, 1), max_new_tokens=2, do_sample=True, temperature=temp, top_p=top_p, top_k=0,
                          generator=gen)
        for key in map(tuple, out[:, 3:5].tolist()):
            counts[key] = counts.get(key, 0) + 1
        drafted += sm.last_stats.drafted
    assert drafted >= 4 * n, "not vacuous: every row's first step verified a whole 4-node tree"
    stat, threshold = chi2_check(counts, exact, n)
    assert stat < threshold, f"chi2={stat:.1f} >= {threshold:.1f}: not the target distribution"
