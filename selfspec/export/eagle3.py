"""EAGLE-3 drafts in the layouts serving engines load, both ways: export selfspec's eagle heads,
and import a draft trained elsewhere so that selfspec's own loop can run it.

Two layouts hold the same weights:

* ``eagle3-sglang`` (SGLang; vLLM loads it too): ``config.json`` with ``architectures:
  ["LlamaForCausalLMEagle3"]``, ``num_hidden_layers: 1``, ``draft_vocab_size``,
  ``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``; tensors ``fc.weight``,
  ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t`` and ``t2d``.
* ``eagle3-speculators`` (vLLM's speculators format, what ``vllm serve DIR`` starts from):
  ``speculators_model_type: "eagle3"``, the layer's shape as a nested ``transformer_layer_config``, a
  ``speculators_config`` naming the verifier; the layer's tensors are ``layers.0.*``.

Both map a draft id to a target id as ``target = draft + d2t[draft]`` and mark the target ids in the
draft vocabulary in the boolean ``t2d``. The embedding is the target's own in every layout (not stored).

Auxiliary layer ids: selfspec's ``aux_layers`` entry a is the residual stream after a decoder
layers. The engines count differently, and both conventions are written:

* vLLM reads the top-level ``eagle_aux_hidden_state_layer_ids`` as written: id a is captured entering
  layer a, after a layers (selfspec's a).
* SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` and captures id k entering layer
  k + 1, after k + 1 layers: selfspec's a is written as a - 1 there.

Both engines default to (2, N/2, N-3) in vLLM's counting, selfspec's default. selfspec's extra id
N (the final state, after the final norm) has no engine equivalent, so such heads are refused.

Layer variants (``HeadsConfig.norm_before_residual``, ``feature_norm``, ``norm_output``): speculators
writes ``norm_before_residual``, ``norm_before_fc`` (``feature_norm`` "concat", tensor
``input_norm.weight``), ``fc_norm`` ("per_layer", ``fc_norm.{i}.weight``) and ``norm_output`` in its
config, and turns the first, second and fourth on by default when it trains. They are imported from
either layout and written back to the speculators layout; SGLang's EAGLE-3 layer reads none of them,
so heads that use one are refused as ``eagle3-sglang``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..heads import Heads, HeadsConfig
from ..settings import DecodeSettings

SGLANG_ARCH = "LlamaForCausalLMEagle3"
SPECULATORS_ARCH = "Eagle3Speculator"
SPECULATORS_VERSION = "0.3.0"    # the speculators config version this layout follows
LAYER_PREFIX = {"eagle3-sglang": "midlayer.", "eagle3-speculators": "layers.0."}
TRAIN_FLAG = "--aux-layers"      # what makes engine-compatible heads


def variants(config: HeadsConfig) -> list[str]:
    """The layer variants these heads use, under the names speculators' config gives them."""
    return [name for name, on in (("norm_before_residual", config.norm_before_residual),
                                  ("norm_before_fc", config.feature_norm == "concat"),
                                  ("fc_norm", config.feature_norm == "per_layer"),
                                  ("norm_output", config.norm_output)) if on]


def refusal(config: HeadsConfig, num_layers: int, fmt: str) -> str | None:
    """Why these eagle heads cannot be written as ``fmt`` (one line naming what fixes it), or None."""
    if fmt == "eagle3-sglang" and variants(config):
        return (f"these eagle heads use {', '.join(variants(config))}, which SGLang's EAGLE-3 layer does not read: "
                "export them as eagle3-speculators (vLLM)")
    aux = list(config.aux_layers)
    fix = ",".join(str(a) for a in sorted({min(2, num_layers), max(1, num_layers // 2), max(1, num_layers - 3)}))
    if any(a >= num_layers for a in aux):
        return (f"these eagle heads read the target's final hidden state (aux layer {num_layers}), which SGLang and "
                f"vLLM cannot capture: train heads with {TRAIN_FLAG} {fix} to export them")
    if len(aux) != 3:
        return (f"these eagle heads fuse {len(aux)} target layers; EAGLE-3 engines fuse exactly 3: train heads with "
                f"{TRAIN_FLAG} {fix} to export them")
    return None


def draft_maps(draft_vocab: torch.Tensor | None, *, draft_size: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d): int64 offsets with ``target = draft + d2t[draft]``, and a bool mask of the target ids drafted."""
    ids = torch.arange(draft_size) if draft_vocab is None else draft_vocab.detach().cpu().to(torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(draft_size), t2d


def tensors(heads: Heads, *, lm_head: torch.Tensor, fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The draft's tensors under ``fmt``'s names: floating ones in ``dtype``, ``d2t``/``t2d`` as the engines read them.
    ``lm_head``: the (V_draft, H) LM head the heads score with (their own, or the target's rows they share)."""
    c = heads.config
    out = {}
    for name, t in heads.module.state_dict().items():
        if name == "lm_head.weight":
            continue
        if name.startswith("midlayer."):
            name = LAYER_PREFIX[fmt] + name.removeprefix("midlayer.")
        out[name] = t.detach().cpu().to(dtype).contiguous()
    out["lm_head.weight"] = lm_head.detach().cpu().to(dtype).contiguous()
    out["d2t"], out["t2d"] = draft_maps(heads.draft_vocab, draft_size=lm_head.shape[0], vocab_size=c.vocab_size)
    return out


def _layer_config(c: HeadsConfig, target_config, draft_size: int, dtype: torch.dtype) -> dict:
    """The one Llama decoder layer's shape, with the target's rotary settings (the draft's positions are the target's)."""
    rope = getattr(target_config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope.get("rope_type", "default") != "default" else None
    return {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.attn_heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_eps,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": draft_size,
        "max_position_embeddings": getattr(target_config, "max_position_embeddings", 2048),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": getattr(target_config, "bos_token_id", None),
        "eos_token_id": getattr(target_config, "eos_token_id", None),
        "pad_token_id": getattr(target_config, "pad_token_id", None),
    }


def config(heads: Heads, *, fmt: str, target_config, verifier: str, draft_size: int, dtype: torch.dtype,
           speculative_tokens: int) -> dict:
    """``config.json`` of ``fmt`` for these heads, drafting for ``verifier`` (the target's hub id or path)."""
    c = heads.config
    layer = _layer_config(c, target_config, draft_size, dtype)
    aux = [int(a) for a in c.aux_layers]
    if fmt == "eagle3-sglang":
        return {**layer, "architectures": [SGLANG_ARCH], "target_hidden_size": c.hidden_size,
                "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": aux,             # vLLM's counting
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [a - 1 for a in aux],        # SGLang's
                                 "use_aux_hidden_state": True}}
    return {
        "architectures": [SPECULATORS_ARCH],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_size,
        "norm_before_residual": c.norm_before_residual,   # False: the residual is the fused feature before hidden_norm
        "norm_before_fc": c.feature_norm == "concat",
        "fc_norm": c.feature_norm == "per_layer",
        "norm_output": c.norm_output,
        "target_hidden_size": c.hidden_size,
        "eagle_aux_hidden_state_layer_ids": aux,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(getattr(target_config, "architectures", None)
                                                                         or ["LlamaForCausalLM"])},
        },
    }


# ---------------------------------------------------------------------------------------------- import


def is_eagle3(raw: dict) -> bool:
    """A config.json written for an EAGLE-3 draft, in either layout."""
    return SGLANG_ARCH in (raw.get("architectures") or []) or raw.get("speculators_model_type") == "eagle3"


def imported_config(raw: dict, *, where: str) -> HeadsConfig:
    """selfspec's view of an EAGLE-3 ``config.json`` (either layout). The base model is unknown until a
    target is at hand: ``base_fingerprint`` is empty and :func:`check_against_target` checks the shapes.
    ``aux_layers`` is empty where the file names none (the engines' default, filled in at load)."""
    layer = raw.get("transformer_layer_config") or raw
    why = unsupported(raw, layer)
    if why:
        raise ValueError(f"{where} is an EAGLE-3 draft selfspec cannot run: {why}; selfspec runs one-layer EAGLE-3 "
                         "drafts (SiLU MLP, no biases), as `selfspec train-heads --kind eagle` trains them")
    try:
        hidden = int(raw.get("target_hidden_size") or layer["hidden_size"])
        if int(layer["hidden_size"]) != hidden:
            raise ValueError(f"its layer width {layer['hidden_size']} differs from the target's {hidden}, which "
                             "selfspec's eagle head does not support")
        heads = int(layer["num_attention_heads"])
        aux = imported_aux_layers(raw)
        verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or ""
        return HeadsConfig(
            kind="eagle", base_model=verifier, base_fingerprint="", hidden_size=hidden,
            vocab_size=int(layer["vocab_size"]), intermediate_size=int(layer["intermediate_size"]),
            aux_layers=[int(a) for a in aux], attn_heads=heads,
            kv_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads), rms_eps=float(layer.get("rms_norm_eps", 1e-6)),
            shared_lm_head=False, draft_vocab_size=int(raw.get("draft_vocab_size") or layer.get("draft_vocab_size")
                                                       or layer["vocab_size"]),
            norm_before_residual=bool(raw.get("norm_before_residual")),
            feature_norm="concat" if raw.get("norm_before_fc") else "per_layer" if raw.get("fc_norm") else "",
            norm_output=bool(raw.get("norm_output")),
            decode=DecodeSettings(), provenance={"imported_from": where, "layout": layout_of(raw)},
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}/config.json is an EAGLE-3 config selfspec cannot read ({e}): export it again") from None


def unsupported(raw: dict, layer: dict) -> str | None:
    """What in an EAGLE-3 config selfspec's one-layer head cannot be, or None."""
    try:
        layers = int(layer.get("num_hidden_layers") or 1)
    except (TypeError, ValueError):
        return None          # a malformed config: imported_config says so
    if layers != 1:
        return f"it has {layers} decoder layers"
    for key in ("attention_bias", "mlp_bias"):
        if layer.get(key):
            return f"its layer sets {key}"
    if layer.get("hidden_act", "silu") != "silu":
        return f"its MLP uses {layer['hidden_act']!r}"
    if raw.get("norm_before_fc") and raw.get("fc_norm"):
        return "it sets both norm_before_fc and fc_norm, which exclude each other"
    return None


def imported_aux_layers(raw: dict) -> list[int]:
    """selfspec's aux layers from an EAGLE-3 config: an SGLang layout's nested ids (SGLang's counting, +1),
    else the top-level ids (vLLM's counting, as written), else [] (the engines' default)."""
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested and layout_of(raw) == "eagle3-sglang":
        return [int(k) + 1 for k in nested]
    return [int(a) for a in raw.get("eagle_aux_hidden_state_layer_ids") or []]


def layout_of(raw: dict) -> str:
    return "eagle3-speculators" if raw.get("speculators_model_type") == "eagle3" else "eagle3-sglang"


def imported_tensors(tensors: dict[str, torch.Tensor], config: HeadsConfig) -> tuple[dict, torch.Tensor | None]:
    """(the module's state dict under selfspec's names, draft vocabulary or None) from an EAGLE-3 file."""
    out, d2t = {}, tensors.get("d2t")
    for name, t in tensors.items():
        if name in ("d2t", "t2d") or name.startswith("embed_tokens."):   # the embedding is the target's
            continue
        for prefix in LAYER_PREFIX.values():
            if name.startswith(prefix):
                name = "midlayer." + name.removeprefix(prefix)
        out[name] = t
    draft_vocab = None
    if d2t is not None and config.draft_vocab_size != config.vocab_size:
        draft_vocab = torch.arange(d2t.shape[0], dtype=torch.int64) + d2t.to(torch.int64)
    return out, draft_vocab


def check_against_target(config: HeadsConfig, target_config, where: str) -> None:
    """Imported heads carry no fingerprint: check the shapes they need from the target, fill in default aux layers."""
    from ..models.eagle import default_aux_layers

    n = target_config.num_hidden_layers
    if config.hidden_size != target_config.hidden_size or config.vocab_size != target_config.vocab_size:
        raise ValueError(f"{where} drafts for a model with hidden size {config.hidden_size} and vocabulary "
                         f"{config.vocab_size}, not this one ({target_config.hidden_size}, {target_config.vocab_size}): "
                         "pass heads trained for this model")
    if not config.aux_layers:
        config.aux_layers = default_aux_layers(n)
    if not all(0 < a < n for a in config.aux_layers):
        raise ValueError(f"{where} reads aux layers {config.aux_layers}, but this model has {n} layers: pass heads "
                         "trained for this model")


def read_raw_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())
