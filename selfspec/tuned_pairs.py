"""What `selfspec tune-tree --draft-model` measured fastest for a (target, draft model) pair.

Heads keep their tuned settings in their own ``config.json``; a draft model is somebody else's
checkpoint, so the pick for a pair lives under ``$SELFSPEC_HOME/tuned/draft-model/<key>.json``,
keyed by both models (their shape fingerprints and a sample of their embedding weights, so a
fine-tune of the same shape is a different pair). ``SelfSpeculativeModel`` reads it when the
draft-model drafter's tree or threshold is "auto"; with no record the drafter's defaults apply.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .backbone import config_fingerprint
from .io import atomic_write_text
from .loading import selfspec_home
from .settings import DecodeSettings


SAMPLED_SEARCH_KEY = "sampled_search"   # a record's sampled timings (``tune-tree --temperature``), beside the greedy ones


def model_key(model) -> str:
    """Shape fingerprint plus a few embedding weights rounded to bfloat16 (the same for a model
    loaded in float32, bfloat16 or converted after loading)."""
    w = model.get_input_embeddings().weight.detach()[:4, :16]
    h = hashlib.sha1(config_fingerprint(model.config).encode())
    h.update(w.to("cpu", torch.bfloat16).float().numpy().tobytes())
    return h.hexdigest()[:16]


def pair_record_path(target, draft) -> Path:
    return selfspec_home() / "tuned" / "draft-model" / f"{model_key(target)}-{model_key(draft)}.json"


def read_pair_record(target, draft) -> dict | None:
    """The pair's tune-tree record, or None when it was never tuned (a torn file: one-line error)."""
    path = pair_record_path(target, draft)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        DecodeSettings.from_json(record["decode"])
    except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a tune-tree record ({e}): delete it, or run `selfspec tune-tree "
                         "--draft-model` again") from None
    return record


def pair_decode(target, draft) -> DecodeSettings | None:
    """The pair's tuned settings (what "auto" resolves to), or None."""
    record = read_pair_record(target, draft)
    return None if record is None else DecodeSettings.from_json(record["decode"])


def write_pair_record(target, draft, decode: DecodeSettings, search: dict, *, sampled_search: dict | None = None) -> Path:
    """The pair's picks (``decode``, its ``sampled`` settings included) and the greedy timings behind them;
    ``sampled_search``: the timings behind the sampled ones (``tune-tree --temperature``), kept apart."""
    path = pair_record_path(target, draft)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = {} if sampled_search is None else {SAMPLED_SEARCH_KEY: sampled_search}
    atomic_write_text(path, json.dumps({"decode": decode.to_json(), **search, **extra}, indent=1))
    return path
