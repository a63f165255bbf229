"""The methods ``selfspec bench`` can compare, each a function (ids, max_new_tokens, generator) -> (tokens, stats)."""

from __future__ import annotations

import copy
import warnings
from dataclasses import asdict

import torch
import transformers
from packaging.version import Version

from ..core.backbone import Backbone, config_fingerprint
from ..corpus import Corpus, is_corpus_dir, load_corpus, read_corpus_config
from ..heads import load_heads
from ..model import SelfSpeculativeModel, untrained_heads
from ..runtime.step import StaticStep
from ..settings import default_exit_layer
from ..shipped import HEADS_DRAFTERS, LOOKUP_DRAFTERS, default_drafter
from .engines import QUANTIZED, engine_method
from .harness import ALIASES, ALL_METHODS, AUTO_METHOD, BASELINE, DRAFT_METHODS, ENGINE_METHOD_NAMES, Method

# The name generate() takes a cache under: transformers 5.24 renamed past_key_values to cache (the old
# name warns, and goes in 6.0); earlier 5.x releases know only past_key_values.
CACHE_KWARG = "cache" if Version(transformers.__version__).release[:2] >= (5, 24) else "past_key_values"

PROMPT_LOOKUP_TOKENS = 10


def left_padded(batch: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts (1, n_b) -> (B, T) ids left-padded with ``pad`` and their attention mask, as a tokenizer
    with padding_side="left" gives them (one prompt: itself, no padding)."""
    T = max(x.shape[1] for x in batch)
    ids = torch.cat([torch.cat([x.new_full((1, T - x.shape[1]), pad), x], dim=1) for x in batch])
    mask = torch.cat([torch.cat([torch.zeros_like(x[:, :1]).expand(1, T - x.shape[1]), torch.ones_like(x)], dim=1)
                      for x in batch])
    return ids, mask


def split_variant(name: str) -> tuple[str, str | None]:
    """"selfspec-medusa@DIR" -> ("selfspec-medusa", "DIR"): the method run with the heads or the corpus in
    DIR instead of its own (so two trainings, or two corpora, compare in one run); a plain name -> (name, None)."""
    base, sep, path = name.partition("@")
    return base, (path if sep else None)


def parse_methods(spec: str | None) -> list[str]:
    """"all" or a comma list -> method names, old names mapped to today's (once each), baseline first if not given.

    A selfspec method with heads may name other heads after an "@" (``selfspec-medusa@DIR``); one whose
    lookup reads a corpus may name another corpus there (``selfspec-lookup@CORPUS_DIR``)."""
    names = list(ALL_METHODS) if spec is None or spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ValueError(f"--methods {spec!r} names no method: give a comma list such as hf-generate,selfspec-medusa, or all")
    known = (*ALL_METHODS, AUTO_METHOD, *ENGINE_METHOD_NAMES)
    unknown = [n for n in names if split_variant(n)[0] not in known and n not in ALIASES]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(known)}")
    with_heads = [m for m, v in SELFSPEC_METHODS.items() if v[0] in HEADS_DRAFTERS]
    with_corpus = [m for m, v in SELFSPEC_METHODS.items() if reads_corpus(v[0], v[2])]
    for n in names:
        base, path = split_variant(n)
        if path is None:
            continue
        if base == AUTO_METHOD:
            raise ValueError(f"{n}: {AUTO_METHOD} takes no @DIR; name a drafter's own method to run other heads "
                             f"(e.g. selfspec-eagle@{path})")
        if not path:
            raise ValueError(f"{n}: name a heads or corpus directory after the @ (e.g. {base}@out/heads)")
        if is_corpus_dir(path):
            if base not in with_corpus:
                raise ValueError(f"{n}: {path} is a corpus, and only a method whose lookup reads one takes a "
                                 f"corpus after the @ ({', '.join(with_corpus)})")
        elif base in with_corpus and base not in with_heads:
            try:
                read_corpus_config(path)          # says what is wrong with it
            except ValueError as e:
                raise ValueError(f"{n}: {e}") from None
        elif base not in with_heads:
            raise ValueError(f"{n}: only a selfspec method with trained heads takes @HEADS_DIR "
                             f"({', '.join(with_heads)}), and one whose lookup reads a corpus @CORPUS_DIR "
                             f"({', '.join(with_corpus)})")
    names = list(dict.fromkeys(ALIASES.get(n, n) for n in names))
    if BASELINE not in names:
        names.insert(0, BASELINE)  # the baseline every speedup is divided by
    return names


# selfspec's methods: name -> (drafter, the bench flag prefix for its heads and settings, settings the method
# pins). The flags themselves (--medusa-heads, --medusa-tree, --exit-threshold, ...) are derived from this
# table and the drafters' declared settings (settings.DRAFTER_SETTINGS). "-heads": the same heads with
# the lookup off (what the heads draft on their own; "auto" settings are then those tune-tree picked
# without the lookup, where it recorded them); "-context": the lookup reads the context
# only, never the --corpus (what the corpus adds); "-whole": every step verifies each row's whole tree
# (width fitting and back-off off: what the runtime adds).
SELFSPEC_METHODS = {
    "selfspec-ar": ("none", None, {}),
    "selfspec-lookup": ("lookup", None, {}),
    "selfspec-lookup-context": ("lookup", None, {"corpus": "none"}),
    "selfspec-lookup-whole": ("lookup", None, {"fit_width": False}),
    "selfspec-early-exit": ("early-exit", "exit", {}),
    "selfspec-medusa": ("medusa", "medusa", {}),
    "selfspec-medusa-heads": ("medusa", "medusa", {"lookup": 0}),
    "selfspec-medusa-context": ("medusa", "medusa", {"corpus": "none"}),
    "selfspec-medusa-whole": ("medusa", "medusa", {"fit_width": False}),
    "selfspec-eagle": ("eagle", "eagle", {}),
    "selfspec-eagle-heads": ("eagle", "eagle", {"lookup": 0}),
    "selfspec-eagle-context": ("eagle", "eagle", {"corpus": "none"}),
    "selfspec-eagle-whole": ("eagle", "eagle", {"fit_width": False}),
    "selfspec-draft-model": ("draft-model", "draft", {}),
}


def resolve_auto(names: list[str], *, model: str, temperature: float) -> tuple[list[str], str | None]:
    """``selfspec-auto`` in ``names`` -> the method of the drafter ``drafter="auto"`` picks for ``model``
    (``shipped.default_drafter``; its --PREFIX flags apply), once, in its place.
    Returns (names, that method or None where auto was not asked for)."""
    if AUTO_METHOD not in names:
        return names, None
    drafter = default_drafter(model)
    method = next(m for m, (d, _, pinned) in SELFSPEC_METHODS.items() if d == drafter and not pinned)
    return list(dict.fromkeys(method if n == AUTO_METHOD else n for n in names)), method


def reads_corpus(drafter: str, pinned: dict) -> bool:
    """Whether a method of ``drafter`` with ``pinned`` settings reads a corpus where the context has no
    match (not a "-context" method, nor a "-heads" one, whose lookup is off)."""
    return drafter in LOOKUP_DRAFTERS and pinned.get("corpus") != "none" and pinned.get("lookup") != 0


def flag_prefixes() -> dict[str, str]:
    """Bench flag prefix -> the drafter it configures ("exit" -> "early-exit")."""
    return {prefix: drafter for drafter, prefix, _ in SELFSPEC_METHODS.values() if prefix}


def build_methods(
    names: list[str],
    *,
    model,
    tokenizer,
    model_name: str,
    temperature: float,
    repetition_penalty: float = 1.0,
    heads: dict | None = None,
    draft_model=None,
    settings: dict | None = None,
    corpus: Corpus | None = None,
    compile: bool = False,
    engines: dict | None = None,
) -> tuple[list[Method], dict]:
    """Returns (methods, notes): notes record which heads/draft and which settings each method used.

    compile: selfspec's methods verify through one shared compiled static step (``compile=True``).

    heads: drafter -> heads directory (a drafter left out runs untrained heads, with a warning).
    settings: drafter -> {setting: value} as the user gave them ("auto" for tuned or default).
    corpus: what the lookup of the lookup, medusa and eagle methods reads where the context has no
    match (their "-context" variants never read it; a METHOD@CORPUS_DIR reads that corpus instead).
    engines: what the engine methods run (``engines.engine_method``'s keywords bar the name, eos and
    temperature); their workers start here.
    """
    heads, settings = heads or {}, settings or {}
    sampling = temperature > 0
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id if model.generation_config.pad_token_id is not None else eos
    if isinstance(pad, list):
        pad = pad[0]
    pad = 0 if pad is None else int(pad)
    notes: dict = {}
    n_layers = model.config.num_hidden_layers
    step = StaticStep(Backbone(model), compile=True) if compile else None   # shared: each shape compiles once

    eos_ids = set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))
    kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if sampling else dict(do_sample=False)
    if repetition_penalty != 1.0:   # every method, transformers' too
        kw["repetition_penalty"] = repetition_penalty

    def rows_of(out: torch.Tensor, width: int) -> list[list[int]]:
        """Each row's new tokens: up to its first EOS (kept); after it come only pads."""
        rows = []
        for row in out[:, width:].tolist():
            cut = next((i for i, t in enumerate(row) if t in eos_ids), None)
            rows.append(row if cut is None else row[: cut + 1])
        return rows

    def hf(**extra):
        def fn(batch, n, gen):
            if sampling:
                torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))  # transformers samples with the global RNG
            ids, mask = left_padded(batch, pad)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, pad_token_id=pad, **kw, **extra)
            return rows_of(out, ids.shape[1]), None
        return fn

    def hf_static():
        """transformers' generate on its static cache with the decoding forward compiled (torch.compile;
        on CPU transformers compiles only when asked). One cache per batch size, sized once for the whole
        run (``prepare``: the longest prompt plus the new tokens, rounded up to 512 positions) and reset
        between calls, so every call reuses the graph the warm-up compiled."""
        from transformers import CompileConfig, StaticCache

        device = model.get_output_embeddings().weight.device
        config = CompileConfig(fullgraph=False, mode="reduce-overhead" if device.type == "cuda" else "default")
        config._compile_all_devices = True   # transformers' own switch for compiling off CUDA
        caches: dict[int, StaticCache] = {}
        size = [512]

        def prepare(positions: int, batch_sizes=(), prefill_rows: int | None = None) -> None:
            size[0] = -(-positions // 512) * 512

        def fn(batch, n, gen):
            if sampling:
                torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
            ids, mask = left_padded(batch, pad)
            if ids.shape[1] + n > size[0]:      # a caller that did not prepare: grow (and recompile)
                prepare(ids.shape[1] + n)
                caches.clear()
            cache = caches.get(len(batch))
            if cache is None:
                cache = caches[len(batch)] = StaticCache(config=model.config, max_cache_len=size[0])
            cache.reset()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, pad_token_id=pad, **{CACHE_KWARG: cache},
                                 compile_config=config, **kw)
            return rows_of(out, ids.shape[1]), None
        fn.prepare = prepare
        return fn

    def ours(sm: SelfSpeculativeModel):
        def fn(batch, n, gen):
            ids, mask = left_padded(batch, pad)
            out = sm.generate(ids, attention_mask=mask, max_new_tokens=n, generator=gen, pad_token_id=pad, **kw)
            return rows_of(out, ids.shape[1]), sm.last_stats

        def prepare(positions: int, batch_sizes=(1,), prefill_rows: int | None = None) -> None:
            """Before anything is timed: eager, time width fitting's cost prior at the run's batch sizes;
            compiled, size the static cache for the run, compile every tree bucket the drafter can fill at
            every batch size the run has, and time those buckets for width fitting."""
            if sm.step is None:
                sm.time_costs(max(batch_sizes))
                return
            sm.step.reserve(positions)
            drafter = sm.drafter_for(sampling)
            for b in batch_sizes:
                sm.step.warm_up(batch=b, max_nodes=drafter.max_nodes, capture=drafter.capture_layers)
                drafter.warm_up(sm.step, batch=b, sampled=sampling)
                sm.time_costs(b)
        fn.prepare = prepare
        return fn

    loaded_heads = {}   # heads loaded once per (kind, directory), shared by a method and its "-heads" variant

    def heads_for(kind: str, variant: str | None = None):
        """The heads of ``kind``: those ``variant`` names (a method@DIR), else the --PREFIX-heads ones."""
        path = variant if variant is not None else heads.get(kind)
        if (kind, path) in loaded_heads:
            return loaded_heads[kind, path]
        note = kind if variant is None else f"{kind}@{variant}"
        if path is None:
            warnings.warn(f"no {kind} heads given: benchmarking untrained heads (exact, little speed-up)", stacklevel=3)
            notes[note] = "untrained"
            loaded_heads[kind, path] = untrained_heads(kind, model, model_name)
        else:
            notes[note] = str(path)
            p = model.get_output_embeddings().weight
            loaded_heads[kind, path] = load_heads(path, expect_kind=kind, fingerprint=config_fingerprint(model.config),
                                                  device=p.device, dtype=p.dtype, model=model)
        return loaded_heads[kind, path]

    needs_draft = DRAFT_METHODS & set(names)
    if needs_draft and draft_model is None:
        raise ValueError(f"{', '.join(sorted(needs_draft))} need a draft model: pass --draft-model PATH")
    if needs_draft:
        notes["draft_model"] = getattr(draft_model, "name_or_path", None) or "given"

    loaded_corpora = {}  # a METHOD@CORPUS_DIR's corpus, loaded once per directory

    def corpus_for(variant: str) -> Corpus:
        if variant not in loaded_corpora:
            loaded_corpora[variant] = load_corpus(variant, fingerprint=config_fingerprint(model.config))
            notes[f"corpus@{variant}"] = variant
        return loaded_corpora[variant]

    def selfspec_method(name: str):
        base, variant = split_variant(name)
        drafter, _, pinned = SELFSPEC_METHODS[base]
        own_corpus = variant is not None and is_corpus_dir(variant)
        pinned = dict(pinned)
        method_corpus = (corpus_for(variant) if own_corpus else corpus) if reads_corpus(drafter, pinned) else None
        pinned.pop("corpus", None)
        heads_variant = None if own_corpus else variant
        sm = SelfSpeculativeModel(model, tokenizer, drafter_name=drafter, name=model_name,
                                  heads=heads_for(drafter, heads_variant) if drafter in HEADS_DRAFTERS else None,
                                  draft_model=draft_model if drafter == "draft-model" else None,
                                  corpus=method_corpus,
                                  compile=step if step is not None else False, **{**settings.get(drafter, {}), **pinned})
        key = base.removeprefix("selfspec-").replace("-", "_") + ("" if variant is None else f"@{variant}")
        for setting, value in asdict(sm.sampled_settings if sampling else sm.settings).items():
            if value is not None:
                tree = getattr(sm.drafter_for(sampling), "tree", None) if setting == "tree" else None
                notes[f"{key}_{setting}"] = [list(p) for p in tree.paths] if tree is not None else value
        return ours(sm)

    methods = []
    for name in names:
        if name == BASELINE:
            fn = hf()
        elif name == "hf-static":
            fn = hf_static()
        elif name == "hf-assisted":
            fn = hf(assistant_model=draft_model)
        elif name == "hf-assisted-bf16":
            fn = hf(assistant_model=copy.deepcopy(draft_model).to(torch.bfloat16))
        elif name == "hf-early-exit":
            fn = hf(assistant_early_exit=default_exit_layer(n_layers))
        elif name == "hf-prompt-lookup":
            fn = hf(prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)
        elif name in ENGINE_METHOD_NAMES:
            if sampling or repetition_penalty != 1.0:
                raise ValueError(f"{name} decodes greedily only: leave out --temperature and --repetition-penalty")
            fn = engine_method(name, eos=sorted(eos_ids), **(engines or {}))
            notes[name] = fn.note
        else:
            fn = selfspec_method(name)
        methods.append(Method(name=name, fn=fn, quantized=name in QUANTIZED, external=name in ENGINE_METHOD_NAMES))
    return methods, notes
