"""selfspec.io: one prompt -> ids helper (byte-identical to the two it replaced) and the atomic writers."""

from __future__ import annotations

import os

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from selfspec.io import atomic_dir, atomic_path, atomic_write_text, prompt_ids, remove_stale_temporaries
from selfspec.training.data import prompt_token_ids

WORDS = ["<pad>", "<unk>", "<bos>", "<eos>", "user:", "assistant:"] + [f"w{i}" for i in range(20)]
CHAT_TEMPLATE = ("{% for m in messages %}<bos> user: {{ m['content'] }} <eos> {% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPTS = ["w1 w2 w3", "w4", "  w5   w6 ", "w7 <eos> w8"]


def _tokenizer(*, chat: bool, bos: bool) -> PreTrainedTokenizerFast:
    from tokenizers import processors

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:  # a tokenizer that adds BOS: the chat path must not add it a second time
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    t = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                unk_token="<unk>")
    if chat:
        t.chat_template = CHAT_TEMPLATE
    return t


def _old_cli_encode(tokenizer, prompt: str, *, chat: bool) -> list[int]:
    """What ``cli.encode_prompt`` returned (generate, bench) before selfspec.io existed."""
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt")
        if not torch.is_tensor(ids):
            ids = ids["input_ids"]
        return ids[0].tolist()
    return tokenizer(prompt, return_tensors="pt").input_ids[0].tolist()


def _old_data_encode(tokenizer, prompts: list[str]) -> list[list[int]]:
    """What ``training.data.prompt_token_ids`` returned (gen-data) before selfspec.io existed."""
    if getattr(tokenizer, "chat_template", None):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=False) for p in prompts]
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    return tokenizer(list(prompts))["input_ids"]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "raw"])
@pytest.mark.parametrize("bos", [True, False], ids=["bos", "no-bos"])
def test_prompt_ids_match_both_old_encoders(chat, bos):
    tok = _tokenizer(chat=chat, bos=bos)
    for p in PROMPTS:
        assert prompt_ids(tok, p, chat=chat) == _old_cli_encode(tok, p, chat=chat)
    assert prompt_token_ids(tok, PROMPTS) == _old_data_encode(tok, PROMPTS)
    assert prompt_token_ids(tok, PROMPTS) == [prompt_ids(tok, p, chat=chat) for p in PROMPTS]


@pytest.mark.demo
def test_prompt_ids_match_on_the_demo_tokenizer():
    from transformers import AutoTokenizer

    from selfspec.loading import resolve_source

    tok = AutoTokenizer.from_pretrained(resolve_source("smollm2-135m")[0])
    prompts = ["Name three primes.", "  leading space", "émoji 🎉 and\nnewlines\n", "<|im_start|> a literal special"]
    for chat in (True, False):
        for p in prompts:
            assert prompt_ids(tok, p, chat=chat) == _old_cli_encode(tok, p, chat=chat)
    assert prompt_token_ids(tok, prompts) == _old_data_encode(tok, prompts)


def test_prompt_ids_refuse_empty_prompt_and_missing_template():
    with pytest.raises(ValueError, match="empty"):
        prompt_ids(_tokenizer(chat=True, bos=False), "  ", chat=True)
    with pytest.raises(ValueError, match="no chat template"):
        prompt_ids(_tokenizer(chat=False, bos=False), "w1", chat=True)


def test_atomic_file_writes_replace_whole_or_not_at_all(tmp_path):
    path = tmp_path / "f.json"
    atomic_write_text(path, "one")
    assert path.read_text() == "one" and oct(path.stat().st_mode & 0o777) == "0o644"
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            (tmp.parent / ".tmpAb12Cd").write_text("the writer's own")   # as safetensors makes beside its target
            tmp.write_text("torn")
            raise RuntimeError("killed mid-write")
    assert path.read_text() == "one"
    assert os.listdir(tmp_path) == ["f.json"]   # no temporary file left, the writer's own neither
    # A write killed outright leaves one scratch directory, which the next run's clean-up deletes.
    writer = atomic_path(path)
    tmp = writer.__enter__()
    (tmp.parent / ".tmpAb12Cd").write_text("the writer's own")
    remove_stale_temporaries(tmp_path)
    assert os.listdir(tmp_path) == ["f.json"] and path.read_text() == "one"


def test_atomic_dir_replaces_keeps_and_cleans_up(tmp_path):
    out = tmp_path / "d"
    with atomic_dir(out) as tmp:
        (tmp / "a").write_text("1")
    with atomic_dir(out) as tmp:                       # replaces the old directory
        (tmp / "b").write_text("2")
    assert sorted(os.listdir(out)) == ["b"]
    with atomic_dir(out, keep_existing=True) as tmp:   # a concurrent writer got there first: keep it
        (tmp / "c").write_text("3")
    assert sorted(os.listdir(out)) == ["b"]
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "e") as tmp:
            (tmp / "x").write_text("half")
            raise RuntimeError("killed")
    assert sorted(os.listdir(tmp_path)) == ["d"]


def test_drafter_names_match_the_registry():
    from selfspec.drafters import DRAFTERS
    from selfspec.shipped import DRAFTER_NAMES, HEADS_DRAFTERS

    assert tuple(DRAFTERS) == DRAFTER_NAMES and set(HEADS_DRAFTERS) <= set(DRAFTER_NAMES)


def test_no_import_cycles_between_cli_bench_and_loading():
    """cli <-> bench and loading <-> training.draft used to import each other (inside functions)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "selfspec"

    def imports(rel: str) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse((root / rel).read_text())):
            if isinstance(node, ast.ImportFrom):
                names.add("." * node.level + (node.module or ""))
        return names

    assert not {i for i in imports("loading.py") if "training" in i}
    assert not {i for i in imports("bench/__init__.py") | imports("bench/methods.py") if i.endswith("cli")}
