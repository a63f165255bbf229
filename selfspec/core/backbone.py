"""The one place that knows where a decoder's parts live.

``Backbone`` is a thin view over a Hugging Face causal LM of the Llama family shape
(``model.model.{embed_tokens, layers, norm, rotary_emb}`` + ``model.lm_head``). It runs any
slice of decoder layers with a caller-built 4-D additive mask, explicit position ids and a KV
cache (``cache.KVCache``: anything with the ``update`` call the layers make), all through the
layers' public ``forward`` arguments. Nothing is
stored on the model and nothing is patched; the config is never rewritten.

Running ``layers[a:b]`` is what lets early exit draft with the first E layers and lets the
verifier resume at layer E from the hidden states the draft already computed.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from dataclasses import dataclass

import torch
from torch.nn import functional as F

# Families whose decoder is embed -> layers -> norm -> lm_head with rotary embeddings shared by
# all layers, and whose layers take (hidden, attention_mask, position_ids, cache (past_key_values before
# transformers renamed it),
# position_embeddings). Gemma's embedding scale lives inside its embedding module.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3")
# Rope types whose angles are a function of the position alone (dynamic NTK and longrope re-derive theirs from
# the sequence length as it grows): their (cos, sin) can be read from a table the rotary module filled.
POSITION_ONLY_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ForwardOut:
    hidden: torch.Tensor   # (n, H) after the last layer run (pre-norm)


class Backbone:
    def __init__(self, model: torch.nn.Module):
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {config.model_type!r} is not supported: selfspec handles {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        attn = getattr(config, "_attn_implementation", None)
        if attn not in (None, "sdpa", "eager"):
            raise ValueError(
                f"attention implementation {attn!r} cannot take tree masks: load the model with attn_implementation='sdpa'"
            )
        self.model = model
        self.config = config
        inner = model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.rotary_emb = inner.rotary_emb
        self.lm_head = model.lm_head
        self.num_layers = len(self.layers)
        self.cache_arg = cache_argument(self.layers[0])   # every layer of a model is one class
        self.hidden_size = config.hidden_size
        self.vocab_size = self.lm_head.weight.shape[0]
        self.sliding_window = self._sliding_window(config)
        self._rope_tables: dict | None = {} if getattr(self.rotary_emb, "rope_type", None) in POSITION_ONLY_ROPE else None

    @staticmethod
    def _sliding_window(config) -> int | None:
        window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None)
        if window is None or (types is not None and "sliding_attention" not in types):
            return None
        if getattr(config, "use_sliding_window", True) is False:
            return None
        return int(window)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(n,) ids -> (1, n, H); (B, n) ids -> (B, n, H) through ``embed_tokens``."""
        return self.embed_tokens(input_ids[None])

    def rope(self, like: torch.Tensor, position_ids: torch.Tensor, *, top: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary (cos, sin) of ``position_ids`` (B, n) in ``like``'s dtype, as the model's rotary module gives
        them. With ``top`` (every position is known to lie below it) and a rope whose angles depend on the
        position alone, they are read from a table of positions 0 .. top - 1 that the module itself filled
        (grown by doubling as positions grow): one index per step instead of the module's own work."""
        tables = self._rope_tables
        if top is None or tables is None or torch.compiler.is_compiling():
            return self.rotary_emb(like, position_ids=position_ids)
        key = (like.dtype, like.device)
        table = tables.get(key)
        if table is None or table[0].shape[0] < top:
            n = max(top, 256, 0 if table is None else 2 * table[0].shape[0])
            cos, sin = self.rotary_emb(like, position_ids=torch.arange(n, device=like.device)[None])
            table = tables[key] = (cos[0], sin[0])
        return table[0][position_ids], table[1][position_ids]

    def run_layers(
        self,
        hidden: torch.Tensor,
        *,
        start: int,
        end: int,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run ``layers[start:end]`` on (B, n, H), appending their KV to ``cache``. Mask: (B, 1, n, kv_len) additive.
        rope: the positions' rotary (cos, sin) when the caller has it (``rope``); else the rotary module's."""
        pos_emb = rope if rope is not None else self.rotary_emb(hidden, position_ids=position_ids)
        for i in range(start, end):   # (indexed: a slice of a ModuleList builds a new module)
            hidden = self.layers[i](
                hidden,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **{self.cache_arg: cache},
                use_cache=True,
                position_embeddings=pos_emb,
            )
        return hidden

    def clone_layer(self, index: int, *, residual_writes: bool) -> torch.nn.Module:
        """A standalone copy of decoder layer ``index`` that keeps its KV in slot 0 of its own cache.

        With ``residual_writes=False`` its attention output and MLP down projections are zeroed, so
        the copy starts as the identity on the residual stream (an adapter that is untrained = absent).
        """
        import copy

        layer = copy.deepcopy(self.layers[index])
        layer.self_attn.layer_idx = 0
        if not residual_writes:
            with torch.no_grad():
                for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    proj.weight.zero_()
                    if proj.bias is not None:
                        proj.bias.zero_()
        return layer

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """(..., H) final-normed states -> (..., V) logits."""
        return F.linear(normed, self.lm_head.weight, self.lm_head.bias)


def cache_argument(layer: torch.nn.Module) -> str:
    """The name a decoder layer's forward takes its KV cache under: ``cache`` in current
    transformers, ``past_key_values`` in releases before the rename (still accepted, with a warning,
    until it is removed)."""
    return _cache_argument(type(layer))


@functools.lru_cache(maxsize=None)
def _cache_argument(cls) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def config_fingerprint(config) -> str:
    """Short hash of the parts of a config that heads depend on (shapes, depth, vocabulary, rope)."""
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "rope_theta", "max_position_embeddings", "tie_word_embeddings")
    d = {k: getattr(config, k, None) for k in keys}
    return hashlib.sha1(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]
