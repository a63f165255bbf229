"""train-draft: distillation loss, the small checkpoint format, materialisation, resume, a tiny end-to-end run."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import distill_dataset, hf_greedy, tiny_model
from safetensors.torch import load_file

from selfspec.core.backbone import Backbone, config_fingerprint
from selfspec.core.decode import decode
from selfspec.core.sampling import SamplingParams
from selfspec.core.tree import build_tree, chain
from selfspec.drafters import DraftModelDrafter
from selfspec.training.checkpoint import STATE_FILE
from selfspec.loading import materialize_draft
from selfspec.training.draft import DraftConfig, train_draft
from selfspec.training.features import target_view
from selfspec.training.split import collate, to_sequences
from selfspec.training.tasks.draft import META_FILE, draft_loss, make_student, trained_names

V = 97




def _random_data(n=12, length=20, start=8):
    return distill_dataset([(torch.randint(1, V, (length,), generator=torch.Generator().manual_seed(i)).tolist(), start)
                     for i in range(n)])


def _self_generated(model, *, n=24, new=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        prompt = torch.randint(1, V, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g)
        rows.append((hf_greedy(model, prompt[None], new)[0].tolist(), len(prompt)))
    return distill_dataset(rows)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0", unk_token="w1")


def _saved_base(model, path):
    """The tiny target as a model directory, so materialize_draft can load it by name."""
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return str(path)


def _cfg(tmp_path, name, **kw):
    base = dict(steps=4, lr=1e-2, warmup=1, batch_size=4, draft_vocab_size=32, eval_fraction=0.2, eval_every=100,
                save_every=2, out=str(tmp_path / name))
    return DraftConfig(**{**base, **kw})


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))


# ---------------------------------------------------------------------------------------------- loss


def test_loss_is_zero_when_student_equals_teacher():
    model, L = tiny_model(seed=1), 2
    batch = collate(to_sequences(_random_data(n=4), max_len=100), lead=0)
    target = target_view(model, vocab=torch.arange(0, V, 2), exit_layer=None)
    student = make_student(model, layers=L)
    assert float(draft_loss(student, target, batch, device="cpu").loss.detach()) > 1e-3  # real upper layers: a gap to close

    with torch.no_grad():  # layers >= L add nothing to the residual stream: the target *is* its first L layers
        for layer in model.model.layers[L:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    r = draft_loss(make_student(model, layers=L), target_view(model, vocab=None, exit_layer=None), batch, device="cpu")
    assert float(r.loss.detach()) == pytest.approx(0.0, abs=1e-5) and float(r.top1[0]) == 1.0
    assert int(r.count[0]) == int(batch.mask.sum())


def test_student_freezes_embeddings_and_head():
    model = tiny_model(seed=1, tie_word_embeddings=True)
    student = make_student(model, layers=2)
    frozen = [n for n, p in student.named_parameters() if not p.requires_grad]
    assert frozen == ["model.embed_tokens.weight"]  # tied: the LM head is the same tensor
    assert student.get_output_embeddings().weight is student.get_input_embeddings().weight
    assert all(n.startswith(("model.layers.", "model.norm.")) for n in trained_names(student))
    assert torch.equal(student.get_output_embeddings().weight, model.get_output_embeddings().weight)


# ---------------------------------------------------------------------------------------------- checkpoint format


def test_checkpoint_holds_only_trained_tensors_and_materializes(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = tiny_model(seed=1, tie_word_embeddings=True)
    base = _saved_base(model, tmp_path / "base")
    cfg = _cfg(tmp_path, "d", steps=3)
    train_draft(model, _random_data(), layers=2, config=cfg, name=base, tokenizer=_tokenizer(), progress=False)

    out = tmp_path / "d"
    stored = load_file(out / "model.safetensors")
    meta = json.loads((out / META_FILE).read_text())
    assert all(n.startswith(("model.layers.", "model.norm.")) for n in stored) and "model.layers.1.mlp.up_proj.weight" in stored
    assert {t.dtype for t in stored.values()} == {torch.float16} and meta["dtype"] == "float16"
    assert "model.embed_tokens.weight" in meta["shared"] and not set(meta["shared"]) & set(stored)
    assert meta["base_fingerprint"] == config_fingerprint(model.config) and meta["base_model"] == base
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    assert all((out / n).stat().st_mode & 0o777 == 0o644 for n in ("model.safetensors", META_FILE))
    from selfspec.card import write_card

    card = write_card(out, hardware="cpu").read_text()   # a draft model's card (no heads: no tune-tree sections)
    assert "distilled draft model" in card and "## Training" in card and "## When sampling" not in card

    full = materialize_draft(out)
    assert full.parent == tmp_path / "home" / "drafts" and full.name.startswith("d-")
    draft = AutoModelForCausalLM.from_pretrained(full)
    assert draft.config.num_hidden_layers == 2
    trained = torch.load(out / STATE_FILE, weights_only=True)["student"]  # fp32 master weights of the same step
    sd = draft.state_dict()
    for n, t in trained.items():
        torch.testing.assert_close(sd[n], t.half().float(), rtol=0, atol=0, msg=n)
    assert torch.equal(sd["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    assert torch.equal(sd["lm_head.weight"], model.lm_head.weight)

    def no_load(*a, **k):
        raise AssertionError("a cached draft must not load the base model again")

    monkeypatch.setattr("selfspec.loading.load_model", no_load)
    assert materialize_draft(out) == full
    # selfspec's own loader (and so --draft-model / draft_model=) resolves the stored draft the same way.
    monkeypatch.undo()
    from selfspec.loading import load_model

    loaded = load_model(str(out), device="cpu").model
    for k, v in AutoModelForCausalLM.from_pretrained(full).state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, msg=k)
    assert materialize_draft(full) == full  # an ordinary model directory is returned as is


def test_fingerprint_mismatch_is_refused(tmp_path):
    model = tiny_model(seed=1)
    train_draft(model, _random_data(), layers=2, config=_cfg(tmp_path, "d", steps=1), name="tiny", progress=False)
    other = _saved_base(tiny_model(seed=1, num_hidden_layers=5), tmp_path / "other")
    with pytest.raises(ValueError, match="fingerprint"):
        materialize_draft(tmp_path / "d", base_model=other)


# ---------------------------------------------------------------------------------------------- resume


def test_resume_continues_the_step_count(tmp_path):
    model, ds = tiny_model(seed=1), _random_data()
    straight = train_draft(model, ds, layers=2, config=_cfg(tmp_path, "a"), name="tiny", progress=False)

    def stop_at_3(step):
        if step == 3:
            raise KeyboardInterrupt

    cut = train_draft(model, ds, layers=2, config=_cfg(tmp_path, "b"), name="tiny", progress=False, callback=stop_at_3)
    assert cut.interrupted and cut.step == 2 and not list((tmp_path / "b").glob("*.tmp"))
    assert json.loads((tmp_path / "b" / META_FILE).read_text())["training"]["steps"] == 2
    with pytest.raises(ValueError, match="--resume"):
        train_draft(model, ds, layers=2, config=_cfg(tmp_path, "b"), name="tiny", progress=False)
    with pytest.raises(ValueError, match="layers"):
        train_draft(model, ds, layers=3, config=_cfg(tmp_path, "b"), name="tiny", progress=False, resume=True)
    resumed = train_draft(model, ds, layers=2, config=_cfg(tmp_path, "b"), name="tiny", progress=False, resume=True)
    assert resumed.step == straight.step == 4
    a, b = (torch.load(tmp_path / x / STATE_FILE, weights_only=True)["student"] for x in "ab")
    for n in a:  # equal only if optimizer moments, schedule and batch order all carried over
        torch.testing.assert_close(a[n], b[n], msg=n)


# ---------------------------------------------------------------------------------------------- end to end


def test_end_to_end_draft_learns_and_decoding_stays_exact(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model(seed=2)
    ds = _self_generated(model)
    base = _saved_base(model, tmp_path / "base")
    cfg = _cfg(tmp_path, "d", steps=20, lr=3e-3, warmup=2, batch_size=6, draft_vocab_size=48, eval_fraction=0.25,
               eval_every=10, save_every=10)
    result = train_draft(model, ds, layers=2, config=cfg, name=base, tokenizer=_tokenizer(), progress=False)
    kl = [e.loss for e in result.evals]
    assert [e.step for e in result.evals] == [0, 10, 20] and kl[-1] < 0.6 * kl[0], kl

    draft = AutoModelForCausalLM.from_pretrained(materialize_draft(cfg.out)).eval()
    # Storing in float16 must not change what the draft proposes: same argmax as the fp32 student.
    student = make_student(model, layers=2)
    student.load_state_dict(torch.load(tmp_path / "d" / STATE_FILE, weights_only=True)["student"], strict=False)
    with torch.no_grad():
        for i in range(4):
            ids = torch.tensor([ds[i]["input_ids"]])
            assert torch.equal(draft(ids).logits.argmax(-1), student(ids).logits.argmax(-1))

    # The draft records the 48-token subset it was distilled on; the drafter scores only those rows.
    vocab = torch.load(tmp_path / "d" / STATE_FILE, weights_only=True)["vocab"]
    assert draft.config.selfspec_draft_vocab == vocab.tolist() and len(vocab) == 48
    bb = Backbone(model)
    for i in range(3):
        prompt = torch.randint(1, V, (1, 5), generator=torch.Generator().manual_seed(100 + i))
        drafter = DraftModelDrafter(draft, build_tree(chain(3)), vocab_size=bb.vocab_size)
        assert torch.equal(drafter.vocab, vocab)
        new, _ = decode(bb, drafter, prompt[0], params=SamplingParams(), max_new_tokens=24, eos_token_ids=set(),
                        generator=None)
        assert new == hf_greedy(model, prompt, 24)[0, 5:].tolist()

    # eval-heads scores a draft as the drafter uses it: top-1 on its vocabulary subset, next token
    # at every response position; checked against a fresh forward per position.
    from selfspec.training.evaluate import draft_rank_accuracy

    seqs = to_sequences(ds, max_len=1024)[:4]
    hits = total = 0
    with torch.no_grad():
        for s in seqs:
            for t in range(s.response_start - 1, len(s.ids) - 1):
                z = draft(s.ids[None, : t + 1]).logits[0, -1, vocab]
                hits += int(vocab[z.argmax()]) == int(s.ids[t + 1])
                total += 1
    acc = draft_rank_accuracy(draft, seqs)
    assert acc[0][0] == pytest.approx(hits / total, abs=1e-6) and sum(acc[0]) <= 1
