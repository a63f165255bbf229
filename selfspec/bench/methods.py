"""The methods ``selfspec bench`` can compare, each a function (ids, max_new_tokens, generator) -> (tokens, stats)."""

from __future__ import annotations

import warnings

import torch

from ..backbone import config_fingerprint
from ..heads import load_heads
from ..model import SelfSpeculativeModel, untrained_heads
from ..settings import default_exit_layer
from .harness import ALIASES, ALL_METHODS, BASELINE, Method

PROMPT_LOOKUP_TOKENS = 10


def parse_methods(spec: str | None) -> list[str]:
    """"all" or a comma list -> method names, old names mapped to today's (once each), baseline first if not given."""
    names = list(ALL_METHODS) if not spec or spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in ALL_METHODS and n not in ALIASES]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(ALL_METHODS)}")
    names = list(dict.fromkeys(ALIASES.get(n, n) for n in names))
    if BASELINE not in names:
        names.insert(0, BASELINE)  # the baseline every speedup is divided by
    return names


def build_methods(
    names: list[str],
    *,
    model,
    tokenizer,
    model_name: str,
    temperature: float,
    medusa_heads=None,
    exit_heads=None,
    draft_model=None,
    medusa_tree="auto",
    exit_tree="auto",
    draft_tree="auto",
    medusa_threshold="auto",
    exit_threshold="auto",
    medusa_gate="auto",
    medusa_lookup="auto",
    eagle_heads=None,
    eagle_tree="auto",
    eagle_threshold="auto",
    eagle_lookup="auto",
) -> tuple[list[Method], dict]:
    """Returns (methods, notes): notes record which heads/draft each method used."""
    sampling = temperature > 0
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id if model.generation_config.pad_token_id is not None else eos
    if isinstance(pad, list):
        pad = pad[0]
    notes: dict = {}
    n_layers = model.config.num_hidden_layers

    def hf(**extra):
        def fn(ids, n, gen):
            if sampling:
                torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))  # transformers samples with the global RNG
            kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if sampling else dict(do_sample=False)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, pad_token_id=pad, **kw, **extra)
            return out[0, ids.shape[1]:].tolist(), None
        return fn

    def ours(sm: SelfSpeculativeModel):
        def fn(ids, n, gen):
            kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if sampling else dict(do_sample=False)
            out = sm.generate(ids, max_new_tokens=n, generator=gen, **kw)
            return out[0, ids.shape[1]:].tolist(), sm.last_stats
        return fn

    def heads_for(kind: str, path):
        if path is None:
            warnings.warn(f"no {kind} heads given: benchmarking untrained heads (exact, little speed-up)", stacklevel=3)
            notes[kind] = "untrained"
            return untrained_heads(kind, model, model_name)
        notes[kind] = str(path)
        p = model.get_output_embeddings().weight
        return load_heads(path, expect_kind=kind, fingerprint=config_fingerprint(model.config), device=p.device,
                          dtype=p.dtype, model=model)

    needs_draft = {"hf-assisted", "selfspec-draft-model"} & set(names)
    if needs_draft and draft_model is None:
        raise ValueError(f"{', '.join(sorted(needs_draft))} need a draft model: pass --draft-model PATH")
    if needs_draft:
        notes["draft_model"] = getattr(draft_model, "name_or_path", None) or "given"

    def spec(drafter, **kw):
        return SelfSpeculativeModel(model, tokenizer, drafter_name=drafter, name=model_name, **kw)

    loaded_heads = {}   # heads loaded once per kind, shared by a method and its "-heads" variant

    def shared_heads(kind: str, path):
        if kind not in loaded_heads:
            loaded_heads[kind] = heads_for(kind, path)
        return loaded_heads[kind]

    methods = []
    for name in names:
        if name == BASELINE:
            fn = hf()
        elif name == "hf-assisted":
            fn = hf(assistant_model=draft_model)
        elif name == "hf-early-exit":
            fn = hf(assistant_early_exit=default_exit_layer(n_layers))
        elif name == "hf-prompt-lookup":
            fn = hf(prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)
        elif name == "selfspec-ar":
            fn = ours(spec("none", heads=None, tree="auto"))
        elif name == "selfspec-lookup":
            sm = spec("lookup", heads=None, tree="auto")
            notes["lookup"] = sm.drafter.lookup
            fn = ours(sm)
        elif name in ("selfspec-medusa", "selfspec-medusa-heads", "selfspec-early-exit"):
            kind = name.removeprefix("selfspec-").removesuffix("-heads")
            medusa = kind == "medusa"
            sm = spec(kind, heads=shared_heads(kind, medusa_heads if medusa else exit_heads),
                      tree=medusa_tree if medusa else exit_tree,
                      threshold=medusa_threshold if medusa else exit_threshold,
                      gate=medusa_gate if medusa else "auto",
                      lookup=(0 if name.endswith("-heads") else medusa_lookup) if medusa else "auto")
            key = name.removeprefix("selfspec-").replace("-", "_")
            notes[f"{key}_tree"] = [list(p) for p in sm.drafter.tree.paths]
            notes[f"{key}_threshold"] = sm.drafter.threshold
            if medusa:
                notes[f"{key}_gate"] = sm.drafter.gate
                notes[f"{key}_lookup"] = sm.drafter.lookup
            fn = ours(sm)
        elif name in ("selfspec-eagle", "selfspec-eagle-heads"):
            sm = spec("eagle", heads=shared_heads("eagle", eagle_heads), tree=eagle_tree, threshold=eagle_threshold,
                      lookup=0 if name.endswith("-heads") else eagle_lookup)
            d = sm.drafter
            key = name.removeprefix("selfspec-").replace("-", "_")
            notes[f"{key}_tree"] = f"dynamic-{d.depth}-{d.expand}-{d.nodes}"
            notes[f"{key}_threshold"], notes[f"{key}_lookup"] = d.threshold, d.lookup
            fn = ours(sm)
        else:
            fn = ours(spec("draft-model", heads=None, tree=draft_tree, draft_model=draft_model))
        methods.append(Method(name=name, fn=fn))
    return methods, notes
