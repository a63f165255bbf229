"""What `selfspec tune-tree --draft-model` measured fastest for a (target, draft model) pair.

Heads keep their tuned settings in their own ``config.json``; a draft model is somebody else's
checkpoint, so the pick for a pair lives under ``$SELFSPEC_HOME/tuned/draft-model/<key>.json``,
keyed by both models (their shape fingerprints and a sample of their embedding weights, so a
fine-tune of the same shape is a different pair). ``SelfSpeculativeModel`` reads it when the
draft-model drafter's tree or threshold is "auto"; with no record the drafter's defaults apply.
As for heads, the picks are kept per kind of device (``DecodeSettings.devices``: the CPU's at the top
level), and so are the timings behind them (``pair_searches``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .core.backbone import config_fingerprint
from .io import atomic_write_text
from .loading import selfspec_home
from .settings import HOME_DEVICE, DecodeSettings

SAMPLED_SEARCH_KEY = "sampled_search"   # a record's sampled timings (``tune-tree --temperature``), beside the greedy ones
DEVICE_SEARCHES_KEY = "device_searches"  # the timings on other kinds of device: {device: {"greedy": ..., "sampled": ...}}


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
        others = record.get(DEVICE_SEARCHES_KEY, {})
        if not isinstance(others, dict) or not all(isinstance(m, dict) and set(m) <= {"greedy", "sampled"}
                                                   for m in others.values()):
            raise ValueError(f"{DEVICE_SEARCHES_KEY} is not {{device: {{greedy, sampled}}}}")
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a tune-tree record ({e}): delete it, or run `selfspec tune-tree "
                         "--draft-model` again") from None
    return record


def pair_decode(target, draft) -> DecodeSettings | None:
    """The pair's tuned settings (what "auto" resolves to), or None."""
    record = read_pair_record(target, draft)
    return None if record is None else DecodeSettings.from_json(record["decode"])


def pair_searches(record: dict) -> dict[tuple[str, bool], dict]:
    """A record's timings by (kind of device, sampled): the CPU's greedy ones at its top level (where
    they always were), its sampled ones under ``SAMPLED_SEARCH_KEY``, other devices' under
    ``DEVICE_SEARCHES_KEY``."""
    out = {}
    top = {k: v for k, v in record.items() if k not in ("decode", SAMPLED_SEARCH_KEY, DEVICE_SEARCHES_KEY)}
    if top:
        out[HOME_DEVICE, False] = top
    if record.get(SAMPLED_SEARCH_KEY):
        out[HOME_DEVICE, True] = record[SAMPLED_SEARCH_KEY]
    for device, modes in record.get(DEVICE_SEARCHES_KEY, {}).items():
        for mode, search in modes.items():
            out[device, mode == "sampled"] = search
    return out


def write_pair_record(target, draft, decode: DecodeSettings, searches: dict[tuple[str, bool], dict]) -> Path:
    """The pair's picks (``decode``: its ``sampled`` settings and other devices' included) and the timings
    behind them, by (kind of device, sampled) as ``pair_searches`` reads them back."""
    path = pair_record_path(target, draft)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"decode": decode.to_json(), **searches.get((HOME_DEVICE, False), {})}
    if searches.get((HOME_DEVICE, True)):
        record[SAMPLED_SEARCH_KEY] = searches[HOME_DEVICE, True]
    others: dict = {}
    for (device, sampled), search in sorted(searches.items()):
        if device != HOME_DEVICE and search:
            others.setdefault(device, {})["sampled" if sampled else "greedy"] = search
    if others:
        record[DEVICE_SEARCHES_KEY] = others
    atomic_write_text(path, json.dumps(record, indent=1))
    return path
