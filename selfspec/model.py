"""SelfSpeculativeModel: the public API.

    from selfspec import SelfSpeculativeModel
    sm = SelfSpeculativeModel.from_pretrained("smollm2-135m", drafter="medusa",
                                              heads="checkpoints/smollm2-135m/medusa")
    ids = sm.generate(input_ids, max_new_tokens=128)   # same tokens as model.generate(...)
    print(sm.last_stats.tau)
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .core.backbone import Backbone, config_fingerprint
from .core.decode import DecodeStats, decode_rows
from .core.sampling import SamplingParams
from .core.stopping import StopStrings
from .core.tree import build_tree, parse_dynamic_tree, parse_tree
from .corpus import Corpus, load_corpus, read_corpus_config
from .drafters import (
    DraftModelDrafter,
    EagleDrafter,
    EarlyExitDrafter,
    LookupDrafter,
    MedusaDrafter,
    NoDrafter,
    check_drafter_name,
)
from .heads import (
    Heads,
    HeadsConfig,
    build_heads,
    head_widths,
    heads_in_dtype,
    load_heads,
    read_heads_config,
    save_heads,
)
from .loading import check_model_name, load_model, resolve_device, resolve_dtype
from .models.eagle import default_aux_layers, init_from_target
from .runtime.backoff import Backoff
from .runtime.step import StaticStep
from .runtime.width import Calibrated, Calibration, VerifyCost, verify_cost
from .settings import (
    AUTO,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_NUM_HEADS,
    DEFAULT_TOKEN_INPUT,
    DRAFTER_SETTINGS,
    DrafterSettings,
    check_settings,
    default_exit_layer,
    resolve_settings,
)
from .shipped import (
    HEADS_DRAFTERS,
    LOOKUP_DRAFTERS,
    default_drafter,
    shipped_corpus,
    shipped_draft,
    shipped_heads,
)
from .tuned_pairs import pair_decode

log = logging.getLogger(__name__)

# generate() kwargs transformers users commonly pass that have no effect here.
_IGNORED_KWARGS = {"pad_token_id", "use_cache", "bos_token_id"}
# Generation-config settings that would change transformers' output and that selfspec does not apply, each with
# the value that leaves the output alone (None, or an empty list, is off too). A model whose generation_config.json
# sets one is refused, not decoded differently; the second set acts only when sampling.
_UNAPPLIED = {"no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None,
              "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
              "forced_eos_token_id": None, "exponential_decay_length_penalty": None, "sequence_bias": None,
              "guidance_scale": 1.0, "diversity_penalty": 0.0, "penalty_alpha": None, "num_beam_groups": 1,
              "dola_layers": None, "force_words_ids": None, "constraints": None, "encoder_repetition_penalty": 1.0,
              "watermarking_config": None, "renormalize_logits": False}
_UNAPPLIED_SAMPLING = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None}


def _prompt_rows(input_ids, attention_mask) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """generate()'s input -> (each row's unpadded prompt, the (B, T) ids the output starts with;
    None for a list of prompts, which the caller left-pads)."""
    if isinstance(input_ids, Mapping):   # what a tokenizer returns (transformers 5's apply_chat_template too)
        if "input_ids" not in input_ids:
            raise ValueError("generate() got a mapping without 'input_ids': pass a tokenizer's output or the ids themselves")
        if attention_mask is None:
            attention_mask = input_ids.get("attention_mask")
        input_ids = input_ids["input_ids"]
    if input_ids is None:
        raise ValueError("generate() needs input_ids (tokenize your prompt first)")
    if isinstance(input_ids, (list, tuple)) and input_ids and not isinstance(input_ids[0], int):
        if attention_mask is not None:
            raise ValueError("a list of prompts carries no padding: drop attention_mask, or pass one padded tensor")
        rows = [torch.as_tensor(r, dtype=torch.long).reshape(-1) for r in input_ids]
        if any(r.numel() == 0 for r in rows):
            raise ValueError("one of the prompts is empty: give each at least one token")
        return rows, None
    input_ids = torch.as_tensor(input_ids)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (T,) or (batch, T); got shape {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: give at least one prompt token")
    if attention_mask is None:
        return list(input_ids), input_ids
    mask = torch.as_tensor(attention_mask).to(input_ids.device).bool()
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but input_ids {tuple(input_ids.shape)}: they must match")
    rows = []
    for b in range(input_ids.shape[0]):
        keep = mask[b].nonzero()[:, 0]
        if keep.numel() == 0:
            raise ValueError(f"row {b} of attention_mask is all padding: every prompt needs at least one token")
        if int(keep[-1] - keep[0]) + 1 != keep.numel():
            raise ValueError(f"row {b} of attention_mask has padding inside the prompt: pad on the left (or right) only")
        rows.append(input_ids[b, keep])
    return rows, input_ids


@dataclass
class GenerateOutput:
    sequences: torch.Tensor   # (B, prompt + new)
    stats: DecodeStats


def untrained_heads(kind: str, model, name: str, *, num_heads: int = DEFAULT_NUM_HEADS,
                    exit_layer: int | None = None, adapter: str = "mlp", intermediate_size: int = 0,
                    token_input: bool = DEFAULT_TOKEN_INPUT, head_mlp=(), aux_layers=None, draft_vocab: torch.Tensor | None = None) -> Heads:
    """Initial heads: Medusa heads repeat the target's next token; an untrained exit adapter is plain early exit.

    token_input: Medusa heads that also read the root token's embedding (see heads.py).
    head_mlp: Medusa: width of each head's extra residual MLP (0 = none; heads past the list get none).
    adapter: "mlp" (residual MLP, width ``intermediate_size`` or the hidden size) or "layer" (a copy of
    decoder layer E with its residual writes zeroed).
    aux_layers / draft_vocab: eagle: the target layers whose hidden states feed the head (default low/mid/high)
    and the token ids its LM head scores (None: all); it starts from the target's LM head and norm.
    """
    cfg = model.config
    n_layers = cfg.num_hidden_layers
    exit_layer = (exit_layer if exit_layer is not None else default_exit_layer(n_layers)) if kind == "early-exit" else None
    if exit_layer is not None and not 0 < exit_layer < n_layers:
        raise ValueError(f"exit layer {exit_layer} is out of range: this model has {n_layers} layers, so it takes 1 to {n_layers - 1}")
    config = HeadsConfig(
        kind=kind, base_model=name, base_fingerprint=config_fingerprint(cfg), hidden_size=cfg.hidden_size,
        vocab_size=model.get_output_embeddings().weight.shape[0],
        num_heads=num_heads if kind == "medusa" else 0,
        token_input=token_input and kind == "medusa",
        head_mlp=head_widths(head_mlp, num_heads) if kind == "medusa" and any(head_mlp) else [],
        exit_layer=exit_layer,
        adapter=adapter if kind == "early-exit" else "mlp",
        intermediate_size=(intermediate_size or cfg.hidden_size) if kind == "early-exit" and adapter == "mlp" else 0,
    )
    if kind == "eagle":
        config.aux_layers = list(aux_layers) if aux_layers is not None else default_aux_layers(n_layers)
        if not config.aux_layers or not all(0 < a <= n_layers for a in config.aux_layers):
            raise ValueError(f"eagle aux layers {config.aux_layers} must lie between 1 and {n_layers}")
        config.attn_heads, config.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        config.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        config.intermediate_size, config.rms_eps = cfg.intermediate_size, float(cfg.rms_norm_eps)
        config.draft_vocab_size = 0 if draft_vocab is None else int(draft_vocab.numel())
    p = model.get_output_embeddings().weight
    module = build_heads(config, model=model)
    if kind == "eagle":
        init_from_target(module, Backbone(model), draft_vocab)
    return Heads(config=config, module=module.to(device=p.device, dtype=p.dtype).eval(),
                 draft_vocab=None if draft_vocab is None else draft_vocab.to(p.device))


class SelfSpeculativeModel:
    def __init__(self, model, tokenizer, *, drafter_name: str, heads: Heads | None, name: str, tree="auto",
                 draft_model=None, exit_layer: int | None = None, threshold="auto", gate="auto", lookup="auto",
                 corpus: Corpus | None = None, compile: "bool | StaticStep" = False, fit_width: bool = True):
        if corpus is not None and drafter_name not in LOOKUP_DRAFTERS:
            raise ValueError(f"a corpus feeds the lookup of the {', '.join(LOOKUP_DRAFTERS)} drafters, not {drafter_name!r}")
        self.model = model
        self.corpus = corpus   # the target's own answers, looked up where the context has no match (corpus.py)
        self.tokenizer = tokenizer
        self.name = name
        self.backbone = Backbone(model)
        self.drafter_name = check_drafter_name(drafter_name)
        self.heads = heads
        self._drafting_heads: dict[int, Heads] = {}   # id(heads) -> the EAGLE head in its drafting dtype
        # compile=True: every verification at static shapes on a static cache, through torch.compile (step.py);
        # a StaticStep given here is shared (models on one target then share its compiled graphs).
        self.step = compile if isinstance(compile, StaticStep) else (StaticStep(self.backbone) if compile else None)
        self.last_stats: DecodeStats | None = None
        # Greedy, eager: each step's trees cut to the width the (batched) pass is worth (runtime/width.py).
        if not isinstance(fit_width, bool):
            raise ValueError(f"fit_width must be True or False (got {fit_width!r})")
        self.fit_width = fit_width
        self._timed_batches: set[int] = set()   # batch sizes whose step costs are timed (time_costs)
        self._stops: dict[tuple, tuple] = {}   # (id(tokenizer), strings) -> (tokenizer, its stop rule): _stop_strings
        self._step_costs: dict[tuple, VerifyCost] = {}   # width fitting's prices for the static step, per capture
        self._calibrations: dict[tuple, Calibration] = {}   # (drafter, sampled) -> its chances as accepted
        self._backoffs: dict[tuple, Backoff] = {}         # (id(drafter), rows) -> its back-off (runtime/backoff.py)
        decode = heads.config.decode if heads is not None else None
        if drafter_name == "draft-model" and draft_model is not None and (tree in AUTO or threshold in AUTO):
            decode = pair_decode(model, draft_model)   # what `tune-tree --draft-model` measured fastest, if it ran
        # "auto" reads the settings tune-tree measured on this kind of device where it ran on one (a GPU's
        # differ from a CPU's), else the CPU's (``DecodeSettings.for_device``).
        given = dict(tree=tree, threshold=threshold, gate=gate, lookup=lookup, device=self.backbone.device.type)
        self.settings = resolve_settings(drafter_name, decode, **given)   # what this drafter runs with (DrafterSettings)
        # Sampling reads the settings tune-tree timed sampling with, where it did (``DecodeSettings.sampled``).
        self.sampled_settings = resolve_settings(drafter_name, decode, **given, sampling=True)
        self.drafter = self._make_drafter(drafter_name, heads, self.settings, draft_model=draft_model,
                                          exit_layer=exit_layer)
        self.sampled_drafter = self.drafter if self.sampled_settings == self.settings \
            else self._make_drafter(drafter_name, heads, self.sampled_settings, draft_model=draft_model,
                                    exit_layer=exit_layer)

    def _make_drafter(self, name: str, heads: Heads | None, st: DrafterSettings, *, draft_model,
                      exit_layer: int | None):
        """A drafter of kind ``name`` over ``heads`` with settings ``st`` (an EAGLE head in its drafting dtype,
        converted once for the drafters that share it)."""
        corpus, device = self.corpus, str(self.backbone.device)
        if name == "eagle":
            key = id(heads)
            if key not in self._drafting_heads:
                self._drafting_heads[key] = heads_in_dtype(heads, self.backbone.dtype)
            heads = self._drafting_heads[key]
        if name == "none":
            return NoDrafter(self.backbone.device)
        if name == "lookup":
            return LookupDrafter(self.backbone.device, lookup=st.lookup, vocab_size=self.backbone.vocab_size, corpus=corpus)
        if name == "medusa":
            paths = parse_tree(st.tree, default=())
            if st.tree is DRAFTER_SETTINGS["medusa"].tree:   # the default tree, cut to the depth these heads fill
                paths = tuple(p for p in paths if len(p) <= heads.config.num_heads)
            return MedusaDrafter(self.backbone, heads, build_tree(paths, device), threshold=st.threshold,
                                 gate=st.gate, lookup=st.lookup, corpus=corpus)
        if name == "early-exit":
            if exit_layer is not None and exit_layer != heads.config.exit_layer:
                raise ValueError(f"exit_layer={exit_layer} but the heads were trained at layer {heads.config.exit_layer}")
            return EarlyExitDrafter(self.backbone, heads, build_tree(parse_tree(st.tree, default=()), device),
                                    threshold=st.threshold)
        if name == "eagle":
            return EagleDrafter(self.backbone, heads, **parse_dynamic_tree(st.tree), threshold=st.threshold,
                                lookup=st.lookup, corpus=corpus)
        return DraftModelDrafter(draft_model, build_tree(parse_tree(st.tree, default=()), device),
                                 vocab_size=self.backbone.vocab_size, threshold=st.threshold)

    def drafter_for(self, sampling: bool):
        """The drafter a greedy (``sampling`` False) or sampled ``generate`` decodes with."""
        return self.sampled_drafter if sampling else self.drafter

    def drafters(self) -> list:
        """This model's drafters: the greedy one, and the sampled one where its settings differ."""
        return [self.drafter] + ([] if self.sampled_drafter is self.drafter else [self.sampled_drafter])

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, name_or_path, drafter: str = "auto", heads=None, exit_layer: int | None = None,
                        draft_model=None, tree="auto", dtype=None, device=None, *, num_heads: int = DEFAULT_NUM_HEADS,
                        threshold="auto", gate="auto", lookup="auto", corpus="auto", compile: bool = False,
                        fit_width: bool = True):
        """Load a target model and attach a drafter.

        drafter: "auto" is the shipped drafter ``checkpoints/<model>/default.json`` names for the demo model,
        else the context lookup.
        heads: a heads directory (from ``selfspec train-heads``) for ``medusa`` / ``early-exit`` / ``eagle``; None
        takes the shipped heads of the demo model, and for any other model gives untrained heads (output still
        exact, acceptance low) with a warning. draft_model: a model name/path
        (anything ``load_model`` takes) or a loaded causal LM, for ``draft-model``. tree: "auto", "chain-K",
        "chain-K-wW" or a list of paths (see selfspec.core.tree). threshold: medusa / early-exit / eagle / draft-model; each step
        drops the tree's nodes whose draft path probability is below it (0 keeps the whole tree; "auto" is
        the value ``selfspec tune-tree`` measured fastest for these heads, or for this target and draft model
        with ``tune-tree --draft-model``; 0 when never tuned). gate: medusa only; a step
        whose tree the heads expect fewer than this many tokens accepted from proposes nothing (a plain step;
        "auto" as for threshold). lookup: medusa; each greedy step also proposes up to this many tokens
        copied from where the context's last few tokens occurred before (0 = off; "auto" as for threshold).
        drafter="lookup" drafts only such copies (no heads; "auto" = 8). corpus: where the context has no
        match, the lookup (lookup, medusa and eagle drafters) proposes what followed the same tokens in the
        target's own earlier answers: a directory from ``selfspec build-corpus`` (or a loaded ``Corpus``);
        "auto" takes the one shipped for the demo model (none for other models), None turns it off. compile: run each verification at
        static shapes on a preallocated cache through ``torch.compile`` (CUDA graphs on GPU; on CPU a tree of several
        nodes reads the weights frozen into the compiled code, packed once: a copy of them per tree size, and
        weights changed in place later are not seen); the first calls pay the compilation (minutes on CPU), so it
        pays over long or many generations. fit_width: the
        runtime adapts to this machine's measured costs: each step (greedy or sampled) verifies every row's tree
        cut to the width the pass is worth (the most expected tokens per second, from the draft's probabilities
        and the pass's cost here, timed on first use in about a second, then learned from the steps), and
        drafting backs off to plain steps where it does not beat them (``runtime/backoff.py``); False drafts and
        verifies whole trees on every step, whatever they cost. Output is unchanged either way.
        """
        # Everything that can be checked without the model is checked first: a mistake costs no load.
        check_model_name(name_or_path)
        if drafter == "auto":
            drafter = default_drafter(name_or_path)
        check_settings(drafter, tree=tree, threshold=threshold, gate=gate, lookup=lookup)
        if drafter not in HEADS_DRAFTERS + ("draft-model",) and (heads is not None or draft_model is not None):
            raise ValueError(f"drafter={drafter!r} takes neither heads nor draft_model")
        if heads is None and drafter in HEADS_DRAFTERS:
            heads = shipped_heads(name_or_path, drafter)
        elif heads is not None:
            read_heads_config(heads, expect_kind=drafter)
        if draft_model is None and drafter == "draft-model":
            draft_model = shipped_draft(name_or_path)
            if draft_model is None:
                raise ValueError("drafter='draft-model' needs draft_model= (a model directory, .gguf, or hub id)")
        if isinstance(draft_model, (str, os.PathLike)):
            check_model_name(draft_model)
        corpus = cls._corpus_dir(corpus, drafter, name_or_path)
        dtype, device = resolve_dtype(dtype), resolve_device(device)
        loaded = load_model(name_or_path, dtype=dtype, device=device)
        model = loaded.model
        head_obj, draft = None, None
        if drafter in ("medusa", "early-exit", "eagle"):
            fp = config_fingerprint(model.config)
            p = model.get_output_embeddings().weight
            if heads is None:
                warnings.warn(f"no heads given for drafter {drafter!r}: using untrained heads (exact output, little "
                              "speed-up); train some with `selfspec train-heads`", stacklevel=2)
                head_obj = untrained_heads(drafter, model, loaded.name, num_heads=num_heads, exit_layer=exit_layer)
            else:
                head_obj = load_heads(heads, expect_kind=drafter, fingerprint=fp, device=p.device, dtype=p.dtype,
                                      model=model)
                if head_obj.config.lora:
                    cls._apply_lora(model, Path(heads), head_obj.config)
        elif drafter == "draft-model":
            if draft_model is None:
                raise ValueError("drafter='draft-model' needs draft_model= (a model directory, .gguf, or hub id)")
            if isinstance(draft_model, (str, os.PathLike)):
                draft = load_model(str(draft_model), dtype=dtype, device=device).model
            else:
                draft = draft_model
        elif heads is not None or draft_model is not None:
            raise ValueError(f"drafter={drafter!r} takes neither heads nor draft_model")
        fp = config_fingerprint(model.config)
        if isinstance(corpus, Corpus) and corpus.config.base_fingerprint != fp:
            raise ValueError(f"the corpus holds answers of {corpus.config.base_model!r}, not of this model: "
                             "build one with `selfspec build-corpus --model MODEL --data DIR`")
        corpus_obj = corpus if corpus is None or isinstance(corpus, Corpus) else load_corpus(corpus, fingerprint=fp)
        return cls(model, loaded.tokenizer, drafter_name=drafter, heads=head_obj, tree=tree, name=loaded.name,
                   draft_model=draft, exit_layer=exit_layer, threshold=threshold, gate=gate, lookup=lookup,
                   corpus=corpus_obj, compile=compile, fit_width=fit_width)

    @staticmethod
    def _corpus_dir(corpus, drafter: str, name_or_path) -> "Path | Corpus | None":
        """from_pretrained's ``corpus`` -> the directory to load (checked before any model loads), a
        ``Corpus`` given loaded, or None."""
        if corpus == "auto":
            return shipped_corpus(name_or_path) if drafter in LOOKUP_DRAFTERS else None
        if corpus is None or corpus == "none":
            return None
        if drafter not in LOOKUP_DRAFTERS:
            raise ValueError(f"corpus= feeds the lookup of the {', '.join(LOOKUP_DRAFTERS)} drafters, not {drafter!r}")
        if isinstance(corpus, Corpus):
            return corpus
        read_corpus_config(corpus)
        return Path(corpus)

    @staticmethod
    def _apply_lora(model, heads_dir: Path, config: HeadsConfig) -> None:
        """Medusa-2 checkpoints fine-tune the backbone too: merge their LoRA adapter (output changes)."""
        from peft import PeftModel

        adapter = heads_dir / "lora"
        if not adapter.is_dir():
            raise ValueError(f"{heads_dir} says it was trained with LoRA but has no lora/ adapter directory")
        # merge_and_unload folds the adapters into the base weights of ``model`` itself.
        PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
        warnings.warn(f"{heads_dir} fine-tuned the backbone with LoRA (Medusa-2): generations follow the fine-tuned "
                      "model, not the original one", stacklevel=3)

    def save_pretrained(self, directory) -> None:
        """Save the drafter's heads as a heads directory (config.json + model.safetensors)."""
        if self.heads is None:
            raise ValueError(f"drafter {self.drafter_name!r} has no heads to save")
        save_heads(self.heads, directory)

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, input_ids=None, attention_mask=None, *, max_new_tokens=None, do_sample=None,
                 temperature=None, top_k=None, top_p=None, min_p=None, repetition_penalty=None, eos_token_id=None,
                 min_new_tokens=None, min_length=None, stop_strings=None, tokenizer=None,
                 num_return_sequences=None, num_beams=None, streamer=None, generation_config=None,
                 generator: torch.Generator | None = None,
                 return_dict_in_generate: bool = False, **kwargs):
        """Like transformers' ``generate``; returns (B, prompt + new) ids.

        input_ids: (T,) or (B, T), with ``attention_mask`` marking padding (left padding, as a
        tokenizer with ``padding_side="left"`` gives it; right padding works too), or a list of
        prompts of different lengths (lists or 1-D tensors; they come back left-padded with
        ``pad_token_id``), or a tokenizer's output whole (a mapping with ``input_ids`` and
        ``attention_mask``, as transformers 5's ``apply_chat_template`` returns). Rows that finish early are padded on the right with ``pad_token_id``, as
        transformers pads them. Every row's tokens are exactly the plain model's for that prompt
        alone (greedy), or follow its distribution (sampling). Pass ``generator=`` for reproducible
        sampling. It applies, as transformers does, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``min_p``, ``repetition_penalty``, ``eos_token_id``, ``min_new_tokens``, ``min_length``,
        ``num_return_sequences`` (sampling) and ``stop_strings``, each read from the generation config where
        not given; what would change transformers' output and is not applied is refused. ``stop_strings``
        (a string or a list) ends a row at the first token that completes one, kept, as transformers'
        ``generate(stop_strings=..., tokenizer=...)`` does; the tokenizer defaults to this model's. Stats,
        summed over rows, go to ``last_stats``.
        """
        unknown = set(kwargs) - _IGNORED_KWARGS
        if unknown:
            raise ValueError(f"generate() does not support {', '.join(sorted(unknown))}: drop it (help("
                             "SelfSpeculativeModel.generate) lists what it applies)")
        prompts, input_ids = _prompt_rows(input_ids, attention_mask)
        gc = generation_config if generation_config is not None else self.model.generation_config
        pick = lambda given, attr, default: given if given is not None else (getattr(gc, attr, None) if getattr(gc, attr, None) is not None else default)  # noqa: E731
        max_new = pick(max_new_tokens, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if int(max_new) < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (got {max_new})")
        sampling = bool(pick(do_sample, "do_sample", False))
        unapplied = {**_UNAPPLIED, **(_UNAPPLIED_SAMPLING if sampling else {})}
        active = {k: getattr(gc, k) for k, off in unapplied.items() if getattr(gc, k, None) not in (None, off, [], ())}
        if active:
            raise ValueError(f"the generation config sets {', '.join(f'{k}={v!r}' for k, v in active.items())}, which "
                             "selfspec does not apply: pass a generation_config= without it to decode exactly")
        if int(pick(num_beams, "num_beams", 1)) != 1:
            raise ValueError(f"num_beams={pick(num_beams, 'num_beams', 1)}: beam search is not supported (selfspec "
                             "decodes greedily or samples); set num_beams=1")
        copies = int(pick(num_return_sequences, "num_return_sequences", 1))
        if copies < 1:
            raise ValueError(f"num_return_sequences must be >= 1 (got {copies})")
        if copies > 1 and not sampling:
            raise ValueError(f"num_return_sequences={copies}: greedy decoding returns one sequence a prompt (as "
                             "transformers' does); sample (do_sample=True) for more, or set it to 1")
        if copies > 1:   # each prompt's samples side by side, as transformers orders them
            prompts = [p for p in prompts for _ in range(copies)]
            input_ids = None if input_ids is None else input_ids.repeat_interleave(copies, dim=0)
        if streamer is not None and len(prompts) > 1:
            raise ValueError(f"a streamer takes one sequence; got a batch of {len(prompts)} (drop streamer= or pass "
                             "one prompt, with num_return_sequences=1)")
        params = SamplingParams(
            do_sample=sampling,
            temperature=float(pick(temperature, "temperature", 1.0)),
            top_k=int(pick(top_k, "top_k", 0)) if sampling else 0,
            top_p=float(pick(top_p, "top_p", 1.0)) if sampling else 1.0,
            min_p=float(pick(min_p, "min_p", 0.0)) if sampling else 0.0,
            repetition_penalty=float(pick(repetition_penalty, "repetition_penalty", 1.0)),
        )
        eos = pick(eos_token_id, "eos_token_id", None)
        eos_ids = set() if eos is None else ({int(eos)} if isinstance(eos, int) else {int(e) for e in eos})
        stop = self._stop_strings(tokenizer if tokenizer is not None else self.tokenizer,
                                  pick(stop_strings, "stop_strings", None))

        window = self.backbone.sliding_window
        longest = max(int(p.shape[0]) for p in prompts)
        if window is not None and longest + max_new > window:
            raise ValueError(f"prompt + max_new_tokens ({longest + max_new}) exceeds the model's sliding "
                             f"window ({window}), which selfspec's tree masks do not implement")
        pad = kwargs.get("pad_token_id", getattr(gc, "pad_token_id", None))
        pad = int(pad) if pad is not None else (min(eos_ids) if eos_ids else 0)
        if input_ids is None:   # a list of prompts: left-padded, as a tokenizer would
            T = max(int(p.shape[0]) for p in prompts)
            input_ids = torch.stack([torch.cat([p.new_full((T - p.shape[0],), pad), p]) for p in prompts])

        dev = self.backbone.device
        if streamer is not None:
            streamer.put(input_ids.cpu())
        on_tokens = (lambda _row, toks: streamer.put(torch.tensor(toks))) if streamer is not None else None
        if self.step is not None:   # the static cache's size now, so that the cost prior times the shapes decoding runs
            self.step.reserve(longest + int(max_new))
        drafter = self.drafter_for(sampling)
        cost = self._cost(len(prompts), drafter)
        pace = self._pace(len(prompts), drafter)
        if cost is not None and len(prompts) not in self._timed_batches:
            # Time the pass's cost prior now, not inside the steps whose times the fitting learns from.
            self.time_costs(len(prompts))
        if cost is not None:   # the shared prices, with what this drafter's drafts were accepted with in this mode
            cost = Calibrated(cost, self._calibrations.setdefault((id(drafter), sampling), Calibration()))
        new, stats = decode_rows(self.backbone, drafter, [p.to(dev) for p in prompts], params=params,
                                 max_new_tokens=int(max_new), eos_token_ids=eos_ids, generator=generator,
                                 on_tokens=on_tokens, step=self.step, cost=cost, pace=pace, stop=stop,
                                 min_new_tokens=int(pick(min_new_tokens, "min_new_tokens", 0)),
                                 min_length=int(pick(min_length, "min_length", 0)))
        if streamer is not None:
            streamer.end()
        self.last_stats = stats
        width = max(len(x) for x in new)
        tail = torch.tensor([x + [pad] * (width - len(x)) for x in new], device=dev, dtype=input_ids.dtype)
        sequences = torch.cat([input_ids.to(dev), tail], dim=1)
        return GenerateOutput(sequences=sequences, stats=stats) if return_dict_in_generate else sequences

    def _stop_strings(self, tokenizer, strings) -> StopStrings | None:
        """The stop rule for ``strings`` (None where none are given), built once per tokenizer and strings:
        building one reads the whole vocabulary."""
        if not strings:
            return None
        key = (id(tokenizer), (strings,) if isinstance(strings, str) else tuple(strings))
        if key not in self._stops:   # the tokenizer kept beside its rule, so that its id is never reused
            self._stops[key] = (tokenizer, StopStrings(tokenizer, strings))
        return self._stops[key][1]

    def time_costs(self, batch: int = 1) -> None:
        """Time now the verification pass's cost at every row count up to ``batch`` (width fitting's prior,
        runtime/width.py), so that no later call pays for it; decoding otherwise times it on first use."""
        if batch < 1:
            raise ValueError(f"batch={batch}: costs are timed for batches of at least one row")
        self._timed_batches.update(range(1, batch + 1) if self.step is None else (batch,))
        costs = {id(c): c for c in (self._cost(batch, d) for d in self.drafters()) if c is not None}
        for cost in costs.values():   # a static step always runs all ``batch`` rows
            for rows in (batch,) if self.step is not None else range(1, batch + 1):
                cost.table(rows, self.max_nodes)

    def _pace(self, rows: int, drafter) -> Backoff | None:
        """What turns ``drafter``'s drafting off where it does not pay on this machine, for batches of ``rows``
        (kept across calls: the machine is the same); None with ``fit_width=False`` or nothing to draft."""
        if not self.fit_width or drafter.max_nodes < 2:
            return None
        return self._backoffs.setdefault((id(drafter), rows), Backoff(self.backbone.device))

    def _cost(self, rows: int, drafter) -> VerifyCost | None:
        """What prices ``drafter``'s verification passes of a batch for width fitting; None where it does not apply."""
        if not self.fit_width or rows < 1 or self.max_nodes < 2:
            return None
        if self.step is not None:   # priced by bucket, through the step's own (compiled) passes with its capture
            capture = tuple(drafter.capture_layers)
            if capture not in self._step_costs:
                self._step_costs[capture] = VerifyCost(self.backbone, step=self.step, capture=capture)
            return self._step_costs[capture]
        return verify_cost(self.backbone)

    @property
    def max_nodes(self) -> int:
        """The most tree nodes a step of either drafter verifies per row."""
        return max(d.max_nodes for d in self.drafters())

    def __repr__(self) -> str:
        return f"SelfSpeculativeModel({self.name!r}, drafter={self.drafter_name!r})"
