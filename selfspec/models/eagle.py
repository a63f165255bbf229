"""The EAGLE-3-class feature head: one decoder layer that drafts autoregressively over the
target's own features.

Slot i of the head reads two things: a *feature* g_i for token x_i and the embedding of the
next token x_{i+1} (known: the target chose it, or the draft did), and predicts x_{i+2}. For
committed tokens the feature is ``fc`` of the target's hidden states after three of its layers
(low, middle, high), concatenated: (..., 3H) -> (..., H). While drafting ahead, the target has
not run the drafted tokens, so slot i instead reads the head's own output state from slot i - 1.

The layer (names as SGLang and vLLM load EAGLE-3 drafts, so export is a renaming)::

    x = [input_layernorm(embedding), hidden_norm(feature)]          (..., 2H)
    h = feature + o_proj(attention(q_proj(x), k_proj(x), v_proj(x))) (rotary positions)
    h = h + mlp(post_attention_layernorm(h))                          -> the slot's output state
    logits = lm_head(norm(h))                                         (..., V_draft)

Drafts trained elsewhere may use variants of it, which speculators (vLLM's training library) turns
on by default and selfspec reads when it imports them (``HeadsConfig``; selfspec's own training uses
none): ``norm_before_residual`` (the residual is hidden_norm(feature)), ``feature_norm`` (an RMSNorm
over the concatenated aux states before ``fc``, "concat", or one per aux state, "per_layer") and
``norm_output`` (the output state is norm(h), which the next draft step reads and the LM head
scores as it is).

``forward`` runs n slots against a KV cache (transformers' ``DynamicCache``, layer 0, through its
public ``update``), with an optional additive mask, as the drafter does. ``ttt_attention`` is
the training-time-test form: step j of an unrolled draft, where slot i attends to the
committed slots up to i - j and to its own j draft ancestors (see training/tasks/eagle.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..core.tree import additive_mask
from .stacked import decoding, stacked

FEATURE_NORMS = ("", "concat", "per_layer")


def default_aux_layers(num_layers: int) -> list[int]:
    """Low, middle and high: the hidden states after layers 2, N/2 and N-3 (as EAGLE-3 picks them)."""
    return sorted({min(2, num_layers), max(1, num_layers // 2), max(1, num_layers - 3)})


@torch.no_grad()
def init_from_target(head: "EagleHead", backbone, vocab: torch.Tensor | None) -> None:
    """Start where the target is: LM head rows (draft vocabulary) and final norm copied from the
    target, and ``fc`` passing the highest aux layer through unchanged, so that an untrained head
    already reads a sensible feature; the layer itself starts small and random."""
    w = backbone.lm_head.weight
    head.lm_head.weight.copy_(w if vocab is None else w.index_select(0, vocab.to(w.device)))
    if backbone.config.model_type != "gemma":   # Gemma's norm scales by 1 + weight
        head.norm.weight.copy_(backbone.norm.weight)
    H = head.fc.weight.shape[0]
    head.fc.weight.zero_()
    head.fc.weight[:, -H:].copy_(torch.eye(H))
    for lin in (m for m in head.midlayer.modules() if isinstance(m, nn.Linear)):
        nn.init.normal_(lin.weight, std=0.02)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on (B, heads, n, d) with cos/sin (B, n, d) from the target's rotary module."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _norm(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` without the module call."""
    return F.rms_norm(x, norm.normalized_shape, norm.weight, norm.eps)


@dataclass(frozen=True)
class _Decoding:
    """What ``EagleHead.decode`` reads: the head's weights as plain tensors, some of them combined."""

    qkv: torch.Tensor                  # ``EagleAttention.decoding_weight`` of the input norms' weights
    o_t: torch.Tensor                  # o_proj's weight, transposed (a view): the residual adds in the product
    gate_up: torch.Tensor              # gate's rows, then up's
    down_t: torch.Tensor               # down_proj's weight, transposed (a view), likewise
    post_norm: torch.Tensor
    hidden_norm: torch.Tensor | None   # norm_before_residual: the residual is hidden_norm(feature)
    norm: torch.Tensor                 # the output norm
    lm_head: torch.Tensor
    eps: float
    post_eps: float
    norm_eps: float
    heads: int
    kv_heads: int
    head_dim: int


class EagleAttention(nn.Module):
    def __init__(self, *, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(2 * hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, n, 2H) -> q (B, nh, n, d), k and v (B, nkv, n, d), rotary applied to q and k."""
        B, n, _ = x.shape
        cos, sin = position_embeddings
        q = self.q_proj(x).view(B, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def decoding_weight(self, norms: torch.Tensor) -> torch.Tensor:
        """(2H,) the two input norms' weights -> one (rows, 2H) weight giving, for a weightless-normed input,
        q, k, the rotary half-turn of q and of k, and v (in that order, each in (heads, d) rows): the norms
        and ``rotate``'s half-turn folded into one product (the half-turn only moves and negates rows)."""
        d = self.head_dim

        def turned(w: torch.Tensor) -> torch.Tensor:   # rows of rotate_half(x @ w.T), per head
            w = w.view(-1, d, w.shape[-1])
            return torch.cat([-w[:, d // 2:], w[:, : d // 2]], dim=1).reshape(-1, w.shape[-1])

        q, k, v = self.q_proj.weight, self.k_proj.weight, self.v_proj.weight
        return torch.cat([q, k, turned(q), turned(k), v]) * norms

    def expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """(B, nkv, T, d) -> (B, nh, T, d): grouped-query attention shares each kv head."""
        return t.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """(B, nh, n, d) -> (B, n, H)."""
        B, _, n, _ = o.shape
        return F.linear(o.transpose(1, 2).reshape(B, n, -1), self.o_proj.weight)


class EagleMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EagleLayer(nn.Module):
    def __init__(self, *, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float, norm_before_residual: bool = False):
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = nn.RMSNorm(hidden_size, eps=eps)
        self.hidden_norm = nn.RMSNorm(hidden_size, eps=eps)
        self.self_attn = EagleAttention(hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                        head_dim=head_dim)
        self.post_attention_layernorm = nn.RMSNorm(hidden_size, eps=eps)
        self.mlp = EagleMLP(hidden_size, intermediate_size)

    def attn_input(self, feature: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        return torch.cat([_norm(self.input_layernorm, embedding), _norm(self.hidden_norm, feature)], dim=-1)

    def finish(self, feature: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Residual over the feature, then the MLP block: (B, n, H) output states."""
        h = (_norm(self.hidden_norm, feature) if self.norm_before_residual else feature) + attended
        return h + self.mlp(_norm(self.post_attention_layernorm, h))


class EagleHead(nn.Module):
    def __init__(self, *, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 num_aux: int, draft_vocab_size: int, eps: float, norm_before_residual: bool = False,
                 feature_norm: str = "", norm_output: bool = False):
        super().__init__()
        if feature_norm not in FEATURE_NORMS:
            raise ValueError(f"eagle feature_norm {feature_norm!r}: choose from {', '.join(map(repr, FEATURE_NORMS))}")
        if feature_norm == "concat":
            self.input_norm = nn.RMSNorm(num_aux * hidden_size, eps=eps)
        elif feature_norm == "per_layer":
            self.fc_norm = nn.ModuleList(nn.RMSNorm(hidden_size, eps=eps) for _ in range(num_aux))
        self.feature_norm, self.norm_output = feature_norm, norm_output
        self.fc = nn.Linear(num_aux * hidden_size, hidden_size, bias=False)
        self.midlayer = EagleLayer(hidden_size=hidden_size, intermediate_size=intermediate_size, num_heads=num_heads,
                                   num_kv_heads=num_kv_heads, head_dim=head_dim, eps=eps,
                                   norm_before_residual=norm_before_residual)
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.lm_head = nn.Linear(hidden_size, draft_vocab_size, bias=False)
        self.scale = 1.0 / math.sqrt(head_dim)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """(..., A*H) the target's hidden states after the aux layers, concatenated -> (..., H) feature."""
        if self.feature_norm == "concat":
            aux = self.input_norm(aux)
        elif self.feature_norm == "per_layer":
            aux = torch.cat([norm(x) for norm, x in zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return F.linear(aux, self.fc.weight)

    def output(self, h: torch.Tensor) -> torch.Tensor:
        """The layer's result -> the output state a slot passes on (normed under ``norm_output``)."""
        return _norm(self.norm, h) if self.norm_output else h

    def scored(self, states: torch.Tensor) -> torch.Tensor:
        """(..., H) output states -> what the LM head reads (already normed under ``norm_output``)."""
        return states if self.norm_output else _norm(self.norm, states)

    def logits(self, states: torch.Tensor, weights: "_Decoding | None" = None) -> torch.Tensor:
        """(..., H) output states -> (..., V_draft) draft logits. weights: ``decoding_weights()``, where the
        caller keeps them for a decode (eager, no autograd; else ignored)."""
        if decoding():
            w = weights or self.decoding_weights()
            normed = states if self.norm_output else F.rms_norm(states, states.shape[-1:], w.norm, w.norm_eps)
            return F.linear(normed, w.lm_head)
        return self.lm_head(self.scored(states))

    def forward(self, feature: torch.Tensor, embedding: torch.Tensor, *, position_embeddings, cache,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """n slots (B, n, H) features + next-token embeddings -> (B, n, H) output states.

        Their KV is appended to ``cache`` (a ``DynamicCache``, layer 0). Mask: (B, 1, n, past + n)
        additive; None means causal within the n slots (and every cached slot visible).
        """
        if decoding():
            cos, sin = position_embeddings
            return self.decode(feature, embedding, (cos[:, :, None], sin[:, :, None]), cache, attention_mask)
        layer, attn = self.midlayer, self.midlayer.self_attn
        q, k, v = attn.qkv(layer.attn_input(feature, embedding), position_embeddings)
        k, v = cache.update(k, v, 0)
        o = F.scaled_dot_product_attention(q, k, v, **self._attention(attention_mask, q.shape[2], k))
        return self.output(layer.finish(feature, attn.out(o)))

    def _attention(self, mask: torch.Tensor | None, n: int, keys: torch.Tensor) -> dict:
        """sdpa's mask arguments for n slots over ``keys`` (B, nkv, T, d): the caller's mask, or where it gives
        none, causal among the new slots with all of the cache visible."""
        T = keys.shape[2]
        if mask is None and n > 1 and T > n:
            mask = additive_mask(torch.ones(n, T, dtype=torch.bool, device=keys.device).tril(T - n), keys.dtype)
        attn = self.midlayer.self_attn
        return dict(attn_mask=mask, is_causal=mask is None and n > 1, scale=self.scale,
                    enable_gqa=attn.num_heads != attn.num_kv_heads)

    def decode(self, feature: torch.Tensor, embedding: torch.Tensor, position_embeddings, cache,
               mask: torch.Tensor | None, weights: "_Decoding | None" = None) -> torch.Tensor:
        """``forward`` while decoding (eager, no autograd): the same layer in fewer ops, reading plain tensors
        (``weights``: ``decoding_weights()``, which a drafter keeps for a decode; None: made or checked
        here). The two input norms are one weightless norm over the embedding and the feature side by side,
        their weights folded into one product that also gives the rotary half-turn of q and k
        (``EagleAttention.decoding_weight``), so the rotation is two products and a sum; gate and up are one
        product, every product reads a matrix of B * n rows, and the residual is added inside the two products
        that write to it. position_embeddings: (cos, sin), each (B, n or 1, 1, head_dim), broadcast over the
        heads. Equal to ``forward`` up to float rounding."""
        w = weights or self.decoding_weights()
        B, n, H = feature.shape
        nh, m = w.heads, w.heads + w.kv_heads
        x = F.rms_norm(torch.stack([embedding, feature], dim=2), (H,), None, w.eps)             # (B, n, 2, H)
        y = F.linear(x.view(B * n, 2 * H), w.qkv).view(B, n, -1, w.head_dim)
        cos, sin = position_embeddings
        qk = torch.addcmul(y[:, :, :m] * cos, y[:, :, m: 2 * m], sin).transpose(1, 2)
        k, v = cache.update(qk[:, nh:], y[:, :, 2 * m:].transpose(1, 2), 0)
        o = F.scaled_dot_product_attention(qk[:, :nh], k, v, **self._attention(mask, n, k))
        residual = feature if w.hidden_norm is None else x[:, :, 1] * w.hidden_norm
        h = torch.addmm(residual.reshape(B * n, H), o.transpose(1, 2).reshape(B * n, -1), w.o_t)
        gate, up = F.linear(F.rms_norm(h, (H,), w.post_norm, w.post_eps), w.gate_up).chunk(2, dim=-1)
        h = torch.addmm(h, F.silu(gate) * up, w.down_t).view(B, n, H)
        return F.rms_norm(h, (H,), w.norm, w.norm_eps) if self.norm_output else h

    def decoding_weights(self) -> "_Decoding":
        """The head's weights as ``decode`` reads them (``stacked``: made again whenever a parameter changes)."""
        params = self.__dict__.get("_decoding_params")
        if params is None:
            params = self.__dict__["_decoding_params"] = tuple(self.parameters())
        return stacked(self, "decoding", params, make=lambda _: self._make_decoding())

    def _make_decoding(self) -> "_Decoding":
        layer, attn = self.midlayer, self.midlayer.self_attn
        if layer.input_layernorm.eps != layer.hidden_norm.eps:
            raise ValueError("the eagle head's input norms must share one eps")
        norms = torch.cat([layer.input_layernorm.weight, layer.hidden_norm.weight])
        return _Decoding(
            qkv=attn.decoding_weight(norms), o_t=attn.o_proj.weight.t(),
            gate_up=torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]),
            down_t=layer.mlp.down_proj.weight.t(), post_norm=layer.post_attention_layernorm.weight,
            hidden_norm=layer.hidden_norm.weight if layer.norm_before_residual else None,
            norm=self.norm.weight, lm_head=self.lm_head.weight, eps=layer.input_layernorm.eps,
            post_eps=layer.post_attention_layernorm.eps, norm_eps=self.norm.eps, heads=attn.num_heads,
            kv_heads=attn.num_kv_heads, head_dim=attn.head_dim)

    def ttt_step(self, feature: torch.Tensor, embedding: torch.Tensor, *, position_embeddings,
                 past: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Training-time test, unrolled step j = len(past) over all L slots of a batch at once.

        feature: (B, L, H), at step 0 the fused target features, at step j > 0 the previous step's
        output states shifted one slot right (slot i reads slot i - 1's). past: the (k, v) of steps
        0..j-1, each (B, nkv, L, d). Slot i of step j attends to step 0's slots <= i - j and to step
        m's slot i - j + m for m = 1..j (its own draft ancestors and itself), which is exactly
        what the drafter's tree mask gives the j-th drafted token. Returns (states, this step's k, v).
        """
        layer, attn = self.midlayer, self.midlayer.self_attn
        q, k, v = attn.qkv(layer.attn_input(feature, embedding), position_embeddings)
        j, L = len(past), q.shape[2]
        steps = past + [(k, v)]
        k0, v0 = attn.expand_kv(steps[0][0]), attn.expand_kv(steps[0][1])
        scores = [torch.matmul(q, k0.transpose(-1, -2)) * self.scale]                  # (B, nh, L, L)
        idx = torch.arange(L, device=q.device)
        visible = idx[None, :] <= (idx[:, None] - j)                                    # key s <= i - j
        scores[0] = scores[0].masked_fill(~visible, torch.finfo(scores[0].dtype).min)
        shifted_v = []
        for m in range(1, j + 1):
            # Slot i meets step m's key at slot i - (j - m): shift step m's keys/values right by j - m.
            km, vm = attn.expand_kv(steps[m][0]), attn.expand_kv(steps[m][1])
            s = j - m
            if s:
                km = F.pad(km, (0, 0, s, 0))[:, :, :L]
                vm = F.pad(vm, (0, 0, s, 0))[:, :, :L]
            d = (q * km).sum(-1, keepdim=True) * self.scale                           # (B, nh, L, 1)
            if s:
                d = d.masked_fill((idx < s)[None, None, :, None], torch.finfo(d.dtype).min)
            scores.append(d)
            shifted_v.append(vm)
        probs = torch.cat(scores, dim=-1).float().softmax(-1).to(q.dtype)
        o = torch.matmul(probs[..., :L], v0)
        for m, vm in enumerate(shifted_v):
            o = o + probs[..., L + m: L + m + 1] * vm
        return self.output(layer.finish(feature, attn.out(o))), (k, v)
