"""Independent readers of the serving engines' draft-head layouts, for the export tests.

Written from the formats as the engines describe and load them (SGLang's and vLLM's EAGLE-3 drafts,
vLLM speculators, vLLM and TGI Medusa), in plain PyTorch: no selfspec import, so a mistake in
selfspec's writer cannot hide behind the same mistake in the reader.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding of (n, heads, d) at integer ``positions`` (n,)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = positions.float()[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class Eagle3Draft:
    """An EAGLE-3 draft directory, SGLang or speculators layout, run as the engines run it.

    ``capture``: how many target layers each fused feature comes after. SGLang captures config id k
    entering layer k + 1; vLLM (and so a speculators config) captures id a entering layer a.
    """

    def __init__(self, directory, *, target_embed: torch.Tensor):
        directory = Path(directory)
        cfg = json.loads((directory / "config.json").read_text())
        w = {k: v.float() if v.is_floating_point() else v for k, v in load_file(directory / "model.safetensors").items()}
        if cfg.get("speculators_model_type") == "eagle3":
            assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_config"]["algorithm"] == "eagle3"
            # speculators' layer variants (its config names them; the engines' defaults are all off)
            self.norm_before_residual = cfg.get("norm_before_residual", False)
            self.norm_before_fc, self.fc_norm = cfg.get("norm_before_fc", False), cfg.get("fc_norm", False)
            self.norm_output = cfg.get("norm_output", False)
            layer_cfg, prefix = cfg["transformer_layer_config"], "layers.0."
            self.capture = list(cfg["eagle_aux_hidden_state_layer_ids"])
        else:
            assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
            assert cfg.get("norm_before_residual") is False        # SGLang's layer: the residual is the raw feature
            self.norm_before_residual = self.norm_before_fc = self.fc_norm = self.norm_output = False
            layer_cfg, prefix = cfg, "midlayer."
            self.capture = [k + 1 for k in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
            # vLLM reads the top-level ids of the same file, in its own counting: the same layers.
            assert list(cfg["eagle_aux_hidden_state_layer_ids"]) == self.capture
        assert layer_cfg["hidden_act"] == "silu" and cfg["draft_vocab_size"] == w["lm_head.weight"].shape[0]
        self.H = layer_cfg["hidden_size"]
        self.nh, self.nkv = layer_cfg["num_attention_heads"], layer_cfg["num_key_value_heads"]
        self.d = layer_cfg.get("head_dim") or self.H // self.nh
        self.eps, self.theta = layer_cfg["rms_norm_eps"], layer_cfg["rope_theta"]
        self.vocab = layer_cfg["vocab_size"]
        assert w["fc.weight"].shape == (self.H, 3 * cfg["target_hidden_size"])
        self.w = {k.removeprefix(prefix): v for k, v in w.items()}
        self.embed = target_embed.float()                    # the engines take the target's embedding
        self.target_ids = torch.arange(w["d2t"].shape[0]) + w["d2t"]    # target = draft + d2t[draft]
        assert w["t2d"].dtype == torch.bool and w["t2d"].shape == (self.vocab,)
        assert torch.equal(w["t2d"].nonzero().flatten(), self.target_ids.sort().values)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def features(self, hidden_states) -> torch.Tensor:
        """Target hidden states (transformers' ``output_hidden_states``: index i = after i layers) -> fc input."""
        parts = [hidden_states[a][0].float() for a in self.capture]
        if self.fc_norm:                                     # one norm per captured state
            parts = [rms_norm(x, self.w[f"fc_norm.{i}.weight"], self.eps) for i, x in enumerate(parts)]
        x = torch.cat(parts, -1)
        if self.norm_before_fc:                              # one norm over all of them
            x = rms_norm(x, self.w["input_norm.weight"], self.eps)
        return x @ self.w["fc.weight"].T

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots (n, H) hidden + the next tokens (n,) at ``positions`` -> (the states the next step reads,
        full-vocab logits): pre-norm states, or normed ones under ``norm_output``. Attends causally to
        every slot run before (kept as this reader's cache)."""
        w, n = self.w, hidden.shape[0]
        normed = rms_norm(hidden, w["hidden_norm.weight"], self.eps)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([rms_norm(self.embed[tokens], w["input_layernorm.weight"], self.eps), normed], -1)
        q = rope((x @ w["self_attn.q_proj.weight"].T).view(n, self.nh, self.d), positions, self.theta)
        k = rope((x @ w["self_attn.k_proj.weight"].T).view(n, self.nkv, self.d), positions, self.theta)
        v = (x @ w["self_attn.v_proj.weight"].T).view(n, self.nkv, self.d)
        self.k.append(k)
        self.v.append(v)
        K, V = torch.cat(self.k), torch.cat(self.v)
        rep = self.nh // self.nkv
        K, V = K.repeat_interleave(rep, 1), V.repeat_interleave(rep, 1)
        T = K.shape[0]
        scores = torch.einsum("nhd,thd->hnt", q, K) / math.sqrt(self.d)
        allowed = torch.arange(T)[None, :] <= (T - n + torch.arange(n))[:, None]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        o = torch.einsum("hnt,thd->nhd", scores.softmax(-1), V).reshape(n, -1) @ w["self_attn.o_proj.weight"].T
        h = residual + o
        m = rms_norm(h, w["post_attention_layernorm.weight"], self.eps)
        h = h + (torch.nn.functional.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) @ w[
            "mlp.down_proj.weight"].T
        out = rms_norm(h, w["norm.weight"], self.eps)
        full = torch.full((n, self.vocab), float("-inf"))
        full[:, self.target_ids] = out @ w["lm_head.weight"].T
        return (out if self.norm_output else h), full


class MedusaHeads:
    """vLLM's (``medusa-vllm``) or TGI's (``medusa-tgi``) Medusa directory: full-vocabulary logits per head
    from the target's last hidden state."""

    def __init__(self, directory):
        directory = Path(directory)
        cfg = json.loads((directory / "config.json").read_text())
        if (directory / "medusa_lm_head.safetensors").is_file():          # TGI
            assert "architectures" not in cfg and cfg["base_model_name_or_path"]
            w = load_file(directory / "medusa_lm_head.safetensors")
            self.K, L = cfg["medusa_num_heads"], cfg["medusa_num_layers"]
            self.blocks = [[(w[f"{h}.{l}.linear.weight"], w[f"{h}.{l}.linear.bias"]) for l in range(L)]
                           for h in range(self.K)]
            self.lm = [w[f"{h}.{L}.weight"] for h in range(self.K)]
            self.token_map, self.vocab = None, self.lm[0].shape[0]
        else:                                                              # vLLM
            assert cfg["architectures"] == ["MedusaModel"] and cfg["medusa_fc_bias"] is True
            w = load_file(directory / "model.safetensors")
            self.K, L = cfg["num_heads"], cfg["num_hidden_layers"]
            self.blocks = [[(w[f"blocks.{h}.layers.{l}.weight"], w[f"blocks.{h}.layers.{l}.bias"]) for l in range(L)]
                           for h in range(self.K)]
            self.lm = [w[f"lm_heads.{h}.weight"] for h in range(self.K)]
            self.vocab = cfg["vocab_size"]
            truncated = cfg["truncated_vocab_size"]
            assert self.lm[0].shape[0] == truncated
            self.token_map = w["token_map"] if truncated < self.vocab else None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(H,) post-norm hidden -> (K, V) logits, -inf outside a truncated vocabulary."""
        rows = []
        for blocks, lm in zip(self.blocks, self.lm):
            x = hidden.float()
            for weight, bias in blocks:
                x = x + torch.nn.functional.silu(x @ weight.float().T + bias.float())
            logits = x @ lm.float().T
            if self.token_map is not None:
                full = torch.full((self.vocab,), float("-inf"))
                full[self.token_map] = logits
                logits = full
            rows.append(logits)
        return torch.stack(rows)
