"""The second real model: Qwen2.5-Coder-1.5B-Instruct as the target, its off-the-shelf 0.5B sibling as
the two-model draft (`make test-pair`, which installs and assembles both; not part of `make test`,
whose time budget a 1.5B model on two CPU cores would take over). Greedy output of every drafter
must be transformers' own, token for token."""

from __future__ import annotations

import pytest
import torch

from selfspec.model import SelfSpeculativeModel, untrained_heads

pytestmark = pytest.mark.pair

PROMPTS = ["Write a Python function that checks whether a string is a palindrome.",
           "Explain in two sentences what a hash map is."]
N = 32


@pytest.fixture(scope="module")
def pair():
    from selfspec.loading import load_model

    return load_model("qwen2.5-coder-1.5b"), load_model("qwen2.5-coder-0.5b")


def _ids(tokenizer, text: str) -> torch.Tensor:
    from selfspec.io import prompt_ids

    return torch.tensor([prompt_ids(tokenizer, text, chat=True)])


@torch.no_grad()
def test_every_drafter_reproduces_transformers_greedy_on_the_pair(pair):
    target, draft = pair
    model, tok = target.model, target.tokenizer
    eos = model.generation_config.eos_token_id
    drafters = {
        "none": dict(heads=None),
        "lookup": dict(heads=None),
        "draft-model": dict(heads=None, draft_model=draft.model),
        "draft-model-stop": dict(heads=None, draft_model=draft.model, threshold=0.4),
        "medusa": dict(heads=untrained_heads("medusa", model, target.name)),
        "early-exit": dict(heads=untrained_heads("early-exit", model, target.name)),
        "eagle": dict(heads=untrained_heads("eagle", model, target.name)),
    }
    for text in PROMPTS:
        ids = _ids(tok, text)
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False,
                             pad_token_id=tok.pad_token_id or 0)
        for name, kw in drafters.items():
            sm = SelfSpeculativeModel(model, tok, drafter_name=name.removesuffix("-stop"), name=target.name, **kw)
            out = sm.generate(ids, max_new_tokens=N, eos_token_id=eos)
            assert torch.equal(out, ref), f"{name} diverged on {text!r}"


def test_the_draft_accepts_deep_on_the_pair(pair):
    """The 0.5B draft agrees with the 1.5B target often: deep chains are accepted (the basis of its speed)."""
    target, draft = pair
    sm = SelfSpeculativeModel(target.model, target.tokenizer, drafter_name="draft-model", name=target.name,
                              heads=None, draft_model=draft.model, tree="chain-4", fit_width=False)
    sm.generate(_ids(target.tokenizer, PROMPTS[0]), max_new_tokens=N)
    assert sm.last_stats.tau > 2.0
