"""Self-instruct prompt synthesis: request format, the proposal filter, resuming, and the CLI's errors."""

import json
import subprocess
import sys

import pytest
from test_training_data import make_model, make_tokenizer

from selfspec.training.synth import clean_proposal, few_shot_request, synthesize_prompts

pytestmark = pytest.mark.usefixtures("one_thread")


def test_request_numbers_the_examples_and_leaves_the_next_task_open():
    assert few_shot_request(["Sort a list.", "  Name a colour.\n"]) == "Task 1: Sort a list.\n\nTask 2: Name a colour.\n\nTask 3:"


@pytest.mark.parametrize(
    "text, expected",
    [
        (" Write a haiku about the sea.\n\nTask 5: Something else", "Write a haiku about the sea."),
        (" Summarise the text below.\nText: The cat sat on the mat all day.\n\nThe cat sat.",
         "Summarise the text below.\nText: The cat sat on the mat all day."),
        (" Name three rivers in Europe.\nTask 4: more", "Name three rivers in Europe."),
        (" ok", None),  # too short
        (" 12345 67890 12345 67890", None),  # too few letters
        (" A movie was released.\nA movie was released.", None),  # looped lines
        (" the the the the the the the the cat", None),  # looped words
        (" " + "word " * 100, None),  # too long
    ],
)
def test_clean_proposal(text, expected):
    assert clean_proposal(text) == expected


def test_synthesis_keeps_unique_new_prompts_and_resumes(tmp_path):
    model, tok = make_model(), make_tokenizer(chat=False)
    seeds = [" ".join(f"w{(5 * i + j) % 58}" for j in range(10)) for i in range(6)]
    out = tmp_path / "synth.jsonl"
    first = synthesize_prompts(model, tok, seeds, out, n=3, examples=2, max_new_tokens=12, batch_size=4, progress=False)
    assert [r["id"] for r in first] == ["synth-0", "synth-1", "synth-2"]
    prompts = [r["prompt"] for r in first]
    assert len(set(prompts)) == 3 and not set(prompts) & set(seeds)
    assert all(clean_proposal(" " + p) == p for p in prompts)
    # Resume to 6: the first three rows stay, three more are added, and a fresh run makes the same six.
    more = synthesize_prompts(model, tok, seeds, out, n=6, examples=2, max_new_tokens=12, batch_size=4, progress=False)
    assert more[:3] == first and len(more) == 6
    assert [json.loads(line) for line in out.read_text().splitlines()] == more
    fresh = synthesize_prompts(model, tok, seeds, tmp_path / "fresh.jsonl", n=6, examples=2, max_new_tokens=12,
                               batch_size=4, progress=False)
    assert len(fresh) == 6 and fresh[:3] == first


def test_synthesis_gives_up_after_max_requests(tmp_path, capsys):
    model, tok = make_model(), make_tokenizer(chat=False)
    seeds = ["w1 w2 w3 w4 w5 w6 w7 w8", "w9 w10 w11 w12 w13 w14 w15 w16"]
    rows = synthesize_prompts(model, tok, seeds, tmp_path / "s.jsonl", n=500, examples=1, max_new_tokens=2,
                              batch_size=4, max_requests=8, progress=False)
    assert rows == []  # two new tokens never make a usable task
    assert "stopped after 8 requests with 0 of 500 prompts" in capsys.readouterr().err


def test_cli_errors_are_one_line(tmp_path):
    seeds = tmp_path / "seeds.jsonl"
    seeds.write_text(json.dumps({"prompt": "Write a poem.", "source": "a"}) + "\n")
    for extra, message in [
        (["--out", str(tmp_path / "o.txt")], "must end in .jsonl"),
        (["--out", str(tmp_path / "o.jsonl"), "--sources", "b"], "no prompt has source 'b'"),
    ]:
        proc = subprocess.run([sys.executable, "-m", "selfspec.cli", "synth-prompts", "--model", "smollm2-135m",
                               "--seeds", str(seeds), *extra], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "o.jsonl").exists()
