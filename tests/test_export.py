"""``selfspec export-heads``: every format read back by an independent reader (tests/engine_readers.py)
gives selfspec's own draft logits; EAGLE-3 directories import back and decode exactly; what a format
cannot hold is refused in one line."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import hf_greedy, jitter, tiny_model
from engine_readers import Eagle3Draft, MedusaHeads
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from selfspec.cli import main
from selfspec.core import cache as kv
from selfspec.core.backbone import Backbone, config_fingerprint
from selfspec.core.decode import prefill
from selfspec.export import export_heads
from selfspec.heads import Heads, build_heads, load_heads, save_heads
from selfspec.model import SelfSpeculativeModel, untrained_heads
from selfspec.models.eagle import init_from_target

N_LAYERS = 8   # default aux layers 2, 4, 5: three of them, as EAGLE-3 engines need


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny llama target saved as a model directory (weights + tokenizer), as export-heads loads it."""
    model = tiny_model("llama", seed=5, num_hidden_layers=N_LAYERS, rope_theta=5000.0)
    path = tmp_path_factory.mktemp("target") / "tiny"
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(model.config.vocab_size)}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w1", pad_token="w0").save_pretrained(path)
    return model, path


def _randomised(heads, seed: int, std: float = 0.1):
    jitter(heads.module, std, seed)
    return heads


# Layer variants a draft trained elsewhere may use (speculators trains with the first one's by default).
VARIANTS = {"speculators-defaults": {"norm_before_residual": True, "feature_norm": "concat", "norm_output": True},
            "fc-norm": {"feature_norm": "per_layer"}}


def _eagle_heads(model, path, tmp_path, *, draft_vocab: bool, variant: dict | None = None):
    vocab = torch.tensor(sorted(torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(1))[:40]
                                .tolist())) if draft_vocab else None
    heads = untrained_heads("eagle", model, str(path), draft_vocab=vocab)
    if variant:
        config = dataclasses.replace(heads.config, **variant)
        module = build_heads(config)
        init_from_target(module, Backbone(model), vocab)
        heads = Heads(config=config, module=module.eval(), draft_vocab=vocab)
    heads = _randomised(heads, seed=2)
    save_heads(heads, tmp_path / "heads")
    return load_heads(tmp_path / "heads", expect_kind="eagle", fingerprint=config_fingerprint(model.config), model=model)


def _selfspec_eagle(heads, model, ids: torch.Tensor, next_token: int):
    """selfspec's features and full-vocabulary draft logits: the committed slots of ``ids``, then one drafted slot."""
    bb = Backbone(model)
    out = prefill(bb, kv.new_cache(), ids, capture=tuple(heads.config.aux_layers))
    head, T = heads.module, ids.shape[0]
    feature = head.fuse(torch.cat(out.captured, -1))[:, :T - 1]
    cache = kv.new_cache()

    def run(f, tokens, positions):
        states = head(f, bb.embed(tokens), position_embeddings=bb.rotary_emb(f, position_ids=positions[None]), cache=cache)
        logits = head.logits(states)[0]
        if heads.draft_vocab is None:
            return states, logits
        full = torch.full((logits.shape[0], model.config.vocab_size), float("-inf"))
        full[:, heads.draft_vocab] = logits
        return states, full

    states, committed = run(feature, ids[1:], torch.arange(T - 1))
    _, drafted = run(states[:, -1:], torch.tensor([next_token]), torch.tensor([T - 1]))
    return feature[0], committed, drafted


def _reader_eagle(directory, model, ids: torch.Tensor, next_token: int):
    reader = Eagle3Draft(directory, target_embed=model.get_input_embeddings().weight)
    hidden_states = model(ids[None], output_hidden_states=True).hidden_states
    feature = reader.features(hidden_states)[:-1]
    T = ids.shape[0]
    h, committed = reader.step(feature, ids[1:], torch.arange(T - 1))
    _, drafted = reader.step(h[-1:], torch.tensor([next_token]), torch.tensor([T - 1]))
    return feature, committed, drafted


@pytest.mark.parametrize("fmt,variant", [("eagle3-sglang", None), ("eagle3-speculators", None),
                                         *[("eagle3-speculators", v) for v in VARIANTS]])
@pytest.mark.parametrize("draft_vocab", [True, False])
@torch.no_grad()
def test_eagle3_export_read_independently_gives_selfspecs_draft_logits(fmt, variant, draft_vocab, target, tmp_path):
    model, path = target
    heads = _eagle_heads(model, path, tmp_path, draft_vocab=draft_vocab, variant=VARIANTS.get(variant))
    out = export_heads(tmp_path / "heads", fmt, tmp_path / "out", model=str(path))
    ids = torch.tensor([3, 17, 42, 8, 61, 29, 5, 77, 12])
    ours = _selfspec_eagle(heads, model, ids, next_token=33)
    theirs = _reader_eagle(out, model, ids, next_token=33)
    torch.testing.assert_close(theirs[0], ours[0], rtol=1e-4, atol=1e-4)     # the aux layers the engine captures
    for a, b in zip(theirs[1:], ours[1:]):
        assert torch.equal(torch.isinf(a), torch.isinf(b))                   # the draft vocabulary, mapped by d2t
        torch.testing.assert_close(a[~torch.isinf(a)], b[~torch.isinf(b)], rtol=1e-4, atol=1e-4)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == (40 if draft_vocab else model.config.vocab_size)
    assert "```bash" in (out / "README.md").read_text()


@pytest.mark.parametrize("fmt,variant", [("eagle3-sglang", None), ("eagle3-speculators", None),
                                         ("eagle3-speculators", "speculators-defaults")])
@torch.no_grad()
def test_eagle3_directories_import_and_decode_exactly(fmt, variant, target, tmp_path):
    """from_pretrained(heads=an EAGLE-3 directory): same drafts as the heads it came from, exact output."""
    model, path = target
    heads = _eagle_heads(model, path, tmp_path, draft_vocab=True, variant=VARIANTS.get(variant))
    out = export_heads(tmp_path / "heads", fmt, tmp_path / "out", model=str(path))
    imported = load_heads(out, expect_kind="eagle", fingerprint="ignored for EAGLE-3 directories", model=model)
    assert imported.config.aux_layers == heads.config.aux_layers
    for key in VARIANTS["speculators-defaults"]:
        assert getattr(imported.config, key) == getattr(heads.config, key)
    assert torch.equal(imported.draft_vocab, heads.draft_vocab)
    ids = torch.tensor([[3, 17, 42, 8, 61]])
    runs = []
    for h in (heads, imported):
        sm = SelfSpeculativeModel(model, None, drafter_name="eagle", heads=h, name="tiny", tree="dynamic-3-2-4",
                                  fit_width=False)   # whole trees: fitting's cuts follow timings, so runs could differ
        runs.append((sm.generate(ids, max_new_tokens=20), sm.last_stats.acceptance_by_depth))
    assert torch.equal(runs[0][0], hf_greedy(model, ids, 20)) and torch.equal(runs[1][0], runs[0][0])
    assert runs[1][1] == runs[0][1]                                          # identical drafts, step for step


@pytest.mark.parametrize("fmt", ["medusa-vllm", "medusa-tgi"])
@torch.no_grad()
def test_medusa_export_read_independently_gives_selfspecs_draft_logits(fmt, target, tmp_path):
    model, path = target
    heads = _randomised(untrained_heads("medusa", model, str(path), token_input=False), seed=3)
    if fmt == "medusa-vllm":   # vLLM takes a draft vocabulary (as zero rows); TGI refuses one
        heads.draft_vocab = torch.arange(0, model.config.vocab_size, 3)
        heads.config.draft_vocab_size = int(heads.draft_vocab.numel())
    save_heads(heads, tmp_path / "heads")
    heads = load_heads(tmp_path / "heads", expect_kind="medusa", fingerprint=config_fingerprint(model.config), model=model)
    out = export_heads(tmp_path / "heads", fmt, tmp_path / "out", model=str(path))
    bb = Backbone(model)
    hidden = prefill(bb, kv.new_cache(), torch.tensor([4, 9, 22, 51]), capture=()).hidden[-1]   # post-norm, as served
    rows = bb.lm_head.weight if heads.draft_vocab is None else bb.lm_head.weight[heads.draft_vocab]
    logits = heads.module(hidden) @ rows.T
    theirs = MedusaHeads(out).logits(hidden)
    if heads.draft_vocab is not None:   # the draft vocabulary's logits, 0 elsewhere
        full = torch.zeros(logits.shape[0], model.config.vocab_size)
        full[:, heads.draft_vocab] = logits
        logits = full
        outside = torch.ones(model.config.vocab_size, dtype=torch.bool)
        outside[heads.draft_vocab] = False
        assert torch.equal(theirs[:, outside], torch.zeros_like(theirs[:, outside]))
    torch.testing.assert_close(theirs, logits, rtol=1e-5, atol=1e-5)


def test_what_a_format_cannot_hold_is_refused_in_one_line(target, tmp_path, capsys):
    model, path = target

    def export(heads, fmt):
        save_heads(heads, tmp_path / fmt / "heads")
        code = main(["export-heads", "--heads", str(tmp_path / fmt / "heads"), "--format", fmt,
                     "--out", str(tmp_path / fmt / "out"), "--model", str(path)])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "\n" not in err and not (tmp_path / fmt / "out").exists(), err
        return err

    assert "--token-input false" in export(untrained_heads("medusa", model, str(path), token_input=True), "medusa-vllm")
    assert "--head-mlp" in export(untrained_heads("medusa", model, str(path), token_input=False, head_mlp=(8,)),
                                  "medusa-tgi")
    vocab = untrained_heads("medusa", model, str(path), token_input=False)
    vocab.draft_vocab, vocab.config.draft_vocab_size = torch.arange(10), 10
    assert "--draft-vocab-size 0" in export(vocab, "medusa-tgi")
    final = untrained_heads("eagle", model, str(path), aux_layers=[2, 4, N_LAYERS])
    assert f"--aux-layers 2,4,{N_LAYERS - 3}" in export(final, "eagle3-sglang")
    assert "exactly 3" in export(untrained_heads("eagle", model, str(path), aux_layers=[2, 5]), "eagle3-speculators")
    plain = untrained_heads("eagle", model, str(path))
    config = dataclasses.replace(plain.config, norm_output=True)
    variant = Heads(config=config, module=build_heads(config), draft_vocab=None)
    err = export(variant, "eagle3-sglang")
    assert "norm_output" in err and "eagle3-speculators" in err
    assert "holds medusa heads" in export(untrained_heads("early-exit", model, str(path)), "medusa-vllm")


@pytest.mark.parametrize("change,words", [({"num_hidden_layers": 2}, "it has 2 decoder layers"),
                                          ({"mlp_bias": True}, "mlp_bias"),
                                          ({"hidden_act": "gelu"}, "'gelu'")])
def test_eagle3_drafts_selfspec_cannot_run_are_refused_in_one_line(change, words, target, tmp_path):
    """An EAGLE-3 directory whose layer selfspec's head cannot be: one line at load, not a silent misreading."""
    model, path = target
    _eagle_heads(model, path, tmp_path, draft_vocab=False)
    out = export_heads(tmp_path / "heads", "eagle3-speculators", tmp_path / "out", model=str(path))
    cfg = json.loads((out / "config.json").read_text())
    cfg["transformer_layer_config"].update(change)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        load_heads(out, expect_kind="eagle", fingerprint="", model=model)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_eagle3_draft_with_another_layers_tensors_is_refused_in_one_line(target, tmp_path):
    """A draft whose layer has tensors selfspec's head lacks (a Qwen3-style layer's q/k norms): one line that
    says it is another kind of layer, not a request to re-export."""
    from safetensors.torch import load_file, save_file

    model, path = target
    _eagle_heads(model, path, tmp_path, draft_vocab=False)
    out = export_heads(tmp_path / "heads", "eagle3-speculators", tmp_path / "out", model=str(path))
    tensors = load_file(out / "model.safetensors")
    tensors["layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        load_heads(out, expect_kind="eagle", fingerprint="", model=model)
    msg = str(e.value)
    assert "cannot run" in msg and "q_norm" in msg and "re-export" not in msg and "\n" not in msg


def test_export_heads_cli_writes_a_whole_directory(target, tmp_path, capsys):
    model, path = target
    save_heads(untrained_heads("eagle", model, str(path)), tmp_path / "h")
    argv = ["export-heads", "--heads", str(tmp_path / "h"), "--format", "eagle3-speculators", "--out",
            str(tmp_path / "o"), "--model", str(path), "--dtype", "bfloat16", "--speculative-tokens", "4"]
    assert main(argv) == 0
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(path)
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["README.md", "config.json", "model.safetensors"]
    capsys.readouterr()
    assert main(argv) == 2 and "exists" in capsys.readouterr().err      # never over a directory without --force
    assert main(argv + ["--force"]) == 0


def test_shipped_medusa_heads_say_which_training_flag_makes_them_exportable(demo, capsys, tmp_path):
    """The demo's shipped Medusa heads read the next token, which the engines cannot run; the refusal
    names the fix (medusa-portable, below, is the engine-compatible set)."""
    from selfspec.shipped import shipped_heads

    assert main(["export-heads", "--heads", str(shipped_heads("smollm2-135m", "medusa")), "--format", "medusa-vllm",
                 "--out", str(tmp_path / "medusa")]) == 2
    assert "--token-input false" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["eagle3-sglang", "eagle3-speculators"])
@torch.no_grad()
def test_shipped_eagle_head_exports_and_reads_back_on_the_real_model(fmt, demo, tmp_path):
    """The demo's shipped eagle head, exported: the independent reader, fed the real model's hidden
    states, gives selfspec's features and draft logits for committed and drafted slots."""
    from selfspec.io import prompt_ids
    from selfspec.shipped import shipped_heads

    path = shipped_heads("smollm2-135m", "eagle")
    model = demo.model
    heads = load_heads(path, expect_kind="eagle", fingerprint=config_fingerprint(model.config), model=model,
                       dtype=torch.float32)
    out = export_heads(path, fmt, tmp_path / "out")
    ids = torch.tensor(prompt_ids(demo.tokenizer, "Write a function that reverses a list.", chat=True))
    ours = _selfspec_eagle(heads, model, ids, next_token=int(ids[-1]))
    theirs = _reader_eagle(out, model, ids, next_token=int(ids[-1]))
    torch.testing.assert_close(theirs[0], ours[0], rtol=1e-4, atol=1e-4)
    for a, b in zip(theirs[1:], ours[1:]):
        assert torch.equal(torch.isinf(a), torch.isinf(b))
        torch.testing.assert_close(a[~torch.isinf(a)], b[~torch.isinf(b)], rtol=1e-3, atol=1e-3)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == heads.draft_vocab.shape[0]


@torch.no_grad()
def test_shipped_portable_medusa_heads_run_in_vllms_layout(demo, tmp_path):
    """The demo's engine-compatible Medusa heads, exported for vLLM: the independent reader gives
    selfspec's draft logits on the real model's hidden state, and selfspec's own output stays exact."""
    from selfspec.io import prompt_ids
    from selfspec.shipped import shipped_heads

    path = shipped_heads("smollm2-135m", "medusa").parent / "medusa-portable"
    model = demo.model
    heads = load_heads(path, expect_kind="medusa", fingerprint=config_fingerprint(model.config), model=model)
    assert not heads.config.token_input and not any(heads.config.head_mlp)
    out = export_heads(path, "medusa-vllm", tmp_path / "vllm")
    bb = Backbone(model)
    ids = torch.tensor(prompt_ids(demo.tokenizer, "Write a function that reverses a list.", chat=True))
    hidden = prefill(bb, kv.new_cache(), ids, capture=()).hidden[-1]
    logits = heads.module(hidden) @ bb.lm_head.weight[heads.draft_vocab].T
    full = torch.zeros(logits.shape[0], model.config.vocab_size)    # 0 outside the draft vocabulary
    full[:, heads.draft_vocab] = logits
    theirs = MedusaHeads(out).logits(hidden)
    torch.testing.assert_close(theirs, full, rtol=1e-4, atol=1e-4)
    # every head's best token is the draft vocabulary's best, as selfspec drafts it
    assert torch.equal(theirs.argmax(-1), heads.draft_vocab[logits.argmax(-1)])
    # Whole trees: the tau floor is about the heads, not about how this machine's timings cut them.
    sm = SelfSpeculativeModel(model, demo.tokenizer, drafter_name="medusa", heads=heads, name=demo.name, fit_width=False)
    got = sm.generate(ids[None], max_new_tokens=48)
    assert torch.equal(got, model.generate(ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=48,
                                           do_sample=False, pad_token_id=demo.tokenizer.eos_token_id))
    assert sm.last_stats.tau > 1.2
