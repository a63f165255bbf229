"""Read an EAGLE head's exports with vLLM's own `speculators` library and compare its draft with selfspec's.

    PYTHONPATH=DIR python scripts/check_speculators.py [--heads DIR] [--model NAME] [--prompts N] [--new-tokens N]

`tests/test_export.py` reads every export with readers this project wrote from the engines' docs
(`tests/engine_readers.py`). This script asks a reader it did not write: speculators (vllm-project),
whose `Eagle3DraftModel` is what vLLM's EAGLE-3 checkpoints are trained and converted with. For the
`eagle3-speculators` export it loads the directory as it is; for `eagle3-sglang` it converts the
directory with speculators' own `Eagle3Converter` first (its path for SGLang/EAGLE checkpoints), then
loads that. The other way round, speculators starts a draft for the target as its trainer does, with
the layer variants it trains with by default (perturbed weights: the check is of the layout, not of
training), saves it, and selfspec imports it. For each prompt (the target's greedy answer appended), the target's hidden states at the
layers the config names go through speculators' training-time forward (two unrolled steps, teacher
forced) and through selfspec's head, and the script prints, per export:

* step 1 (every committed slot): the largest difference of draft logits, and how often the two argmax
  tokens (draft ids mapped to target ids, by speculators' `d2t` and selfspec's draft vocabulary) agree;
* step 2 (a drafted slot after the committed ones): the same, at a few cut points of each sequence.

speculators pins transformers <= 5.19 and pulls in a serving stack, so it is not a dependency of this
project. Install it beside the environment without its dependencies, e.g.
`pip install --no-deps --target /tmp/spec speculators==0.9.0 loguru hs-connectors==0.9.0` and
`pip install --target /tmp/spec-deps openai aiohttp psutil`, then run with
`PYTHONPATH=/tmp/spec:/tmp/spec-deps`. Exit status 1 where an export disagrees, 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
LOGIT_TOL = 2e-3        # float32 on both sides; different op orders round differently


def speculators_model(directory: Path):
    """speculators' own ``Eagle3DraftModel`` for an EAGLE-3 directory, in float32 on CPU."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(directory)
    config.transformer_layer_config._attn_implementation = "eager"   # flex attention wants a GPU
    model = Eagle3DraftModel.from_pretrained(directory, config=config).float().eval()
    # The checkpoint has no embedding: the engines take the verifier's. speculators loads it only where
    # the missing weight was initialised to NaN, which transformers newer than its pin no longer does.
    model._load_verifier_weights(overwrite_embed_tokens=True)
    return model


def speculators_draft(model, hidden: tuple[torch.Tensor, ...], ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """speculators' two teacher-forced steps over one sequence: per step (1, T-1, V_draft) logits, and d2t."""
    layers = model.config.eagle_aux_hidden_state_layer_ids
    features = torch.cat([hidden[a] for a in layers], -1)          # HF index a: after a decoder layers
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    T = ids.shape[0]
    # speculators' own alignment (models/eagle3/data.py: shift_batch): slot i pairs x_{i+1} with g_i.
    model(hidden_states=features[:, :-1], input_ids=ids[None, 1:], document_ids=torch.zeros(1, T - 1, dtype=torch.long),
          position_ids=torch.arange(1, T)[None], ttt_steps=2)
    hook.remove()
    d2t = model.d2t if getattr(model, "d2t", None) is not None else torch.zeros(seen[0].shape[-1], dtype=torch.long)
    return seen, d2t.long()


def selfspec_draft(heads, backbone, ids: torch.Tensor, cut: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """selfspec's head over ids: (committed slots' logits (T-1, V_draft); with ``cut``, the logits of one drafted
    slot after the committed slots of ids[:cut + 2], fed the true token ids[cut + 2])."""
    from selfspec.core import cache as kv
    from selfspec.core.decode import prefill

    seq = ids if cut is None else ids[:cut + 2]
    out = prefill(backbone, kv.new_cache(), seq, capture=tuple(heads.config.aux_layers))
    head, T = heads.module, seq.shape[0]
    feature = head.fuse(torch.cat(out.captured, -1))[:, :T - 1]
    cache = kv.new_cache()

    def run(f, tokens, positions):
        states = head(f, backbone.embed(tokens), position_embeddings=backbone.rotary_emb(f, position_ids=positions[None]),
                      cache=cache)
        return states, head.logits(states)[0]

    states, committed = run(feature, seq[1:], torch.arange(T - 1))
    if cut is None:
        return committed, None
    _, drafted = run(states[:, -1:], ids[cut + 2:cut + 3], torch.tensor([T - 1]))
    return committed, drafted[0]


def to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    return draft_ids + d2t[draft_ids]


def compare(name: str, directory: Path, heads, backbone, sequences: list[tuple[torch.Tensor, tuple]]) -> bool:
    """``sequences``: (token ids, the target's hidden states over them) per prompt."""
    ours_vocab = heads.draft_vocab
    theirs_model = speculators_model(directory)
    worst = [0.0, 0.0]
    agree, total = [0, 0], [0, 0]
    for ids, hidden in sequences:
        theirs, d2t = speculators_draft(theirs_model, hidden, ids)
        committed, _ = selfspec_draft(heads, backbone, ids)
        worst[0] = max(worst[0], (theirs[0][0] - committed).abs().max().item())
        agree[0] += int((to_target(theirs[0][0].argmax(-1), d2t) == ours_vocab[committed.argmax(-1)]).sum())
        total[0] += committed.shape[0]
        T = ids.shape[0]
        for cut in sorted({int(x) for x in torch.linspace(0, T - 3, 6)}):
            _, drafted = selfspec_draft(heads, backbone, ids, cut)
            row = theirs[1][0, cut]
            worst[1] = max(worst[1], (row - drafted).abs().max().item())
            agree[1] += int(to_target(row.argmax(-1), d2t) == ours_vocab[drafted.argmax(-1)])
            total[1] += 1
    ok = all(w <= LOGIT_TOL for w in worst) and agree == total
    print(f"| {name} | {worst[0]:.1e} | {agree[0]}/{total[0]} | {worst[1]:.1e} | {agree[1]}/{total[1]} | "
          f"{'agrees' if ok else 'DISAGREES'} |")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default=str(ROOT / "checkpoints/smollm2-135m/eagle"), help="an eagle heads directory")
    ap.add_argument("--model", default="smollm2-135m", help="the target the heads were trained for")
    ap.add_argument("--prompts", type=int, default=4, help="how many prompts of training/prompts/dev.jsonl")
    ap.add_argument("--new-tokens", type=int, default=48, help="greedy answer tokens appended to each prompt")
    a = ap.parse_args()
    if a.prompts < 1 or a.new_tokens < 2:
        ap.exit(2, "check_speculators: --prompts must be at least 1 and --new-tokens at least 2\n")
    try:
        import speculators  # noqa: F401
        from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    except ImportError as e:
        ap.exit(2, f"check_speculators: speculators is not importable ({e}); see this script's docstring for how to "
                   "install it beside the environment\n")
    torch.set_grad_enabled(False)
    from selfspec.bench.harness import load_prompts
    from selfspec.core.backbone import Backbone, config_fingerprint
    from selfspec.export import export_heads
    from selfspec.heads import load_heads
    from selfspec.io import prompt_ids
    from selfspec.loading import load_model, resolve_source

    try:
        loaded = load_model(a.model, dtype=torch.float32)
        model = loaded.model.eval()
        heads = load_heads(a.heads, expect_kind="eagle", fingerprint=config_fingerprint(model.config), model=model,
                           dtype=torch.float32)
    except (ValueError, OSError) as e:
        ap.exit(2, f"check_speculators: {str(e).splitlines()[0]}\n")
    if heads.draft_vocab is None:
        heads.draft_vocab = torch.arange(model.config.vocab_size)
    backbone = Backbone(model)
    source, _ = resolve_source(a.model)
    sequences = []
    for p in load_prompts(ROOT / "training/prompts/dev.jsonl", limit=a.prompts):
        ids = torch.tensor(prompt_ids(loaded.tokenizer, p.text, chat=True))
        out = model.generate(ids[None], attention_mask=torch.ones(1, ids.shape[0], dtype=torch.long),
                             max_new_tokens=a.new_tokens, do_sample=False)
        sequences.append((out[0], model(out, output_hidden_states=True).hidden_states))
    print(f"speculators {version('speculators')}, heads {a.heads}, {len(sequences)} prompts of dev.jsonl with "
          f"{a.new_tokens} greedy answer tokens each\n")
    print("| export | step 1: largest logit difference | argmax agrees | step 2: largest logit difference "
          "| argmax agrees | |\n|---|---|---|---|---|---|")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        spec = export_heads(a.heads, "eagle3-speculators", Path(tmp) / "speculators", model=str(source))
        ok &= compare("eagle3-speculators, loaded as it is", spec, heads, backbone, sequences)
        sglang = export_heads(a.heads, "eagle3-sglang", Path(tmp) / "sglang", model=str(source))
        Eagle3Converter().convert(sglang, Path(tmp) / "converted", base_model=str(source), validate=False)
        ok &= compare("eagle3-sglang, through speculators' converter", Path(tmp) / "converted", heads, backbone, sequences)
        trained = speculators_trained(Path(tmp) / "trained", source, heads, model)
        imported = load_heads(trained, expect_kind="eagle", fingerprint="", model=model, dtype=torch.float32)
        ok &= compare("a draft speculators made (its training defaults), imported", trained, imported, backbone, sequences)
    return 0 if ok else 1


def speculators_trained(out: Path, source: Path, heads, model) -> Path:
    """A draft as speculators' trainer starts one for this target, with the layer variants it trains with by
    default (norm_before_residual, norm_before_fc, norm_output), its weights perturbed (seeded) so that every
    norm and projection counts, saved by speculators itself."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import AutoConfig

    vocab = heads.draft_vocab.cpu()
    t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    layer = AutoConfig.from_pretrained(source)
    layer.num_hidden_layers = 1          # its trainer sets the draft's depth on the verifier's config (one layer)
    draft = Eagle3DraftModel.from_training_args(
        layer, t2d=t2d, d2t=vocab - torch.arange(vocab.shape[0]),
        draft_vocab_size=vocab.shape[0], norm_before_residual=True, norm_before_fc=True, norm_output=True, ttt_steps=3,
        verifier_name_or_path=str(source), target_layer_ids=list(heads.config.aux_layers), draft_attn_impl="eager")
    g = torch.Generator().manual_seed(0)
    for name, p in draft.named_parameters():
        if not name.startswith(("embed_tokens", "verifier_", "lm_head")):
            p.data.add_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() == 1 else 0.02))
    draft.save_pretrained(out)
    return out


if __name__ == "__main__":
    sys.exit(main())
