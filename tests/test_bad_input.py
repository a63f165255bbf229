"""Bad input never crashes selfspec: every command answers it with one line on stderr and exit
status 2, and leaves nothing behind (no output file or directory); the Python API raises a
ValueError / FileNotFoundError whose message is one line.

Each CLI case runs ``selfspec.cli.main`` in this process, as ``python -m selfspec ...`` would; a
fresh interpreter pays seconds of importing torch and transformers per case on a slow CPU, and most
cases need them. One case of each kind of failure also runs as the real command line in a
subprocess (``SUBPROCESS_CASES``). Most fail while the flags are checked, before torch loads; those
that need a model use a tiny random one saved to a temporary directory, and a handful use the demo
model's name.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from selfspec.cli import COMMANDS

V = 97


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0", unk_token="w1", eos_token="w2")


def _save_heads(kind: str, model, name: str, path: Path) -> Path:
    from selfspec.heads import save_heads
    from selfspec.model import untrained_heads

    save_heads(untrained_heads(kind, model, name), path)
    return path


@pytest.fixture(scope="module")
def d(tmp_path_factory) -> Path:
    """A directory of inputs, good and bad: a tiny model, heads of each kind, broken files."""
    root = tmp_path_factory.mktemp("bad-input")
    model = tiny_model("llama")
    tiny = root / "tiny"
    model.save_pretrained(tiny)
    _tokenizer().save_pretrained(tiny)
    _save_heads("medusa", model, str(tiny), root / "medusa")
    _save_heads("eagle", model, str(tiny), root / "eagle")
    _save_heads("medusa", tiny_model("llama", num_hidden_layers=2), "other", root / "other-medusa")
    trunc = _save_heads("medusa", model, str(tiny), root / "trunc-medusa") / "model.safetensors"
    trunc.write_bytes(trunc.read_bytes()[: trunc.stat().st_size // 2])
    _save_heads("medusa", model, str(tiny), root / "badcfg-medusa")
    (root / "badcfg-medusa" / "config.json").write_text('{"kind": "medusa", ')
    cfg = _save_heads("medusa", model, str(tiny), root / "badsampled-medusa") / "config.json"   # a sampled pick that is no tree
    raw = json.loads(cfg.read_text())
    raw["decode"] = {"tree": "chain-2", "lookup": 8, "sampled": {"tree": 5}}
    cfg.write_text(json.dumps(raw))

    (root / "good.jsonl").write_text('{"prompt": "w3 w4 w5"}\n{"prompt": "w6 w7"}\n')
    (root / "empty.jsonl").write_text("")
    (root / "noprompt.jsonl").write_text('{"prompt": "w3"}\n{"text": "w4"}\n')
    (root / "notjson.jsonl").write_text('{"prompt": "w3"}\nthis is not json\n')
    (root / "nested.jsonl").write_text('{"prompt": "w3"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")   # too deep to parse
    (root / "bad.yaml").write_text("steps: [1, 2\nlr: : 3\n")                   # malformed YAML
    (root / "lots.yaml").write_text("steps: lots\n")                             # a value of the wrong type
    (root / "emptyprompt.jsonl").write_text('{"prompt": ""}\n')
    (root / "fake.gguf").write_text("this is a text file, not a model\n")
    (root / "empty.gguf").write_bytes(b"")
    (root / "python").symlink_to(sys.executable)      # a Python without the serving engines
    (root / "nodata").mkdir()                         # a directory that is neither a model nor gen-data output
    (root / "full").mkdir()                           # a non-empty output directory
    (root / "full" / "keep.txt").write_text("mine\n")
    (root / "run").mkdir()                            # an earlier training run
    (root / "run" / "trainer_state.pt").write_bytes(b"x")
    (root / "data").mkdir()                           # gen-data output (its meta.json is all the checks read)
    (root / "data" / "meta.json").write_text(json.dumps({"format": 1, "model": str(tiny)}))
    (root / "other-data").mkdir()                     # gen-data output of another model
    (root / "other-data" / "meta.json").write_text(json.dumps({"format": 1, "model": "some-other-model"}))
    from selfspec.core.backbone import config_fingerprint
    from selfspec.corpus import Corpus

    for name, fp in (("corpus", config_fingerprint(model.config)), ("other-corpus", "0123456789abcdef")):
        Corpus.from_answers([[3, 4, 5, 6]], base_model=str(tiny), base_fingerprint=fp, vocab_size=V).save(root / name)
    return root


DEMO = "smollm2-135m"
# (id, argv with {d} for the inputs directory and {o} for this case's own output path).
CASES = [
    # generate: flags
    ("generate-max-new-tokens-zero", "generate --prompt hi --max-new-tokens 0"),
    ("generate-max-new-tokens-negative", "generate --prompt hi --max-new-tokens -5"),
    ("generate-top-p-above-one", "generate --prompt hi --temperature 0.7 --top-p 1.5"),
    ("generate-top-p-zero", "generate --prompt hi --temperature 0.7 --top-p 0"),
    ("generate-negative-temperature", "generate --prompt hi --temperature -1"),
    ("generate-negative-top-k", "generate --prompt hi --temperature 0.7 --top-k -3"),
    ("generate-empty-prompt", ["generate", "--prompt", ""]),
    ("generate-empty-stop", ["generate", "--prompt", "hi", "--stop", ""]),
    ("generate-min-p-above-one", "generate --prompt hi --temperature 0.7 --min-p 1.5"),
    ("generate-negative-min-new-tokens", "generate --prompt hi --min-new-tokens -1"),
    ("generate-min-new-tokens-above-max", "generate --prompt hi --min-new-tokens 50 --max-new-tokens 10"),
    ("generate-zero-repetition-penalty", "generate --prompt hi --repetition-penalty 0"),
    ("generate-infinite-temperature", "generate --prompt hi --temperature inf"),
    ("generate-infinite-repetition-penalty", "generate --prompt hi --repetition-penalty inf"),
    ("generate-heads-for-lookup", "generate --prompt hi --drafter lookup --heads {d}/medusa"),
    ("generate-draft-model-for-medusa", "generate --prompt hi --drafter medusa --draft-model {d}/tiny"),
    ("generate-unknown-drafter", "generate --prompt hi --drafter warp"),
    ("generate-max-new-tokens-not-a-number", "generate --prompt hi --max-new-tokens lots"),
    ("generate-unknown-device", "generate --model {d}/tiny --prompt hi --device tpu"),
    ("generate-missing-gpu", "generate --model {d}/tiny --prompt hi --device cuda:99"),
    ("generate-draft-model-missing", "generate --model {d}/tiny --prompt hi --drafter draft-model"),
    # generate: model names and files
    ("generate-missing-model-dir", "generate --model ./no-such-model --prompt hi"),
    ("generate-malformed-model-name", ["generate", "--model", "not a model!", "--prompt", "hi"]),
    ("generate-model-dir-without-config", "generate --model {d}/nodata --prompt hi"),
    ("generate-text-file-as-gguf", "generate --model {d}/fake.gguf --prompt hi"),
    ("generate-empty-gguf", "generate --model {d}/empty.gguf --prompt hi"),
    # generate: decoding settings and heads
    ("generate-threshold-above-one", "generate --model {d}/tiny --prompt w3 --drafter medusa --threshold 1.5"),
    ("generate-negative-gate", "generate --model {d}/tiny --prompt w3 --drafter medusa --gate -1"),
    ("generate-infinite-gate", "generate --model {d}/tiny --prompt w3 --drafter medusa --gate inf"),
    ("generate-malformed-tree", "generate --model {d}/tiny --prompt w3 --drafter medusa --tree chain-x"),
    ("generate-eagle-heads-for-medusa", "generate --model {d}/tiny --prompt w3 --drafter medusa --heads {d}/eagle"),
    ("generate-heads-of-another-model", "generate --model {d}/tiny --prompt w3 --drafter medusa --heads {d}/other-medusa"),
    ("generate-truncated-heads", "generate --model {d}/tiny --prompt w3 --drafter medusa --heads {d}/trunc-medusa"),
    ("generate-invalid-heads-config", "generate --model {d}/tiny --prompt w3 --drafter medusa --heads {d}/badcfg-medusa"),
    ("generate-sampled-settings-not-a-tree", "generate --model {d}/tiny --prompt w3 --drafter medusa "
                                             "--heads {d}/badsampled-medusa"),
    ("generate-corpus-not-a-corpus", "generate --model {d}/tiny --prompt w3 --drafter lookup --corpus {d}/nodata"),
    ("generate-corpus-for-early-exit", "generate --model {d}/tiny --prompt w3 --drafter early-exit --corpus {d}/corpus"),
    ("generate-corpus-of-another-model", "generate --model {d}/tiny --prompt w3 --drafter lookup --corpus {d}/other-corpus"),
    # bench
    ("bench-corpus-not-a-corpus", "bench --model {d}/tiny --prompts {d}/good.jsonl --methods selfspec-lookup "
                                  "--corpus {d}/nodata --out {o}"),
    ("bench-unknown-device", "bench --model {d}/tiny --prompts {d}/good.jsonl --methods selfspec-ar --device tpu --out {o}"),
    ("bench-methods-naming-none", ["bench", "--model", "{d}/tiny", "--prompts", "{d}/good.jsonl", "--methods", ",",
                                   "--out", "{o}"]),
    ("bench-unknown-method", "bench --model {d}/tiny --prompts {d}/good.jsonl --methods hf-greedy,warp-speed --out {o}"),
    ("bench-auto-with-heads", "bench --model {d}/tiny --prompts {d}/good.jsonl --methods selfspec-auto@{d}/medusa --out {o}"),
    ("bench-negative-repetition-penalty", "bench --model {d}/tiny --prompts {d}/good.jsonl --methods selfspec-ar "
                                          "--repetition-penalty -1 --out {o}"),
    ("bench-row-without-prompt", "bench --model {d}/tiny --prompts {d}/noprompt.jsonl --methods selfspec-ar --out {o}"),
    ("bench-non-json-line", "bench --model {d}/tiny --prompts {d}/notjson.jsonl --methods selfspec-ar --out {o}"),
    ("bench-deeply-nested-json", "bench --model {d}/tiny --prompts {d}/nested.jsonl --methods selfspec-ar --out {o}"),
    ("bench-prompts-a-directory", "bench --model {d}/tiny --prompts {d}/nodata --methods selfspec-ar --out {o}"),
    ("bench-empty-prompts-file", "bench --model {d}/tiny --prompts {d}/empty.jsonl --methods selfspec-ar --out {o}"),
    ("bench-empty-prompt", "bench --model {d}/tiny --prompts {d}/emptyprompt.jsonl --methods selfspec-ar --out {o}"),
    ("bench-non-empty-out", "bench --model {d}/tiny --prompts {d}/good.jsonl --methods selfspec-ar --out {d}/full"),
    ("bench-variant-heads-of-another-kind", "bench --model {d}/tiny --prompts {d}/good.jsonl "
                                            "--methods selfspec-medusa@{d}/eagle --out {o}"),
    ("bench-variant-without-heads", "bench --model {d}/tiny --prompts {d}/good.jsonl --methods selfspec-lookup@{d}/medusa "
                                    "--out {o}"),
    ("bench-threshold-above-one", "bench --model {d}/tiny --prompts {d}/good.jsonl --methods selfspec-medusa "
                                  "--medusa-threshold 2 --out {o}"),
    ("bench-engine-sampling", "bench --model {d}/tiny --prompts {d}/good.jsonl --methods vllm --temperature 0.7 --out {o}"),
    ("bench-llamacpp-without-gguf", "bench --model {d}/tiny --prompts {d}/good.jsonl --methods llamacpp --out {o}"),
    ("bench-engines-python-missing", "bench --model {d}/tiny --prompts {d}/good.jsonl --methods vllm "
                                     "--engines-python {d}/no-such-python --out {o}"),
    ("bench-engines-not-installed", "bench --model {d}/tiny --prompts {d}/good.jsonl --methods vllm,vllm-ngram "
                                    "--engines-python {d}/python --out {o}"),
    ("bench-vllm-spec-tokens-zero", "bench --model {d}/tiny --prompts {d}/good.jsonl --methods vllm-eagle3 "
                                    "--vllm-spec-tokens 0 --out {o}"),
    # gen-data
    ("gen-data-max-prompts-zero", "gen-data --model {d}/tiny --prompts {d}/good.jsonl --out {o} --max-prompts 0"),
    ("gen-data-batch-size-zero", "gen-data --model {d}/tiny --prompts {d}/good.jsonl --out {o} --batch-size 0"),
    ("gen-data-non-json-line", "gen-data --model {d}/tiny --prompts {d}/notjson.jsonl --out {o}"),
    ("gen-data-deeply-nested-json", "gen-data --model {d}/tiny --prompts {d}/nested.jsonl --out {o}"),
    ("gen-data-non-empty-out", "gen-data --model {d}/tiny --prompts {d}/good.jsonl --out {d}/full"),
    ("gen-data-skip-stored-not-gen-data", "gen-data --model {d}/tiny --prompts {d}/good.jsonl --out {o} --skip-stored {d}/nodata"),
    # build-corpus
    ("build-corpus-not-gen-data", "build-corpus --model {d}/tiny --data {d}/nodata --out {o}"),
    ("build-corpus-non-empty-out", "build-corpus --model {d}/tiny --data {d}/data --out {d}/full"),
    ("build-corpus-another-models-data", "build-corpus --model {d}/tiny --data {d}/other-data --out {o}"),
    # train-heads / train-draft
    ("train-heads-steps-zero", "train-heads --model {d}/tiny --data {d}/data --out {o} --steps 0"),
    ("train-heads-infinite-lr", "train-heads --model {d}/tiny --data {d}/data --out {o} --lr inf"),
    ("train-heads-threads-zero", "train-heads --model {d}/tiny --data {d}/data --out {o} --threads 0"),
    # Flags of the data generated from --prompts, and of the head, refused before any data is written to --out:
    ("train-heads-max-prompts-zero", "train-heads --model {d}/tiny --prompts {d}/good.jsonl --out {o} --max-prompts 0"),
    ("train-heads-max-new-tokens-zero", "train-heads --model {d}/tiny --prompts {d}/good.jsonl --out {o} "
                                        "--max-new-tokens 0"),
    ("train-heads-gen-batch-size-zero", "train-heads --model {d}/tiny --prompts {d}/good.jsonl --out {o} "
                                        "--gen-batch-size 0"),
    ("train-heads-ttt-steps-zero", "train-heads --model {d}/tiny --prompts {d}/good.jsonl --out {o} --kind eagle "
                                   "--ttt-steps 0"),
    ("train-heads-aux-layers-out-of-range", "train-heads --model {d}/tiny --prompts {d}/good.jsonl --out {o} "
                                            "--kind eagle --aux-layers 1,99"),
    ("train-heads-recipe-value-of-wrong-type", "train-heads --model {d}/tiny --data {d}/data --out {o} "
                                               "--config {d}/lots.yaml"),
    ("train-heads-malformed-yaml-config", "train-heads --model {d}/tiny --data {d}/data --out {o} --config {d}/bad.yaml"),
    ("train-heads-missing-config", "train-heads --model {d}/tiny --data {d}/data --out {o} --config {d}/no.yaml"),
    ("train-heads-unknown-mixed-precision", "train-heads --model {d}/tiny --data {d}/data --out {o} --mixed-precision fp8"),
    ("train-heads-negative-lr", "train-heads --model {d}/tiny --data {d}/data --out {o} --lr -0.001"),
    ("train-heads-existing-run", "train-heads --model {d}/tiny --data {d}/data --out {d}/run"),
    ("train-heads-non-empty-out", "train-heads --model {d}/tiny --data {d}/data --out {d}/full"),
    ("train-heads-data-not-gen-data", "train-heads --model {d}/tiny --data {d}/nodata --out {o}"),
    ("train-heads-exit-layer-out-of-range", "train-heads --model {d}/tiny --data {d}/data --out {o} --kind early-exit "
                                            "--exit-layer 9"),
    ("train-draft-max-prompts-zero", "train-draft --model {d}/tiny --prompts {d}/good.jsonl --out {o} --layers 1 "
                                     "--max-prompts 0"),
    ("train-draft-layers-zero", "train-draft --model {d}/tiny --data {d}/data --out {o} --layers 0"),
    # eval-heads / tune-tree / export / synth-prompts
    ("eval-heads-truncated-heads", "eval-heads --model {d}/tiny --heads {d}/trunc-medusa --prompts {d}/good.jsonl"),
    ("tune-tree-repeats-zero", "tune-tree --model {d}/tiny --heads {d}/medusa --data {d}/data --repeats 0"),
    ("tune-tree-finalists-negative", "tune-tree --model {d}/tiny --heads {d}/medusa --data {d}/data --finalists -1"),
    ("tune-tree-unknown-device", "tune-tree --model {d}/tiny --heads {d}/eagle --prompts {d}/good.jsonl --device tpu"),
    ("tune-tree-unknown-dtype", "tune-tree --model {d}/tiny --heads {d}/eagle --prompts {d}/good.jsonl --dtype fp8"),
    ("tune-tree-neither-heads-nor-draft", "tune-tree --model {d}/tiny --data {d}/data"),
    ("tune-tree-heads-and-draft", "tune-tree --model {d}/tiny --heads {d}/medusa --draft-model {d}/tiny "
                                  "--prompts {d}/good.jsonl"),
    ("tune-tree-draft-without-prompts", "tune-tree --model {d}/tiny --draft-model {d}/tiny"),
    ("tune-tree-draft-with-data", "tune-tree --model {d}/tiny --draft-model {d}/tiny --data {d}/data "
                                  "--prompts {d}/good.jsonl"),
    ("export-non-empty-out", "export --model {d}/tiny --layers 2 --out {d}/full"),
    ("synth-out-not-jsonl", "synth-prompts --model {d}/tiny --seeds {d}/good.jsonl --out {o}.txt"),
    # the demo model's name: shipped heads and drafts, checked before it loads
    ("demo-no-shipped-draft", f"generate --model {DEMO} --prompt hi --drafter draft-model"),
    ("demo-eagle-heads-for-medusa", f"generate --model {DEMO} --prompt hi --drafter medusa --heads checkpoints/{DEMO}/eagle"),
    ("demo-bench-empty-tree", f"bench --model {DEMO} --prompts {{d}}/good.jsonl --methods hf-greedy,selfspec-medusa "
                              "--medusa-tree chain-0 --out {o}"),
]


def _snapshot(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


ROOT = Path(__file__).resolve().parent.parent
# Also run as the real command line: a bad flag (argparse), a bad value checked before torch loads, a
# model name that resolves to nothing, heads refused once the model has loaded, a training run refused
# before it starts, and the demo model's shipped settings.
SUBPROCESS_CASES = ("generate-max-new-tokens-not-a-number", "generate-top-p-above-one", "generate-missing-model-dir",
                    "generate-heads-of-another-model", "train-heads-existing-run", "demo-bench-empty-tree")


def _run_subprocess(argv: list[str]) -> tuple[int, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-m", "selfspec", *argv], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    return proc.returncode, proc.stderr


def _run_in_process(argv: list[str], capsys, monkeypatch) -> tuple[int, str]:
    """``selfspec.cli.main(argv)`` here, from the repository root; an exception it lets through fails the
    test as a traceback would. What main() sets for the process (warning format and filters, logging,
    torch's thread count) is put back afterwards."""
    from selfspec import cli

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    handlers, threads = list(logging.getLogger().handlers), torch.get_num_threads()
    capsys.readouterr()
    try:
        with warnings.catch_warnings():
            try:
                code = cli.main(argv)
            except SystemExit as e:          # argparse's own refusals
                code = e.code
    finally:
        torch.set_num_threads(threads)
        for h in logging.getLogger().handlers:
            if h not in handlers:
                logging.getLogger().removeHandler(h)
    return code, capsys.readouterr().err


def _check_refused(code: int, stderr: str, d: Path, before: set[str], out: Path) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, f"exit {code}\n{stderr[-3000:]}"
    assert lines and "Traceback" not in stderr, stderr[-3000:]
    assert "error" in lines[-1], lines[-1]
    assert _snapshot(d) == before, f"left behind: {sorted(_snapshot(d) - before)}"
    for suffix in ("", ".jsonl", ".txt"):
        assert not Path(f"{out}{suffix}").exists()


def _argv(argv, d: Path, out: Path) -> list[str]:
    parts = argv.split() if isinstance(argv, str) else argv
    return [p.format(d=d, o=out) for p in parts]


@pytest.mark.parametrize("argv", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_cli_input_is_one_line_and_exit_2(argv, d, request, capsys, monkeypatch):
    out = d / f"out-{request.node.callspec.id}"
    before = _snapshot(d)
    _check_refused(*_run_in_process(_argv(argv, d, out), capsys, monkeypatch), d, before, out)


@pytest.mark.parametrize("command", ["train-heads --kind medusa", "train-draft --layers 1"])
def test_training_on_prompts_with_several_processes_is_refused(command, d, capsys, monkeypatch):
    """Under a multi-process launch every process would answer the prompts into the same directory:
    both training commands refuse --prompts there, before the model loads."""
    out = d / f"out-world-{command.split()[0]}"
    before = _snapshot(d)
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, err = _run_in_process(_argv(f"{command} --model {{d}}/tiny --prompts {{d}}/good.jsonl --out {{o}}", d, out),
                                capsys, monkeypatch)
    _check_refused(code, err, d, before, out)
    assert "generate the data first" in err


@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_bad_command_line_in_a_subprocess_is_one_line_and_exit_2(case, d):
    out = d / f"out-sub-{case}"
    before = _snapshot(d)
    _check_refused(*_run_subprocess(_argv(dict(CASES)[case], d, out)), d, before, out)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_prints_its_help(command, capsys):
    """``selfspec COMMAND --help`` prints every option's help and exits 0 (argparse formats help
    strings with %, so a stray percent sign crashes the help of that command alone)."""
    from selfspec.cli import main

    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--" in out, out[:500]


# ---------------------------------------------------------------------------------------------- API


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(name_or_path="not a model!"), ValueError, "not a model"),
    (dict(name_or_path="{d}/fake.gguf"), ValueError, "not a GGUF"),
    (dict(name_or_path="{d}/empty.gguf"), ValueError, "empty"),
    (dict(name_or_path="{d}/tiny", drafter="medusa", heads="{d}/eagle"), ValueError, "'eagle' heads"),
    (dict(name_or_path="{d}/tiny", drafter="medusa", heads="{d}/no-heads"), FileNotFoundError, "does not exist"),
    (dict(name_or_path="{d}/tiny", drafter="medusa", heads="{d}/trunc-medusa"), ValueError, "truncated"),
    (dict(name_or_path="{d}/tiny", drafter="medusa", threshold=1.5), ValueError, "threshold"),
    (dict(name_or_path="{d}/tiny", drafter="eagle", tree="dynamic-0-4-8"), ValueError, "depth"),
    (dict(name_or_path="{d}/tiny", drafter="lookup", heads="{d}/medusa"), ValueError, "neither heads"),
    (dict(name_or_path="{d}/tiny", drafter="draft-model"), ValueError, "draft_model="),
    (dict(name_or_path="{d}/tiny", drafter="early-exit", exit_layer=9), ValueError, "exit layer 9"),
    (dict(name_or_path="{d}/tiny", drafter="early-exit", corpus="{d}/corpus"), ValueError, "feeds the lookup"),
    (dict(name_or_path="{d}/tiny", drafter="lookup", corpus="{d}/nodata"), ValueError, "not a corpus directory"),
    (dict(name_or_path="{d}/tiny", drafter="lookup", corpus="{d}/other-corpus"), ValueError, "not of this model"),
], ids=["malformed-name", "text-gguf", "empty-gguf", "wrong-kind-heads", "missing-heads", "truncated-heads",
        "threshold", "eagle-tree", "heads-for-lookup", "no-draft-model", "exit-layer", "corpus-for-early-exit",
        "not-a-corpus", "corpus-of-another-model"])
def test_from_pretrained_bad_input(kwargs, error, match, d):
    from selfspec import SelfSpeculativeModel

    kwargs = {k: v.format(d=d) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(error) as excinfo:
        SelfSpeculativeModel.from_pretrained(**kwargs, device="cpu")
    assert match in _one_line(excinfo)


@pytest.mark.parametrize("ids, kwargs", [
    ([[]], {}),
    ([[3, 4]], dict(max_new_tokens=0)),
    ([[3, 4]], dict(do_sample=True, temperature=0.7, top_p=1.5)),
    ([[3, 4]], dict(do_sample=True, temperature=-1.0)),
    ([[3, 4]], dict(do_sample=True, temperature=float("inf"))),
    ([[3, 4]], dict(repetition_penalty=float("inf"))),
    ([[[3, 4], [5, 6]]], {}),
], ids=["empty-prompt", "zero-new-tokens", "top-p", "negative-temperature", "infinite-temperature",
        "infinite-repetition-penalty", "three-dims"])
def test_generate_bad_input(ids, kwargs, d, one_thread):
    from selfspec import SelfSpeculativeModel

    sm = SelfSpeculativeModel.from_pretrained(str(d / "tiny"), drafter="lookup", device="cpu")
    with pytest.raises(ValueError) as excinfo:
        sm.generate(torch.tensor(ids, dtype=torch.long), **kwargs)
    _one_line(excinfo)


def test_time_costs_needs_a_batch_of_at_least_one_row(d, one_thread):
    from selfspec import SelfSpeculativeModel

    sm = SelfSpeculativeModel.from_pretrained(str(d / "tiny"), drafter="lookup", device="cpu")
    sm.time_costs(batch=2)
    with pytest.raises(ValueError) as excinfo:
        sm.time_costs(batch=0)
    assert "at least one row" in _one_line(excinfo)


def test_generate_reads_the_prompt_from_stdin_for_a_dash(monkeypatch):
    """``--prompt -`` takes the prompt from standard input (a pipe, a file); an empty one is refused like
    an empty --prompt."""
    import argparse
    import io

    from selfspec.cli import add_generate, check_generate_args

    parser = argparse.ArgumentParser()
    add_generate(parser)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Name two colours.\nThen a third.\n"))
    args = parser.parse_args(["--prompt", "-"])
    check_generate_args(args)
    assert args.prompt == "Name two colours.\nThen a third.\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(" \n"))
    with pytest.raises(ValueError, match="--prompt is empty"):
        check_generate_args(parser.parse_args(["--prompt", "-"]))
