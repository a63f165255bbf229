"""Self-distillation data: the target model answers prompts itself, stored as resumable Arrow shards.

On-disk layout of ``out_dir``::

    meta.json          settings the data was made with; a rerun with different settings is refused
    shard-00000/       one ``datasets.Dataset.save_to_disk`` directory per chunk of prompts
    shard-00001/ ...

Each row: ``id`` (str), ``input_ids`` (prompt tokens then response tokens, no padding; uint16 when the
vocabulary fits, else int32, as ``meta.json``'s ``token_dtype`` says; loading gives int32 either way),
``response_start`` (index of the first response token) and ``n_response`` (number of response tokens).
A response ends after the first EOS token, which is kept; a response without EOS ran to ``max_new_tokens``.

Prompt tokens are exactly what the target saw: the chat template with the generation prompt when the
tokenizer has one, else the raw prompt with the tokenizer's special tokens. A prompt longer than
``max_prompt_tokens`` is truncated from the left (its end is kept), because the end holds the question
and the template's assistant header, which the response is conditioned on.

Resuming: shards appear by ``os.rename`` of a finished temporary directory, so a killed run leaves
only whole shards (plus a ``.tmp-*`` directory that the next run deletes); a rerun skips every prompt
id already stored. Ids identify prompts: a stored id is never regenerated, even if its text changed.

CLI: ``python -m selfspec.training.data --model smollm2-135m --prompts FILE --out DIR``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
from tqdm.auto import tqdm

from ..io import atomic_dir, atomic_write_text, prompt_ids, remove_stale_temporaries
from .cli_args import at_least, check_input_file

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
META_FILE = "meta.json"
SHARD_PREFIX = "shard-"
TMP_PREFIX = ".tmp-"
# Settings that change what a row means; appending rows made under different values is refused.
# The seed is recorded but not compared: other seeds give other samples of the same distribution.
COMPARED_SETTINGS = ("format", "model", "max_new_tokens", "temperature", "max_prompt_tokens", "prompt_format", "eos_token_ids",
                     "answers")


@dataclass(frozen=True)
class DataGenConfig:
    """Defaults for generation; the CLI flags are derived from these fields."""

    max_new_tokens: int = 128
    batch_size: int = 64
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0
    max_prompt_tokens: int = 512
    shard_size: int = 8  # batches per shard: the most work a killed run can lose
    static_cache: bool = False  # one shape for every batch on a preallocated KV cache (see generate_distillation_data)


@dataclass(frozen=True)
class GenerationSummary:
    """What one CLI run did; ``generated``/``response_tokens``/``wall_s`` count this run only."""

    prompts: int
    generated: int
    skipped: int
    response_tokens: int
    wall_s: float
    rows: int
    out: str

    @property
    def tokens_per_s(self) -> float:
        return self.response_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def line(self) -> str:
        return (
            f"gen-data: {self.prompts} prompts ({self.generated} generated, {self.skipped} already stored), "
            f"{self.response_tokens} response tokens in {self.wall_s:.1f} s = {self.tokens_per_s:.1f} tok/s "
            f"-> {self.out} ({self.rows} rows)"
        )


# ---------------------------------------------------------------------------------------------- prompts


def load_prompts(source, *, max_prompts: int | None = None, split: str = "train") -> list[dict]:
    """Read prompts as ``[{"id": str, "prompt": str, ...}]`` in source order, at most ``max_prompts``.

    ``source`` is a ``.jsonl`` file (one JSON object per line with a "prompt"; a row without "id" gets
    its 0-based line index as id), a directory written by ``Dataset.save_to_disk``, or anything
    ``datasets.load_dataset`` accepts (a hub name, a data file, a dataset script directory), read from
    ``split`` with its "prompt" column. Raises ValueError (one line: what is wrong, how to fix it) for
    a missing source, invalid JSON, a row without a non-empty string prompt, or duplicate ids.
    """
    if max_prompts is not None and max_prompts < 0:
        raise ValueError(f"max_prompts must be >= 0, got {max_prompts}")
    path = Path(str(source)).expanduser()
    if path.suffix == ".jsonl":
        if not path.is_file():
            raise ValueError(f"prompt file {path} does not exist: pass a JSONL file with one {{\"prompt\": ...}} per line")
        rows = _read_jsonl(path, max_prompts=max_prompts)
    else:
        rows = _read_dataset(str(source), path=path, split=split, max_prompts=max_prompts)
    seen = set()
    for row in rows:
        if row["id"] in seen:
            raise ValueError(f"{source}: id {row['id']!r} appears twice: prompt ids must be unique")
        seen.add(row["id"])
    return rows


def select_prompts(rows: list[dict], *, sources: str | list[str] | None = None, samples: int = 1) -> list[dict]:
    """Keep the rows whose "source" is in ``sources`` (a list or "a,b"; all when None/empty), each repeated ``samples`` times.

    Copy k of a prompt gets the id ``<id>~<k>``: ids stay unique, a resumed run skips the copies it
    already stored, and each copy's batch seeds its own sample (so ``samples > 1`` needs sampling).
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if isinstance(sources, str):
        sources = [s.strip() for s in sources.split(",") if s.strip()]
    if sources:
        known = {row.get("source") for row in rows}
        missing = [s for s in sources if s not in known]
        if missing:
            raise ValueError(f"no prompt has source {', '.join(map(repr, missing))} (sources present: "
                             f"{', '.join(sorted(str(k) for k in known))}): fix --sources")
        rows = [row for row in rows if row.get("source") in sources]
    if samples == 1:
        return rows
    return [{**row, "id": f"{row['id']}~{k}"} for row in rows for k in range(samples)]


def _read_jsonl(path: Path, *, max_prompts: int | None) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for index, line in enumerate(f):
            if max_prompts is not None and len(rows) >= max_prompts:
                break
            if not line.strip():
                continue  # a trailing blank line is common and harmless; it still counts as a line index
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{index + 1}: invalid JSON ({e.msg}): each line must be one JSON object") from None
            except RecursionError:
                raise ValueError(f"{path}:{index + 1}: JSON nested too deeply to read: each line must be one flat "
                                 "JSON object") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{index + 1}: expected a JSON object with a \"prompt\" key, got {type(row).__name__}")
            rows.append(_check_row(row, index=index, where=f"{path}:{index + 1}"))
    return rows


def _read_dataset(source: str, *, path: Path, split: str, max_prompts: int | None) -> list[dict]:
    if path.is_dir() and (path / "state.json").is_file():
        ds = datasets.load_from_disk(str(path))
    else:
        try:
            ds = datasets.load_dataset(source, split=split)
        except (FileNotFoundError, ConnectionError, datasets.exceptions.DatasetNotFoundError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(
                f"cannot load prompts from {source!r}: {first} (pass a .jsonl file, a saved dataset directory, "
                f"or a dataset name available offline)"
            ) from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"{source} has no split {split!r} (splits: {', '.join(ds)}): pick one of them")
        ds = ds[split]
    if "prompt" not in ds.column_names:
        raise ValueError(
            f"{source} has no 'prompt' column (columns: {', '.join(ds.column_names)}): rename the column holding the prompts to 'prompt'"
        )
    if max_prompts is not None:
        ds = ds.select(range(min(max_prompts, len(ds))))
    return [_check_row(dict(row), index=index, where=f"{source} row {index}") for index, row in enumerate(ds)]


def _check_row(row: dict, *, index: int, where: str) -> dict:
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: no prompt (need a non-empty string under \"prompt\"): fix or drop that row")
    row_id = row.get("id")
    row["id"] = str(index) if row_id is None else str(row_id)
    return row


# ---------------------------------------------------------------------------------------------- tokens


def uses_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_token_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """The token ids the target model is given for each prompt (untruncated).

    With a chat template: the template applied to one user turn plus the generation prompt, then
    tokenized without adding special tokens again (the template already wrote them). Without one:
    the raw prompt with the tokenizer's usual special tokens (e.g. BOS).
    """
    chat = uses_chat_template(tokenizer)
    return [prompt_ids(tokenizer, p, chat=chat) for p in prompts]


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every token that ends a response: the model's generation-config EOS ids plus the tokenizer's."""
    ids = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else value)
    if not ids:
        raise ValueError("neither the model's generation_config nor the tokenizer defines an EOS token: set tokenizer.eos_token")
    return sorted(int(i) for i in ids)


def cut_after_eos(tokens: list[int], eos_ids) -> list[int]:
    """Keep tokens up to and including the first EOS (everything after it is generate's padding)."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens


def token_dtype(vocab_size: int) -> str:
    """How token ids are stored: uint16 where the vocabulary fits (half of int32), else int32."""
    return "uint16" if vocab_size <= 65536 else "int32"


def _features(tokens: str = "int32") -> datasets.Features:
    return datasets.Features(
        {
            "id": datasets.Value("string"),
            "input_ids": datasets.Sequence(datasets.Value(tokens)),  # a List on datasets >= 4
            "response_start": datasets.Value("int32"),
            "n_response": datasets.Value("int32"),
        }
    )


# ---------------------------------------------------------------------------------------------- generation


def generate_distillation_data(
    model,
    tokenizer,
    prompts: list[dict],
    out_dir,
    *,
    max_new_tokens: int = DataGenConfig.max_new_tokens,
    batch_size: int = DataGenConfig.batch_size,
    temperature: float = DataGenConfig.temperature,
    seed: int = DataGenConfig.seed,
    max_prompt_tokens: int = DataGenConfig.max_prompt_tokens,
    shard_size: int = DataGenConfig.shard_size,
    model_name: str | None = None,
    progress: bool = True,
    references: bool = False,
    static_cache: bool = DataGenConfig.static_cache,
) -> datasets.Dataset:
    """Let ``model`` answer every prompt whose id is not yet in ``out_dir``; return all rows stored there.

    ``references=True`` (teacher forcing) stores each prompt's own ``reference`` text as its answer
    instead of generating one (at most ``max_new_tokens`` tokens, EOS appended when it fits):
    training then runs the target over prompt + reference and learns the target's distributions
    at every position, which costs one forward pass instead of a generation. Prompts without a
    reference are left out.

    ``prompts`` are rows as returned by :func:`load_prompts` (unique "id", "prompt"). Pending prompts
    are sorted longest first (less padding per batch, and a batch size that does not fit in memory
    fails in the first minute rather than the last), left-padded into batches of ``batch_size`` and
    passed to ``model.generate``: greedy when ``temperature == 0``, else plain sampling at
    ``temperature`` (no top-k/top-p, so the data follows the model's own distribution) with the RNG
    seeded from ``seed`` and the batch's ids, so a rerun of the same batches samples the same tokens.
    Every ``shard_size`` batches become one shard. ``model_name`` (default: ``model.config.name_or_path``)
    goes into ``meta.json``; ValueError if ``out_dir`` was made with other settings (see
    ``COMPARED_SETTINGS``) or another run is writing to it. The returned rows are in shard order.

    ``static_cache=True`` gives every ``generate`` call one shape: prompts left-padded to
    ``max_prompt_tokens`` (and taken in their given order, not longest first), a short last batch
    filled up to ``batch_size`` with copies of its first prompt (their answers are dropped), and
    transformers' preallocated ("static") KV cache. On a GPU,
    transformers then compiles the decoding step (CUDA graphs) once for the whole run, instead of
    paying Python and kernel launches for every layer of every token, which is what bounds eager
    generation of a small model at any batch size. Greedy answers are the same either way (up to
    float rounding in the attention over the padded width); sampled ones are other draws.
    """
    if batch_size < 1 or shard_size < 1 or max_new_tokens < 1 or max_prompt_tokens < 1:
        raise ValueError("batch_size, shard_size, max_new_tokens and max_prompt_tokens must all be >= 1")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    prompts = [{**row, "id": str(row["id"])} for row in prompts]  # ids are stored as strings; compare them as such
    if len({row["id"] for row in prompts}) != len(prompts):
        raise ValueError("prompt ids are not unique: give every prompt its own id")
    out_dir = Path(out_dir)
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    meta = {
        "format": FORMAT_VERSION,
        "model": model_name or getattr(model.config, "name_or_path", "") or type(model).__name__,
        "max_new_tokens": int(max_new_tokens),
        "temperature": float(temperature),
        "max_prompt_tokens": int(max_prompt_tokens),
        "prompt_format": "chat" if uses_chat_template(tokenizer) else "raw",
        "eos_token_ids": eos_ids,
        "seed": int(seed),
        "vocab_size": len(tokenizer),
        "token_dtype": token_dtype(len(tokenizer)),
        "answers": "reference" if references else "generated",
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(out_dir):
        remove_stale_temporaries(out_dir)   # the directory lock guarantees no live writer owns them
        _check_or_write_meta(out_dir, meta)
        tokens = read_meta(out_dir).get("token_dtype", "int32")   # a directory keeps the layout it began with
        shards = _finished_shards(out_dir)
        done = _stored_ids(shards)
        pending = [row for row in prompts if row["id"] not in done]
        if references:
            pending = [row for row in pending if isinstance(row.get("reference"), str) and row["reference"].strip()]
        log.info("%d prompts: %d already stored in %s, %d to generate", len(prompts), len(prompts) - len(pending), out_dir, len(pending))
        token_ids = prompt_token_ids(tokenizer, [row["prompt"] for row in pending]) if pending else []
        n_truncated = sum(len(t) > max_prompt_tokens for t in token_ids)
        if n_truncated:
            log.warning("%d prompts longer than %d tokens keep only their last %d", n_truncated, max_prompt_tokens, max_prompt_tokens)
        # Longest first (less padding); ties keep source order, so the batches are a pure function of the
        # pending set. A static cache pads every batch to one width anyway: there the source order stays,
        # so a run stopped early has answered a fair sample of the prompts, not the longest ones.
        work = [(row["id"], t[-max_prompt_tokens:]) for row, t in zip(pending, token_ids)]
        if not static_cache:
            work.sort(key=lambda item: -len(item[1]))
        refs = {row["id"]: row["reference"] for row in pending} if references else {}
        first_shard = 1 + max((int(p.name[len(SHARD_PREFIX):]) for p in shards), default=-1)
        per_shard = batch_size * shard_size
        started, n_tokens = time.perf_counter(), 0
        with tqdm(total=len(work), unit="prompt", disable=not progress, desc="gen-data", file=sys.stderr) as bar:
            for shard_no, lo in enumerate(range(0, len(work), per_shard)):
                rows = []
                for b in range(lo, min(lo + per_shard, len(work)), batch_size):
                    batch = work[b : b + batch_size]
                    if references:
                        rows += _reference_batch(tokenizer, batch, refs, eos_id=eos_ids[0], max_new_tokens=max_new_tokens)
                    else:
                        rows += _answer_batch(
                            model, batch, pad_id=pad_id, eos_ids=eos_ids, max_new_tokens=max_new_tokens,
                            temperature=temperature, seed=_batch_seed(seed, [row_id for row_id, _ in batch]),
                            shape=(batch_size, max_prompt_tokens) if static_cache else None,
                        )
                    n_tokens += sum(row["n_response"] for row in rows[-len(batch):])
                    bar.update(len(batch))
                    bar.set_postfix(tok_s=f"{n_tokens / (time.perf_counter() - started):.1f}")
                _write_shard(out_dir, index=first_shard + shard_no, rows=rows, tokens=tokens)
    return load_distillation_data(out_dir)


def _batch_seed(seed: int, batch_ids: list[str]) -> int:
    # Keyed on the batch's ids, not its position, so a resumed run reproduces the batches it redoes.
    return zlib.crc32(("\x1f".join([str(seed), *batch_ids])).encode())


def _reference_batch(tokenizer, batch: list[tuple[str, list[int]]], refs: dict, *, eos_id: int,
                     max_new_tokens: int) -> list[dict]:
    """Rows whose answer is the prompt's reference text (teacher forcing), cut to ``max_new_tokens``."""
    answers = tokenizer([refs[row_id] for row_id, _ in batch], add_special_tokens=False)["input_ids"]
    rows = []
    for (row_id, prompt), answer in zip(batch, answers):
        response = (answer + [eos_id])[:max_new_tokens]
        rows.append({"id": row_id, "input_ids": prompt + response, "response_start": len(prompt), "n_response": len(response)})
    return rows


def _answer_batch(model, batch: list[tuple[str, list[int]]], *, pad_id: int, eos_ids: list[int], max_new_tokens: int,
                  temperature: float, seed: int, shape: tuple[int, int] | None = None) -> list[dict]:
    """Rows for one batch of (id, prompt token ids), generated as one left-padded ``generate`` call.

    shape: (rows, width) to run every call at (a static KV cache): the batch is filled up to ``rows``
    with copies of its first prompt and left-padded to ``width`` tokens; None: the batch as it is."""
    device = model.device
    padded = batch if shape is None else batch + [batch[0]] * (shape[0] - len(batch))
    width = max(len(p) for _, p in batch) if shape is None else shape[1]
    input_ids = torch.full((len(padded), width), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(padded), width), dtype=torch.long)  # (B, T)
    for i, (_, p) in enumerate(padded):
        # Left padding: every prompt ends at column T-1, so every response starts at column T.
        input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, width - len(p):] = 1
    kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=eos_ids, pad_token_id=pad_id)
    if shape is not None:
        kwargs["cache_implementation"] = "static"
    if temperature > 0:
        # Override any top-k/top-p in the model's generation_config: the heads must learn the model's own distribution.
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, min_p=None)
    else:
        kwargs.update(do_sample=False)
    # generate() samples from the global RNG; fork it so that seeding here leaks into no other code.
    fork_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices), torch.inference_mode():
        torch.manual_seed(seed)
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **kwargs)  # (B, T + new)
    eos = set(eos_ids)
    rows = []
    for (row_id, prompt), generated in zip(batch, out[:, width:].tolist()):
        response = cut_after_eos(generated, eos)
        rows.append({"id": row_id, "input_ids": prompt + response, "response_start": len(prompt), "n_response": len(response)})
    return rows


# ---------------------------------------------------------------------------------------------- storage


def data_sources(spec) -> list[tuple[Path, int | None]]:
    """(directory, row cap) for each entry of ``spec``: "DIR", "DIR@N" (its first N rows only), comma-separated."""
    parts = spec if isinstance(spec, (list, tuple)) else str(spec).split(",")
    out = []
    for part in (str(p).strip() for p in parts):
        if not part:
            continue
        path, cap = part, None
        head, sep, tail = part.rpartition("@")
        if sep and tail.isdigit():
            path, cap = head, int(tail)
        out.append((Path(path).expanduser(), cap))
    if not out:
        raise ValueError("no data directory given: pass one, or several separated by commas")
    return out


def data_dirs(spec) -> list[Path]:
    """The directories in ``spec`` (see :func:`data_sources`)."""
    return [path for path, _ in data_sources(spec)]


def load_distillation_data(spec, *, rows: list[int] | None = None) -> datasets.Dataset:
    """All rows of every finished shard of each directory in ``spec`` (directory, then shard order).

    A "DIR@N" entry keeps only the first N rows of DIR. ``rows[i]`` keeps only the first that many rows of directory i: data directories only grow by
    appended shards, so this reproduces exactly what a run saw (ValueError if a directory now holds
    fewer). Several directories must come from the same model and prompt format (see :func:`read_meta`).
    """
    sources = data_sources(spec)
    if rows is not None and len(rows) != len(sources):
        raise ValueError(f"the run read {len(rows)} data directories but {len(sources)} were given: pass the ones it used "
                         "(comma-separated, in the same order)")
    read_meta(spec)  # checks that every directory is distillation data, and that they agree
    parts = []
    for i, (out_dir, cap) in enumerate(sources):
        shards = _finished_shards(out_dir)
        ds = (datasets.concatenate_datasets([datasets.load_from_disk(str(p)) for p in shards]) if shards
              else datasets.Dataset.from_dict({name: [] for name in _features()}, features=_features()))
        if ds.features != _features():   # stored as uint16: every reader sees int32, whatever the directory holds
            with _datasets_progress_bars_off():   # in memory: never a cache file inside the data directory
                ds = ds.cast(_features(), keep_in_memory=True)
        keep = rows[i] if rows is not None else cap
        if keep is not None and keep > len(ds):
            raise ValueError(f"{out_dir} holds {len(ds)} rows but the run used {keep}: pass the data it was trained on"
                             if rows is not None else
                             f"{out_dir}@{cap} asks for {cap} rows but {out_dir} holds {len(ds)}: lower the @ count or generate more")
        if keep is not None:
            ds = ds.select(range(keep))
        parts.append(ds)
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def row_counts(spec) -> list[int]:
    """Rows used now from each directory of ``spec``: all it stores, or N for "DIR@N" (pin them with
    ``load_distillation_data(rows=...)``); ValueError if a capped directory holds fewer than N."""
    counts = []
    for d, cap in data_sources(spec):
        stored = sum(len(datasets.load_from_disk(str(p))) for p in _finished_shards(d)) if d.is_dir() else 0
        if cap is not None and cap > stored:
            raise ValueError(f"{d}@{cap} asks for {cap} rows but {d} holds {stored}: lower the @ count or generate more")
        counts.append(stored if cap is None else cap)
    return counts


@dataclass
class RunData:
    """What a training command trains on (``run_data``)."""

    dir: str                  # the data spec: comma-separated directories (DIR@N caps one)
    rows: list[int]           # rows read from each directory, pinned for the run's provenance
    dataset: datasets.Dataset
    eos_token_ids: list[int]


def run_data(loaded, *, data: str | None, prompts: str | None, out, max_prompts: int | None = None,
             max_new_tokens: int | None = None, batch_size: int | None = None, progress: bool = True) -> RunData:
    """The data of ``train-heads`` and ``train-draft``: the gen-data directories ``data``, or where it is
    empty, the target's (``loaded``: ``loading.load_model``'s) answers to ``prompts``, generated into
    ``out``/data first (resumable, with gen-data's defaults where an argument is None; in one process
    only, which ``check_training_sources`` makes sure of before the model loads). Rows are counted once
    and pinned (gen-data may still be appending shards to a directory)."""
    if not data:
        data = str(Path(out) / "data")
        d = DataGenConfig()
        generate_distillation_data(loaded.model, loaded.tokenizer, load_prompts(prompts, max_prompts=max_prompts), data,
                                   max_new_tokens=max_new_tokens or d.max_new_tokens, batch_size=batch_size or d.batch_size,
                                   model_name=loaded.name, progress=progress)
    rows = row_counts(data)
    return RunData(dir=str(data), rows=rows, dataset=load_distillation_data(data, rows=rows),
                   eos_token_ids=read_meta(data).get("eos_token_ids", []))


# Settings that must agree between data directories trained on together (temperature and length may differ).
SHARED_SETTINGS = ("format", "model", "prompt_format", "eos_token_ids")


def read_meta(spec) -> dict:
    """The settings a data directory was made with (its ``meta.json``); for several, the first's, once they agree."""
    dirs, metas = data_dirs(spec), []
    for out_dir in dirs:
        if not (out_dir / META_FILE).is_file():
            raise ValueError(f"{out_dir} has no {META_FILE}: it is not distillation data; make it with `selfspec gen-data`")
        metas.append(json.loads((out_dir / META_FILE).read_text()))
    for out_dir, meta in zip(dirs[1:], metas[1:]):
        diffs = [k for k in SHARED_SETTINGS if meta.get(k) != metas[0].get(k)]
        if diffs:
            raise ValueError(f"{out_dir} differs from {dirs[0]} in {', '.join(diffs)}: "
                             "only data made by the same model with the same prompt format can be combined")
    return metas[0]


def _finished_shards(out_dir: Path) -> list[Path]:
    return sorted(p for p in out_dir.iterdir() if p.is_dir() and p.name.startswith(SHARD_PREFIX))


def stored_ids(spec) -> set[str]:
    """The prompt ids stored in the data directories of ``spec`` (comma-separated; ValueError if one is
    not gen-data output)."""
    read_meta(spec)
    return set().union(*(_stored_ids(_finished_shards(d)) for d in data_dirs(spec)))


def _stored_ids(shards: list[Path]) -> set[str]:
    ids = set()
    for p in shards:
        ids.update(datasets.load_from_disk(str(p))["id"])
    return ids


def _write_shard(out_dir: Path, *, index: int, rows: list[dict], tokens: str) -> None:
    final = out_dir / f"{SHARD_PREFIX}{index:05d}"
    columns = {name: [row[name] for row in rows] for name in _features()}
    ds = datasets.Dataset.from_dict(columns, features=_features(tokens))
    with _datasets_progress_bars_off(), atomic_dir(final, prefix=TMP_PREFIX) as tmp:  # readers see a whole shard or none
        ds.save_to_disk(str(tmp))
    log.info("wrote %s (%d rows)", final.name, len(rows))


def _check_or_write_meta(out_dir: Path, meta: dict) -> None:
    path = out_dir / META_FILE
    if path.is_file():
        stored = json.loads(path.read_text())
        # Directories from before teacher forcing existed hold generated answers.
        diffs = [k for k in COMPARED_SETTINGS if stored.get(k, "generated" if k == "answers" else None) != meta[k]]
        if diffs:
            was = ", ".join(f"{k}={stored.get(k, 'generated' if k == 'answers' else None)!r}" for k in diffs)
            now = ", ".join(f"{k}={meta[k]!r}" for k in diffs)
            raise ValueError(f"{out_dir} was made with {was} but this run has {now}: use another output directory or the same settings")
        return
    if any(not p.name.startswith(TMP_PREFIX) for p in out_dir.iterdir()):
        raise ValueError(f"{out_dir} is not empty and has no {META_FILE}: pick a new or empty output directory")
    atomic_write_text(path, json.dumps(meta, indent=2) + "\n")


def compact_data(out_dir) -> tuple[int, int, int]:
    """Rewrite an int32 data directory (older gen-data output) with uint16 token ids where the
    vocabulary fits: the same rows in the same order at about half the size. Returns (shards
    rewritten, bytes before, bytes after); a uint16 directory, or a vocabulary over 65,536, is left as it is.

    Each shard is replaced whole (:func:`~selfspec.io.atomic_dir`), its ids checked equal first, and
    ``meta.json`` changes last, so a killed run leaves a directory that loads the same (shards of
    both layouts load as int32) and a rerun finishes the job. A shard caught between its two renames
    is put back before anything else."""
    out_dir = Path(out_dir)
    meta = read_meta(out_dir)
    size = lambda: sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file())  # noqa: E731
    before = size()
    if meta.get("vocab_size") is None:
        raise ValueError(f"{out_dir}/{META_FILE} does not record the vocabulary size, so the ids may not fit uint16: "
                         "it was left as it is")
    if meta.get("token_dtype", "int32") != "int32" or token_dtype(int(meta["vocab_size"])) != "uint16":
        return 0, before, before
    rewritten = 0
    with _exclusive(out_dir):
        for aside in out_dir.glob(f"{TMP_PREFIX}old-{SHARD_PREFIX}*"):   # atomic_dir moved a shard aside, then died
            for shard in aside.iterdir():
                if shard.name.startswith(SHARD_PREFIX) and not (out_dir / shard.name).exists():
                    os.rename(shard, out_dir / shard.name)
        remove_stale_temporaries(out_dir)
        for path in _finished_shards(out_dir):
            ds = datasets.load_from_disk(str(path))
            if ds.features == _features("uint16"):
                continue
            with _datasets_progress_bars_off():
                small = ds.cast(_features("uint16"), keep_in_memory=True)
                if small["input_ids"] != ds["input_ids"]:   # lists of Python ints: equal whatever the stored width
                    raise ValueError(f"{path} holds token ids that uint16 cannot store: it was left as it is")
                with atomic_dir(path, prefix=TMP_PREFIX) as tmp:
                    small.save_to_disk(str(tmp))
            rewritten += 1
        atomic_write_text(out_dir / META_FILE, json.dumps({**meta, "token_dtype": "uint16"}, indent=2) + "\n")
    return rewritten, before, size()


@contextlib.contextmanager
def _exclusive(out_dir: Path):
    """Hold an advisory lock on the directory itself (no lock file to leave behind)."""
    fd = os.open(out_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"another run is writing to {out_dir}: wait for it to finish or use another output directory") from None
        yield
    finally:
        os.close(fd)  # closing releases the lock


@contextlib.contextmanager
def _datasets_progress_bars_off():
    # save_to_disk draws its own bar per shard, which would interleave with ours.
    was_enabled = datasets.utils.is_progress_bar_enabled()
    datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.utils.enable_progress_bars()


# ---------------------------------------------------------------------------------------------- CLI


def add_data_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the generation flags (defaults from :class:`DataGenConfig`) to ``parser``; shared with ``selfspec gen-data``."""
    d = DataGenConfig()
    parser.add_argument("--model", required=True, help="model alias, local directory, .gguf file or hub id (e.g. smollm2-135m)")
    parser.add_argument("--prompts", required=True, help="JSONL file with a \"prompt\" (and optional \"id\") per line, or a dataset name/path")
    parser.add_argument("--out", required=True, help="output directory; rerunning with the same one resumes")
    parser.add_argument("--max-prompts", type=int, default=None, help="use only the first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=d.seed, help="sampling seed (ignored when greedy)")
    parser.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens, help="longer prompts keep their last N tokens")
    parser.add_argument("--shard-size", type=int, default=d.shard_size, help="batches per shard (the most a killed run loses)")
    parser.add_argument("--split", default="train", help="split to read when --prompts is a dataset")
    parser.add_argument("--sources", default=None,
                        help="comma-separated values of the prompts' \"source\" field to keep (default: all)")
    parser.add_argument("--samples", type=int, default=1,
                        help="answers per prompt (ids <id>~<k>); more than 1 needs --temperature > 0")
    parser.add_argument("--references", action="store_true",
                        help="teacher forcing: store each prompt's \"reference\" answer instead of generating one "
                             "(rows without a reference are left out); training runs the target over it")
    parser.add_argument("--skip-stored", default=None, metavar="DIRS",
                        help="comma-separated gen-data directories: leave out the prompts whose ids any of them "
                             "already stores (to answer prompts no other directory has)")
    parser.add_argument("--static-cache", action="store_true",
                        help="run every batch at one shape (--batch-size rows, prompts padded to --max-prompt-tokens) "
                             "on a preallocated KV cache, which transformers compiles once on a GPU (CUDA graphs)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: float32 on CPU)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def check_training_sources(*, data, prompts) -> None:
    """What train-heads / train-draft read, checked before they load a model: --data must be gen-data
    output (every directory, with its meta.json), a --prompts JSONL file must exist and hold something.
    Answers to --prompts are generated in one process only: with several (``WORLD_SIZE`` > 1) each would
    write the same directory."""
    if data:
        read_meta(data)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("with several processes, generate the data first (`selfspec gen-data`) and pass --data")
    if prompts and str(prompts).endswith(".jsonl"):
        check_input_file(prompts, "prompts")


def check_data_args(args: argparse.Namespace) -> None:
    """The flags' numbers, and an --out that is new, empty or earlier gen-data output (which resumes)."""
    for name in ("max_new_tokens", "batch_size", "max_prompt_tokens", "shard_size", "samples", "threads"):
        at_least(getattr(args, name), 1, name)
    at_least(args.max_prompts, 1, "max_prompts")
    at_least(args.temperature, 0, "temperature")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: pass a directory path")
    if out.is_dir() and not (out / META_FILE).is_file() and any(not p.name.startswith(TMP_PREFIX) for p in out.iterdir()):
        raise ValueError(f"--out {out} is not empty and holds no gen-data output ({META_FILE}): pass a new or empty "
                         "directory (or the --out of an earlier gen-data run, to resume it)")


def run_from_args(args: argparse.Namespace) -> GenerationSummary:
    """Run generation as the parsed flags say, print the one-line summary, and return it."""
    from selfspec.loading import check_model_name, load_model

    check_data_args(args)
    check_model_name(args.model)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.references and (args.temperature > 0 or args.samples > 1):
        raise ValueError("--references stores the prompts' own reference answers: drop --temperature and --samples")
    if args.samples > 1 and args.temperature == 0:
        raise ValueError(f"--samples {args.samples} with greedy decoding would store {args.samples} identical answers: "
                         "set --temperature > 0 (e.g. 0.7)")
    prompts = load_prompts(args.prompts, max_prompts=args.max_prompts, split=args.split)
    prompts = select_prompts(prompts, sources=args.sources, samples=args.samples)
    if not prompts:
        raise ValueError(f"{args.prompts} holds no prompts: give a JSONL file with one {{\"prompt\": ...}} per line")
    if args.skip_stored:
        elsewhere = stored_ids(args.skip_stored)
        kept = [row for row in prompts if str(row["id"]) not in elsewhere]
        if not kept:   # like a finished run resumed: nothing to do, and no model to load
            out_dir = Path(args.out)
            rows = len(load_distillation_data(out_dir)) if (out_dir / META_FILE).is_file() else 0
            summary = GenerationSummary(prompts=len(prompts), generated=0, skipped=len(prompts), response_tokens=0,
                                        wall_s=0.0, rows=rows, out=str(out_dir))
            print(summary.line(), flush=True)
            return summary
        prompts = kept
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    out_dir = Path(args.out)
    before = _stored_ids(_finished_shards(out_dir)) if out_dir.is_dir() else set()
    started = time.perf_counter()
    ds = generate_distillation_data(
        loaded.model,
        loaded.tokenizer,
        prompts,
        out_dir,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        temperature=args.temperature,
        seed=args.seed,
        max_prompt_tokens=args.max_prompt_tokens,
        shard_size=args.shard_size,
        model_name=loaded.name,
        progress=not args.no_progress,
        references=args.references,
        static_cache=args.static_cache,
    )
    wall = time.perf_counter() - started
    wanted = {row["id"] for row in prompts} - before
    new_tokens = sum(n for row_id, n in zip(ds["id"], ds["n_response"]) if row_id in wanted)
    summary = GenerationSummary(
        prompts=len(prompts),
        generated=len(wanted),
        skipped=len(prompts) - len(wanted),
        response_tokens=new_tokens,
        wall_s=wall,
        rows=len(ds),
        out=str(out_dir),
    )
    print(summary.line(), flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = add_data_args(argparse.ArgumentParser(prog="python -m selfspec.training.data", description=__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        run_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def answers_from_data(data) -> tuple[list[list[int]], list[dict]]:
    """The response tokens of ``selfspec gen-data`` directories (comma list or list), and per source a
    record of what it gave."""
    answers, sources = [], []
    for path, cap in data_sources(data):
        ds = load_distillation_data(f"{path}@{cap}" if cap is not None else str(path))
        rows = [r["input_ids"][r["response_start"]: r["response_start"] + r["n_response"]] for r in ds]
        answers += rows
        sources.append({"path": str(path), "sequences": len(rows), "tokens": sum(len(r) for r in rows)})
    return answers, sources


if __name__ == "__main__":
    sys.exit(main())

