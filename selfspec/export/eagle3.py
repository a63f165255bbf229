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

import torch

from ..heads import LAYER_PREFIX, SGLANG_ARCH, Heads, HeadsConfig

SPECULATORS_ARCH = "Eagle3Speculator"
SPECULATORS_VERSION = "0.3.0"    # the speculators config version this layout follows
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
