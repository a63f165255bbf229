"""Greedy exactness on the REAL demo model (SmolLM2-135M-Instruct), against transformers' generate.

Untrained heads: acceptance is low, but the output must still be identical token for token. The
shipped trained heads, with their tuned settings (tree, cuts, context lookup), must be too.
"""

from __future__ import annotations

import pytest
import torch

from selfspec.core.backbone import config_fingerprint
from selfspec.drafters.draft_model import truncated_copy
from selfspec.heads import load_heads
from selfspec.io import prompt_ids
from selfspec.model import SelfSpeculativeModel, untrained_heads
from selfspec.shipped import shipped_heads

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
    "List three tips for writing clear emails.",
]
N_NEW = 64

pytestmark = pytest.mark.demo


class References:
    """(prompt ids, transformers' greedy output) for each of PROMPTS, each computed on first use: a run
    that reads one prompt (scripts/gpu_check.sh --quick, a parallel worker) pays for that one."""

    def __init__(self, demo):
        self.demo = demo
        self.done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(PROMPTS)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]
        if i not in self.done:
            demo = self.demo
            ids = torch.tensor([prompt_ids(demo.tokenizer, PROMPTS[i], chat=True)], device=demo.model.device)
            ref = demo.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, do_sample=False,
                                      pad_token_id=demo.tokenizer.eos_token_id)
            self.done[i] = ids, ref
        return self.done[i]

    def __iter__(self):
        return (self[i] for i in range(len(self)))


@pytest.fixture(scope="module")
def references(demo):
    return References(demo)


@pytest.mark.parametrize("drafter", ["none", "medusa", "early-exit", "eagle", "draft-model"])
def test_demo_greedy_identical_to_transformers(demo, references, drafter):
    heads = untrained_heads(drafter, demo.model, demo.name) if drafter in ("medusa", "early-exit", "eagle") else None
    draft = truncated_copy(demo.model, 4) if drafter == "draft-model" else None   # on the target's device
    sm = SelfSpeculativeModel(demo.model, demo.tokenizer, drafter_name=drafter, heads=heads, tree="auto",
                              name=demo.name, draft_model=draft)
    # Untrained drafts are nearly all rejected, so a step costs more than a plain one: the drafters run on
    # two of the prompts (the shipped heads, the batch and the compiled tests below run all three).
    for ids, ref in references if drafter == "none" else references[:2]:
        out = sm.generate(ids, max_new_tokens=N_NEW, do_sample=False)
        assert out.shape == ref.shape and torch.equal(out, ref), f"{drafter} diverged from transformers' greedy"
        stats = sm.last_stats
        assert stats.new_tokens == ref.shape[1] - ids.shape[1]
        assert stats.tau >= 1.0


@pytest.mark.parametrize("drafter", ["medusa", "early-exit", "eagle"])
def test_demo_shipped_heads_identical_to_transformers(demo, references, drafter):
    path = shipped_heads("smollm2-135m", drafter)
    assert path is not None, f"no shipped {drafter} heads in checkpoints/"
    p = demo.model.get_output_embeddings().weight
    heads = load_heads(path, expect_kind=drafter, fingerprint=config_fingerprint(demo.model.config), device=p.device,
                       dtype=p.dtype, model=demo.model)
    # Whole trees (no width fitting, whose cuts follow this machine's timings): the heads' own acceptance is
    # what the tau floor checks. The fitted path on the real model: the batch test below and the untrained runs.
    sm = SelfSpeculativeModel(demo.model, demo.tokenizer, drafter_name=drafter, heads=heads, tree="auto",
                              name=demo.name, fit_width=False)
    taus = []
    for ids, ref in references:
        out = sm.generate(ids, max_new_tokens=N_NEW, do_sample=False)
        assert out.shape == ref.shape and torch.equal(out, ref), f"shipped {drafter} heads diverged from transformers"
        taus.append(sm.last_stats.tau)
    # Trained heads get drafts accepted (the tuned exit threshold proposes only confident ones, so fewer).
    assert sum(taus) / len(taus) > {"medusa": 1.2, "eagle": 1.1}.get(drafter, 1.02)


@pytest.mark.parametrize("drafter", ["medusa", "eagle"])
def test_demo_batch_rows_identical_to_each_prompt_alone(demo, references, drafter):
    """The three prompts (different lengths) as one left-padded batch with the shipped heads: each row
    is transformers' greedy output for that prompt alone."""
    sm = SelfSpeculativeModel.from_pretrained("smollm2-135m", drafter=drafter, device=demo.model.device,
                                              dtype=torch.float32)
    rows = [ids[0] for ids, _ in references]
    T = max(len(r) for r in rows)
    pad = demo.tokenizer.eos_token_id
    ids = torch.stack([torch.cat([r.new_full((T - len(r),), pad), r]) for r in rows])
    mask = torch.stack([torch.cat([torch.zeros(T - len(r), dtype=torch.long), torch.ones(len(r), dtype=torch.long)])
                        for r in rows]).to(ids.device)
    out = sm.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False)
    for b, (prompt, ref) in enumerate(references):
        alone = ref[0, prompt.shape[1]:].tolist()    # ends at EOS or after N_NEW; a batch row is padded after EOS
        assert out[b, T:T + len(alone)].tolist() == alone, f"{drafter}: row {b} differs from its prompt alone"


def test_demo_default_drafter_is_the_shipped_one(demo, references):
    """from_pretrained("smollm2-135m") with no drafter and no heads: the shipped default with what it
    ships with (trained heads, or for the lookup the shipped corpus), exact."""
    import warnings

    from selfspec.shipped import default_drafter

    with warnings.catch_warnings():
        warnings.simplefilter("error")            # no "untrained heads" warning
        sm = SelfSpeculativeModel.from_pretrained("smollm2-135m", device=demo.model.device, dtype=torch.float32)
    assert sm.drafter_name == default_drafter("smollm2-135m")
    if sm.drafter_name in ("lookup", "medusa", "eagle"):
        assert sm.corpus is not None and sm.corpus.config.sequences > 10_000   # the shipped corpus
    if sm.drafter_name != "lookup":
        assert sm.heads is not None and sm.heads.config.provenance.get("steps", 0) > 0
    ids, ref = references[0]
    assert torch.equal(sm.generate(ids, max_new_tokens=N_NEW), ref)
    # Sampling decodes with the same kind of drafter, with the settings tune-tree picked for sampling where it picked some.
    from selfspec.settings import resolve_settings

    sampled = sm.drafter_for(True)
    assert sampled.name == sm.drafter_name
    decode = sm.heads.config.decode if sm.heads is not None else None
    assert sm.sampled_settings == resolve_settings(sm.drafter_name, decode, device=demo.model.device.type, sampling=True)
    sm.fit_width = False   # how much a fitted step drafts follows this machine's timings; the verdict must not
    sm.generate(ids, max_new_tokens=N_NEW, do_sample=True, temperature=0.7,
                generator=torch.Generator(device=demo.model.device).manual_seed(0))
    assert sm.last_stats.new_tokens > 0 and sm.last_stats.drafted > 0     # drafted, by that drafter


def test_demo_stop_strings_and_repetition_penalty_identical_to_transformers(demo, references):
    """stop_strings on the real byte-level tokenizer: the default drafter's rows end on the token
    transformers' generate(stop_strings=..., tokenizer=...) ends them on, a string inside a token included.
    A repetition penalty: the same tokens as transformers' penalised greedy output."""
    sm = SelfSpeculativeModel.from_pretrained("smollm2-135m", device=demo.model.device, dtype=torch.float32)
    ids, plain = references[0]
    ref = demo.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, do_sample=False,
                              repetition_penalty=1.3, pad_token_id=demo.tokenizer.eos_token_id)
    assert not torch.equal(ref, plain) and torch.equal(sm.generate(ids, max_new_tokens=N_NEW, repetition_penalty=1.3), ref)
    for i, strings in ((0, ["):"]), (1, [" the"]), (2, ["\n\n", "2."])):
        ids, _ = references[i]
        ref = demo.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, do_sample=False,
                                  stop_strings=strings, tokenizer=demo.tokenizer,
                                  pad_token_id=demo.tokenizer.eos_token_id)
        assert ref.shape[1] - ids.shape[1] < N_NEW, f"{strings} never met: pick strings the answer holds"
        assert torch.equal(sm.generate(ids, max_new_tokens=N_NEW, stop_strings=strings), ref), strings


def test_demo_loading_is_cached_and_fast(demo):
    import time

    from selfspec.loading import load_model

    t = time.perf_counter()
    again = load_model("smollm2-135m")
    assert time.perf_counter() - t < 20
    assert again.model.config.num_hidden_layers == 30 and again.model.config.hidden_size == 576


def test_demo_compiled_step_identical_to_transformers(demo, references):
    """compile=True: the verify pass at static shapes through torch.compile, and the shipped EAGLE head's
    draft levels and commits on its static cache, on a batch of the three prompts (ragged, one row
    finishing before the others and idling in the static caches): every row is transformers' greedy
    output for its prompt alone. Small trees (3 nodes, no lookup) keep the compilation to the 1- and
    4-node buckets."""
    # Width fitting off: how much a fitted step drafts follows this machine's timings, and the test's verdict must not.
    sm = SelfSpeculativeModel.from_pretrained("smollm2-135m", drafter="eagle", tree="dynamic-3-2-3", lookup=0,
                                              device=demo.model.device, dtype=torch.float32, compile=True,
                                              fit_width=False)
    assert sm.step is not None and sm.step.compiled
    rows = [ids[0] for ids, _ in references]
    out = sm.generate(rows, max_new_tokens=N_NEW, do_sample=False)
    T = max(len(r) for r in rows)
    for b, (prompt, ref) in enumerate(references):
        alone = ref[0, prompt.shape[1]:].tolist()
        assert out[b, T:T + len(alone)].tolist() == alone, f"compiled: row {b} differs from its prompt alone"
    assert sm.last_stats.tau > 1.05 and sm.drafter._static is not None and sm.drafter._static.compiled


def test_demo_readme_python_examples_run_and_are_exact(demo, capsys):
    """The README's Python blocks, run as a user would paste them (with this run's device and float32, and
    the first block's 128 new tokens cut to N_NEW): they run on the installed transformers (whose
    ``apply_chat_template`` returns a mapping since 5.0) and give transformers' greedy tokens."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert len(blocks) >= 2, "the README lost its Python examples"
    load = 'from_pretrained("smollm2-135m")'
    assert load in blocks[0] and "max_new_tokens=128" in blocks[0]
    first = blocks[0].replace(load, f'from_pretrained("smollm2-135m", device="{demo.model.device}", dtype=torch.float32)')
    first = first.replace("max_new_tokens=128", f"max_new_tokens={N_NEW}")
    scope = {"torch": torch}
    exec(first, scope)
    inputs, out = scope["inputs"], scope["out"]
    ref = demo.model.generate(**inputs.to(demo.model.device), max_new_tokens=N_NEW, do_sample=False,
                              pad_token_id=demo.tokenizer.eos_token_id)
    assert torch.equal(out, ref), "the README's first example diverged from transformers' greedy"
    assert capsys.readouterr().out.strip(), "the README's first example printed nothing"
    exec(blocks[1], scope)          # the batch example, with the same ``sm`` (batch exactness: the test above)
    batch, out = scope["batch"], scope["out"]
    T = batch["input_ids"].shape[1]
    assert out.shape[0] == 2 and out.shape[1] > T and torch.equal(out[:, :T], batch["input_ids"].to(out.device))
