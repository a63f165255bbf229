"""Medusa heads in the layouts vLLM and TGI load.

Both engines run head h as residual blocks ``x = x + SiLU(W x + b)`` on the target's last (post-norm)
hidden state, then the head's own LM head: exactly selfspec's ``ResBlock`` without a token input or
an extra MLP, scored by the target's LM head rows (written out per head).

* ``medusa-vllm``: ``config.json`` (``architectures: ["MedusaModel"]``, ``num_heads``,
  ``num_hidden_layers``, ``hidden_size``, ``vocab_size``, ``truncated_vocab_size``, ``medusa_fc_bias``)
  and ``model.safetensors`` with ``blocks.{h}.layers.0.{weight,bias}`` and ``lm_heads.{h}.weight``.
  A draft vocabulary is written as full-vocabulary LM heads whose rows outside it are zero (logit 0:
  below the draft's best token wherever that token's logit is positive, as it nearly always is). vLLM's
  own form for it, a ``token_map`` with truncated heads, does not load in vLLM 0.32 (its Medusa heads are
  sized to the full vocabulary, and the loader asserts that size after cutting the rows to the map).
* ``medusa-tgi``: ``config.json`` with ``medusa_num_heads``, ``medusa_num_layers`` and
  ``base_model_name_or_path`` (and no ``architectures``: TGI then looks for a speculator of another
  kind), weights in ``medusa_lm_head.safetensors``: ``{h}.0.linear.{weight,bias}`` and the head's LM head
  ``{h}.1.weight`` over the full vocabulary (TGI has no draft vocabulary).
"""

from __future__ import annotations

import torch

from ..heads import Heads, HeadsConfig

VLLM_ARCH = "MedusaModel"
TGI_WEIGHTS = "medusa_lm_head.safetensors"


def refusal(config: HeadsConfig, fmt: str) -> str | None:
    """Why these Medusa heads cannot be written as ``fmt`` (one line naming the training flag), or None."""
    engine = "vLLM" if fmt == "medusa-vllm" else "TGI"
    if config.token_input:
        return (f"these Medusa heads also read the root token's embedding, which {engine}'s Medusa has no place for: "
                "train heads with --token-input false to export them")
    if any(config.head_mlp):
        return (f"these Medusa heads have wider residual MLPs ({list(config.head_mlp)}), which {engine}'s Medusa "
                "cannot hold: train heads without --head-mlp to export them")
    if fmt == "medusa-tgi" and config.draft_vocab_size and config.draft_vocab_size != config.vocab_size:
        return (f"these Medusa heads score a {config.draft_vocab_size}-token draft vocabulary; TGI scores the full "
                "one: train heads with --draft-vocab-size 0 to export them (or export --format medusa-vllm)")
    return None


def files(heads: Heads, *, fmt: str, lm_head: torch.Tensor, dtype: torch.dtype, verifier: str,
          target_config) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """({file name: tensors}, config.json) for ``fmt``. ``lm_head``: the target's (V, H) LM head."""
    c = heads.config
    vocab = heads.draft_vocab
    rows = lm_head.detach().cpu().to(dtype)
    if vocab is not None:   # the draft vocabulary's rows, zero elsewhere
        keep = torch.zeros(rows.shape[0], dtype=torch.bool)
        keep[vocab.cpu()] = True
        rows = rows.masked_fill(~keep[:, None], 0)
    rows = rows.contiguous()
    out: dict[str, torch.Tensor] = {}
    for h, block in enumerate(heads.module.blocks):
        w = block.linear.weight.detach().cpu().to(dtype).contiguous()
        b = block.linear.bias.detach().cpu().to(dtype).contiguous()
        if fmt == "medusa-vllm":
            out[f"blocks.{h}.layers.0.weight"], out[f"blocks.{h}.layers.0.bias"] = w, b
            out[f"lm_heads.{h}.weight"] = rows.clone()
        else:
            out[f"{h}.0.linear.weight"], out[f"{h}.0.linear.bias"] = w, b
            out[f"{h}.1.weight"] = rows.clone()
    if fmt == "medusa-vllm":
        config = {"architectures": [VLLM_ARCH], "model_type": "medusa", "hidden_size": c.hidden_size,
                  "vocab_size": c.vocab_size, "truncated_vocab_size": rows.shape[0], "num_heads": c.num_heads,
                  "num_hidden_layers": 1, "medusa_fc_bias": True, "torch_dtype": str(dtype).removeprefix("torch."),
                  "base_model_name_or_path": verifier}
        return {"model.safetensors": out}, config
    config = {"medusa_num_heads": c.num_heads, "medusa_num_layers": 1, "base_model_name_or_path": verifier,
              "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
              "torch_dtype": str(dtype).removeprefix("torch.")}
    return {TGI_WEIGHTS: out}, config
