"""selfspec bench: JSON schema, interleaving, the identical-output check, a tiny end-to-end run."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model

from selfspec.bench.harness import (
    BASELINE,
    TIE_MARGIN,
    Method,
    Prompt,
    Run,
    compare_to_baseline,
    interleaved_order,
    load_prompts,
    run_bench,
    tie_tolerance,
    top2_margin,
)
from selfspec.bench.methods import build_methods, parse_methods
from selfspec.bench.report import decoding_mode, markdown, write_report


def test_interleaving_rotates_every_method_through_every_slot():
    names = ["a", "b", "c"]
    orders = [interleaved_order(names, i) for i in range(6)]
    assert orders[0] == ["a", "b", "c"] and orders[1] == ["b", "c", "a"] and orders[3] == orders[0]
    for slot in range(3):
        assert sorted(o[slot] for o in orders[:3]) == names


def test_identical_check_catches_a_planted_divergence():
    base = {"p1": Run([1, 2, 3, 4], 1.0), "p2": Run([5, 6, 7], 1.0)}
    same = {"p1": Run([1, 2, 3, 4], 1.0), "p2": Run([5, 6, 7], 1.0)}
    planted = {"p1": Run([1, 2, 9, 4], 1.0), "p2": Run([5, 6, 7], 1.0)}
    shorter = {"p1": Run([1, 2, 3], 1.0), "p2": Run([5, 6, 7], 1.0)}
    big_margin = lambda pid, pos: 5.0  # noqa: E731
    tie_margin = lambda pid, pos: 1e-4  # noqa: E731
    assert compare_to_baseline(base, same, big_margin).identical
    c = compare_to_baseline(base, planted, big_margin)
    assert not c.identical and c.diverged == ["p1"]
    c = compare_to_baseline(base, planted, tie_margin)   # hf-generate itself was on a knife edge there
    assert c.identical and c.ties == ["p1"]
    assert not compare_to_baseline(base, shorter, tie_margin).identical  # a length change is never a tie


def test_tie_tolerance_follows_the_dtype_resolution():
    assert tie_tolerance(20.0, torch.float32) == TIE_MARGIN
    assert tie_tolerance(20.0, torch.bfloat16) == 4 * 0.125     # bfloat16 steps by 1/8 between 16 and 32
    assert tie_tolerance(-20.0, torch.float16) == 4 * 2 ** -6   # float16: 10 mantissa bits
    assert tie_tolerance(0.01, torch.bfloat16) == 4 * 2 ** -7   # small logits: the step at 1
    m = tiny_model("llama").to(torch.bfloat16)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        top = torch.topk(m(ids).logits[0, -1].float(), 2).values
    assert top2_margin(m, ids, []) == pytest.approx(float(top[0] - top[1]) / tie_tolerance(float(top[0]), torch.bfloat16))


def test_prompt_loading_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "category": "x"}\n{"prompt": "b"}\n')
    ps = load_prompts(f)
    assert [p.category for p in ps] == ["x", "all"] and len(load_prompts(f, limit=1)) == 1
    f.write_text("".join(f'{{"prompt": "p{i}", "id": "{i}"}}\n' for i in range(20)))
    picked = load_prompts(f, sample=5, seed=1)
    assert len(picked) == 5 and [int(p.id) for p in picked] == sorted(int(p.id) for p in picked)
    assert [p.id for p in load_prompts(f, sample=5, seed=1)] == [p.id for p in picked]   # reproducible
    assert [p.id for p in load_prompts(f, sample=5, seed=2)] != [p.id for p in picked]
    f.write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match="no \"prompt\""):
        load_prompts(f)
    with pytest.raises(ValueError, match="not found"):
        load_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="unknown method"):
        parse_methods("hf-generate,warp-speed")
    assert parse_methods("selfspec-medusa")[0] == BASELINE == "hf-generate"


def test_old_baseline_name_still_selects_hf_generate():
    """hf-greedy was the baseline's name even when it sampled; old commands keep working."""
    assert parse_methods("hf-greedy,selfspec-ar") == ["hf-generate", "selfspec-ar"]
    assert parse_methods("hf-greedy,hf-generate") == ["hf-generate"]
    assert "hf-greedy" not in parse_methods("all")


def test_tiny_end_to_end_bench_schema(tmp_path):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    draft = tiny_model("llama", seed=3, num_hidden_layers=1)
    prompts = [Prompt(id=str(i), category="code" if i % 2 else "chat", text=f"p{i}") for i in range(4)]

    def encode(text):
        g = torch.Generator().manual_seed(int(text[1:]))
        return torch.randint(3, 97, (1, 5), generator=g)

    names = parse_methods("all")
    methods, notes = build_methods(names, model=model, tokenizer=None, model_name="tiny", temperature=0.0,
                                   draft_model=draft)
    results = run_bench(methods, prompts, encode, model=model, max_new_tokens=12, temperature=0.0, progress=False)
    assert list(results) == names
    for name, m in results.items():
        for key in ("tokens_per_s", "speedup", "tau", "identical", "n_tokens", "per_category"):
            assert key in m, (name, key)
        assert isinstance(m["tokens_per_s"], float) and m["n_tokens"] == 48
        assert m["identical"] is True, name          # every greedy method reproduces hf-generate
        assert set(m["per_category"]) == {"code", "chat"}
        for cat in m["per_category"].values():
            assert set(cat) == {"tokens_per_s", "speedup", "tau"}
    assert results[BASELINE]["speedup"] == pytest.approx(1.0) and results[BASELINE]["tau"] == 1.0
    # hf-assisted-bf16 and selfspec-draft-model draft in bfloat16 on copies: hf-assisted's draft is left as given.
    assert all(p.dtype == torch.float32 for p in draft.parameters())
    # "-whole" verifies the whole 4-deep tree every step; the fitted method cuts it where it is not worth its cost.
    assert results["selfspec-medusa-whole"]["tau"] >= 1.0
    assert len(results["selfspec-medusa-whole"]["acceptance_by_depth"]) == 4
    assert len(results["selfspec-medusa"]["acceptance_by_depth"]) <= 4
    assert results["selfspec-medusa"]["drafted_per_step"] <= results["selfspec-medusa-whole"]["drafted_per_step"]
    # The "-heads" variants run the same heads and tree with the context lookup off.
    assert notes["medusa_heads_lookup"] == 0 and notes["eagle_heads_lookup"] == 0
    assert notes["medusa_heads_tree"] == notes["medusa_tree"] and notes["eagle_heads_tree"] == notes["eagle_tree"]
    result = {"config": {"model": "tiny", "device": "cpu", "dtype": "float32", "threads": 1, "prompts": "mem",
                         "n_prompts": 4, "limit": None, "max_new_tokens": 12, "temperature": 0.0}, "methods": results}
    write_report(result, tmp_path / "out")
    back = json.loads((tmp_path / "out" / "results.json").read_text())
    assert back["methods"]["selfspec-ar"]["identical"] is True
    for chart in ("speedup.png", "acceptance.png", "speed_tau.png"):
        assert (tmp_path / "out" / chart).stat().st_size > 1000, chart
    assert "| selfspec-medusa |" in (tmp_path / "out" / "results.md").read_text()
    assert "chat" in markdown(result) and ", greedy" in markdown(result).splitlines()[0]
    sampled = {**result, "config": {**result["config"], "temperature": 0.7, "decoding": decoding_mode(0.7)}}
    assert "sampling (T=0.7, top-p 1, top-k off)" in markdown(sampled).splitlines()[0]


def test_batched_bench_rows_match_and_refusals_are_reported(tmp_path):
    """--batch-size 3: ragged prompts in left-padded batches; every selfspec row equals hf-generate's,
    transformers' assisted path (which refuses batches) is reported as refused, not dropped."""
    model = tiny_model("llama")
    draft = tiny_model("llama", seed=3, num_hidden_layers=1)
    prompts = [Prompt(id=str(i), category="all", text=f"p{i}") for i in range(5)]

    def encode(text):
        i = int(text[1:])
        g = torch.Generator().manual_seed(i)
        return torch.randint(3, 97, (1, 3 + 2 * i), generator=g)

    names = parse_methods("hf-generate,hf-assisted,selfspec-ar,selfspec-medusa,selfspec-eagle")
    methods, _ = build_methods(names, model=model, tokenizer=None, model_name="tiny", temperature=0.0, draft_model=draft)
    results = run_bench(methods, prompts, encode, model=model, max_new_tokens=10, temperature=0.0, progress=False,
                        batch_size=3)
    assert "batch" in results["hf-assisted"]["refused"]
    for name in ("selfspec-ar", "selfspec-medusa", "selfspec-eagle"):
        assert results[name]["identical"] is True and results[name]["n_tokens"] == 50, name
    alone = [model.generate(encode(p.text), max_new_tokens=10, do_sample=False, pad_token_id=0)[0, -10:].tolist()
             for p in prompts]
    assert [methods[2].runs[p.id].tokens for p in prompts] == alone   # selfspec-ar's rows, each as if alone
    result = {"config": {"model": "tiny", "device": "cpu", "dtype": "float32", "threads": 1, "prompts": "mem",
                         "n_prompts": 5, "limit": None, "max_new_tokens": 10, "temperature": 0.0, "batch_size": 3},
              "methods": results}
    text = markdown(result)
    assert "batches of 3" in text and "Refused batches of 3: hf-assisted" in text and "| hf-assisted |" not in text
    write_report(result, tmp_path / "out")


def test_bench_requires_the_baseline():
    m = Method(name="selfspec-ar", fn=lambda ids, n, g: ([1], None))
    with pytest.raises(ValueError, match="hf-generate"):
        run_bench([m], [Prompt("0", "all", "x")], lambda t: torch.ones(1, 2, dtype=torch.long),
                  model=tiny_model(), max_new_tokens=2, temperature=0.0, progress=False)


def test_bench_flags_follow_each_drafters_declared_settings():
    """--PREFIX-SETTING exists exactly for the settings a drafter declares, and reaches build_methods."""
    import argparse

    from selfspec.bench import _method_settings, add_bench_args
    from selfspec.bench.methods import flag_prefixes
    from selfspec.settings import DRAFTER_SETTINGS, SETTING_KEYS

    p = argparse.ArgumentParser()
    add_bench_args(p)
    flags = {a.dest for a in p._actions}
    for prefix, drafter in flag_prefixes().items():
        for key in SETTING_KEYS:
            assert (f"{prefix}_{key}" in flags) == (getattr(DRAFTER_SETTINGS[drafter], key) is not None), (prefix, key)
    args = p.parse_args(["--prompts", "x.jsonl", "--medusa-gate", "0.5", "--eagle-tree", "dynamic-3-2-4"])
    settings = _method_settings(args)
    assert settings["medusa"]["gate"] == "0.5" and settings["eagle"]["tree"] == "dynamic-3-2-4"
    assert settings["early-exit"] == {"tree": "auto", "threshold": "auto"}
    with pytest.raises(SystemExit):
        p.parse_args(["--prompts", "x.jsonl", "--exit-lookup", "3"])   # early exit takes no lookup


def test_a_method_can_run_other_heads_beside_its_own(tmp_path):
    """selfspec-medusa@DIR runs the heads in DIR in the same run as selfspec-medusa's own (an A/B of two
    trainings); the variant is checked like any method and refused where it means nothing."""
    from selfspec.heads import save_heads
    from selfspec.model import untrained_heads

    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    one = untrained_heads("medusa", model, "tiny", num_heads=2)
    save_heads(one, tmp_path / "two-heads")
    names = parse_methods(f"selfspec-medusa,selfspec-medusa@{tmp_path / 'two-heads'}")
    assert names == [BASELINE, "selfspec-medusa", f"selfspec-medusa@{tmp_path / 'two-heads'}"]
    methods, notes = build_methods(names, model=model, tokenizer=None, model_name="tiny", temperature=0.0)
    assert notes[f"medusa@{tmp_path / 'two-heads'}"] == str(tmp_path / "two-heads") and notes["medusa"] == "untrained"
    prompts = [Prompt(id=str(i), category="all", text=f"p{i}") for i in range(2)]
    results = run_bench(methods, prompts, lambda t: torch.tensor([[3, 4, 5 + int(t[1:])]]), model=model,
                        max_new_tokens=8, temperature=0.0, progress=False)
    assert results[names[2]]["identical"] is True
    # Each ran its own heads' tree (width fitting may cut either one at run time).
    assert max(map(len, notes[f"medusa@{tmp_path / 'two-heads'}_tree"])) == 2 and max(map(len, notes["medusa_tree"])) == 4
    assert len(results[names[2]]["acceptance_by_depth"]) <= 2 and len(results["selfspec-medusa"]["acceptance_by_depth"]) <= 4
    for bad, match in (("selfspec-ar@x", "only a selfspec method with trained heads"),
                       ("hf-generate@x", "only a selfspec method"), ("selfspec-medusa@", "name a heads or corpus directory"),
                       ("selfspec-warp@x", "unknown method")):
        with pytest.raises(ValueError, match=match):
            parse_methods(bad)


def test_a_method_can_read_another_corpus_beside_its_own(tmp_path):
    """selfspec-lookup@CORPUS_DIR (and the heads drafters' likewise) reads that corpus in the same run as
    the method reading the run's own (an A/B of two corpora); the heads stay the method's own, and a
    corpus is refused after a method whose lookup reads none."""
    from selfspec.core.backbone import config_fingerprint
    from selfspec.corpus import Corpus

    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    answers = []
    for seed in range(100, 108):   # the model's own answers to other prompts: what a corpus holds
        ids = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(seed))
        answers.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                      pad_token_id=0)[0, 6:].tolist())
    Corpus.from_answers(answers, base_model="tiny", base_fingerprint=config_fingerprint(model.config),
                        vocab_size=model.config.vocab_size).save(tmp_path / "corpus")
    other = f"@{tmp_path / 'corpus'}"
    names = parse_methods(f"selfspec-lookup,selfspec-lookup{other},selfspec-eagle{other}")
    assert names == [BASELINE, "selfspec-lookup", f"selfspec-lookup{other}", f"selfspec-eagle{other}"]
    # Whole trees, no back-off: what the lookup drafts must not follow this machine's timings (under load,
    # back-off could turn both methods to plain steps, and their taus would tie).
    whole = {"fit_width": False}
    methods, notes = build_methods(names, model=model, tokenizer=None, model_name="tiny", temperature=0.0,
                                   settings={"lookup": whole, "eagle": whole})
    assert notes[f"corpus{other}"] == str(tmp_path / "corpus") and notes["eagle"] == "untrained"
    prompts = [Prompt(id=str(i), category="all", text=str(100 + i)) for i in range(3)]

    def encode(text):   # the prompts the corpus's answers followed: its chains apply from the first step
        return torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(int(text)))
    results = run_bench(methods, prompts, encode, model=model, max_new_tokens=16, temperature=0.0, progress=False)
    assert all(results[n]["identical"] is True for n in names[1:])
    # Without a corpus the lookup has only the context (and the last token alone); with it, it drafts more.
    assert results[f"selfspec-lookup{other}"]["tau"] > results["selfspec-lookup"]["tau"]
    for bad, match in ((f"selfspec-lookup-context{other}", "only a method whose lookup reads one"),
                       (f"selfspec-eagle-heads{other}", "only a method whose lookup reads one"),
                       (f"selfspec-early-exit{other}", "only a method whose lookup reads one"),
                       ("selfspec-lookup@x", "x is not a corpus directory"),
                       ("selfspec-ar@x", "one whose lookup reads a corpus @CORPUS_DIR")):
        with pytest.raises(ValueError, match=match):
            parse_methods(bad)


def test_methods_all_leaves_out_the_draft_model_methods_when_there_is_no_draft(capsys):
    # The default ("all") runs what can run, and says what it left out; naming such a method without
    # a draft model is still an error.
    import argparse

    from selfspec.bench import add_bench_args
    from selfspec.bench.__init__ import check_bench_args
    from selfspec.bench.harness import ALL_METHODS, DRAFT_METHODS

    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    names, auto = check_bench_args(parser.parse_args(["--model", "smollm2-135m", "--prompts", "p.jsonl"]))
    assert names == [n for n in ALL_METHODS if n not in DRAFT_METHODS] and auto is None
    assert "need --draft-model" in capsys.readouterr().err
    with pytest.raises(ValueError, match="need --draft-model"):
        check_bench_args(parser.parse_args(["--model", "smollm2-135m", "--prompts", "p.jsonl",
                                            "--methods", "hf-generate,hf-assisted"]))


def test_selfspec_auto_runs_as_the_default_drafters_method(capsys, tmp_path):
    """selfspec-auto is what from_pretrained(model) decodes with at the run's temperature: the drafter
    default.json names (greedy, or for sampling), the lookup where a model has none; run once."""
    import argparse

    from selfspec.bench import add_bench_args
    from selfspec.bench.__init__ import check_bench_args
    from selfspec.bench.methods import SELFSPEC_METHODS, resolve_auto
    from selfspec.shipped import default_drafter

    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    for temperature in ("0", "0.7"):
        names, auto = check_bench_args(parser.parse_args(["--model", "smollm2-135m", "--prompts", "p.jsonl",
                                                          "--methods", "selfspec-ar,selfspec-auto",
                                                          "--temperature", temperature]))
        drafter = default_drafter("smollm2-135m")
        assert names == ["hf-generate", "selfspec-ar", auto] and SELFSPEC_METHODS[auto][::2] == (drafter, {})
        assert f"selfspec-auto runs as {auto}" in capsys.readouterr().err
    assert resolve_auto(["hf-generate", "selfspec-auto"], model=str(tmp_path), temperature=0) == (
        ["hf-generate", "selfspec-lookup"], "selfspec-lookup")
    assert resolve_auto(["hf-generate", "selfspec-lookup", "selfspec-auto"], model=str(tmp_path),
                        temperature=0.7)[0] == ["hf-generate", "selfspec-lookup"]     # once
    assert resolve_auto(["hf-generate", "selfspec-ar"], model="smollm2-135m", temperature=0) == (
        ["hf-generate", "selfspec-ar"], None)
    with pytest.raises(ValueError, match="takes no @DIR"):
        parse_methods("selfspec-auto@heads")


def test_bench_threads_default_to_the_share_omp_num_threads_gives(monkeypatch):
    import os

    from selfspec.bench import default_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads() == 3
    for unset in ("", "0", "two"):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert default_threads() == (os.cpu_count() or 1)
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert default_threads() == (os.cpu_count() or 1)


def test_a_quantized_engines_output_is_not_compared_and_its_counters_become_stats():
    """An engine on quantized weights (llama.cpp) reports "n/a (quantized)", however its tokens differ, and no
    peak memory (it runs in another process); vLLM's spec-decode counters become a histogram and tau."""
    from selfspec.bench.engines import engine_stats
    from selfspec.bench.harness import Method

    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    prompts = [Prompt(id=str(i), category="all", text=f"p{i}") for i in range(2)]
    counters = {"drafts": 10, "draft_tokens": 30, "accepted_per_pos": [6, 3, 1]}   # at least 1, 2, 3 accepted

    def other_weights(batch, n, gen):
        return [[5] * n for _ in batch], engine_stats(counters, n)

    methods, _ = build_methods([BASELINE], model=model, tokenizer=None, model_name="tiny", temperature=0.0)
    methods.append(Method(name="llamacpp", fn=other_weights, quantized=True, external=True))
    results = run_bench(methods, prompts, lambda t: torch.tensor([[3, 4, int(t[1:]) + 5]]), model=model,
                        max_new_tokens=6, temperature=0.0, progress=False)
    m = results["llamacpp"]
    assert m["identical"] is None and m["quantized"] and m["peak_memory_mb"] is None
    assert m["tau"] == pytest.approx(1 + 10 / 10) and m["acceptance_by_depth"] == pytest.approx([0.6, 0.3, 0.1])
    stats = engine_stats(counters, 20)
    assert stats.accepted_hist == [4, 3, 2, 1] and stats.steps == 10 and stats.tau == pytest.approx(2.0)
    assert engine_stats({"drafts": 0, "draft_tokens": 0, "accepted_per_pos": []}, 5) is None
    table = markdown({"config": {"model": "tiny", "device": "cpu", "dtype": "float32", "threads": 1, "prompts": "mem",
                                 "n_prompts": 2, "max_new_tokens": 6, "temperature": 0.0}, "methods": results})
    assert "| llamacpp |" in table and "n/a (quantized) |" in table
