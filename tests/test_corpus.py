"""The corpus lookup (selfspec/corpus.py): majority votes over the target's own earlier answers,
files that round-trip, and drafters that read a corpus stay exact (greedy) and lossless (sampling)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import chi2_check, hf_greedy, tiny_model

from selfspec.core.backbone import Backbone, config_fingerprint
from selfspec.core.decode import decode, decode_rows
from selfspec.core.sampling import SamplingParams
from selfspec.core.tree import build_tree
from selfspec.corpus import Corpus, load_corpus, read_corpus_config
from selfspec.drafters import EagleDrafter, LookupDrafter, MedusaDrafter
from selfspec.model import SelfSpeculativeModel, untrained_heads

GREEDY = SamplingParams()


def _corpus(answers, vocab_size=100, fingerprint="fp") -> Corpus:
    return Corpus.from_answers(answers, base_model="m", base_fingerprint=fingerprint, vocab_size=vocab_size)


# ---------------------------------------------------------------------------------------------- lookup


def test_continuation_follows_the_majority_and_stops_where_occurrences_disagree():
    c = _corpus([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7], [1, 2, 3, 4, 5, 9], [8, 2, 3, 9]])
    # [2, 3] occurs 4 times: 4 -> 3 of 4 (stays), then 5 -> 2 of 3, then 6 vs 9: 1 each, too few: stop.
    assert c.continuation([0, 2, 3], 8) == [4, 5]
    # [1, 2, 3] (the longest suffix) occurs 3 times, all followed by 4.
    assert c.continuation([1, 2, 3], 1) == [4]
    assert c.continuation([0, 2, 3], 1) == [4]
    # Thresholds: one occurrence never passes the default min_count of 2 (the longest match decides:
    # no fall-back to a shorter one); a looser vote follows it.
    assert c.continuation([8, 2], 4) == []
    assert c.continuation([8, 2], 4, min_count=1) == [3, 9]
    assert c.continuation([4, 7], 3) == []                                   # [4, 7] ends an answer
    assert c.continuation([0, 2, 3], 8, min_share=0.9) == []                  # 3 of 4 agree: below 90%
    assert c.continuation([0, 2, 3], 8, min_count=1, min_share=0.0)[:3] == [4, 5, 6]
    assert c.continuation([0, 2, 3], 0) == []


def test_continuation_needs_two_tokens_and_never_crosses_an_answer():
    c = _corpus([[5, 6, 7], [5, 6, 7], [9, 9, 9, 9]])
    assert c.continuation([6], 3) == []                                      # one token is too weak a cue
    assert c.continuation([5, 6], 3) == [7]                                  # the answers end after 7
    assert c.continuation([], 3) == []
    assert c.continuation([1, 2], 3) == []
    assert c.continuation([9, 9], 2) == [9]      # 9 after 2 of its 3 matches, then after only 1 of the 2 left
    with pytest.raises(ValueError, match="at least one"):
        _corpus([[], []])
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        _corpus([[1, 200]])


@pytest.mark.parametrize("vocab_size", [100, 65534, 65535, 1 << 17])
def test_a_corpus_round_trips_through_its_files(tmp_path, vocab_size):
    """uint16 storage below 65,535 ids (65,535 marks answer ends), int32 from there; indexes agree after loading."""
    rng = np.random.default_rng(0)
    answers = [rng.integers(0, vocab_size, size=n).tolist() for n in (5, 40, 17)] + [[vocab_size - 1, 0, vocab_size - 1]]
    c = _corpus(answers * 2, vocab_size=vocab_size)
    c.save(tmp_path / "c")
    loaded = load_corpus(tmp_path / "c", fingerprint="fp")
    assert np.array_equal(loaded.tokens, c.tokens) and loaded.config == c.config
    assert loaded.config.sequences == 8 and loaded.config.tokens == 2 * (5 + 40 + 17 + 3)
    ids = answers[1][:10]
    assert loaded.continuation(ids, 6) == c.continuation(ids, 6) == answers[1][10:16]
    with np.load(tmp_path / "c" / "corpus.npz") as f:
        assert f["tokens"].dtype == (np.uint16 if vocab_size < 65535 else np.int32)


def test_loading_refuses_another_models_corpus_and_non_corpus_directories(tmp_path):
    _corpus([[1, 2, 3]]).save(tmp_path / "c")
    with pytest.raises(ValueError, match="not of this model"):
        load_corpus(tmp_path / "c", fingerprint="other")
    with pytest.raises(ValueError, match="not a corpus directory"):
        read_corpus_config(tmp_path)
    (tmp_path / "c" / "corpus.npz").write_bytes(b"not an archive")
    with pytest.raises(ValueError, match="cannot be read"):
        load_corpus(tmp_path / "c", fingerprint="fp")
    (tmp_path / "c" / "config.json").write_text('{"kind": "medusa"}')
    with pytest.raises(ValueError, match="not a corpus config"):
        read_corpus_config(tmp_path / "c")


# ---------------------------------------------------------------------------------------------- decoding


def _own_answers(model, seeds, n=40) -> list[list[int]]:
    """The model's own greedy answers to random prompts: a corpus that proposes its habits."""
    out = []
    for seed in seeds:
        ids = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(seed))
        out.append(hf_greedy(model, ids, n)[0, ids.shape[1]:].tolist())
    return out


def test_drafters_reading_a_corpus_stay_exact_and_draft_from_it(one_thread):
    """Greedy with a corpus of the model's own answers to other prompts: token for token plain greedy,
    for each drafter whose lookup reads it; the lookup alone drafts more with the corpus than without."""
    model = tiny_model("llama")
    bb = Backbone(model)
    corpus = _corpus(_own_answers(model, range(100, 112)), vocab_size=bb.vocab_size)
    drafters = {
        "lookup": lambda c: LookupDrafter(bb.device, lookup=4, vocab_size=bb.vocab_size, corpus=c),
        "medusa": lambda c: MedusaDrafter(bb, untrained_heads("medusa", model, "t"), build_tree(((0,), (1,), (0, 0))),
                                          lookup=4, corpus=c),
        "eagle": lambda c: EagleDrafter(bb, untrained_heads("eagle", model, "t"), depth=2, expand=2, nodes=3,
                                        lookup=4, corpus=c),
    }
    drafted = {}
    for seed in range(3):
        ids = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(seed))
        ref = hf_greedy(model, ids, 40)[0, ids.shape[1]:].tolist()
        for name, make in drafters.items():
            for c in (corpus, None):
                new, stats = decode(bb, make(c), ids[0], params=GREEDY, max_new_tokens=40, eos_token_ids=set(),
                                    generator=None)
                assert new == ref, f"{name} with{'' if c else 'out'} a corpus differs from plain greedy"
                drafted[name, c is not None] = drafted.get((name, c is not None), 0) + stats.drafted
    assert drafted["lookup", True] > drafted["lookup", False]


N_SAMPLES, ROWS = 3000, 50


def test_corpus_chains_keep_sampling_lossless(one_thread):
    """A copied corpus chain is a point-mass draft: sampled sequences follow the target exactly (chi-square
    against the enumerated distribution of the first 3 tokens)."""
    from test_eagle import L_SEQ, V_SMALL, _exact_sequences

    model = tiny_model("llama", vocab_size=V_SMALL)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.25)      # spread-out p: every branch gets samples
    bb = Backbone(model)
    params = SamplingParams(do_sample=True, temperature=1.0)
    prompt = [0, 1]
    # Strong opinions after [0, 1] and after the likely tokens: chains get proposed (and partly rejected).
    answers = [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5], [1, 2, 3, 4], [1, 2, 3, 4], [1, 5, 5, 5], [1, 5, 5, 5]]
    drafter = LookupDrafter(bb.device, lookup=3, vocab_size=V_SMALL, corpus=_corpus(answers, vocab_size=V_SMALL))
    exact = _exact_sequences(model, prompt, params)
    g = torch.Generator().manual_seed(3)
    counts, drafted = {}, 0
    for _ in range(N_SAMPLES // ROWS):   # batches of ROWS copies of the prompt: independent samples, 7x cheaper a row
        rows, stats = decode_rows(bb, drafter, [torch.tensor(prompt)] * ROWS, params=params, max_new_tokens=L_SEQ,
                                  eos_token_ids=set(), generator=g)
        for new in rows:
            counts[tuple(new)] = counts.get(tuple(new), 0) + 1
        drafted += stats.drafted
    assert drafted > N_SAMPLES          # the corpus proposed on most runs
    stat, threshold = chi2_check(counts, exact, N_SAMPLES)
    assert stat < threshold, f"chi2={stat:.1f} >= {threshold:.1f}: not the target distribution"


def test_the_api_takes_a_corpus_only_for_drafters_with_a_lookup(tmp_path, one_thread):
    model = tiny_model("llama")
    c = _corpus([[1, 2, 3]], vocab_size=model.config.vocab_size, fingerprint=config_fingerprint(model.config))
    sm = SelfSpeculativeModel(model, None, drafter_name="lookup", heads=None, name="tiny", corpus=c)
    assert sm.drafter.corpus is c
    with pytest.raises(ValueError, match="not 'none'"):
        SelfSpeculativeModel(model, None, drafter_name="none", heads=None, name="tiny", corpus=c)


# ---------------------------------------------------------------------------------------------- command line


def test_build_corpus_indexes_gen_data_answers(tmp_path, one_thread):
    """`selfspec build-corpus` over two gen-data directories: their response tokens, one answer each,
    and a directory that generate and bench read with --corpus."""
    from test_training_data import make_model, make_tokenizer, prompts

    from selfspec.training.data import generate_distillation_data, load_distillation_data

    model, tok = make_model(), make_tokenizer(chat=False)
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    for name in ("a", "b"):
        generate_distillation_data(model, tok, prompts(6), tmp_path / name, max_new_tokens=12, batch_size=3,
                                   model_name=str(tmp_path / "tiny"), progress=False)
    env_cmd = [sys.executable, "-m", "selfspec"]
    root = Path(__file__).resolve().parent.parent
    data = f"{tmp_path / 'a'},{tmp_path / 'b'}@2"
    proc = subprocess.run([*env_cmd, "build-corpus", "--model", str(tmp_path / "tiny"), "--data", data,
                           "--out", str(tmp_path / "corpus")], capture_output=True, text=True, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = json.loads((tmp_path / "corpus" / "config.json").read_text())
    rows = list(load_distillation_data(str(tmp_path / "a"))) + list(load_distillation_data(str(tmp_path / "b")))[:2]
    answers = [r["input_ids"][r["response_start"]:r["response_start"] + r["n_response"]] for r in rows]
    assert config["sequences"] == 8 and config["tokens"] == sum(len(a) for a in answers)
    assert [s["sequences"] for s in config["sources"]] == [6, 2]
    corpus = load_corpus(tmp_path / "corpus", fingerprint=config_fingerprint(model.config))
    assert corpus.tokens[: len(answers[0])].tolist() == answers[0]
    proc = subprocess.run([*env_cmd, "generate", "--model", str(tmp_path / "tiny"), "--prompt", "w3 w4", "--drafter",
                           "lookup", "--corpus", str(tmp_path / "corpus"), "--max-new-tokens", "8", "--json"],
                          capture_output=True, text=True, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(json.loads(proc.stdout)["token_ids"]) == 8


def test_from_pretrained_takes_a_corpus_directory_or_object(tmp_path, one_thread):
    from test_bad_input import _tokenizer

    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "tiny")
    _tokenizer().save_pretrained(tmp_path / "tiny")
    mine = _corpus([[3, 4, 5, 6]] * 2, vocab_size=model.config.vocab_size, fingerprint=config_fingerprint(model.config))
    mine.save(tmp_path / "c")
    for given in (tmp_path / "c", str(tmp_path / "c"), mine):
        sm = SelfSpeculativeModel.from_pretrained(str(tmp_path / "tiny"), drafter="lookup", corpus=given, device="cpu")
        assert sm.corpus.continuation([3, 4], 2) == [5, 6]
    assert SelfSpeculativeModel.from_pretrained(str(tmp_path / "tiny"), drafter="lookup", corpus=None).corpus is None
    assert SelfSpeculativeModel.from_pretrained(str(tmp_path / "tiny"), drafter="lookup").corpus is None   # auto: none shipped
    with pytest.raises(ValueError, match="not of this model"):
        SelfSpeculativeModel.from_pretrained(str(tmp_path / "tiny"), drafter="lookup", corpus=_corpus([[3, 4]]))
