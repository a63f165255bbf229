"""Trainable draft heads and their on-disk format.

* ``MedusaHeads``: K residual blocks on the target's last (post-norm) hidden state; head k
  (1-based) predicts the token k positions after the target's own next token. With
  ``token_input`` each block also reads the embedding of that next token (the tree's root, which
  is known when drafting), so head 1 need not guess which token comes in between. ``head_mlp``
  gives chosen heads a second, wider residual MLP after the block: more capacity where the
  single block underfits. Everything is zero-initialised, so an untrained head repeats the
  target's own next-token prediction, and adding the MLP to trained heads keeps what they do.
* ``EagleHead`` (``models/eagle.py``): one decoder layer over the target's fused low/mid/high
  features and the next token's embedding, drafting autoregressively (EAGLE-3 design), with its
  own LM head over a draft vocabulary.
* ``ExitHead``: a residual MLP on the hidden state after decoder layer E, followed by the
  target's final norm and LM head. Zero-initialised: untrained, it *is* plain early exit.

Both feed the target's shared LM head (not stored here). A heads directory holds
``config.json`` (kind, base model name and config fingerprint, sizes, exit layer, selfspec
version; ``decode``: the per-step settings tune-tree measured fastest; ``provenance``: how they were
trained) and ``model.safetensors``. Loading refuses heads made for another model.
"""

from __future__ import annotations

import copy
import json
import os
import struct
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from . import __version__
from .core.backbone import cache_argument
from .io import atomic_path, atomic_write_text
from .models.stacked import decoding, stacked
from .settings import HOME_DEVICE, DecodeSettings, is_device_type

KINDS = ("medusa", "early-exit", "eagle")


@dataclass
class HeadsConfig:
    kind: str
    base_model: str
    base_fingerprint: str
    hidden_size: int
    vocab_size: int
    num_heads: int = 0              # medusa
    token_input: bool = False       # medusa: heads also read the embedding of the root (the target's next token)
    head_mlp: list = field(default_factory=list)  # medusa: width of head k's extra residual MLP (0 or absent = none)
    exit_layer: int | None = None   # early-exit
    adapter: str = "mlp"            # early-exit adapter: "mlp" (residual MLP) or "layer" (a decoder layer)
    intermediate_size: int = 0      # early-exit "mlp" adapter width; eagle: the layer's MLP width
    aux_layers: list = field(default_factory=list)  # eagle: target hidden states after these layers feed the head
    attn_heads: int = 0             # eagle: attention shape of its one layer (the target's by default)
    kv_heads: int = 0
    head_dim: int = 0
    rms_eps: float = 1e-6
    shared_lm_head: bool = False    # eagle: the LM head is the target's own rows (draft vocabulary), frozen and not stored
    draft_vocab_size: int = 0       # 0 = the full vocabulary; else heads score only `draft_vocab` tokens
    # eagle, variants of the EAGLE-3 layer that drafts trained elsewhere use (speculators' training defaults):
    norm_before_residual: bool = False  # the layer's residual is hidden_norm(feature), not the feature itself
    feature_norm: str = ""          # "concat": one RMSNorm over the aux states before fc; "per_layer": one per aux state
    norm_output: bool = False       # a draft step passes norm(state) on, and scores it without a second norm
    lora: dict | None = None        # set when the backbone was fine-tuned with the heads (Medusa-2): output changes
    storage_dtype: str = "float32"  # how model.safetensors stores floating tensors (float16 halves a checkpoint)
    selfspec_version: str = __version__
    decode: DecodeSettings = field(default_factory=DecodeSettings)  # per-step settings tune-tree measured fastest ("auto")
    provenance: dict = field(default_factory=dict)  # how they were trained: data, rows, steps, tokens, wall time, held-out accuracy


# Keys of the one untyped ``extra`` section that configs written before selfspec 0.2 carry.
_LEGACY_DECODE_KEYS = ("tree", "threshold", "gate", "lookup")


def _migrated(raw: dict) -> dict:
    """A config.json from before the ``decode`` / ``provenance`` split, in today's layout (its
    tune-tree timings, once under ``extra``, stay readable as ``provenance["tree_search"]``)."""
    if "extra" not in raw:
        return raw
    raw = dict(raw)
    extra = raw.pop("extra") or {}
    raw.setdefault("decode", {k: extra[k] for k in _LEGACY_DECODE_KEYS if k in extra})
    raw.setdefault("provenance", {k: v for k, v in extra.items() if k not in _LEGACY_DECODE_KEYS})
    return raw


class ResidualMLP(nn.Module):
    """x + down(SiLU(up(RMSNorm(x)))); ``down`` is zero-initialised, so untrained it is the identity.

    The input norm matters: mid-depth residual streams have large, uneven scales, and an MLP fed
    with them directly trains unstably.
    """

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.up = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)
        nn.init.zeros_(self.down.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.down(nn.functional.silu(self.up(self.norm(hidden))))


class ResBlock(nn.Module):
    """x + SiLU(W x + U e + b), zero-initialised so it starts as the identity (U: only with a token
    input e), then optionally a wider ``ResidualMLP`` (width ``mlp``)."""

    def __init__(self, hidden_size: int, *, token_input: bool = False, mlp: int = 0):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.token = nn.Linear(hidden_size, hidden_size, bias=False) if token_input else None
        if self.token is not None:
            nn.init.zeros_(self.token.weight)
        self.mlp = ResidualMLP(hidden_size, mlp) if mlp else None

    def forward(self, x: torch.Tensor, e: torch.Tensor | None = None) -> torch.Tensor:
        pre = self.linear(x) if self.token is None else self.linear(x) + self.token(e)
        y = x + nn.functional.silu(pre)
        return y if self.mlp is None else self.mlp(y)


def head_widths(head_mlp, num_heads: int) -> list[int]:
    """One extra-MLP width per head (0 = none): ``head_mlp`` padded with zeros to ``num_heads``."""
    if any(w < 0 for w in head_mlp) or len(head_mlp) > num_heads:
        raise ValueError(f"head_mlp gives one width >= 0 per head, at most {num_heads} (got {list(head_mlp)})")
    return [int(w) for w in head_mlp] + [0] * (num_heads - len(head_mlp))


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, *, token_input: bool = False, head_mlp=()):
        super().__init__()
        self.token_input = token_input
        self.blocks = nn.ModuleList(ResBlock(hidden_size, token_input=token_input, mlp=w)
                                    for w in head_widths(head_mlp, num_heads))

    def forward(self, hidden: torch.Tensor, root_embedding: torch.Tensor | None = None) -> torch.Tensor:
        """(..., H) post-norm hidden [+ (..., H) embedding of the token it produced] -> (..., K, H) LM-head inputs."""
        if self.token_input and root_embedding is None:
            raise ValueError("these Medusa heads read the root token: pass root_embedding")
        e = root_embedding if self.token_input else None
        if decoding() and all(block.mlp is None for block in self.blocks):   # every head in one product
            blocks, shape = self.blocks, (*hidden.shape[:-1], len(self.blocks), hidden.shape[-1])
            pre = nn.functional.linear(hidden, stacked(self, "w", [b.linear.weight for b in blocks]),
                                       stacked(self, "b", [b.linear.bias for b in blocks]))
            if e is not None:
                pre = pre + nn.functional.linear(e, stacked(self, "token", [b.token.weight for b in blocks]))
            return hidden[..., None, :] + nn.functional.silu(pre.view(shape))
        return torch.stack([block(hidden, e) for block in self.blocks], dim=-2)


class ExitHead(ResidualMLP):
    """The "mlp" exit adapter: a pre-norm residual MLP on layer-E hidden states, whose output goes
    to the final norm + LM head. Untrained (``down`` zero) it is plain early exit."""


class ExitLayerHead(nn.Module):
    """One decoder layer on layer-E hidden states, initialised from layer E with its residual writes
    zeroed (untrained: plain early exit). Unlike the MLP it attends over earlier positions, so the
    drafter keeps a KV cache for it (see drafters/early_exit.py). Output: final norm + LM head."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, hidden, *, position_embeddings, position_ids=None, attention_mask=None, cache=None):
        """(B, n, H) -> (B, n, H). Without a mask and cache, attention is causal over the n positions."""
        return self.layer(hidden, attention_mask=attention_mask, position_ids=position_ids,
                          **{cache_argument(self.layer): cache}, use_cache=cache is not None,
                          position_embeddings=position_embeddings)


@dataclass
class Heads:
    config: HeadsConfig
    module: nn.Module
    draft_vocab: torch.Tensor | None = None  # (V_draft,) token ids the heads may propose; None = all


def heads_in_dtype(heads: Heads, dtype: torch.dtype) -> Heads:
    """``heads`` with a module in ``dtype``: themselves, or a converted copy where the dtype differs."""
    if next(heads.module.parameters()).dtype == dtype:
        return heads
    return replace(heads, module=copy.deepcopy(heads.module).to(dtype))


def build_heads(config: HeadsConfig, *, model=None) -> nn.Module:
    """``model`` (the target) is needed only for the "layer" exit adapter, a copy of one of its layers."""
    if config.kind == "medusa":
        return MedusaHeads(config.hidden_size, config.num_heads, token_input=config.token_input,
                           head_mlp=config.head_mlp)
    if config.kind == "eagle":
        from .models.eagle import EagleHead

        return EagleHead(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                         num_heads=config.attn_heads, num_kv_heads=config.kv_heads, head_dim=config.head_dim,
                         num_aux=len(config.aux_layers), draft_vocab_size=config.draft_vocab_size or config.vocab_size,
                         eps=config.rms_eps, norm_before_residual=config.norm_before_residual,
                         feature_norm=config.feature_norm, norm_output=config.norm_output)
    if config.kind == "early-exit" and config.adapter == "layer":
        if model is None:
            raise ValueError("a 'layer' exit adapter is built from the target model: pass model=")
        from .core.backbone import Backbone

        return ExitLayerHead(Backbone(model).clone_layer(config.exit_layer, residual_writes=False))
    if config.kind == "early-exit" and config.adapter == "mlp":
        return ExitHead(config.hidden_size, config.intermediate_size)
    if config.kind == "early-exit":
        raise ValueError(f"unknown exit adapter {config.adapter!r}: expected 'mlp' or 'layer'")
    raise ValueError(f"unknown heads kind {config.kind!r}: expected one of {', '.join(KINDS)}")


def shared_tensors(config: HeadsConfig) -> set[str]:
    """Module tensors that are copies of the target's and so are not stored (rebuilt at load)."""
    return {"lm_head.weight"} if config.kind == "eagle" and config.shared_lm_head else set()


def save_heads(heads: Heads, directory: str | os.PathLike) -> None:
    """Write config.json + model.safetensors atomically (temporary files, then rename)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    store = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(heads.config.storage_dtype)
    if store is None:
        raise ValueError(f"storage_dtype must be float32, float16 or bfloat16 (got {heads.config.storage_dtype!r})")
    tensors = {k: (v.to(store) if v.is_floating_point() else v).detach().cpu().contiguous()
               for k, v in heads.module.state_dict().items() if k not in shared_tensors(heads.config)}
    if heads.draft_vocab is not None:
        tensors["draft_vocab"] = heads.draft_vocab.detach().cpu().to(torch.int64)
    with atomic_path(directory / "model.safetensors") as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})
    write_heads_config(directory, asdict(heads.config))


def write_heads_config(directory: str | os.PathLike, config: dict) -> None:
    """Replace ``directory/config.json`` atomically (also how tune-tree re-records a choice)."""
    if isinstance(config.get("decode"), dict):   # callers pass ``asdict`` of a HeadsConfig
        config = {**config, "decode": DecodeSettings.json_of(config["decode"])}
    atomic_write_text(Path(directory) / "config.json", json.dumps(config, indent=2))


def check_safetensors(path: Path) -> None:
    """Refuse a safetensors file whose header is unreadable or whose tensors run past its end (a
    truncated copy), reading only the header: the loader's own error on such a file is a Rust panic text."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError
            header = json.loads(f.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError):
        raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt): copy it again or "
                         "retrain the heads") from None
    if 8 + n + end > size:
        raise ValueError(f"{path} is truncated ({size} bytes, its header describes {8 + n + end}): copy it again or "
                         "retrain the heads")


SEARCH_FILE = "tune-tree.json"
SAMPLED_SEARCH_FILE = "tune-tree-sampled.json"   # ``--temperature``: the timings behind ``decode.sampled``


def search_file(*, sampled: bool = False, device: str = HOME_DEVICE) -> str:
    """Where a heads directory keeps the timings behind its settings for one mode and kind of device:
    tune-tree.json / tune-tree-sampled.json for the CPU's, tune-tree-cuda.json / tune-tree-cuda-sampled.json
    for a GPU's."""
    if device == HOME_DEVICE:
        return SAMPLED_SEARCH_FILE if sampled else SEARCH_FILE
    return f"tune-tree-{device}{'-sampled' if sampled else ''}.json"


def recorded_devices(heads_dir) -> tuple[str, ...]:
    """The kinds of device tune-tree timed these heads on (the CPU first), from the record files present."""
    found = set()
    for path in Path(heads_dir).glob("tune-tree*.json"):   # search_file's names: tune-tree[-DEVICE][-sampled].json
        parts = path.stem.split("-")[2:]
        parts = parts[:-1] if parts and parts[-1] == "sampled" else parts
        kind = HOME_DEVICE if not parts else parts[0] if len(parts) == 1 and is_device_type(parts[0]) else None
        if kind:
            found.add(kind)
    return tuple(sorted(found, key=lambda k: (k != HOME_DEVICE, k)))


def recorded_search(heads_dir, *, sampled: bool = False, device: str = HOME_DEVICE) -> dict | None:
    """The candidates the last tune-tree run on this kind of device timed for these heads, greedy or
    (``sampled``) at a temperature (heads tuned before selfspec 0.2 keep the CPU's greedy ones in their
    provenance), or None."""
    path = Path(heads_dir) / search_file(sampled=sampled, device=device)
    if path.is_file():
        try:
            search = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            search = None
        if not isinstance(search, dict):
            raise ValueError(f"{path} is not a tune-tree record (corrupt JSON): delete it and run `selfspec tune-tree` again")
        return search
    return None if sampled or device != HOME_DEVICE else read_heads_config(heads_dir).provenance.get("tree_search")


# What a heads directory holds (and all a hub download of one fetches).
# tune-tree*.json: the timings behind the decode settings, per mode and device (search_file).
HEADS_FILES = ("config.json", "model.safetensors", "README.md", "tune-tree*.json")


def heads_directory(heads: str | os.PathLike) -> Path:
    """A local heads directory for ``heads``: the path itself, or, for a hub id (owner/name) that is no
    local path, the hub's copy (downloaded once into the Hugging Face cache; offline, that cache)."""
    path = Path(heads).expanduser()
    text = str(heads)
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        return path
    from .loading import _HUB_ID

    if not _HUB_ID.match(text):
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(text, allow_patterns=[*HEADS_FILES, "lora/*"]))
    except Exception as e:   # offline without a cached copy, unknown repo, no access: all one answer
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise FileNotFoundError(f"heads {text!r} is no local directory and the hub could not provide it ({reason[:160]}): "
                                "pass a heads directory, or go online once to cache it") from None


def _read_eagle3(directory: Path, raw: dict, expect_kind: str | None) -> HeadsConfig:
    if expect_kind is not None and expect_kind != "eagle":
        raise _Refused(f"{directory} holds an EAGLE-3 draft, but the drafter is {expect_kind!r}: pass --drafter eagle")
    try:
        config = imported_config(raw, where=str(directory))
        check_safetensors(directory / "model.safetensors")
    except ValueError as e:
        raise _Refused(str(e)) from None
    return config


class _Refused(ValueError):
    """A heads directory that is readable but not usable here: its message stands as it is."""


def read_heads_config(directory: str | os.PathLike, *, expect_kind: str | None = None) -> HeadsConfig:
    """A heads directory's config, checked without loading any tensor: the files are there and whole,
    config.json is valid, and (given ``expect_kind``) the heads are of the kind the drafter needs.
    ``directory`` may also be a hub id (see :func:`heads_directory`)."""
    directory = heads_directory(directory)
    cfg_path, weights = directory / "config.json", directory / "model.safetensors"
    if not directory.is_dir():
        raise FileNotFoundError(f"heads directory {directory} does not exist: pass a directory from `selfspec train-heads`")
    if not cfg_path.is_file() or not weights.is_file():
        raise ValueError(f"{directory} is not a heads directory (needs config.json and model.safetensors): "
                         "pass a directory from `selfspec train-heads`")
    try:
        raw = json.loads(cfg_path.read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        if is_eagle3(raw):   # an EAGLE-3 draft exported by selfspec or trained elsewhere (SGLang / speculators layout)
            return _read_eagle3(directory, raw, expect_kind)
        raw = _migrated(raw)
        known = set(HeadsConfig.__dataclass_fields__)
        config = HeadsConfig(**{**{k: v for k, v in raw.items() if k in known},
                                "decode": DecodeSettings.from_json(raw.get("decode"))})
        if not isinstance(config.provenance, dict):
            raise ValueError("its provenance section must be a mapping")
    except _Refused:
        raise
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{cfg_path} is not a valid heads config ({reason}): copy the heads again or retrain them") from None
    if config.kind not in KINDS:
        raise ValueError(f"{cfg_path} names an unknown heads kind {config.kind!r} (expected one of {', '.join(KINDS)})")
    if expect_kind is not None and config.kind != expect_kind:
        raise ValueError(f"{directory} holds {config.kind!r} heads, but the drafter is {expect_kind!r}: pass "
                         f"--drafter {config.kind}, or heads trained with --kind {expect_kind}")
    check_safetensors(weights)
    return config


def load_heads(directory: str | os.PathLike, *, expect_kind: str, fingerprint: str, device=None, dtype=None,
               model=None) -> Heads:
    directory = heads_directory(directory)
    config = read_heads_config(directory, expect_kind=expect_kind)
    imported = "imported_from" in config.provenance   # an EAGLE-3 directory: no fingerprint, its shapes are checked instead
    if imported:
        if model is None:
            raise ValueError(f"{directory} is an EAGLE-3 draft: pass model= (the target) to load it")
        check_against_target(config, model.config, str(directory))
    elif config.base_fingerprint != fingerprint:
        raise ValueError(
            f"{directory} was trained for {config.base_model!r} (config fingerprint {config.base_fingerprint}), "
            f"which does not match this model (fingerprint {fingerprint}): train heads for this model with `selfspec train-heads`"
        )
    try:
        tensors = load_file(directory / "model.safetensors")
    except Exception as e:  # safetensors raises its own SafetensorError (no ValueError) on a corrupt file
        raise ValueError(f"{directory}/model.safetensors could not be read ({type(e).__name__}): copy the heads "
                         "again or retrain them") from None
    if imported:
        tensors, draft_vocab = imported_tensors(tensors, config)
    else:
        draft_vocab = tensors.pop("draft_vocab", None)
    module = build_heads(config, model=model)
    shared = shared_tensors(config)
    if shared:
        if model is None:
            raise ValueError(f"{directory} shares the target's LM head: pass model= to load it")
        from .core.backbone import Backbone
        from .models.eagle import init_from_target

        init_from_target(module, Backbone(model), draft_vocab)
    missing = set(module.state_dict()) - set(tensors) - shared
    odd = sorted(missing | (set(tensors) - set(module.state_dict())))
    if odd and imported:   # e.g. a Qwen3-style layer's q_norm / k_norm: another layer than selfspec's head
        raise ValueError(f"{directory} is an EAGLE-3 draft selfspec cannot run: its tensors do not fit a one-layer "
                         f"Llama-style EAGLE-3 head (missing or unexpected: {', '.join(odd[:4])}"
                         f"{', ...' if len(odd) > 4 else ''}); pass such a draft, or train one with "
                         "`selfspec train-heads --kind eagle`")
    if odd:
        raise ValueError(f"{directory}/model.safetensors does not match its config.json (missing or unexpected tensors: "
                         f"{', '.join(odd)}): retrain or re-export the heads")
    module.load_state_dict(tensors, strict=False)  # copies into the module's own (float32) parameters
    module.to(device=device, dtype=dtype).eval()
    if draft_vocab is not None:
        draft_vocab = draft_vocab.to(device)
    return Heads(config=config, module=module, draft_vocab=draft_vocab)


# ------------------------------------------------------------------- EAGLE-3 directories (SGLang / speculators layouts)

SGLANG_ARCH = "LlamaForCausalLMEagle3"   # SGLang's architecture name for an EAGLE-3 draft
# Where an EAGLE-3 file keeps the head's one decoder layer, by layout.
LAYER_PREFIX = {"eagle3-sglang": "midlayer.", "eagle3-speculators": "layers.0."}


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
    from .models.eagle import default_aux_layers

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
