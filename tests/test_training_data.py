"""Self-distillation data: prompt loading, generated rows, EOS handling, resuming, settings checks.

Everything runs on a tiny random Llama and a word-level tokenizer built in memory (no files, no network).
"""

import json
import shutil
import subprocess
import sys

import datasets
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from selfspec.training.data import (
    add_data_args,
    compact_data,
    cut_after_eos,
    generate_distillation_data,
    load_distillation_data,
    load_prompts,
    prompt_token_ids,
    read_meta,
    row_counts,
    select_prompts,
)

PAD, BOS, EOS = 0, 2, 3
WORDS = ["<pad>", "<unk>", "<bos>", "<eos>", "user:", "assistant:"] + [f"w{i}" for i in range(58)]
CHAT_TEMPLATE = (
    "{% for m in messages %}<bos> user: {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def make_tokenizer(*, chat: bool) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = EOS
    return model


def prompts(n: int) -> list[dict]:
    # Different lengths so that sorting and left padding both matter.
    return [{"id": f"p{i}", "prompt": " ".join(f"w{(7 * i + j) % 58}" for j in range(1 + (i * 3) % 7))} for i in range(n)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------- prompts


def test_load_prompts_jsonl_ids_default_to_line_index(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "x"}\n{"prompt": "y", "source": "s"}\n\n{"id": 7, "prompt": "z"}\n')
    rows = load_prompts(path)
    assert [r["id"] for r in rows] == ["a", "1", "7"]
    assert [r["prompt"] for r in rows] == ["x", "y", "z"]
    assert rows[1]["source"] == "s"
    assert [r["id"] for r in load_prompts(path, max_prompts=2)] == ["a", "1"]


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"id": "a", "prompt": "x"}\n{"id": "b"}\n', "no prompt"),
        ('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": \n', "invalid JSON"),
        ('{"id": "a", "prompt": ""}\n', "no prompt"),
        ('["x"]\n', "expected a JSON object"),
        ('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n', "appears twice"),
    ],
)
def test_load_prompts_rejects_bad_rows(tmp_path, text, message):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        load_prompts(path)
    assert "\n" not in str(info.value)


def test_load_prompts_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(tmp_path / "nope.jsonl")


def test_load_prompts_from_dataset(tmp_path):
    datasets.Dataset.from_dict({"prompt": ["x", "y"], "other": [1, 2]}).save_to_disk(str(tmp_path / "ds"))
    assert load_prompts(tmp_path / "ds") == [{"prompt": "x", "other": 1, "id": "0"}, {"prompt": "y", "other": 2, "id": "1"}]
    datasets.Dataset.from_dict({"text": ["x"]}).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match="no 'prompt' column"):
        load_prompts(tmp_path / "bad")


# ------------------------------------------------------------------------------------------- generation


@pytest.mark.parametrize("chat", [True, False])
def test_rows_hold_prompt_then_response(tmp_path, chat):
    model, tokenizer = make_model(), make_tokenizer(chat=chat)
    rows = prompts(5)
    ds = generate_distillation_data(model, tokenizer, rows, tmp_path / "d", max_new_tokens=6, batch_size=2, progress=False)
    assert set(ds.column_names) >= {"id", "input_ids", "response_start", "n_response"}
    assert ds.features["input_ids"].feature.dtype == "int32"
    assert sorted(ds["id"]) == sorted(r["id"] for r in rows)
    expected_prompts = dict(zip([r["id"] for r in rows], prompt_token_ids(tokenizer, [r["prompt"] for r in rows])))
    for row in ds:
        prompt = expected_prompts[row["id"]]
        assert row["input_ids"][: row["response_start"]] == prompt
        assert row["response_start"] == len(prompt)
        assert row["n_response"] == len(row["input_ids"]) - row["response_start"] <= 6
        if chat:
            assert prompt[0] == BOS and prompt[-1] == WORDS.index("assistant:")
        else:
            assert prompt == tokenizer(dict((r["id"], r["prompt"]) for r in rows)[row["id"]])["input_ids"]


def test_batched_greedy_matches_one_prompt_at_a_time(tmp_path):
    # Left padding must not change what the model answers.
    model, tokenizer = make_model(), make_tokenizer(chat=True)
    rows = prompts(4)
    batched = generate_distillation_data(model, tokenizer, rows, tmp_path / "b", max_new_tokens=5, batch_size=4, progress=False)
    single = generate_distillation_data(model, tokenizer, rows, tmp_path / "s", max_new_tokens=5, batch_size=1, progress=False)
    as_dict = lambda ds: {r["id"]: r["input_ids"] for r in ds}  # noqa: E731
    assert as_dict(batched) == as_dict(single)


def test_static_cache_answers_as_the_dynamic_cache_does(tmp_path):
    # One shape for every call: prompts padded to max_prompt_tokens, the short last batch filled with
    # copies (answers dropped), a preallocated cache. Greedy answers must not change.
    model, tokenizer = make_model(), make_tokenizer(chat=True)
    rows = prompts(5)
    shapes = []
    original = model.generate

    def generate(**kwargs):
        shapes.append((tuple(kwargs["input_ids"].shape), kwargs.get("cache_implementation")))
        return original(**kwargs)

    model.generate = generate
    kw = dict(max_new_tokens=6, batch_size=2, max_prompt_tokens=16, progress=False)
    static = generate_distillation_data(model, tokenizer, rows, tmp_path / "static", static_cache=True, **kw)
    assert shapes == [((2, 16), "static")] * 3
    dynamic = generate_distillation_data(model, tokenizer, rows, tmp_path / "dynamic", **kw)
    assert all(cache is None for _, cache in shapes[3:])
    as_dict = lambda ds: {r["id"]: (r["input_ids"], r["response_start"], r["n_response"]) for r in ds}  # noqa: E731
    assert len(static) == len(rows)
    assert as_dict(static) == as_dict(dynamic)
    # One width for all: the prompts keep their order (a stopped run has a fair sample), not longest first.
    assert list(static["id"]) == [r["id"] for r in rows] != list(dynamic["id"])


def test_response_stops_after_first_eos_which_is_kept(tmp_path):
    model, tokenizer = make_model(), make_tokenizer(chat=True)
    rows = prompts(4)
    free = generate_distillation_data(model, tokenizer, rows, tmp_path / "free", max_new_tokens=8, batch_size=4, progress=False)
    first = free[0]
    response = first["input_ids"][first["response_start"]:]
    # Declare a token the model emits at step j >= 1 (first occurrence) to be EOS, then regenerate.
    j = next(j for j in range(1, len(response)) if response[j] not in response[:j] and response[j] != PAD)
    model.generation_config.eos_token_id = response[j]
    stopped = generate_distillation_data(model, tokenizer, rows, tmp_path / "eos", max_new_tokens=8, batch_size=4, progress=False)
    by_id = {r["id"]: r for r in stopped}
    row = by_id[first["id"]]
    assert row["input_ids"][row["response_start"]:] == response[: j + 1]
    assert row["n_response"] == j + 1
    eos_ids = set(read_meta(tmp_path / "eos")["eos_token_ids"])
    assert eos_ids == {EOS, response[j]}
    for r in stopped:
        resp = r["input_ids"][r["response_start"]:]
        # No padding and nothing after the first EOS; without EOS the response ran to max_new_tokens.
        assert not any(t in eos_ids for t in resp[:-1])
        assert resp[-1] in eos_ids or len(resp) == 8


def test_cut_after_eos():
    assert cut_after_eos([5, 6, 3, 0, 0], {3}) == [5, 6, 3]
    assert cut_after_eos([5, 6, 7], {3}) == [5, 6, 7]
    assert cut_after_eos([3, 3], {3, 9}) == [3]


def test_sampling_is_reproducible(tmp_path):
    model, tokenizer = make_model(), make_tokenizer(chat=True)
    rows = prompts(4)
    kw = dict(max_new_tokens=6, batch_size=2, temperature=1.0, seed=3, progress=False)
    a = generate_distillation_data(model, tokenizer, rows, tmp_path / "a", **kw)
    b = generate_distillation_data(model, tokenizer, rows, tmp_path / "b", **kw)
    c = generate_distillation_data(model, tokenizer, rows, tmp_path / "c", **{**kw, "seed": 4})
    assert a["input_ids"] == b["input_ids"]
    assert a["input_ids"] != c["input_ids"]


# ------------------------------------------------------------------------------------------- resuming


class Interrupted(RuntimeError):
    pass


def count_generate_calls(monkeypatch, model, *, fail_on: int | None = None) -> list[int]:
    """Record the batch size of every generate call; raise on call number ``fail_on`` (1-based)."""
    calls, original = [], model.generate

    def generate(**kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        if fail_on is not None and len(calls) == fail_on:
            raise Interrupted("killed mid-shard")
        return original(**kwargs)

    monkeypatch.setattr(model, "generate", generate)
    return calls


def test_interrupted_run_resumes_without_duplicates(tmp_path, monkeypatch):
    model, tokenizer = make_model(), make_tokenizer(chat=True)
    rows, out = prompts(6), tmp_path / "d"
    kw = dict(max_new_tokens=5, batch_size=2, shard_size=1, progress=False)
    reference = generate_distillation_data(model, tokenizer, rows, tmp_path / "ref", **kw)

    calls = count_generate_calls(monkeypatch, model, fail_on=2)
    with pytest.raises(Interrupted):
        generate_distillation_data(model, tokenizer, rows, out, **kw)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "shard-00000"]  # no half-written shard
    assert len(load_distillation_data(out)) == 2
    (out / ".tmp-shard-00001-999").mkdir()  # what a SIGKILL during save_to_disk leaves behind

    monkeypatch.undo()
    calls = count_generate_calls(monkeypatch, model)
    resumed = generate_distillation_data(model, tokenizer, rows, out, **kw)
    assert calls == [2, 2]  # only the 4 missing prompts
    assert sorted(resumed["id"]) == sorted(r["id"] for r in rows)
    assert not any(p.name.startswith(".tmp-") for p in out.iterdir())
    # Same pending set -> same batches -> the same rows an uninterrupted run stores.
    assert {r["id"]: r["input_ids"] for r in resumed} == {r["id"]: r["input_ids"] for r in reference}

    calls.clear()
    again = generate_distillation_data(model, tokenizer, rows, out, **kw)
    assert calls == [] and len(again) == 6


def test_growing_prompt_list_generates_only_new_ids(tmp_path, monkeypatch):
    model, tokenizer = make_model(), make_tokenizer(chat=False)
    kw = dict(max_new_tokens=4, batch_size=4, progress=False)
    generate_distillation_data(model, tokenizer, prompts(3), tmp_path / "d", **kw)
    calls = count_generate_calls(monkeypatch, model)
    ds = generate_distillation_data(model, tokenizer, prompts(6), tmp_path / "d", **kw)
    assert calls == [3]
    assert sorted(ds["id"]) == sorted(r["id"] for r in prompts(6))


def test_different_settings_are_refused(tmp_path):
    model, tokenizer = make_model(), make_tokenizer(chat=True)
    rows, out = prompts(2), tmp_path / "d"
    generate_distillation_data(model, tokenizer, rows, out, max_new_tokens=4, progress=False, model_name="tiny")
    meta = read_meta(out)
    assert (meta["model"], meta["max_new_tokens"], meta["temperature"]) == ("tiny", 4, 0.0)
    for change in [dict(max_new_tokens=5), dict(temperature=0.7), dict(model_name="other")]:
        settings = dict(max_new_tokens=4, model_name="tiny", progress=False) | change
        with pytest.raises(ValueError, match="was made with") as info:
            generate_distillation_data(model, tokenizer, rows, out, **settings)
        assert "\n" not in str(info.value)


def test_foreign_directory_is_refused(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        generate_distillation_data(make_model(), make_tokenizer(chat=True), prompts(1), tmp_path / "d", progress=False)
    with pytest.raises(ValueError, match="no meta.json"):
        load_distillation_data(tmp_path / "d")


def test_select_prompts_filters_sources_and_repeats_with_distinct_ids():
    rows = [{"id": "a", "prompt": "x", "source": "s1"}, {"id": "b", "prompt": "y", "source": "s2"}]
    assert select_prompts(rows) == rows
    assert [r["id"] for r in select_prompts(rows, sources=["s2"])] == ["b"]
    assert select_prompts(rows, sources="s2, ") == select_prompts(rows, sources=["s2"])  # the CLI's comma list
    picked = select_prompts(rows, sources=["s1", "s2"], samples=3)
    assert [r["id"] for r in picked] == ["a~0", "a~1", "a~2", "b~0", "b~1", "b~2"]
    assert [r["prompt"] for r in picked] == ["x"] * 3 + ["y"] * 3
    with pytest.raises(ValueError, match="no prompt has source 's3'"):
        select_prompts(rows, sources=["s3"])
    with pytest.raises(ValueError, match="samples must be >= 1"):
        select_prompts(rows, samples=0)


def test_sampled_copies_of_a_prompt_differ(tmp_path):
    rows = select_prompts(prompts(2), samples=4)
    ds = generate_distillation_data(make_model(), make_tokenizer(chat=True), rows, tmp_path / "d", max_new_tokens=8,
                                    batch_size=8, temperature=1.0, progress=False)
    by_id = dict(zip(ds["id"], ds["input_ids"]))
    assert sorted(by_id) == sorted(r["id"] for r in rows)
    assert len({tuple(by_id[f"p0~{k}"]) for k in range(4)}) > 1


def test_several_directories_load_together_and_pin_their_rows(tmp_path):
    model, tok = make_model(), make_tokenizer(chat=True)
    a = generate_distillation_data(model, tok, prompts(6), tmp_path / "a", max_new_tokens=4, batch_size=2, progress=False)
    b = generate_distillation_data(model, tok, select_prompts(prompts(3), samples=2), tmp_path / "b", max_new_tokens=6,
                                   batch_size=2, temperature=1.0, progress=False)
    spec = f"{tmp_path / 'a'},{tmp_path / 'b'}"
    both = load_distillation_data(spec)
    assert list(both["id"]) == list(a["id"]) + list(b["id"])
    assert row_counts(spec) == [6, 6]
    # Directory a grows later: pinned row counts still give exactly the rows a run saw.
    generate_distillation_data(model, tok, prompts(9), tmp_path / "a", max_new_tokens=4, batch_size=2, progress=False)
    assert row_counts(spec) == [9, 6]
    assert list(load_distillation_data(spec, rows=[6, 6])["id"]) == list(both["id"])
    with pytest.raises(ValueError, match="holds 6 rows but the run used 7"):
        load_distillation_data(spec, rows=[6, 7])
    with pytest.raises(ValueError, match="read 1 data directories but 2 were given"):
        load_distillation_data(spec, rows=[6])
    # "DIR@N" uses only the first N rows of DIR.
    capped = f"{tmp_path / 'a'}@4,{tmp_path / 'b'}"
    assert row_counts(capped) == [4, 6]
    assert list(load_distillation_data(capped)["id"]) == list(a["id"])[:4] + list(b["id"])
    for read in (row_counts, load_distillation_data):
        with pytest.raises(ValueError, match="asks for 10 rows but .* holds 9"):
            read(f"{tmp_path / 'a'}@10")
    # Data from another model (other EOS ids) cannot be mixed in.
    other = tmp_path / "other"
    generate_distillation_data(model, tok, prompts(2), other, max_new_tokens=4, batch_size=2, progress=False)
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta, "eos_token_ids": [1]}))
    with pytest.raises(ValueError, match="differs from .* in eos_token_ids"):
        load_distillation_data(f"{tmp_path / 'a'},{other}")


# ------------------------------------------------------------------------------------------- CLI


def test_cli_arguments_have_documented_defaults():
    import argparse

    args = add_data_args(argparse.ArgumentParser()).parse_args(["--model", "m", "--prompts", "p.jsonl", "--out", "o"])
    assert (args.max_new_tokens, args.batch_size, args.temperature, args.max_prompts, args.threads) == (128, 64, 0.0, None, None)


def test_cli_refuses_several_greedy_samples(tmp_path):
    good = write_jsonl(tmp_path / "p.jsonl", prompts(2))
    proc = subprocess.run(
        [sys.executable, "-m", "selfspec.training.data", "--model", "smollm2-135m", "--prompts", str(good),
         "--out", str(tmp_path / "o"), "--samples", "3"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --samples 3 with greedy decoding would store 3 identical answers: "
                                                "set --temperature > 0 (e.g. 0.7)"]
    assert not (tmp_path / "o").exists()


def test_cli_reports_bad_prompts_in_one_line(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"id": "a"}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "selfspec.training.data", "--model", "smollm2-135m", "--prompts", str(bad), "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: {bad}:1: no prompt (need a non-empty string under \"prompt\"): fix or drop that row"]


# ------------------------------------------------------------------------------------------- teacher forcing


def test_references_are_stored_as_answers_without_generating(tmp_path, monkeypatch):
    """gen-data --references: prompt + the row's reference (cut to max_new_tokens, EOS when it fits);
    rows without a reference are left out; the model never generates; the directory says so."""
    model, tokenizer = make_model(), make_tokenizer(chat=True)
    rows = prompts(4)
    rows[0]["reference"] = "w1 w2 w3"
    rows[1]["reference"] = " ".join(f"w{i}" for i in range(20))   # longer than max_new_tokens
    rows[2]["reference"] = "  "                                   # blank: no reference
    monkeypatch.setattr(model, "generate", lambda *a, **k: pytest.fail("teacher forcing must not generate"))
    ds = generate_distillation_data(model, tokenizer, rows, tmp_path / "tf", max_new_tokens=8, batch_size=2,
                                    progress=False, references=True)
    by_id = {r["id"]: r for r in ds}
    assert sorted(by_id) == ["p0", "p1"]
    ids = {r["id"]: p for r, p in zip(rows, prompt_token_ids(tokenizer, [r["prompt"] for r in rows]))}
    p0, p1 = by_id["p0"], by_id["p1"]
    assert p0["input_ids"] == ids["p0"] + tokenizer("w1 w2 w3", add_special_tokens=False)["input_ids"] + [EOS]
    assert p0["response_start"] == len(ids["p0"]) and p0["n_response"] == 4
    assert p1["input_ids"][p1["response_start"]:] == [WORDS.index(f"w{i}") for i in range(8)]
    assert read_meta(tmp_path / "tf")["answers"] == "reference"
    with pytest.raises(ValueError, match="answers"):   # generated answers never mix into it
        generate_distillation_data(make_model(), tokenizer, rows, tmp_path / "tf", max_new_tokens=8, progress=False)


def test_gen_data_skips_prompts_other_directories_store(tmp_path, capsys):
    """--skip-stored answers only the prompts no listed directory has (none left: nothing to do); a
    directory that is not gen-data output is refused before the model loads."""
    from selfspec.training.data import main

    model_dir = tmp_path / "tiny"
    make_model().save_pretrained(model_dir)
    make_tokenizer(chat=True).save_pretrained(model_dir)
    file = write_jsonl(tmp_path / "p.jsonl", prompts(5))
    common = ["--model", str(model_dir), "--prompts", str(file), "--max-new-tokens", "3", "--batch-size", "2", "--no-progress"]
    assert main(common + ["--out", str(tmp_path / "a"), "--max-prompts", "2"]) == 0
    assert main(common + ["--out", str(tmp_path / "b"), "--skip-stored", str(tmp_path / "a")]) == 0
    assert sorted(load_distillation_data(tmp_path / "b")["id"]) == ["p2", "p3", "p4"]
    capsys.readouterr()
    # Nothing left to answer: done at once, like a finished run resumed, and nothing written.
    assert main(common + ["--out", str(tmp_path / "c"), "--skip-stored", f"{tmp_path / 'a'},{tmp_path / 'b'}"]) == 0
    assert "(0 generated, 5 already stored)" in capsys.readouterr().out and not (tmp_path / "c").exists()
    (tmp_path / "junk").mkdir()
    assert main(common + ["--out", str(tmp_path / "d"), "--skip-stored", str(tmp_path / "junk")]) == 2
    assert "not distillation data" in capsys.readouterr().err and not (tmp_path / "d").exists()


def test_ids_stored_as_uint16_load_as_int32_beside_older_int32_directories(tmp_path):
    """A vocabulary under 65,536 is stored at half the size; an old int32 directory keeps its layout
    when it grows, and both load together as int32 with the same ids."""
    model, tok = make_model(), make_tokenizer(chat=True)
    new = generate_distillation_data(model, tok, prompts(4), tmp_path / "new", max_new_tokens=4, batch_size=2,
                                     progress=False)
    assert json.loads((tmp_path / "new" / "meta.json").read_text())["token_dtype"] == "uint16"
    shard = datasets.load_from_disk(str(next((tmp_path / "new").glob("shard-*"))))
    assert shard.features["input_ids"].feature.dtype == "uint16"
    assert new.features["input_ids"].feature.dtype == "int32"
    # An int32 directory, as gen-data wrote them before: it grows in int32 and loads beside the uint16 one.
    old = tmp_path / "old"
    generate_distillation_data(model, tok, prompts(2), old, max_new_tokens=4, batch_size=2, progress=False)
    meta = json.loads((old / "meta.json").read_text())
    for p in old.glob("shard-*"):
        ds = datasets.load_from_disk(str(p))
        ds.cast(datasets.Features({**ds.features, "input_ids": datasets.Sequence(datasets.Value("int32"))})
                ).save_to_disk(str(p) + "x")
        shutil.rmtree(p)
        (old / (p.name + "x")).rename(p)
    (old / "meta.json").write_text(json.dumps({**meta, "token_dtype": "int32"}))
    generate_distillation_data(model, tok, prompts(4), old, max_new_tokens=4, batch_size=2, progress=False)
    for p in old.glob("shard-*"):
        assert datasets.load_from_disk(str(p)).features["input_ids"].feature.dtype == "int32"
    both = load_distillation_data(f"{old},{tmp_path / 'new'}")
    assert both.features["input_ids"].feature.dtype == "int32"
    assert not list(tmp_path.rglob("cache-*.arrow"))          # reading never writes into a data directory
    by_id = dict(zip(new["id"], new["input_ids"]))
    assert [by_id[i] for i in both["id"]] == list(both["input_ids"])   # same model, same prompts: the same rows

    # Compaction rewrites it as uint16: the same rows in the same order.
    # A shard that a killed compaction left moved aside is put back first.
    rows_before = load_distillation_data(old)
    first = sorted(old.glob("shard-*"))[0]
    aside = old / f".tmp-old-{first.name}-x"
    aside.mkdir()
    first.rename(aside / first.name)
    n, _, _ = compact_data(old)
    assert n == len(list(old.glob("shard-*"))) and not list(old.glob(".tmp-*"))
    assert read_meta(old)["token_dtype"] == "uint16"
    for p in old.glob("shard-*"):
        assert datasets.load_from_disk(str(p)).features["input_ids"].feature.dtype == "uint16"
    after = load_distillation_data(old)
    assert list(after["id"]) == list(rows_before["id"]) and list(after["input_ids"]) == list(rows_before["input_ids"])
    assert compact_data(old)[0] == 0                                  # nothing left to do
    assert compact_data(tmp_path / "new")[0] == 0
